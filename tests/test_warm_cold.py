"""The run-shape matrix: the whole catalog on every shape, no rule failing, and warm equals cold
(from cached partials, again and after one more file of each table: a fresh cache's analysis)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from test_metrics_text import assert_json_close

from rlscope._version import __version__
from rlscope.analysis import analyze as analyze_run
from rlscope.cache import STORE_FORMAT, FooterCache, PartialCache, Parts
from rlscope.reader import open_run
from rlscope.steplocal import read_step_local
from rlscope.synth import generate
from rlscope.tokenscan import FILE_ID

TABLES = ("rollouts", "steps", "tokens", "probes")


def _rewrite(run: Path, table: str, change: Callable[[pl.DataFrame], pl.DataFrame]) -> None:
    """`table` rewritten as one file by `change` (a table it empties is removed)."""
    files = sorted((run / table).rglob("*.parquet"))
    rows = change(pl.read_parquet(files))
    shutil.rmtree(run / table)
    if rows.height:
        (run / table).mkdir()
        rows.write_parquet(run / table / "all.parquet")


def _meta(run: Path, **fields: Any) -> None:
    path = run / "run.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _ppo_critic(run: Path) -> None:
    """One rollout per prompt with a learned critic's fields (verl's `critic/*`, as extras)."""
    _meta(run, algorithm="PPO (GAE critic)", group_size=1)
    rng = np.random.default_rng(3)
    _rewrite(
        run,
        "tokens",
        lambda t: t.with_columns(
            value=pl.Series(rng.normal(0.5, 0.2, t.height), dtype=pl.Float32),
            **{"return": pl.Series(rng.normal(0.5, 0.3, t.height), dtype=pl.Float32)},
        ),
    )
    _rewrite(
        run,
        "steps",
        lambda s: s.with_columns(
            value_loss=pl.Series(rng.uniform(0.02, 0.2, s.height)),
            explained_variance=pl.Series(rng.uniform(0.0, 0.6, s.height)),
            kl_coef=pl.lit(0.02),
        ),
    )


def _only_step(keep: int) -> Callable[[Path], None]:
    def change(run: Path) -> None:
        for table in ("rollouts", "steps", "tokens"):
            _rewrite(run, table, lambda f: f.filter(pl.col("step") < keep))
        ids = pl.read_parquet(sorted((run / "rollouts").rglob("*.parquet")))["rollout_id"]
        _rewrite(run, "probes", lambda p: p.filter(pl.col("rollout_id").is_in(ids.implode())))

    return change


def _drop(*tables: str) -> Callable[[Path], None]:
    return lambda run: [shutil.rmtree(run / t) for t in tables if (run / t).exists()] and None


def _eval_only(run: Path) -> None:
    _rewrite(run, "rollouts", lambda r: r.filter(pl.col("split") != "train"))
    _drop("tokens", "probes")(run)


def _equal_rewards(run: Path) -> None:
    _rewrite(
        run, "rollouts", lambda r: r.with_columns(reward=pl.lit(1.0), correct=pl.lit(value=True))
    )
    _rewrite(run, "tokens", lambda t: t.with_columns(advantage=pl.lit(0.0, pl.Float32)))


def _null_columns(run: Path) -> None:
    """A column all null in each table."""
    for table, column in (
        ("rollouts", "advantage"),
        ("steps", "kl"),
        ("tokens", "entropy"),
        ("probes", "fraction"),
    ):
        _rewrite(
            run,
            table,
            lambda f, c=column: f.with_columns(pl.lit(None, f.schema[c]).alias(c)),
        )


def _probes_without_answers(run: Path) -> None:
    _rewrite(run, "probes", lambda p: p.with_columns(pl.lit(None, pl.String).alias("answer")))


#: name -> (generate's options, a change to the written run).
SHAPES: dict[str, tuple[dict[str, Any], Callable[[Path], None] | None]] = {
    "group-1-ppo-critic": (dict(group_size=1, prompts_per_step=16), _ppo_critic),
    "group-2": (dict(group_size=2), None),
    "group-8": (dict(group_size=8), None),
    "group-64": (dict(group_size=64, prompts_per_step=2), None),
    "steps-only": ({}, _drop("rollouts", "tokens", "probes")),
    "no-tokens": (dict(tokens=False), None),
    "no-text": (dict(text=False), None),
    "one-step": ({}, _only_step(1)),
    "two-steps": ({}, _only_step(2)),
    "eval-only": (dict(eval_every=1), _eval_only),
    "equal-rewards": ({}, _equal_rewards),
    "null-columns": ({}, _null_columns),
    "probes-without-answers": ({}, _probes_without_answers),
}


def _split_files(run: Path) -> None:
    """Each table as a trainer flushing every few steps writes it: one file per range of steps
    (one step: per half of its rows); probes by their rollout's step."""
    for table in TABLES:
        if not (run / table).exists():
            continue
        rows = pl.read_parquet(sorted((run / table).rglob("*.parquet")))
        if table == "probes":
            rollouts = pl.read_parquet(sorted((run / "rollouts").rglob("*.parquet")))
            rows = rows.join(rollouts.select("rollout_id", "step"), on="rollout_id")
        steps = sorted(rows["step"].unique().to_list())
        if len(steps) == 1:
            half = rows.height // 2
            pieces = [rows.slice(0, half), rows.slice(half)]
        else:
            cuts = np.array_split(np.array(steps), min(4, len(steps)))
            pieces = [rows.filter(pl.col("step").is_in(list(cut))) for cut in cuts]
        shutil.rmtree(run / table)
        (run / table).mkdir()
        for i, piece in enumerate(pieces):
            piece.drop("step" if table == "probes" else []).write_parquet(
                run / table / f"part-{i:03d}.parquet"
            )


