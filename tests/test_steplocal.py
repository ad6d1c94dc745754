"""The steps and rollouts tables read per file: each file's results cached, only new files read,
the answers always those of a full read, and a step in two files read whole."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import polars as pl
import pytest
from test_metrics_text import assert_json_close

from rlscope.analysis import analyze
from rlscope.cache import PartialCache
from rlscope.engine import compute
from rlscope.errors import RlscopeError
from rlscope.reader import (
    FILE_INDEX,
    INVALID_PREFIX,
    MAX_RESPONSE_LEN,
    ROLLOUTS_FILE,
    STEPS_OF,
    check_from_index,
    check_rollouts,
    check_rollouts_scan,
    open_run,
)
from rlscope.steplocal import file_index, fingerprint
from rlscope.synth import generate


def _split_by_steps(run: Path, table: str, cuts: list[int]) -> None:
    """The table rewritten as one file per range of steps (cut before each step in `cuts`),
    as a trainer flushing every few steps writes it (probes: by their rollout's step)."""
    folder = run / table
    rows = pl.read_parquet(sorted(folder.glob("*.parquet")))
    if table == "probes":
        steps = pl.read_parquet(sorted((run / "rollouts").glob("*.parquet")))
        rows = rows.join(steps.select("rollout_id", "step"), on="rollout_id", how="left")
    for path in folder.glob("*.parquet"):
        path.unlink()
    bounds = [None, *cuts, None]
    for index, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        part = rows
        if lo is not None:
            part = part.filter(pl.col("step") >= lo)
        if hi is not None:
            part = part.filter(pl.col("step") < hi)
        part.drop("step" if table == "probes" else []).write_parquet(
            folder / f"part-{index:04d}.parquet"
        )


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 24-step run with text, evals and probes, its rollouts and steps in files of a few
    steps each: the first 20 steps (`early`), and the whole run (`whole`)."""
    base = tmp_path_factory.mktemp("steplocal")
    whole = base / "whole"
    generate(whole, "diversity-collapse", steps=24, prompts_per_step=4, group_size=6, seed=5)
    for table in ("probes", "rollouts", "steps"):
        _split_by_steps(whole, table, [5, 9, 13, 17, 21])
    return base, whole


def _json(report: Any) -> dict[str, Any]:
    out = report.to_dict()
    out["run"].pop("table_files")
    out["run"].pop("token_files")
    return out


TABLES = ("rollouts", "steps", "probes")


def _copy_without_last(whole: Path, target: Path) -> Path:
    """The run as it was before its last rollouts, steps and probes files were written."""
    import shutil

    shutil.copytree(whole, target)
    for table in TABLES:
        max(sorted((target / table).glob("*.parquet"))).unlink()
    return target


def test_a_run_growing_by_a_file_reads_that_file_only(
    grown: tuple[Path, Path], tmp_path: Path
) -> None:
    """First analysis: every file read, each file's results stored. Again: nothing read. After
    the trainer writes one more rollouts, steps and probes file: that file only (the probes
    read before are not read again for the new rollouts). Every answer (every metric, finding
    and its example rollouts) is the uncached analysis'."""
    _, whole = grown
    run = _copy_without_last(whole, tmp_path / "live")
    cache = tmp_path / "cache"
    first = analyze(run, cache_dir=cache)
    files = {t: len(list((run / t).glob("*.parquet"))) for t in TABLES}
    assert first.run.table_files == {t: (n, n) for t, n in files.items()}
    assert_json_close(_json(first), _json(analyze(run, use_cache=False)))

    again = analyze(run, cache_dir=cache)
    assert again.run.table_files == {t: (n, 0) for t, n in files.items()}
    assert_json_close(_json(again), _json(first))

    for table in TABLES:
        last = max(sorted((whole / table).glob("*.parquet")))
        (run / table / last.name).write_bytes(last.read_bytes())
    grown_now = analyze(run, cache_dir=cache)
    assert grown_now.run.table_files == {t: (n + 1, 1) for t, n in files.items()}
    assert_json_close(_json(grown_now), _json(analyze(run, use_cache=False)))
    assert grown_now.run.last_step == analyze(whole, use_cache=False).run.last_step


def test_a_step_in_two_files_is_read_whole_and_a_step_range_applies_after_the_merge(
    grown: tuple[Path, Path], tmp_path: Path
) -> None:
    """A file holding rows of a step another file has (a step written by two ranks): the two
    are one group, read together (the two files only), with the full read's answers. A
    --steps range over cached files gives the uncached range's answers."""
    _, whole = grown
    run = _copy_without_last(whole, tmp_path / "overlap")
    cache = tmp_path / "cache"
    analyze(run, cache_dir=cache)
    ranged = analyze(run, cache_dir=cache, steps=(6, 15))
    assert ranged.run.table_files["rollouts"][1] == 0
    assert_json_close(_json(ranged), _json(analyze(run, use_cache=False, steps=(6, 15))))

    rollouts = pl.read_parquet(run / "rollouts" / "part-0000.parquet")
    last = rollouts["step"].max()
    moved = rollouts.filter(
        (pl.col("step") == last) & (pl.col("prompt_id") == rollouts["prompt_id"][-1])
    )
    rest = rollouts.join(moved.select("rollout_id"), on="rollout_id", how="anti")
    assert moved.height and last in rest["step"].to_list()
    rest.write_parquet(run / "rollouts" / "part-0000.parquet")
    moved.write_parquet(run / "rollouts" / "part-9999.parquet")  # the step now in two files
    split = analyze(run, cache_dir=cache)
    n = len(list((run / "rollouts").glob("*.parquet")))
    assert split.run.table_files["rollouts"] == (n, 2)
    assert_json_close(_json(split), _json(analyze(run, use_cache=False)))
    again = analyze(run, cache_dir=cache)
    assert again.run.table_files["rollouts"] == (n, 0)
    assert_json_close(_json(again), _json(split))


def test_per_file_results_are_those_of_the_file_alone(grown: tuple[Path, Path]) -> None:
    """What is cached for a file is what reading that file alone gives: the rows of its steps."""
    _, whole = grown
    run = open_run(whole)
    everything = compute(run)
    for index, path in enumerate(run.tables["rollouts"].files):
        alone = compute(run.only("rollouts", [index]))
        steps = set(pl.read_parquet(path)["step"].to_list())
        for metric_id, result in alone.results.items():
            if result.source.startswith("rollouts"):
                full = dict(
                    zip(
                        everything.results[metric_id].steps,
                        everything.results[metric_id].values,
                        strict=True,
                    )
                )
                for step, value in zip(result.steps, result.values, strict=True):
                    assert step in steps
                    if value is not None and "pass" not in metric_id:
                        assert value == pytest.approx(full[step], rel=1e-9), (metric_id, step)


def test_the_fingerprint_is_the_same_in_another_process(grown: tuple[Path, Path]) -> None:
    """No address or hash seed in it: a second `rlscope analyze` finds what the first stored."""
    _, whole = grown
    code = (
        "import sys; from rlscope.reader import open_run; from rlscope.engine import compute;"
        "from rlscope.cache import PartialCache; import rlscope.steplocal as s;"
        "seen=[]; orig=s.read_step_local\n"
        "def spy(run, table, names, frames_of, **kw):\n"
        "    seen.append(kw['fingerprint']); return orig(run, table, names, frames_of, **kw)\n"
        "import rlscope.sources as e; e.read_step_local=spy\n"
        "compute(open_run(sys.argv[1])); print(seen)"
    )
    prints = [
        subprocess.run(
            [sys.executable, "-c", code, str(whole)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout
        for seed in ("1", "2")
    ]
    # The steps table's, the rollouts' group sizes', the rollouts' series'.
    assert prints[0] == prints[1] and len(json.loads(prints[0].replace("'", '"'))) == 3
    assert fingerprint(open_run(whole), "steps", [pl.col("x").sum()]) != fingerprint(
        open_run(whole), "steps", [pl.col("x").mean()]
    )


def test_an_unwritable_cache_costs_speed_not_results(
    grown: tuple[Path, Path], tmp_path: Path
) -> None:
    _, whole = grown
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    result = compute(open_run(whole), cache=PartialCache(blocked))
    assert result.tables["rollouts"].files_read == len(open_run(whole).tables["rollouts"].files)
    assert_json_close(
        {k: v.values for k, v in result.results.items()},
        {k: v.values for k, v in compute(open_run(whole)).results.items()},
    )


#: A cache file overwritten with garbage, and the table whose files are then read again (the
#: results still hold when only a file's index, read again, is damaged).
DAMAGED: dict[str, set[str]] = {
    "files.arrow": {"rollouts", "steps", "probes"},
    "level.arrow": {"steps"},
    "sizes.arrow": {"rollouts"},
    "steps_of.arrow": set(),
    "ids_of.arrow": set(),
    "checks_of.arrow": set(),
    "probed.arrow": set(),
    "rows.arrow": {"probes"},
}


@pytest.mark.parametrize("damaged", DAMAGED)
def test_a_damaged_cache_is_read_again_never_trusted(
    grown: tuple[Path, Path], tmp_path: Path, damaged: str
) -> None:
    """A cache part overwritten with garbage (its file list, a result, a file's index): what
    it held is read again; results keyed by files whose index was damaged still hold. Every
    answer, warnings included, is that of a full read."""
    _, whole = grown
    cache = tmp_path / "cache"
    first = analyze(whole, cache_dir=cache)
    hit = list((cache / "table-partials").rglob(damaged))
    assert hit
    for path in hit:
        path.write_bytes(b"not arrow")
    again = analyze(whole, cache_dir=cache)
    for table, (_, read) in again.run.table_files.items():
        assert (read > 0) == (table in DAMAGED[damaged])
    assert_json_close(_json(again), _json(first))
    assert again.warnings == first.warnings


def test_a_cache_dir_named_like_a_pattern_is_used(grown: tuple[Path, Path], tmp_path: Path) -> None:
    """`--cache-dir` with glob characters: its parts are read by their literal paths."""
    _, whole = grown
    cache = tmp_path / "cache [1]*"
    analyze(whole, cache_dir=cache)
    again = analyze(whole, cache_dir=cache)
    assert again.run.table_files["rollouts"][1] == 0


def test_probes_are_read_again_only_when_rollouts_that_may_hold_their_ids_change(
    grown: tuple[Path, Path], tmp_path: Path
) -> None:
    """A probes file written before the rollouts it probes: its probes match nothing, then
    the rollouts file comes and only that probes file is read again. A rollouts file
    rewritten: only the probes files whose ids its range holds are read again. Every answer
    is the uncached analysis'."""
    _, whole = grown
    run = _copy_without_last(whole, tmp_path / "early-probes")
    last_probes = max(sorted((whole / "probes").glob("*.parquet")))
    (run / "probes" / last_probes.name).write_bytes(last_probes.read_bytes())
    cache = tmp_path / "cache"
    n = len(list((run / "probes").glob("*.parquet")))
    first = analyze(run, cache_dir=cache)
    assert first.run.table_files["probes"] == (n, n)
    assert any("probes:" in w and "not in the rollouts" in w for w in first.warnings)
    assert_json_close(_json(first), _json(analyze(run, use_cache=False)))

    last_rollouts = max(sorted((whole / "rollouts").glob("*.parquet")))
    (run / "rollouts" / last_rollouts.name).write_bytes(last_rollouts.read_bytes())
    came = analyze(run, cache_dir=cache)
    assert came.run.table_files["probes"] == (n, 1)
    assert not any("probes:" in w for w in came.warnings)
    assert_json_close(_json(came), _json(analyze(run, use_cache=False)))

    first_rollouts = min(sorted((run / "rollouts").glob("*.parquet")))
    rows = pl.read_parquet(first_rollouts)
    rows.with_columns(pl.col("answer").reverse()).write_parquet(first_rollouts)
    rewritten = analyze(run, cache_dir=cache)
    assert rewritten.run.table_files["probes"] == (n, 1)
    assert_json_close(_json(rewritten), _json(analyze(run, use_cache=False)))
    assert analyze(run, cache_dir=cache).run.table_files["probes"] == (n, 0)


def _ids_run(root: Path, id_files: list[list[int]], probed: list[int], seed: int) -> Path:
    """A run whose rollouts files hold `id_files` (with some null steps and rewards, NaN and
    absurd lengths) and one probes file probing `probed`."""
    rng = np.random.default_rng(seed)
    (root / "rollouts").mkdir(parents=True)
    (root / "probes").mkdir()
    (root / "run.json").write_text(
        json.dumps({"schema_version": 1, "run_id": "ids", "algorithm": "GRPO"})
    )
    for index, ids in enumerate(id_files):
        n = len(ids)
        reward = rng.choice([0.0, 1.0, np.nan, None], n, p=[0.4, 0.4, 0.1, 0.1])
        frame = pl.DataFrame(
            {
                "rollout_id": ids,
                "step": [None if rng.random() < 0.1 else int(s) for s in rng.integers(0, 4, n)],
                "prompt_id": [f"p{i % 3}" for i in range(n)],
                "reward": [None if r is None else float(r) for r in reward],
                "response_len": rng.choice([10, 20, -1, 10**9], n, p=[0.45, 0.45, 0.05, 0.05]),
                "advantage": rng.choice([0.5, np.nan, np.inf], n, p=[0.8, 0.1, 0.1]),
            },
            schema_overrides={"rollout_id": pl.Int64, "step": pl.Int64, "response_len": pl.Int32},
        )
        frame.write_parquet(root / "rollouts" / f"part-{index:03d}.parquet")
    pl.DataFrame(
        {"rollout_id": probed, "intervention": "truncate", "answer": "a"},
        schema_overrides={"rollout_id": pl.Int64},
    ).write_parquet(root / "probes" / "part-000.parquet")
    return root


def _expected_check(root: Path) -> list[str] | str:
    """The rollouts check of the run at `root` computed directly, in plain Python over all
    its rows: the duplicate-id error, or the warnings."""
    rows = pl.read_parquet(sorted((root / "rollouts").glob("*.parquet"))).to_dicts()
    probed = pl.read_parquet(root / "probes" / "part-000.parquet")["rollout_id"].to_list()
    seen = Counter(r["rollout_id"] for r in rows)
    dupes = sorted(i for i, n in seen.items() if n > 1)[:5]
    if dupes:
        listed = ", ".join(map(str, dupes))
        return f"{root}: rollouts table has duplicate rollout_id values (e.g. {listed})"

    def finite(x: float | None) -> bool:
        return x is not None and math.isfinite(x)

    stepped = [r for r in rows if r["step"] is not None]
    rewarded = [r for r in stepped if finite(r["reward"])]
    absurd = [r for r in rewarded if not 0 <= r["response_len"] <= MAX_RESPONSE_LEN]
    invalid = sum(r["advantage"] is not None and not math.isfinite(r["advantage"]) for r in rows)
    unknown = [i for i in probed if i not in seen]
    counts = {
        "no_step": len(rows) - len(stepped),
        "no_reward": len(stepped) - len(rewarded),
        "bad_len": len(absurd),
        INVALID_PREFIX + "advantage": invalid,
    }
    return check_rollouts(open_run(root), [], counts, (len(unknown), len(set(unknown))))


@pytest.mark.parametrize("seed", range(6))
def test_the_rollouts_check_from_each_file_s_index(tmp_path: Path, seed: int) -> None:
    """The rollouts check from each file's index (id runs, counts, probed ids), read now or
    from the cache, gives the warnings, or the duplicate-id error with the same first ids, of
    a direct computation over all rows: on ids in order, shuffled, sparse, near the Int64
    limits and repeated within or across files, in files read in one batch or several."""
    rng = np.random.default_rng(seed)
    shapes = [
        lambda n: list(range(n)),
        lambda n: rng.permutation(n * 3)[:n].tolist(),
        lambda n: (rng.choice(2**40, n, replace=False) - 2**39).tolist(),
        lambda n: [2**63 - 1 - i for i in range(n)] + [-(2**63) + i for i in range(n)],
    ]
    ids = shapes[seed % len(shapes)](40)
    cuts = sorted(rng.choice(range(1, len(ids)), 3, replace=False).tolist())
    id_files = [ids[a:b] for a, b in itertools.pairwise([0, *cuts, len(ids)])]
    if seed >= 4:  # repeated ids: within one file, then across two
        id_files[1] = [*id_files[1], id_files[1 if seed == 4 else 0][0]]
    probed = [*rng.choice(ids, 5).tolist(), 10**15 + seed, 10**15 + seed]
    root = _ids_run(tmp_path / "run", id_files, probed, seed)
    expected = _expected_check(root)
    assert ("duplicate rollout_id" in str(expected)) == (seed >= 4)
    if seed < 4:
        assert any("probes: 2 row(s) reference 1 rollout_id" in w for w in expected)
    run = open_run(root, check_rollouts=False)
    cache = PartialCache(tmp_path / "cache")

    def outcome(check: Callable[..., list[str]], *args: Any) -> list[str] | str:
        try:
            return check(*args)
        except RlscopeError as exc:
            return exc.message

    with mock.patch("rlscope.reader.INDEX_BATCH_ROWS", 1 + seed * 7):  # files per batch
        assert outcome(check_rollouts_scan, run) == expected
        for store in (None, cache, cache):  # read, uncached; read and cached; from the cache
            index = {t: file_index(run, t, store).frames for t in ("rollouts", "probes")}
            found = outcome(check_from_index, run, index["rollouts"], index["probes"])
            assert found == expected


@pytest.mark.parametrize("batch_rows", [250_000, 7])
def test_files_of_ids_finds_the_file_of_every_id(tmp_path: Path, batch_rows: int) -> None:
    """Each id's file from the runs of ids (ids interleaved across files, gaps, negative),
    each file read whole or in slices of 7 rows: the file that holds it, and no row for an id
    no file holds; each file's steps once."""
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(-50, 150))[:120]
    id_files = [ids[i::3].tolist() for i in range(3)]
    run = open_run(_ids_run(tmp_path / "run", id_files, [0], 0), check_rollouts=False)
    with mock.patch("rlscope.reader.INDEX_BATCH_ROWS", batch_rows):
        index = file_index(run, "rollouts", PartialCache(tmp_path / "cache"))
    steps = run.scan("rollouts", file_index=True).select(FILE_INDEX, "step").unique().collect()
    assert index.frames[STEPS_OF].sort(FILE_INDEX, "step").equals(steps.sort(FILE_INDEX, "step"))
    where = {i: f for f, part in enumerate(id_files) for i in part}
    asked = pl.DataFrame({"rollout_id": list(range(-60, 160))})
    found = index.files_of_ids(asked)
    assert dict(found.select("rollout_id", ROLLOUTS_FILE).iter_rows()) == where
