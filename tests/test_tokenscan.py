"""The per-file token scan: merged partials equal one pass over all rows, the cache reads only
new or changed files, and the map/merge split runs on another executor (no cluster needed)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlscope import tokenscan
from rlscope.analysis import analyze
from rlscope.cache import PartialCache, Parts
from rlscope.engine import compute, token_plan
from rlscope.reader import open_run
from rlscope.tokenscan import (
    ROWS,
    TokenPlan,
    file_partials,
    is_additive,
    limits,
    mapmerge,
    merge,
    reduce,
    scan_tokens,
    token_files,
)

WriteRun = Callable[..., Path]
SEGMENTS = np.array(["think", "answer", "tool_call"])


def make_tokens(seed: int, steps: range, rollouts_per_step: int = 6) -> dict[str, np.ndarray]:
    """Token rows of `rollouts_per_step` rollouts per step, each rollout's tokens contiguous,
    with think/answer/tool_call segments and a few NaN entropies."""
    rng = np.random.default_rng(seed)
    n_rollouts = len(steps) * rollouts_per_step
    lengths = rng.integers(5, 60, n_rollouts)
    rollout = np.repeat(np.arange(n_rollouts, dtype=np.int64), lengths)
    step = np.repeat(np.repeat(np.array(list(steps), dtype=np.int64), rollouts_per_step), lengths)
    n = rollout.size
    logprob = -rng.gamma(0.7, 1.0, n)
    entropy = rng.gamma(0.6, 1.5, n).astype(np.float32)
    entropy[rng.choice(n, n // 50, replace=False)] = np.nan
    starts = np.cumsum(lengths) - lengths
    return {
        "rollout_id": rollout,
        "step": step,
        "pos": (np.arange(n) - np.repeat(starts, lengths)).astype(np.int32),
        "logprob": logprob.astype(np.float32),
        "old_logprob": (logprob + rng.normal(0, 0.2, n)).astype(np.float32),
        "ref_logprob": (logprob + rng.normal(0, 0.3, n)).astype(np.float32),
        "entropy": entropy,
        "advantage": np.repeat(rng.normal(0, 1, n_rollouts), lengths).astype(np.float32),
        "clipped": rng.random(n) < 0.1,
        "segment": SEGMENTS[rng.integers(0, 3, n)],
    }


def rollouts_of(tokens: dict[str, np.ndarray]) -> dict[str, Any]:
    ids, first = np.unique(tokens["rollout_id"], return_index=True)
    return {
        "rollout_id": ids,
        "step": tokens["step"][first],
        "prompt_id": [f"p{i // 3}" for i in ids],
        "reward": (ids % 2).astype(float),
        "response_len": np.bincount(tokens["rollout_id"])[ids],
    }


def split(tokens: dict[str, np.ndarray], cuts: list[int]) -> list[dict[str, np.ndarray]]:
    """The rows cut into consecutive files at the given row indices."""
    bounds = [0, *cuts, tokens["step"].size]
    return [{k: v[a:b] for k, v in tokens.items()} for a, b in itertools.pairwise(bounds)]


def at_rollout_boundaries(tokens: dict[str, np.ndarray], files: int) -> list[int]:
    starts = np.flatnonzero(np.r_[True, np.diff(tokens["rollout_id"]) != 0])
    return [int(starts[len(starts) * k // files]) for k in range(1, files)]


def plan_for(path: Path) -> TokenPlan:
    """The plan `compute` uses for every token metric."""
    return token_plan(open_run(path))


def assert_frames_close(a: pl.DataFrame, b: pl.DataFrame) -> None:
    assert a.columns == b.columns
    assert a.height == b.height
    for column in a.columns:
        x, y = a[column], b[column]
        if x.dtype.is_float():
            np.testing.assert_allclose(x.to_numpy(), y.to_numpy(), rtol=1e-12, atol=1e-12)
        else:
            assert x.to_list() == y.to_list(), column


def assert_results_close(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Same metrics, steps and values up to float summation order."""
    assert a.keys() == b.keys()
    for metric_id, result in a.items():
        other = b[metric_id]
        assert result.steps == other.steps, metric_id
        np.testing.assert_allclose(
            [np.nan if v is None else v for v in result.values],
            [np.nan if v is None else v for v in other.values],
            rtol=1e-12,
            err_msg=metric_id,
        )