def _shape_run(root: Path, shape: str) -> Path:
    options, change = SHAPES[shape]
    run = root / shape
    generate(
        run,
        "healthy",
        **{"steps": 12, "prompts_per_step": 4, "group_size": 4, "seed": 7, **options},
    )
    if change is not None:
        change(run)
    _split_files(run)
    return run


def analyze(path: Path, **options: Any) -> Any:
    """`rlscope.analyze`, and no rule of the catalog may fail on any shape (a failed rule is
    reported as skipped in the product: here it is a bug found)."""
    report = analyze_run(path, **options)
    failed = [(s.metric, s.reason) for s in report.skipped if s.failed]
    assert not failed, failed
    return report


def _report_json(report: Any) -> dict[str, Any]:
    out = report.to_dict()
    out["run"].pop("table_files")
    out["run"].pop("token_files")
    if any(n.startswith("imported from") for n in out["notes"]):  # into each cache dir
        out["notes"] = [n for n in out["notes"] if not n.startswith("imported from")]
        del out["run"]["path"]
    return out


def assert_same(warm: Any, cold: Any) -> None:
    """Equal JSON, floats to 1e-12 relative (summation order)."""
    assert_json_close(warm, cold, rel=1e-12, absolute=1e-300)


def _held_back(run: Path, target: Path) -> tuple[Path, list[tuple[Path, Path]]]:
    """The run before its last file of each table was written, and those files' moves."""
    shutil.copytree(run, target)
    moves = []
    for table in TABLES:
        files = sorted((target / table).glob("*.parquet")) if (target / table).exists() else []
        if len(files) > 1:
            moves.append((run / table / files[-1].name, files[-1]))
            files[-1].unlink()
    assert moves
    return target, moves


@pytest.mark.parametrize("shape", SHAPES)
def test_warm_equals_cold_on_every_run_shape(shape: str, tmp_path: Path) -> None:
    """Cold (a fresh cache), then warm (nothing read again), then warm after one more file of
    each table (that file read): each is the fresh cache's analysis of the same files."""
    live, appended = _held_back(_shape_run(tmp_path, shape), tmp_path / "live")
    cache = tmp_path / "cache"
    cold = analyze(live, cache_dir=cache)
    assert_same(_report_json(cold), _report_json(analyze(live, use_cache=False)))
    warm = analyze(live, cache_dir=cache)
    assert all(read == 0 for _, read in warm.run.table_files.values())
    assert warm.run.token_files_read == 0
    assert_same(_report_json(warm), _report_json(cold))

    for source, target in appended:
        shutil.copyfile(source, target)
    grown = analyze(live, cache_dir=cache)
    assert any(read for _, read in grown.run.table_files.values()) or grown.run.token_files_read
    fresh = analyze(live, cache_dir=tmp_path / "fresh")
    assert_same(_report_json(grown), _report_json(fresh))
    assert_same(_report_json(analyze(live, cache_dir=cache)), _report_json(fresh))


