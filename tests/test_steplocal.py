"""The steps and rollouts tables read per file: each file's results cached, only new files read,
the answers always those of a full read, and a step in two files read whole."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from test_metrics_text import assert_json_close

from rlscope.analysis import analyze
from rlscope.cache import PartialCache
from rlscope.engine import compute
from rlscope.reader import open_run
from rlscope.steplocal import fingerprint
from rlscope.synth import generate


def _split_by_steps(run: Path, table: str, cuts: list[int]) -> None:
    """The table rewritten as one file per range of steps (cut before each step in `cuts`),
    as a trainer flushing every few steps writes it."""
    folder = run / table
    rows = pl.read_parquet(sorted(folder.glob("*.parquet")))
    for path in folder.glob("*.parquet"):
        path.unlink()
    bounds = [None, *cuts, None]
    for index, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        part = rows
        if lo is not None:
            part = part.filter(pl.col("step") >= lo)
        if hi is not None:
            part = part.filter(pl.col("step") < hi)
        part.write_parquet(folder / f"part-{index:04d}.parquet")


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 24-step run with text, evals and probes, its rollouts and steps in files of a few
    steps each: the first 20 steps (`early`), and the whole run (`whole`)."""
    base = tmp_path_factory.mktemp("steplocal")
    whole = base / "whole"
    generate(whole, "diversity-collapse", steps=24, prompts_per_step=4, group_size=6, seed=5)
    for table in ("rollouts", "steps"):
        _split_by_steps(whole, table, [5, 9, 13, 17, 21])
    return base, whole


def _json(report: Any) -> dict[str, Any]:
    out = report.to_dict()
    out["run"].pop("table_files")
    out["run"].pop("token_files")
    return out


def _copy_without_last(whole: Path, target: Path) -> Path:
    """The run as it was before its last rollouts and steps files were written."""
    import shutil

    shutil.copytree(whole, target)
    for table in ("rollouts", "steps"):
        max(sorted((target / table).glob("*.parquet"))).unlink()
    return target


def test_a_run_growing_by_a_file_reads_that_file_only(
    grown: tuple[Path, Path], tmp_path: Path
) -> None:
    """First analysis: every file read, each file's results stored. Again: nothing read. After
    the trainer writes one more rollouts and steps file: that file only. Every answer (every
    metric, finding and its example rollouts) is the uncached analysis'."""
    _, whole = grown
    run = _copy_without_last(whole, tmp_path / "live")
    cache = tmp_path / "cache"
    first = analyze(run, cache_dir=cache)
    files = {t: len(list((run / t).glob("*.parquet"))) for t in ("rollouts", "steps")}
    assert first.run.table_files == {t: (n, n) for t, n in files.items()}
    assert_json_close(_json(first), _json(analyze(run, use_cache=False)))

    again = analyze(run, cache_dir=cache)
    assert again.run.table_files == {t: (n, 0) for t, n in files.items()}
    assert_json_close(_json(again), _json(first))

    for table in ("rollouts", "steps"):
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
        "import rlscope.engine as e; e.read_step_local=spy\n"
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
    assert prints[0] == prints[1] and len(json.loads(prints[0].replace("'", '"'))) == 2
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


@pytest.mark.parametrize("damaged", ["files.arrow", "level.arrow", "steps_of.arrow"])
def test_a_damaged_cache_is_read_again_never_trusted(
    grown: tuple[Path, Path], tmp_path: Path, damaged: str
) -> None:
    """A cache part overwritten with garbage (its file list, a result): the files are read
    again; a file's steps: they are read again (the results, keyed by the files, still hold).
    Every answer is that of a full read."""
    _, whole = grown
    cache = tmp_path / "cache"
    first = analyze(whole, cache_dir=cache)
    hit = list((cache / "table-partials").rglob(damaged))
    assert hit
    for path in hit:
        path.write_bytes(b"not arrow")
    again = analyze(whole, cache_dir=cache)
    assert (again.run.table_files["rollouts"][1] > 0) == (damaged != "steps_of.arrow")
    assert_json_close(_json(again), _json(first))


def test_a_cache_dir_named_like_a_pattern_is_used(grown: tuple[Path, Path], tmp_path: Path) -> None:
    """`--cache-dir` with glob characters: its parts are read by their literal paths."""
    _, whole = grown
    cache = tmp_path / "cache [1]*"
    analyze(whole, cache_dir=cache)
    again = analyze(whole, cache_dir=cache)
    assert again.run.table_files["rollouts"][1] == 0