def test_merged_file_partials_equal_direct_numpy_sums(write_run: WriteRun) -> None:
    tokens = make_tokens(0, range(1, 9))
    n = tokens["step"].size
    cuts = [n // 5, n // 5 + 1, n // 2, 4 * n // 5]  # anywhere, one file of a single row
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": split(tokens, cuts)})
    levels, stats = scan_tokens(open_run(run), plan_for(run))
    assert stats.files == stats.files_read == 5 and stats.rows == tokens["step"].size
    steps = levels[""]
    for row in steps.iter_rows(named=True):
        m = tokens["step"] == row["step"]
        entropy = tokens["entropy"][m].astype(np.float64)
        assert row[ROWS] == m.sum()
        assert row["ent_n"] == np.isfinite(entropy).sum()
        assert row["ent_sum"] == pytest.approx(np.nansum(entropy), rel=1e-12)
        assert row["clip_n"] == tokens["clipped"][m].sum()
        assert row["__invalid__entropy"] == np.isnan(entropy).sum()
        lp, ref = (tokens[c][m].astype(np.float64) for c in ("logprob", "ref_logprob"))
        d = ref - lp
        assert row["kl_sum"] == pytest.approx(np.sum(np.exp(d) - d - 1), rel=1e-12)
    segments = levels["segments"]
    for row in segments.iter_rows(named=True):
        m = (tokens["step"] == row["step"]) & (tokens["segment"] == row["segment"])
        assert row["seg_tokens"] == m.sum()
        # Exact: every rollout's tokens are within one file (cuts at rollout boundaries or not,
        # a rollout split by a cut is counted once per file: see the bound test below).
        assert row["seg_rollouts"] >= np.unique(tokens["rollout_id"][m]).size
    bins = levels["entropy_bins"]
    finite = np.isfinite(tokens["entropy"])
    assert int(bins["ent_n"].sum()) == finite.sum()
    expected = np.floor(
        np.log1p(np.maximum(tokens["entropy"][finite].astype(np.float64), 0) / 0.05) * 100
    ).astype(np.int64)
    values, counts = np.unique(expected, return_counts=True)
    over_steps = bins.group_by("entropy_bin").agg(pl.col("ent_n").sum()).sort("entropy_bin")
    assert over_steps["entropy_bin"].to_list() == values.tolist()
    assert over_steps["ent_n"].to_list() == counts.tolist()


def test_file_layout_does_not_change_any_metric(write_run: WriteRun) -> None:
    """One file, or many cut at rollout boundaries, or many cut anywhere: the same results
    (the distinct-rollout count per segment is exact when no rollout spans two files)."""
    tokens = make_tokens(1, range(1, 13))
    rollouts = rollouts_of(tokens)
    one = write_run({"rollouts": rollouts, "tokens": tokens})
    many = write_run(
        {"rollouts": rollouts, "tokens": split(tokens, at_rollout_boundaries(tokens, 7))}
    )
    a, b = compute(open_run(one)), compute(open_run(many))
    assert a.tokens.files == 1 and b.tokens.files == 7
    assert_results_close(a.results, b.results)


def test_rollouts_split_across_batches_overcount_within_the_stated_bound(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Distinct rollouts per (step, segment) are counted per batch: a rollout cut by a batch
    (or file) boundary counts once per piece, so the over-count is at most the number of
    boundaries inside the step."""
    tokens = make_tokens(2, range(1, 4), rollouts_per_step=20)
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    exact, _ = scan_tokens(open_run(run), plan_for(run))
    monkeypatch.setattr(limits, "BATCH_ROWS", 97)
    monkeypatch.setattr(limits, "POOL_ROWS", 97)  # a small file's batches reduced apart
    batched, _ = scan_tokens(open_run(run), plan_for(run))
    boundaries = tokens["step"].size // 97
    over = batched["segments"]["seg_rollouts"] - exact["segments"]["seg_rollouts"]
    assert 0 < int(over.sum()) <= boundaries * len(SEGMENTS)
    assert (over >= 0).all()
    # Everything else is a sum, exact whatever the batching.
    assert_frames_close(batched[""], exact[""])
    assert_frames_close(batched["entropy_bins"], exact["entropy_bins"])


def test_unsorted_rows_take_the_group_by_path_with_the_same_result(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sorted rows are reduced run by run of one step (forced here for a small file), shuffled
    ones by a group-by: the same partials."""
    monkeypatch.setattr(limits, "MIN_STEP_RUN_ROWS", 1)
    tokens = make_tokens(3, range(1, 30), rollouts_per_step=1)
    order = np.random.default_rng(0).permutation(tokens["step"].size)
    shuffled = {k: v[order] for k, v in tokens.items()}
    rollouts = rollouts_of(tokens)
    sorted_run = write_run({"rollouts": rollouts, "tokens": tokens})
    shuffled_run = write_run({"rollouts": rollouts, "tokens": shuffled})
    a, _ = scan_tokens(open_run(sorted_run), plan_for(sorted_run))
    b, _ = scan_tokens(open_run(shuffled_run), plan_for(shuffled_run))
    for level in ("", "entropy_bins"):
        assert_frames_close(a[level], b[level])
    assert a["ids"].equals(b["ids"])


def test_merge_is_associative(write_run: WriteRun) -> None:
    tokens = make_tokens(4, range(1, 7))
    n = tokens["step"].size
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": split(tokens, [n // 4, n // 2])})
    plan = plan_for(run)
    parts = [file_partials(f, plan) for f in token_files(open_run(run), plan)]
    flat = merge(parts, plan)
    nested = merge([merge(parts[:2], plan), merge(parts[2:], plan)], plan)
    for level in plan.levels:
        assert_frames_close(flat[level], nested[level])


def test_reanalysis_reads_only_the_appended_file(
    write_run: WriteRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = make_tokens(5, range(1, 11))
    pieces = split(tokens, at_rollout_boundaries(tokens, 4))
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": pieces[:3]})
    cache = tmp_path / "cache"
    read: list[str] = []
    original = mapmerge.chunk_tagged
    monkeypatch.setattr(
        mapmerge,
        "chunk_tagged",
        lambda files, plan: (read.extend(f.path.name for f in files), original(files, plan))[1],
    )

    first = compute(open_run(run), cache=PartialCache(cache))
    assert (first.tokens.files, first.tokens.files_read) == (3, 3) and len(read) == 3
    again = compute(open_run(run), cache=PartialCache(cache))
    assert again.tokens.files_read == 0 and again.tokens.rows_read == 0 and len(read) == 3
    assert_results_close(again.results, first.results)

    # The trainer appends a file: only that one is read.
    extra = pieces[3]
    pl.DataFrame(extra).write_parquet(run / "tokens" / "r000-999999.parquet")
    grown = compute(open_run(run), cache=PartialCache(cache))
    assert (grown.tokens.files, grown.tokens.files_read) == (4, 1)
    assert read[3:] == ["r000-999999.parquet"]
    assert grown.tokens.rows_read == extra["step"].size
    assert grown.tokens.rows == tokens["step"].size
    # And the answer is the full scan's.
    assert_results_close(compute(open_run(run)).results, grown.results)


def test_a_rewritten_file_is_read_again_and_a_corrupt_cache_entry_recomputed(
    write_run: WriteRun, tmp_path: Path
) -> None:
    tokens = make_tokens(6, range(1, 5))
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    cache = PartialCache(tmp_path / "cache")
    before = compute(open_run(run), cache=cache)
    (path,) = (run / "tokens").glob("*.parquet")
    changed = dict(tokens, entropy=tokens["entropy"] * 2)
    pl.DataFrame(changed).write_parquet(path)
    os.utime(path, ns=(1, 1))  # even an odd mtime is a different key
    after = compute(open_run(run), cache=cache)
    assert after.tokens.files_read == 1
    assert after.results["behavior.entropy"].value == pytest.approx(
        2 * before.results["behavior.entropy"].value, rel=1e-6
    )
    for entry in cache.root.rglob("*.arrow"):
        entry.write_bytes(b"not parquet")
    again = compute(open_run(run), cache=cache)
    assert again.tokens.files_read == 1
    assert_results_close(again.results, after.results)


def test_an_unwritable_cache_costs_speed_not_results(write_run: WriteRun, tmp_path: Path) -> None:
    tokens = make_tokens(7, range(1, 5))
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    result = compute(open_run(run), cache=PartialCache(blocked))
    assert_results_close(result.results, compute(open_run(run)).results)


def test_analyze_never_writes_into_the_run_and_no_cache_writes_nothing(
    write_run: WriteRun, tmp_path: Path
) -> None:
    tokens = make_tokens(8, range(1, 5))
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    before = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*"))
    analyze(run, cache_dir=tmp_path / "off", use_cache=False)
    assert not (tmp_path / "off").exists()
    analyze(run, cache_dir=tmp_path / "on")
    assert list((tmp_path / "on").rglob("*.arrow"))
    assert sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def _spawn_pool_map(fn: Any, files: list[Any]) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        return list(pool.map(fn, files))


def test_map_merge_on_another_executor_gives_the_same_report(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-file stage in separate processes (what Ray or Dask would run on workers), the
    merge on the driver: the same metrics as the default in-process scan."""
    monkeypatch.setattr(limits, "CHUNK_BYTES", 1)  # a chunk per file: five tasks
    tokens = make_tokens(9, range(1, 9))
    run = write_run(
        {"rollouts": rollouts_of(tokens), "tokens": split(tokens, at_rollout_boundaries(tokens, 5))}
    )
    local = compute(open_run(run))
    distributed = compute(open_run(run), mapper=_spawn_pool_map)
    assert distributed.tokens.files_read == 5
    assert_results_close(distributed.results, local.results)


def test_every_token_partial_is_mergeable() -> None:
    """A mean or a max per file cannot be merged by summing: the plan refuses it."""
    assert is_additive(pl.col("x").cast(pl.Float64).sum())
    assert is_additive(pl.col("x").count().cast(pl.Int64))
    assert not is_additive(pl.col("x").mean())
    assert not is_additive(pl.col("x").max().cast(pl.Float64))
    with pytest.raises(ValueError, match="must be a sum"):
        TokenPlan({"": {"m": pl.col("x").mean()}})


@pytest.mark.parametrize("segment_type", [pl.String, pl.Categorical])
def test_runs_of_one_rollout_and_segment_give_the_group_by_partials(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch, segment_type: pl.DataType
) -> None:
    """One step's sorted rows get their segments and ids levels from runs of one (rollout,
    segment) (a row per run), shuffled rows from a group-by per row: the same partials, with
    null segments, NaN entropies and segments interleaved within a rollout."""
    monkeypatch.setattr(limits, "MIN_STEP_RUN_ROWS", 1)
    tokens = make_tokens(5, range(1, 9), rollouts_per_step=4)
    n = tokens["step"].size
    rng = np.random.default_rng(5)
    segment = tokens["segment"].astype(object)
    segment[rng.choice(n, n // 10, replace=False)] = None
    # Long spans too (not only one-token runs): the first half of each step's rows is "think".
    segment[: n // 2][rng.random(n // 2) < 0.7] = "think"
    frame = pl.DataFrame({**tokens, "segment": segment}).with_columns(
        pl.col("segment").cast(segment_type)
    )
    order = rng.permutation(n)
    rollouts = rollouts_of(tokens)
    sorted_run = write_run({"rollouts": rollouts, "tokens": [frame]})
    shuffled = frame.select(pl.all().gather(order))
    shuffled_run = write_run({"rollouts": rollouts, "tokens": [shuffled]})
    plan = plan_for(sorted_run)
    a, _ = scan_tokens(open_run(sorted_run), plan)
    b, _ = scan_tokens(open_run(shuffled_run), plan)
    for level in plan.levels:
        assert_frames_close(a[level], b[level])
    # And against numpy, row by row.
    for row in a["segments"].iter_rows(named=True):
        m = (tokens["step"] == row["step"]) & (segment == row["segment"])
        assert row["seg_tokens"] == m.sum()
        assert row["seg_rollouts"] == np.unique(tokens["rollout_id"][m]).size
        entropy = tokens["entropy"][m].astype(np.float64)
        assert row["ent_n"] == np.isfinite(entropy).sum()
        assert row["ent_sum"] == pytest.approx(np.nansum(entropy), rel=1e-12)
    assert a["segments"]["seg_tokens"].sum() == sum(s is not None for s in segment)
    ids = a["ids"]
    assert ids["len"].to_list() == np.bincount(tokens["rollout_id"])[ids["rollout_id"]].tolist()


def test_the_built_in_segment_partials_are_reduced_from_runs(write_run: WriteRun) -> None:
    """Every segments-level partial of the built-in metrics has a shape the runs path computes
    (else that level would fall back to a group-by per row: correct, but slower)."""
    tokens = make_tokens(6, range(1, 3))
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    opened = open_run(run)
    plan = plan_for(run)
    (file,) = token_files(opened, plan)
    frame = pl.read_parquet(file.path, columns=list(file.target)).filter(pl.col("step") == 1)
    assert set(reduce._run_levels(frame, plan)) == {"segments", "ids"}
    # A null rollout_id, or a partial of another shape, is left to the group-by.
    assert reduce._run_levels(frame.with_columns(rollout_id=None), plan) == {}
    odd = TokenPlan({"segments": {"top": pl.col("entropy").max().cast(pl.Float64).sum()}})
    assert reduce._run_levels(frame, odd) == {}


def test_finite_values_whose_float32_sum_overflows_are_not_flagged(write_run: WriteRun) -> None:
    """NaN/inf are found by a column's sum (finite: none), and row by row when the sum is not
    finite: an overflowing sum of finite values flags nothing; a real inf is counted."""
    tokens = make_tokens(7, range(1, 3))
    tokens["entropy"] = np.full(tokens["step"].size, 3e38, dtype=np.float32)
    tokens["logprob"][:3] = np.inf
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    levels, _ = scan_tokens(open_run(run), plan_for(run))
    steps = levels[""]
    assert steps["__invalid__entropy"].sum() == 0
    assert steps["ent_n"].sum() == tokens["step"].size
    assert steps["ent_sum"].sum() == pytest.approx(3e38 * tokens["step"].size, rel=1e-6)
    assert steps["__invalid__logprob"].sum() == 3


def test_a_file_is_read_in_even_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """250 rows at BATCH_ROWS = 100: three batches of about 83, not 100, 100 and 50."""
    monkeypatch.setattr(limits, "BATCH_ROWS", 100)
    path = tmp_path / "tokens.parquet"
    pl.DataFrame({"step": np.arange(250)}).write_parquet(path)
    file = tokenscan.TokenFile(path, {"step": pl.Int64}, {"step": pl.Int64}, {}, (0, 0, 0))
    sizes = [batch.height for batch in reduce._batches(file)]
    assert sum(sizes) == 250 and len(sizes) == 3
    assert max(sizes) - min(sizes) <= 2


def test_a_step_in_two_runs_of_one_file_is_one_row(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of steps 1, 2, then 1 again in one file (three runs of one step): every level has
    one row per key, as the group-by path gives."""
    monkeypatch.setattr(limits, "MIN_STEP_RUN_ROWS", 1)
    first, second = make_tokens(8, range(1, 3)), make_tokens(9, range(1, 2))
    second["rollout_id"] = second["rollout_id"] + first["rollout_id"].max() + 1
    tokens = {k: np.concatenate([first[k], second[k]]) for k in first}
    order = np.random.default_rng(8).permutation(tokens["step"].size)
    rollouts = rollouts_of(tokens)
    runs = write_run({"rollouts": rollouts, "tokens": tokens})
    shuffled = write_run({"rollouts": rollouts, "tokens": {k: v[order] for k, v in tokens.items()}})
    plan = plan_for(runs)
    a, _ = scan_tokens(open_run(runs), plan)
    b, _ = scan_tokens(open_run(shuffled), plan)
    assert a[""]["step"].to_list() == [1, 2]
    for level in plan.levels:
        assert_frames_close(a[level], b[level])


def write_row_groups(
    path: Path, table: pa.Table, bounds: list[int], split_floats: bool, statistics: bool = True
) -> None:
    """`table` written to `path` in row groups cut at `bounds`, its floats byte-stream-split
    (as RunWriter writes them) or dictionary-encoded (pyarrow's default)."""
    floats = [f.name for f in table.schema if pa.types.is_floating(f.type)]
    with pq.ParquetWriter(
        path,
        table.schema,
        write_statistics=statistics,
        use_byte_stream_split=floats if split_floats else False,
        use_dictionary=[c for c in table.column_names if not (split_floats and c in floats)],
    ) as parquet:
        for start, end in itertools.pairwise(bounds):
            parquet.write_table(table.slice(start, end - start), end - start)


def record_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """Patches the two decoders to record, per read, which decoded it and the columns asked."""
    read: list[tuple[str, list[str]]] = []
    for name in ("_arrow_reads", "_polars_reads"):
        original = getattr(reduce, name)

        def recorded(*args: Any, _original: Any = original, _name: str = name) -> Any:
            read.append((_name, args[-2]))  # (…, columns, cap)
            return _original(*args)

        monkeypatch.setattr(reduce, name, recorded)
    return read


@pytest.mark.parametrize("step_type", [pa.int64(), pa.int32()])
@pytest.mark.parametrize("decoder", ["_arrow_reads", "_polars_reads"])
def test_row_groups_of_one_step_are_reduced_without_decoding_the_step(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch, step_type: pa.DataType, decoder: str
) -> None:
    """Row groups whose statistics say one step (minimum = maximum, no nulls) are read without
    their step column, the step given as a constant; a row group of two steps is read row by
    row. The partials are those of the same rows read with every step (no statistics), by
    either decoder (pyarrow for byte-stream-split floats, Polars for dictionary-encoded ones)."""
    tokens = make_tokens(14, range(1, 6))
    table = pl.DataFrame(tokens).to_arrow()
    table = table.set_column(1, "step", table["step"].cast(step_type))
    starts = np.flatnonzero(np.diff(tokens["step"])) + 1
    bounds = [0, *starts[:3].tolist(), table.num_rows]  # steps 1, 2, 3, then 4 and 5 together
    partials = []
    for statistics in (True, False):
        run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
        (path,) = (run / "tokens").glob("*.parquet")
        write_row_groups(path, table, bounds, decoder == "_arrow_reads", statistics)
        plan = plan_for(run)
        (file,) = token_files(open_run(run), plan)
        spans = reduce._step_spans(pq.read_metadata(path), file, [0, 1, 2, 3])
        if statistics:
            assert spans == [([0], 1), ([1], 2), ([2], 3), ([3], None)]
        else:
            assert spans == [([0, 1, 2, 3], None)]
        with monkeypatch.context() as patch:
            patch.setattr(limits, "SMALL_FILE_BYTES", 0)  # not read whole by Polars
            read = record_reads(patch)
            partials.append(file_partials(file, plan))
        assert {name for name, _ in read} == {decoder}
        with_step = ["step" in columns for _, columns in read]
        assert with_step == ([False, False, False, True] if statistics else [True])
    for level in plan.levels:
        assert_frames_close(partials[0][level], partials[1][level])
    assert partials[0][""]["step"].to_list() == [1, 2, 3, 4, 5]


def test_the_decoder_is_chosen_by_encoding_and_row_group_size(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Polars decodes a file's row groups when none of the columns read is byte-stream-split
    and each fits in WHOLE_GROUP_BYTES decoded; else pyarrow, in batches. Both give the same
    rows, in batches of at most the cap, for a whole file and for a piece of its row groups
    (row groups smaller than the cap read together, larger ones cut)."""
    monkeypatch.setattr(limits, "SMALL_FILE_BYTES", 0)
    monkeypatch.setattr(limits, "BATCH_ROWS", 250)
    tokens = make_tokens(15, range(1, 9))
    table = pl.DataFrame(tokens).to_arrow()
    group_rows = [40, 70, 600, 90, 30, 300]  # then the rest
    bounds = [0, *itertools.accumulate(group_rows), table.num_rows]
    assert bounds[-2] < table.num_rows
    read_back: dict[str, list[pl.DataFrame]] = {}
    for split_floats in (False, True):
        run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
        (path,) = (run / "tokens").glob("*.parquet")
        write_row_groups(path, table, bounds, split_floats)
        plan = plan_for(run)
        (file,) = token_files(open_run(run), plan)
        meta = pq.read_metadata(path)
        columns = list(file.target)
        groups = list(range(meta.num_row_groups))
        assert reduce._polars_decodes(meta, columns, groups, 41) is not split_floats
        with monkeypatch.context() as patch:
            patch.setattr(limits, "WHOLE_GROUP_BYTES", 599 * 41)  # the 600-row group too big
            assert not reduce._polars_decodes(meta, columns, groups, 41)
            assert reduce._polars_decodes(meta, columns, [0, 1], 41) is not split_floats
        decoder = "_arrow_reads" if split_floats else "_polars_reads"
        for name, piece in (("whole", None), ("piece", (1, 2, 3, 4))):
            with monkeypatch.context() as patch:
                read = record_reads(patch)
                part = dataclasses.replace(file, row_groups=piece)
                batches = list(reduce._batches(part))
            assert {n for n, _ in read} == {decoder}
            assert max(b.height for b in batches) <= 250
            read_back.setdefault(name, []).append(pl.concat(batches))
    expected = pl.DataFrame(tokens).select(read_back["whole"][0].columns)
    for name, (by_polars, by_arrow) in read_back.items():
        rows = expected if name == "whole" else expected.slice(bounds[1], bounds[5] - bounds[1])
        for frame in (by_polars, by_arrow):
            assert_frames_close(frame.cast(rows.schema), rows)


def test_many_small_files_in_one_chunk_give_the_one_file_partials(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live run written in small flushes: 120 files (one with NaN flags, most without) in one
    chunk of work, their partials collected in slices (COLLECT_SLICE forced small): each file's
    partials are its own, and merged they equal the one-file scan."""
    monkeypatch.setattr(limits, "COLLECT_SLICE", 5)
    tokens = make_tokens(10, range(1, 21), rollouts_per_step=6)
    tokens["entropy"] = np.nan_to_num(tokens["entropy"], nan=0.5)
    tokens["entropy"][7] = np.nan  # in the first file only
    rollouts = rollouts_of(tokens)
    pieces = split(tokens, at_rollout_boundaries(tokens, 120))
    one = write_run({"rollouts": rollouts, "tokens": tokens})
    many = write_run({"rollouts": rollouts, "tokens": pieces})
    plan = plan_for(one)
    files = token_files(open_run(many), plan)
    assert len(tokenscan.chunks(files)) == 1
    per_file = tokenscan.chunk_partials(files, plan)
    for file, partials in zip(files, per_file, strict=True):
        alone = file_partials(file, plan)
        for level in plan.levels:
            assert_frames_close(partials[level], alone[level])
    merged = merge(per_file, plan)
    whole, _ = scan_tokens(open_run(one), plan)
    for level in plan.levels:
        assert_frames_close(merged[level], whole[level])
    assert merged[""]["__invalid__entropy"].sum() == 1


def test_partials_keyed_by_string_categorical_or_enum_segments_merge(write_run: WriteRun) -> None:
    """Files' segments partials keyed by a an enum, a categorical or a string segment (a mapper
    may return any of them): they merge, equal to the all-string partials' merge."""
    tokens = make_tokens(11, range(1, 7))
    run = write_run(
        {"rollouts": rollouts_of(tokens), "tokens": split(tokens, at_rollout_boundaries(tokens, 3))}
    )
    plan = plan_for(run)
    parts = [file_partials(f, plan) for f in token_files(open_run(run), plan)]
    types = [pl.Enum(sorted(SEGMENTS)), pl.Categorical, pl.String]
    typed = [
        {**one, "segments": one["segments"].with_columns(pl.col("segment").cast(t))}
        for one, t in zip(parts, types, strict=True)
    ]
    a, b = merge(parts, plan), merge(typed, plan)
    for level in plan.levels:
        assert_frames_close(a[level], b[level])


def test_a_large_file_is_read_in_pieces_and_byte_capped_batches(
    write_run: WriteRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file of many row groups over PIECE_FILE_BYTES is split into pieces of whole row groups
    (each reduced on its own, as a file would be), read in batches capped by decoded bytes:
    the partials are the one-piece scan's, and the cache holds it as one file."""
    tokens = make_tokens(12, range(1, 9))
    one = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    (path,) = (one / "tokens").glob("*.parquet")
    pq.write_table(pl.DataFrame(tokens).to_arrow(), path, row_group_size=100)  # many groups
    plan = plan_for(one)
    whole, _ = scan_tokens(open_run(one), plan)
    (file,) = token_files(open_run(one), plan)
    groups = pq.read_metadata(path).num_row_groups
    assert groups > 10

    monkeypatch.setattr(limits, "PIECE_FILE_BYTES", 1)
    monkeypatch.setattr(limits, "PIECE_ROWS", 400)
    monkeypatch.setattr(limits, "BATCH_BYTES", 60 * 41)  # ~60 rows of the 9 columns read
    split_up = tokenscan.pieces([file])
    assert len(split_up) > 1
    assert [g for piece in split_up for g in piece.row_groups or ()] == list(range(groups))
    sizes = [batch.height for batch in reduce._batches(split_up[0])]
    assert max(sizes) <= 60 and 400 <= sum(sizes) <= 400 + 100
    read: list[tuple[int, ...] | None] = []
    original = mapmerge.chunk_tagged
    monkeypatch.setattr(
        mapmerge,
        "chunk_tagged",
        lambda files, plan: (read.extend(f.row_groups for f in files), original(files, plan))[1],
    )
    cache = PartialCache(tmp_path / "cache")
    pieced, stats = scan_tokens(open_run(one), plan, cache=cache)
    assert len(read) == len(split_up) and stats.files_read == 1
    again, stats = scan_tokens(open_run(one), plan, cache=PartialCache(tmp_path / "cache"))
    assert stats.files_read == 0
    boundaries = tokens["step"].size // 50  # batches of at least ~50 rows
    for partials in (pieced, again):
        for level in plan.levels:
            if level != "segments":
                assert_frames_close(partials[level], whole[level])
        # A rollout cut by a batch boundary counts once per batch (the stated bound).
        segments, exact = partials["segments"], whole["segments"]
        assert_frames_close(segments.drop("seg_rollouts"), exact.drop("seg_rollouts"))
        over = segments["seg_rollouts"] - exact["seg_rollouts"]
        assert (over >= 0).all() and int(over.sum()) <= boundaries * len(SEGMENTS)


def test_folding_partials_as_files_come_changes_nothing(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files' partials summed every FOLD_FILES files (so thousands of files' frames are never
    all held) give the partials of one pass."""
    tokens = make_tokens(13, range(1, 13))
    rollouts = rollouts_of(tokens)
    one = write_run({"rollouts": rollouts, "tokens": tokens})
    many = write_run(
        {"rollouts": rollouts, "tokens": split(tokens, at_rollout_boundaries(tokens, 9))}
    )
    monkeypatch.setattr(limits, "FOLD_FILES", 2)
    monkeypatch.setattr(limits, "CHUNK_BYTES", 1)  # a chunk per file
    plan = plan_for(one)
    a, _ = scan_tokens(open_run(one), plan)
    b, stats = scan_tokens(open_run(many), plan)
    assert stats.files == 9
    for level in plan.levels:
        assert_frames_close(a[level], b[level])


def _parts(cache: PartialCache) -> list[Path]:
    (manifest,) = cache.root.rglob("MANIFEST")
    return [manifest.parent / name for name in json.loads(manifest.read_text())["parts"]]


def test_the_cache_grows_by_parts_drops_gone_files_and_compacts(
    write_run: WriteRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live run: each analysis after a file is appended writes a part holding that file only
    (never the whole cache again); parts are written as the scan goes; a part whose
    files are all gone leaves the manifest and the disk; past MAX_PARTS parts the live files
    are compacted into one. Every answer is the full scan's."""
    monkeypatch.setattr(Parts, "TAG_FILES", 2)
    monkeypatch.setattr(Parts, "PART_ROWS", 1)  # a part per 2 files
    monkeypatch.setattr(Parts, "MAX_PARTS", 3)
    tokens = make_tokens(14, range(1, 13))
    rollouts = rollouts_of(tokens)
    pieces = split(tokens, at_rollout_boundaries(tokens, 8))
    run = write_run({"rollouts": rollouts, "tokens": pieces[:3]})
    files = sorted((run / "tokens").glob("*.parquet"))

    def analysed() -> tuple[PartialCache, Any]:
        cache = PartialCache(tmp_path / "cache")
        result = compute(open_run(run), cache=cache)
        assert_results_close(result.results, compute(open_run(run)).results)
        return cache, result

    cache, _ = analysed()
    parts = _parts(cache)
    assert len(parts) == 2  # 3 files flushed 2 at a time
    assert sorted(len(pl.read_ipc(p / "files.arrow")) for p in parts) == [1, 2]

    pl.DataFrame(pieces[3]).write_parquet(run / "tokens" / "r000-999991.parquet")
    cache, grown = analysed()
    assert grown.tokens.files_read == 1
    added = [p for p in _parts(cache) if p not in parts]
    assert len(added) == 1 and len(pl.read_ipc(added[0] / "files.arrow")) == 1
    assert set(parts) < set(_parts(cache))

    # The two files of the first part are gone: it is dropped, from the manifest and the disk.
    first_part = next(p for p in parts if len(pl.read_ipc(p / "files.arrow")) == 2)
    keys = set(pl.read_ipc(first_part / "files.arrow")["key"].to_list())
    for path in files:
        file = next(f for f in token_files(open_run(run), plan_for(run)) if f.path == path)
        if PartialCache.key(file) in keys:
            path.unlink()
    cache, shrunk = analysed()
    assert shrunk.tokens.files_read == 0  # nothing new: the manifest is kept as it was
    pl.DataFrame(pieces[4]).write_parquet(run / "tokens" / "r000-999992.parquet")
    cache, _ = analysed()
    assert first_part not in _parts(cache) and not first_part.exists()

    # One more append makes 4 parts, past MAX_PARTS: one part with every live file.
    assert len(_parts(cache)) == 3
    pl.DataFrame(pieces[5]).write_parquet(run / "tokens" / "r000-999993.parquet")
    cache, last = analysed()
    (compacted,) = _parts(cache)
    live = len(list((run / "tokens").glob("*.parquet")))
    assert len(pl.read_ipc(compacted / "files.arrow")) == live
    assert last.tokens.files == live
    assert len(list(compacted.parent.glob("part-*"))) == 1
    again = compute(open_run(run), cache=PartialCache(tmp_path / "cache"))
    assert again.tokens.files_read == 0
    assert_results_close(again.results, compute(open_run(run)).results)


def test_small_files_read_in_pools_give_each_file_its_own_partials(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live run's small files, read together by one scan per pool (POOL_BYTES forced to
    about three files, so pools, single files and a file of another kind alternate): each
    file's partials are those it has read alone, and they merge to the one-file scan."""
    tokens = make_tokens(15, range(1, 21), rollouts_per_step=6)
    rollouts = rollouts_of(tokens)
    many = write_run(
        {"rollouts": rollouts, "tokens": split(tokens, at_rollout_boundaries(tokens, 12))}
    )
    one = write_run({"rollouts": rollouts, "tokens": tokens})
    paths = sorted((many / "tokens").glob("*.parquet"))
    other = pl.read_parquet(paths[5]).with_columns(pl.col("entropy").cast(pl.Float64))
    other.write_parquet(paths[5])  # a file of another kind
    monkeypatch.setattr(limits, "POOL_BYTES", sum(p.stat().st_size for p in paths[:3]))
    plan = plan_for(one)
    files = token_files(open_run(many), plan)
    reads = list(mapmerge._reads(files))
    assert any(index is None for index, _ in reads)  # a pool
    assert any(index is not None for index, _ in reads)  # a file read alone
    per_file = tokenscan.chunk_partials(files, plan)
    for file, partials in zip(files, per_file, strict=True):
        alone = tokenscan.chunk_partials([file], plan)[0]
        for level in plan.levels:
            assert_frames_close(partials[level], alone[level])
    whole, _ = scan_tokens(open_run(one), plan)
    merged = merge(per_file, plan)
    for level in plan.levels:
        assert_frames_close(merged[level], whole[level])


def test_pooled_and_whole_file_reads_take_paths_literally(write_run: WriteRun) -> None:
    """A run directory named like a glob pattern, with `key=value` folder names, read by the
    small-file paths (one file whole, consecutive files in one scan): the files themselves,
    no pattern and no hive column."""
    tokens = make_tokens(16, range(1, 9))
    rollouts = rollouts_of(tokens)
    pieces = split(tokens, at_rollout_boundaries(tokens, 5))
    plain = write_run({"rollouts": rollouts, "tokens": pieces}, name="plain")
    odd = write_run({"rollouts": rollouts, "tokens": pieces}, name="step=9 [run]*")
    a, b = compute(open_run(plain)), compute(open_run(odd))
    assert b.tokens.files == 5 and b.tokens.rows == tokens["step"].size
    assert_results_close(a.results, b.results)


def test_the_entropy_histogram_in_blocks_counts_every_bin_of_every_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The histogram binned a block at a time (blocks forced small, a partial last block) is
    the bincount of the entropy bins over all rows, and those bins are the formula's, in
    float64: negative entropies in bin 0, huge ones in the last bin."""
    monkeypatch.setattr(tokenscan.plan, "BIN_BLOCK_ROWS", 1000)
    rng = np.random.default_rng(3)
    values = rng.gamma(0.6, 1.5, 4321).astype(np.float32)
    values[:3] = [-0.5, 0.0, 3e38]
    expected = np.floor(
        np.minimum(
            np.log1p(np.maximum(values.astype(np.float64), 0) / tokenscan.ENTROPY_BIN_OFFSET)
            * tokenscan.ENTROPY_BINS_PER_EFOLD,
            tokenscan.plan.ENTROPY_MAX_BIN,
        )
    ).astype(np.int64)
    histogram = tokenscan.HISTOGRAMS["entropy_bins"]
    bins = histogram.into(values, np.empty(values.size), np.empty(values.size, np.intp))
    assert bins.tolist() == expected.tolist()
    (tally,) = tokenscan.plan.histogram_tally(histogram, values, {"n": "count"}).values()
    assert tally.tolist() == np.bincount(expected, minlength=tally.size).tolist()
    assert tally[0] >= 2 and tally[-1] == 1
    empty = np.array([], dtype=np.float32)
    assert tokenscan.plan.histogram_tally(histogram, empty, {"n": "count"})["n"].sum() == 0


def test_the_advantage_tiers_tally_equals_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per (group, tier): the tokens, Σ a² (float64) and the group's largest |a|, blocks forced
    small, against numpy masks: a tier is how many of the floors |a| is strictly above (0 in
    tier 0, a float-noise 1e-17 in tier 1, 5e-4 in tier 4, 0.3 in tier 5)."""
    monkeypatch.setattr(tokenscan.plan, "BIN_BLOCK_ROWS", 700)
    rng = np.random.default_rng(5)
    values = (rng.normal(0, 1, 3000) * 10.0 ** rng.integers(-18, 1, 3000)).astype(np.float32)
    values[:4] = [0.0, 1e-17, -5e-4, 0.3]
    group = rng.integers(0, 3, values.size)
    histogram = tokenscan.HISTOGRAMS["advantage_tiers"]
    kinds = {"n": "count", "q": "squares", "max__a": "max_abs"}
    tallies = tokenscan.plan.histogram_tally(histogram, values, kinds, group, 3)
    floors = np.asarray(tokenscan.ADVANTAGE_TIERS)
    magnitude = np.abs(values.astype(np.float64))
    tier = (magnitude[:, None] > floors[None, :]).sum(axis=1)
    assert tier[:4].tolist() == [0, 1, 4, 5]
    for g in range(3):
        for t in range(histogram.size):
            at = (group == g) & (tier == t)
            flat = g * histogram.size + t
            assert tallies["n"][flat] == at.sum()
            assert tallies["q"][flat] == pytest.approx(np.sum(magnitude[at] ** 2), rel=1e-12)
            of_group = magnitude[group == g]
            assert tallies["max__a"][flat] == (of_group.max() if of_group.size else -np.inf)


def test_a_step_whose_segments_are_all_null_has_no_segment_rows(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step's rows all without a segment (the runs path finds no segment to sum), the other
    steps' with: the same partials as the group-by path, and no row for that step."""
    monkeypatch.setattr(limits, "MIN_STEP_RUN_ROWS", 1)
    tokens = make_tokens(12, range(1, 5))
    segment = tokens["segment"].astype(object)
    segment[tokens["step"] == 2] = None
    frame = pl.DataFrame({**tokens, "segment": segment}).with_columns(
        pl.col("segment").cast(pl.Categorical)
    )
    rollouts = rollouts_of(tokens)
    order = np.random.default_rng(12).permutation(frame.height)
    runs = write_run({"rollouts": rollouts, "tokens": [frame]})
    shuffled = write_run({"rollouts": rollouts, "tokens": [frame.select(pl.all().gather(order))]})
    plan = plan_for(runs)
    a, _ = scan_tokens(open_run(runs), plan)
    b, _ = scan_tokens(open_run(shuffled), plan)
    for level in plan.levels:
        assert_frames_close(a[level], b[level])
    assert 2 not in a["segments"]["step"].to_list()


def test_the_scan_leaves_arrows_default_memory_pool_as_it_found_it(write_run: WriteRun) -> None:
    """The scan decodes with Arrow's jemalloc pool where pyarrow has it, and restores the
    process's default afterwards."""
    tokens = make_tokens(13, range(1, 3))
    run = write_run({"rollouts": rollouts_of(tokens), "tokens": tokens})
    before = pa.default_memory_pool().backend_name
    scan_tokens(open_run(run), plan_for(run))
    assert pa.default_memory_pool().backend_name == before


def test_tokens_without_rollouts_or_segments_are_reduced(
    write_run: WriteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose tokens have neither a rollouts table to check ids against nor segments:
    the plan reads no rollout_id, and the step sums (run by run of one step) are the rows'."""
    monkeypatch.setattr(limits, "MIN_STEP_RUN_ROWS", 1)
    tokens = make_tokens(14, range(1, 4))
    del tokens["segment"]
    steps = [{"step": step, "loss": 1.0} for step in range(1, 4)]
    run = write_run({"steps": steps, "tokens": tokens})  # step metrics and tokens, no rollouts
    plan = plan_for(run)
    assert not plan.ids and "segments" not in plan.partials
    assert "rollout_id" not in plan.columns(open_run(run).tables["tokens"].schema)
    levels, _ = scan_tokens(open_run(run), plan)
    assert levels[""][ROWS].to_list() == np.bincount(tokens["step"])[1:].tolist()