def _verl_metrics_line(step: int, rng: np.random.Generator) -> str:
    """One line of verl's FileLogger (`{"step": s, "data": {...}}`) with PPO's critic keys."""
    data = {
        "actor/pg_loss": float(rng.normal(0, 0.02)),
        "actor/grad_norm": float(rng.lognormal(-0.5, 0.2)),
        "actor/entropy": 0.9 - 0.002 * step + float(rng.normal(0, 0.01)),
        "actor/ppo_kl": 1e-3 * float(rng.lognormal(0, 0.2)),
        "actor/pg_clipfrac": 0.005 * float(rng.lognormal(0, 0.2)),
        "actor/lr": 1e-6,
        "critic/score/mean": 0.3 + 0.004 * step + float(rng.normal(0, 0.02)),
        "critic/vf_loss": 0.1 * float(rng.lognormal(0, 0.1)),
        "critic/vf_explained_var": 0.3 + float(rng.normal(0, 0.05)),
        "response_length/mean": 200.0 + float(rng.normal(0, 5)),
    }
    return json.dumps({"step": step, "data": data}) + "\n"


def test_warm_equals_cold_on_a_metrics_only_import(tmp_path: Path) -> None:
    """`analyze --from verl-metrics` of a growing metrics file: the import and the partials
    cached, then the file grown by a few steps: the fresh cache's analysis each time."""
    rng = np.random.default_rng(11)
    source = tmp_path / "metrics.jsonl"
    source.write_text("".join(_verl_metrics_line(s, rng) for s in range(1, 31)))
    cache = tmp_path / "cache"

    def run(cache_dir: Path) -> dict[str, Any]:
        return _report_json(analyze(source, from_format="verl-metrics", cache_dir=cache_dir))

    cold = run(cache)
    assert_same(run(cache), cold)
    assert_same(cold, run(tmp_path / "fresh-1"))
    with source.open("a") as out:
        out.write("".join(_verl_metrics_line(s, rng) for s in range(31, 41)))
    grown = run(cache)
    assert grown["run"]["last_step"] == 40
    assert_same(grown, run(tmp_path / "fresh-2"))


def _groups_of_one_run(out: Path) -> Path:
    """The issue's repro: 40 steps x 16 rollouts, every prompt_id distinct, tokens with
    logprob and entropy, `group_size: 1`."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 60, 40 * 16)
    rollouts = pl.DataFrame(
        {
            "rollout_id": np.arange(lengths.size),
            "step": np.repeat(np.arange(40), 16),
            "prompt_id": [f"p{i}" for i in range(lengths.size)],
            "reward": (rng.random(lengths.size) < 0.6).astype(float),
            "response_len": lengths.astype(np.int32),
        }
    ).with_columns(correct=pl.col("reward") > 0)
    tokens = pl.DataFrame(
        {
            "rollout_id": np.repeat(rollouts["rollout_id"].to_numpy(), lengths),
            "step": np.repeat(rollouts["step"].to_numpy(), lengths),
            "pos": np.concatenate([np.arange(n) for n in lengths]).astype(np.int32),
            "logprob": -rng.random(lengths.sum()).astype(np.float32),
            "entropy": 2 * rng.random(lengths.sum()).astype(np.float32),
        }
    )
    for table, frame in (("rollouts", rollouts), ("tokens", tokens)):
        (out / table).mkdir(parents=True)
        frame.write_parquet(out / table / "part-0.parquet")
    meta = {"schema_version": 1, "run_id": "ppo", "algorithm": "PPO (GAE critic)", "group_size": 1}
    (out / "run.json").write_text(json.dumps(meta))
    return out


def test_groups_of_one_analysed_twice_from_the_command_line(tmp_path: Path) -> None:
    """The default cache, as a user has it: the second analysis is the first."""
    run = _groups_of_one_run(tmp_path / "run")
    env = {**os.environ, "RLSCOPE_CACHE_DIR": str(tmp_path / "cache"), "NO_COLOR": "1"}
    outs = []
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-m", "rlscope", "analyze", str(run), "--format", "json"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        outs.append(json.loads(done.stdout))
    for out in outs:
        del out["run"]["token_files"], out["run"]["table_files"]
    assert_same(outs[1], outs[0])
    assert_same(outs[2], outs[0])
    # Groups of one: no within-group correlation, and why (the frame the rule reads has no row).
    skipped = {s["metric"]: s["reason"] for s in outs[0]["skipped"]}
    assert "one rollout" in skipped["behavior.len_correct_corr"]


def test_a_store_of_another_format_is_rebuilt_never_read(tmp_path: Path) -> None:
    """A store written by another rlscope (the MANIFEST's format key, or the bare list older
    rlscopes wrote) is ignored: every file read again, the old parts removed."""
    run = _shape_run(tmp_path, "group-8")
    cache = tmp_path / "cache"
    first = analyze(run, cache_dir=cache)
    manifests = list(cache.rglob("MANIFEST"))
    assert manifests
    old_parts = set()
    for i, manifest in enumerate(manifests):
        doc = json.loads(manifest.read_text())
        assert doc["format"] == f"{STORE_FORMAT}/{__version__}"
        old_parts |= {manifest.parent / p for p in doc["parts"]}
        manifest.write_text(
            json.dumps(doc["parts"] if i % 2 else {**doc, "format": f"{STORE_FORMAT - 1}/0"})
        )
    again = analyze(run, cache_dir=cache)
    assert all(read == files for files, read in again.run.table_files.values())
    assert again.run.token_files_read == again.run.token_files
    assert_same(_report_json(again), _report_json(first))
    assert not any(part.exists() for part in old_parts)
    assert analyze(run, cache_dir=cache).run.token_files_read == 0


@pytest.mark.parametrize("target", ["MANIFEST", "files.arrow", "data"])
def test_a_cache_file_cut_short_is_rebuilt_never_trusted(tmp_path: Path, target: str) -> None:
    """Every cache file of one kind (a MANIFEST, a part's file list, a part's frames) cut to
    half its bytes: what it held is read again, and the answer is the fresh cache's."""
    run = _shape_run(tmp_path, "group-1-ppo-critic")
    cache = tmp_path / "cache"
    first = analyze(run, cache_dir=cache)
    if target == "data":
        hit = [
            p for p in cache.rglob("*.arrow") if p.name != "files.arrow" and p.stat().st_size > 64
        ]
    else:
        hit = list(cache.rglob(target))
    assert hit
    for path in hit:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    again = analyze(run, cache_dir=cache)
    assert_same(_report_json(again), _report_json(first))
    assert again.warnings == first.warnings
    assert_same(_report_json(analyze(run, cache_dir=cache)), _report_json(first))


#: Columns of every type the per-file stores hold (sums, counts, flags, labels).
STORED_SCHEMA = {
    "step": pl.Int64,
    "sxx": pl.Float64,
    "n": pl.UInt32,
    "count": pl.Int32,
    "segment": pl.String,
    "flag": pl.Boolean,
}


def test_a_stored_frame_keeps_its_columns_and_types_with_or_without_rows(tmp_path: Path) -> None:
    """The cause of the groups-of-one crash: a frame with no row was stored without its
    columns. Stored with no row, with rows, and both compacted: read back with its schema."""
    rows = pl.DataFrame(
        {"step": [1, 2], "sxx": [0.5, 1.5], "n": [2, 3], "count": [4, 5]}
        | {"segment": ["think", None], "flag": [True, False]},
        schema=STORED_SCHEMA,
    )
    folder = tmp_path / "store"

    def stored(keys: list[str]) -> pl.DataFrame:
        store = Parts(folder, ["frame"])
        assert all(store.open(keys))
        return pl.concat(pl.collect_all(store.scans("frame")), how="diagonal_relaxed")

    store = Parts(folder, ["frame"])
    store.open(["empty"])
    store.add("empty", {"frame": rows.clear()})
    store.commit()
    alone = stored(["empty"])
    assert alone.drop(FILE_ID).schema == rows.schema and alone.height == 0

    store = Parts(folder, ["frame"])
    store.open(["empty", "full"])
    store.add("full", {"frame": rows})
    store.commit()
    both = stored(["empty", "full"])
    assert both.drop(FILE_ID).schema == rows.schema
    assert both.drop(FILE_ID).sort("step").equals(rows)

    store = Parts(folder, ["frame"])
    store.open(["full"])  # "empty" is gone: its part holds no live file, compacted away
    store.add("again", {"frame": rows.clear()})
    store.commit()
    assert len(json.loads((folder / "MANIFEST").read_text())["parts"]) <= 2
    after = stored(["full", "again"])
    assert after.drop(FILE_ID).schema == rows.schema and after.height == 2


@pytest.mark.parametrize("shape", ["group-1-ppo-critic", "one-step"])
def test_step_local_frames_from_the_cache_are_those_read(tmp_path: Path, shape: str) -> None:
    """`read_step_local` warm returns the frames it returns cold: every name, the same
    columns and types, the same rows, also for a name with no row (no group of two)."""
    run = open_run(_shape_run(tmp_path, shape))

    def frames_of(part: Any) -> dict[str, pl.DataFrame]:
        train = part.scan("rollouts").filter(pl.col("split") == "train")
        groups = train.group_by("step", "prompt_id").agg(n=pl.len())
        return {
            "pairs": groups.filter(pl.col("n") >= 2).group_by("step").agg(pl.col("n").sum()),
            "singles": groups.filter(pl.col("n") == 1).group_by("step").agg(pl.len()),
        }

    def collected(part: Any) -> dict[str, pl.DataFrame]:
        return {name: query.collect() for name, query in frames_of(part).items()}

    names = ["pairs", "singles"]
    store = PartialCache(tmp_path / "cache")
    cold, read = read_step_local(run, "rollouts", names, collected, store=store, fingerprint="f")
    warm, again = read_step_local(run, "rollouts", names, collected, store=store, fingerprint="f")
    assert read.files_read == read.files > 1 and again.files_read == 0
    assert cold.keys() == warm.keys() == set(names)
    for name in names:
        assert warm[name].schema == cold[name].schema, name
        assert warm[name].sort("step").equals(cold[name].sort("step")), name
    assert cold["pairs"].height == 0 or cold["singles"].height == 0


def test_a_footer_is_read_again_only_when_its_file_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The footer memo (FooterCache): a second open reads no footer; a rewritten file's footer
    is read again and its new rows and schema are those opened; a removed file leaves it; every
    open gives the tables an open without the memo gives."""
    from rlscope import reader

    run = _shape_run(tmp_path, "group-1-ppo-critic")
    memo = FooterCache(tmp_path / "cache")
    read: list[Path] = []
    footer = reader._footer

    def counted(path: Path, size: int) -> Any:
        read.append(path)
        return footer(path, size)

    monkeypatch.setattr(reader, "_footer", counted)

    def tables(opened: Any) -> dict[str, Any]:
        return {name: t for name, t in opened.tables.items()}

    files = sorted(run.rglob("*.parquet"))
    assert tables(open_run(run, memo=memo)) == tables(open_run(run))
    assert len(read) == 2 * len(files)
    read.clear()
    assert tables(open_run(run, memo=memo)) == tables(open_run(run))
    assert len(read) == len(files)  # the memo-less open's only
    # A token file rewritten with a column more and fewer rows; a steps file removed.
    tokens = sorted((run / "tokens").glob("*.parquet"))[0]
    frame = pl.read_parquet(tokens)
    frame.head(frame.height // 2).with_columns(extra=pl.lit(1.0)).write_parquet(tokens)
    removed = sorted((run / "steps").glob("*.parquet"))[0]
    removed.unlink()
    read.clear()
    opened = open_run(run, memo=memo)
    assert read[0] == tokens and len(read) == 1
    assert tables(opened) == tables(open_run(run))
    assert str(removed) not in memo.recall(run)
    i = opened.tables["tokens"].files.index(tokens)
    assert "extra" in opened.tables["tokens"].file_schemas[i]
    assert opened.tables["tokens"].file_rows[i] == frame.height // 2
    # An unreadable memo costs the reads, never a result.
    for path in (tmp_path / "cache" / "footers").glob("*.arrow"):
        path.write_bytes(b"not arrow")
    read.clear()
    assert tables(open_run(run, memo=memo)) == tables(open_run(run))
    assert len(read) == 2 * (len(files) - 1)
