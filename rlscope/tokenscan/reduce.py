"""One token file, batch by batch, reduced to per-step partials (a row per run of one step)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlscope.exactsum import ENGINE
from rlscope.reader import INVALID_PREFIX, conform
from rlscope.store import RunPath, arrow_source, polars_options
from rlscope.tokenscan import limits
from rlscope.tokenscan.plan import (
    HISTOGRAMS,
    ROWS,
    TokenFile,
    TokenPlan,
    histogram_tally,
)


def _batches(file: TokenFile) -> Iterator[pl.DataFrame]:
    """The file's (or piece's) columns that the plan reads, in even batches of at most
    BATCH_ROWS rows and BATCH_BYTES decoded bytes, streamed through a small read buffer: the
    memory is that of the batch (or of one row group of at most WHOLE_GROUP_BYTES decoded,
    where Polars decodes it), not of the file."""
    present = [c for c in file.target if c in file.schema]
    if file.row_groups is None and file.stat[0] <= limits.SMALL_FILE_BYTES:
        # Read whole by Polars: half pyarrow's per-file cost, and a live run has thousands.
        frame = pl.read_parquet(
            str(file.path),
            columns=present,
            hive_partitioning=False,
            glob=False,
            storage_options=polars_options(file.path),
        )
        yield from _even_slices(frame, limits.BATCH_ROWS)
        return
    source, filesystem = arrow_source(file.path)
    parquet = pq.ParquetFile(
        source, buffer_size=limits.READ_BUFFER_BYTES, pre_buffer=False, filesystem=filesystem
    )
    meta = parquet.metadata
    groups = list(range(meta.num_row_groups) if file.row_groups is None else file.row_groups)
    if filesystem is not None and _compressed_bytes(meta, present, groups) <= limits.PREFETCH_BYTES:
        # From a store, a read is a request: the columns' byte ranges fetched at once,
        # coalesced, rather than a buffer's worth at a time (a 1.2M-row file from a local S3
        # server: 2.2 s against 3.2 s for the run).
        parquet.close()
        parquet = pq.ParquetFile(source, metadata=meta, pre_buffer=True, filesystem=filesystem)
    with parquet:
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        rows = sum(sizes[g] for g in groups)
        if rows == 0:
            return
        row_bytes = _decoded_row_bytes(parquet, present, groups, rows)
        cap = max(1, min(limits.BATCH_ROWS, limits.BATCH_BYTES // max(1, row_bytes)))
        by_polars = _polars_decodes(meta, present, groups, row_bytes)
        first_rows = list(itertools.accumulate(sizes, initial=0))
        for span, step in _step_spans(meta, file, groups):
            # A span of row groups of one step (by their statistics) is read without its
            # step column, the step given as a constant: no decoding of a value per row.
            columns = present if step is None else [c for c in present if c != "step"]
            span_sizes = [sizes[g] for g in span]
            if by_polars:
                reads = _polars_reads(file.path, first_rows[span[0]], span_sizes, columns, cap)
            else:
                reads = _arrow_reads(parquet, span, sum(span_sizes), columns, cap)
            for read in reads:
                if step is not None:
                    steps = pl.repeat(step, read.height, dtype=file.schema["step"], eager=True)
                    read.insert_column(present.index("step"), steps.alias("step"))
                yield read


def _arrow_reads(
    parquet: pq.ParquetFile, span: list[int], rows: int, columns: list[str], cap: int
) -> Iterator[pl.DataFrame]:
    """Consecutive row groups (of `rows` rows in all) decoded by pyarrow, in even batches of at
    most `cap` rows."""
    size = _even(rows, cap)
    # One thread per read: the workers are the parallelism (the columns decoded in parallel
    # besides only add hand-offs).
    batches = parquet.iter_batches(
        batch_size=size, columns=columns, row_groups=span, use_threads=False
    )
    for batch in batches:
        yield cast(pl.DataFrame, pl.from_arrow(pa.Table.from_batches([batch])))


def _polars_reads(
    path: RunPath, first_row: int, sizes: list[int], columns: list[str], cap: int
) -> Iterator[pl.DataFrame]:
    """Consecutive row groups (of `sizes` rows, the first starting at row `first_row` of the
    file) decoded by Polars, as many at a time as fit in `cap` rows (at least one: a row group
    is decoded whole), each read in even batches of at most `cap` rows."""
    offset, group = first_row, 0
    while group < len(sizes):
        rows = sizes[group]
        group += 1
        while group < len(sizes) and rows + sizes[group] <= cap:
            rows += sizes[group]
            group += 1
        # The slice is pushed down to the row groups: only those it covers are read.
        scan = pl.scan_parquet(
            str(path), hive_partitioning=False, glob=False, storage_options=polars_options(path)
        )
        yield from _even_slices(scan.slice(offset, rows).select(columns).collect(), cap)
        offset += rows


def _even_slices(frame: pl.DataFrame, cap: int) -> Iterator[pl.DataFrame]:
    """`frame` in even slices of at most `cap` rows (views, no copy)."""
    size = _even(frame.height, cap) or 1
    for offset in range(0, frame.height, size):
        yield frame.slice(offset, size)


def _compressed_bytes(meta: pq.FileMetaData, columns: list[str], groups: list[int]) -> int:
    """The Parquet bytes of `columns` in the row groups `groups` (what reading them fetches)."""
    indexes = [i for c in columns if (i := _column_chunk(meta, c)) is not None]
    return sum(meta.row_group(g).column(i).total_compressed_size for g in groups for i in indexes)


def _polars_decodes(
    meta: pq.FileMetaData, columns: list[str], groups: list[int], row_bytes: int
) -> bool:
    """Whether Polars reads these row groups rather than pyarrow: when no column read is
    byte-stream-split (polars 2.1 decodes those 2.5x slower than pyarrow, and plain or
    dictionary-encoded ones 1.6x faster: 24 against 39 ns per row of the 9 token columns) and
    every row group is small enough to decode whole (Polars reads a row group at a time)."""
    indexes = [i for c in columns if (i := _column_chunk(meta, c)) is not None]
    for group in groups:
        chunk = meta.row_group(group)
        if chunk.num_rows * row_bytes > limits.WHOLE_GROUP_BYTES:
            return False
        if any("BYTE_STREAM_SPLIT" in chunk.column(i).encodings for i in indexes):
            return False
    return True


def _step_spans(
    meta: pq.FileMetaData, file: TokenFile, groups: list[int]
) -> list[tuple[list[int], int | None]]:
    """`groups` as consecutive spans, each with the one step all its rows have when the row
    groups' statistics say so (an integer step column whose minimum is its maximum, without
    nulls), else None (the step read row by row). Trainers write a file per step, so this is
    the usual case."""
    step: list[int | None] = [None] * len(groups)
    index = _column_chunk(meta, "step")
    if "step" in file.target and index is not None and file.schema["step"].is_integer():
        for i, group in enumerate(groups):
            stats = meta.row_group(group).column(index).statistics
            if (
                stats is not None
                and stats.has_min_max
                and stats.has_null_count
                and stats.null_count == 0
                and stats.min == stats.max
            ):
                step[i] = int(stats.min)
    spans: list[tuple[list[int], int | None]] = []
    for group, value in zip(groups, step, strict=True):
        if spans and spans[-1][1] == value:
            spans[-1][0].append(group)
        else:
            spans.append(([group], value))
    return spans


def _column_chunk(meta: pq.FileMetaData, name: str) -> int | None:
    """The index of a flat top-level column's chunks in each row group (by path: a nested
    column's leaf may share its name), or None when the file has no such column."""
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
    return paths.index(name) if name in paths else None


def _even(rows: int, cap: int) -> int:
    """Rows per batch of even batches of at most `cap`: 1.25M rows as two of 625k, not 1.2M
    and a 50k tail of its own."""
    return -(-rows // -(-rows // cap)) if rows else 0


def _decoded_row_bytes(
    parquet: pq.ParquetFile, columns: list[str], groups: list[int], rows: int
) -> int:
    """Bytes per row of `columns` once decoded: the width of fixed-width types, else the
    column's uncompressed Parquet bytes per row (strings, lists), from the file's metadata."""
    schema, meta = parquet.schema_arrow, parquet.metadata
    total = 0
    for name in columns:
        dtype = schema.field(name).type
        if pa.types.is_dictionary(dtype):
            dtype = dtype.index_type
        try:
            total += max(1, dtype.bit_width // 8)
            continue
        except ValueError:  # variable width
            pass
        size = 0
        index = _column_chunk(meta, name)
        if index is not None:
            size = sum(meta.row_group(g).column(index).total_uncompressed_size for g in groups)
        total += 8 + size // rows  # offsets, then the data
    return total


def _step_runs(frame: pl.DataFrame) -> list[tuple[int, int]] | None:
    """(offset, length) of each run of one step value; None when the runs are too many or too
    short for a query per run to beat one group-by (small or unsorted batches)."""
    step = frame["step"]
    if step.null_count() or not frame.height:
        return None
    starts = _run_starts(step.to_numpy())
    if starts.size > limits.MAX_STEP_RUNS or frame.height < limits.MIN_STEP_RUN_ROWS * starts.size:
        return None
    ends = [*starts[1:].tolist(), frame.height]
    return [(start, end - start) for start, end in zip(starts.tolist(), ends, strict=True)]


def _run_starts(*columns: np.ndarray) -> np.ndarray:
    """The first row of each run of rows equal in every column (non-empty columns)."""
    change = np.zeros(len(columns[0]) - 1, dtype=bool)
    for values in columns:
        change |= values[1:] != values[:-1]
    return np.concatenate(([0], np.flatnonzero(change) + 1))


def _level_queries(
    lf: pl.LazyFrame, plan: TokenPlan, keys: list[str], done: Iterable[str] = ()
) -> dict[str, pl.LazyFrame]:
    """Each level's aggregation of conformed rows, grouped by `keys` (["step"], [FILE, "step"]
    for several files at once, or none for one step's run of rows) and the level's own key;
    but not the levels already `done`."""
    queries: dict[str, pl.LazyFrame] = {}
    schema = lf.collect_schema()
    invalid = [
        (pl.col(flag).sum() if flag in schema else pl.lit(0)).cast(pl.Int64).alias(flag)
        for flag in (INVALID_PREFIX + c for c in plan.count_invalid)
    ]
    base = [pl.len().cast(pl.Int64).alias(ROWS), *invalid]
    exprs = [e.alias(n) for n, e in plan.partials.get("", {}).items()]
    stepped = lf
    for name, expr in plan.prelude.items() if exprs else ():  # in order: each may use the last
        stepped = stepped.with_columns(expr.alias(name))
    queries[""] = (
        stepped.group_by(keys).agg(*base, *exprs) if keys else stepped.select(*base, *exprs)
    )
    if "segments" in plan.partials and "segments" not in done:
        exprs = [e.alias(n) for n, e in plan.partials["segments"].items()]
        segmented = lf.filter(pl.col("segment").is_not_null())
        queries["segments"] = (
            segmented.group_by(*keys, "segment")
            .agg(exprs)
            .with_columns(pl.col("segment").cast(pl.String))
        )
    if plan.has_ids and "ids" not in done:
        if "ids" in plan.partials:
            exprs = [e.alias(n) for n, e in plan.partials["ids"].items()]
            rows = pl.len().cast(pl.Int64).alias("len")
            queries["ids"] = lf.group_by(*keys, "rollout_id").agg(rows, *exprs)
        else:
            # Runs of one rollout_id first: a rollout's tokens are usually contiguous, so the
            # group-by sees a row per rollout rather than a row per token.
            runs = lf.select(*keys, pl.col("rollout_id").rle_id().alias("run"), "rollout_id")
            runs = runs.group_by(*keys, "run").agg(pl.col("rollout_id").first(), pl.len())
            queries["ids"] = runs.group_by(*keys, "rollout_id").agg(pl.col("len").sum())
    return queries


def _run_levels(frame: pl.DataFrame, plan: TokenPlan) -> dict[str, pl.DataFrame]:
    """The ids and segments levels of rows without group keys, from the runs of rows of one
    (rollout, segment): a rollout's tokens are contiguous, so the per-row work is a few
    vectorised passes and the grouping (in numpy: a query per batch would cost more to run
    than these few thousand rows) is over a row per run, not per token. A level this can't
    compute (a null rollout_id, a segment partial of another shape) is left out, for
    `_level_queries`."""
    shapes = plan.segment_run_shapes
    sums = plan.ids_run_sums
    if (shapes is None and not plan.has_ids) or "rollout_id" not in frame.columns:
        return {}
    rollout = frame["rollout_id"]
    if not frame.height or rollout.null_count():
        return {}
    ids = rollout.to_numpy()
    keys = [ids]
    segment = frame["segment"] if shapes is not None else None
    if segment is not None:
        categorical = isinstance(segment.dtype, pl.Categorical | pl.Enum)
        codes = segment.to_physical() if categorical else segment.rle_id()
        if codes.null_count():
            keys.append(segment.is_null().to_numpy())
            codes = codes.fill_null(0)
        keys.append(codes.to_numpy())
    starts = _run_starts(*keys)
    lengths = np.diff(starts, append=frame.height)
    run_ids = ids[starts]
    levels: dict[str, pl.DataFrame] = {}
    if plan.has_ids and sums is not None:
        # A row per run of one rollout (its segments' runs joined): one per rollout when its
        # rows are contiguous; the merge sums a rollout's rows if not.
        at = _run_starts(run_ids)
        columns: dict[str, np.ndarray] = {
            "rollout_id": run_ids[at],
            "len": np.add.reduceat(lengths, at),
        }
        if sums:
            # Each distinct per-row expression once, lazily (the eager select evaluates shared
            # subexpressions once per use: 3x the time for a k3 KL's sum, count and squares).
            inners: list[pl.Expr] = []
            for _, inner in sums.values():
                if not any(inner.meta.eq(seen) for seen in inners):
                    inners.append(inner)
            rows = frame.lazy().select(e.alias(str(i)) for i, e in enumerate(inners)).collect()
            for name, (kind, inner) in sums.items():
                which = next(i for i, seen in enumerate(inners) if inner.meta.eq(seen))
                columns[name] = _per_run(kind, rows[str(which)], starts[at], columns["len"])
        levels["ids"] = pl.DataFrame(columns)
    if segment is not None and shapes is not None:
        levels["segments"] = _segment_sums(
            frame, segment.gather(starts), run_ids, starts, lengths, shapes
        )
    return levels


def _segment_sums(
    frame: pl.DataFrame,
    run_segment: pl.Series,
    run_ids: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    shapes: dict[str, tuple[str, str]],
) -> pl.DataFrame:
    """The segments level from the runs of one (rollout, segment): each partial summed over a
    segment's runs (distinct rollouts: distinct (segment, rollout) pairs), runs of a null
    segment left out."""
    keep = run_segment.is_not_null().to_numpy()
    run_segment = run_segment.filter(keep)
    if not isinstance(run_segment.dtype, pl.Categorical | pl.Enum):
        run_segment = run_segment.cast(pl.Categorical)
    codes, first, group = np.unique(
        run_segment.to_physical().to_numpy(), return_index=True, return_inverse=True
    )
    count = codes.size
    columns: dict[str, pl.Series | np.ndarray] = {
        "segment": run_segment.gather(first).cast(pl.String)
    }
    for name, (kind, column) in shapes.items():
        if kind == "len":
            columns[name] = np.bincount(group, lengths[keep], count).astype(np.int64)
        elif kind == "rollouts":
            rollouts = run_ids[keep]
            order = np.lexsort((rollouts, group))
            distinct = _run_starts(group[order], rollouts[order]) if order.size else order
            columns[name] = np.bincount(group[order][distinct], minlength=count).astype(np.int64)
        else:
            values = _per_run(kind, frame[column], starts, lengths)[keep]
            sums = np.bincount(group, values, count)
            columns[name] = sums if kind == "sum" else sums.astype(np.int64)
    return pl.DataFrame(columns)


def _per_run(kind: str, values: pl.Series, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A column's sum (in float64, nulls skipped) or count of non-null values per run."""
    if kind == "sum":
        array = (values.fill_null(0) if values.null_count() else values).to_numpy()
        return np.add.reduceat(array, starts, dtype=np.float64)
    if values.null_count():
        return np.add.reduceat(values.is_not_null().to_numpy(), starts, dtype=np.int64)
    return lengths


def _grouped_levels(
    frame: pl.DataFrame, plan: TokenPlan, keys: list[str]
) -> dict[str, pl.LazyFrame | pl.DataFrame]:
    """Every level of conformed rows grouped by `keys` (["step"], or [FILE, "step"] for
    several files at once): small or unsorted batches. Float sums go through a hash group-by
    (a slice's sum would depend on where the slice starts in the batch, so on which files a
    file is reduced with); the histograms by runs of rows of equal keys (a file's rows are
    contiguous, a step's usually too) in bincounts."""
    queries: dict[str, pl.LazyFrame | pl.DataFrame] = dict(_level_queries(frame.lazy(), plan, keys))
    levels = [level for level in plan.partials if level in HISTOGRAMS]
    if not levels or not frame.height:
        return queries
    columns = []
    for key in keys:
        values = frame[key].to_physical()
        if values.null_count():
            columns.append(values.is_null().to_numpy())
            values = values.fill_null(0)
        columns.append(values.to_numpy())
    starts = _run_starts(*columns)
    # Runs of one key (a key's rows may come in several runs when unsorted) -> its group.
    firsts, group = np.unique(
        np.stack([c[starts].astype(np.int64) for c in columns], axis=1),
        axis=0,
        return_index=True,
        return_inverse=True,
    )[1:]
    lengths = np.diff(starts, append=frame.height)
    row_group = np.repeat(group.reshape(-1).astype(np.int64), lengths)
    for level in levels:
        found, tallies = _histogram(frame, plan, level, row_group, firsts.size)
        width = HISTOGRAMS[level].size
        queries[level] = (
            frame.select(keys)
            .gather(starts[firsts[found // width]])
            .with_columns(
                pl.Series(HISTOGRAMS[level].key, (found % width).astype(np.int32)),
                *(pl.Series(name, tally) for name, tally in tallies.items()),
            )
        )
    return queries


def _histogram(
    frame: pl.DataFrame,
    plan: TokenPlan,
    level: str,
    row_group: np.ndarray | None = None,
    groups: int = 1,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A histogram level of conformed rows (each row's group in `row_group`, else one group):
    the flat (group · size + bin) indexes of its non-empty bins and each partial there."""
    histogram = HISTOGRAMS[level]
    kinds = plan.histogram_kinds(level)
    values = frame[histogram.column]
    if values.null_count():
        present = values.is_not_null().to_numpy()
        row_group = None if row_group is None else row_group[present]
        values = values.drop_nulls()
    counted = {**kinds, ROWS: "count"}  # the bins with tokens, whatever the partials
    tallies = histogram_tally(histogram, values.to_numpy(), counted, row_group, groups)
    found = np.flatnonzero(tallies.pop(ROWS))
    return found, {name: tally[found] for name, tally in tallies.items()}


def _step_levels(piece: pl.DataFrame, plan: TokenPlan) -> dict[str, pl.LazyFrame | pl.DataFrame]:
    """Every level of one step's run of conformed rows, each with that step as a column: a
    plain select (no hashing of every row's step), the run levels of `_run_levels` and the
    histograms as bincounts."""
    step = piece["step"][0]
    frames = _run_levels(piece, plan)
    queries = _level_queries(piece.lazy(), plan, [], done=frames)
    for level in (level for level in plan.partials if level in HISTOGRAMS):
        found, tallies = _histogram(piece, plan, level)
        frames[level] = pl.DataFrame({HISTOGRAMS[level].key: found.astype(np.int32), **tallies})
    levels: dict[str, pl.LazyFrame | pl.DataFrame] = {
        level: query.select(pl.lit(step, pl.Int64).alias("step"), pl.all())
        for level, query in queries.items()
    }
    for level, frame in frames.items():
        levels[level] = frame.insert_column(0, pl.Series("step", [step] * frame.height, pl.Int64))
    return levels


def _collect(
    levels: Sequence[Mapping[str, pl.LazyFrame | pl.DataFrame]],
) -> dict[str, pl.DataFrame]:
    """Levels (of several pieces of rows) collected at once where they are queries, each
    level's pieces concatenated."""
    flat = [(level, part) for one in levels for level, part in one.items()]
    collected = iter(collect_all([q for _, q in flat if isinstance(q, pl.LazyFrame)], ENGINE))
    parts: dict[str, list[pl.DataFrame]] = {}
    for level, part in flat:
        frame = next(collected) if isinstance(part, pl.LazyFrame) else part
        parts.setdefault(level, []).append(frame)
    return {level: pl.concat(frames, how="vertical_relaxed") for level, frames in parts.items()}


def collect_all(
    queries: list[pl.LazyFrame], engine: Literal["auto", "in-memory", "streaming"] = "auto"
) -> list[pl.DataFrame]:
    """`pl.collect_all` in slices of COLLECT_SLICE queries: linear in their number."""
    return [
        frame
        for start in range(0, len(queries), limits.COLLECT_SLICE)
        for frame in pl.collect_all(queries[start : start + limits.COLLECT_SLICE], engine=engine)
    ]


def _reduce_rows(frame: pl.DataFrame, plan: TokenPlan) -> dict[str, pl.DataFrame]:
    """One file's conformed rows reduced: run by run of one step when the rows are sorted by
    step (much cheaper than hashing every row's step), else grouped."""
    runs = _step_runs(frame)
    if runs is None:
        return _collect([_grouped_levels(frame, plan, ["step"])])
    return _collect([_step_levels(frame.slice(offset, n), plan) for offset, n in runs])


def _conformed(
    frame: pl.DataFrame, file: TokenFile, plan: TokenPlan, keep: tuple[str, ...] = ()
) -> pl.DataFrame:
    """A batch with the unified types and NaN/inf as null, flagged per counted column, and the
    columns `keep` as they are. Float columns found all finite (the usual case; one cheap
    reduction tells) skip the per-row rewrite and carry no flag column; a categorical segment
    stays categorical (grouped as is)."""
    floats = [c for c, t in file.schema.items() if c in file.target and t.is_float()]
    # A finite sum means no NaN or inf (either makes the sum NaN or inf); a non-finite one
    # (or an overflow) is checked row by row.
    sums = [frame[c].sum() for c in floats]  # a Series' sum: no query to plan
    finite = [c for c, total in zip(floats, sums, strict=True) if math.isfinite(total)]
    suspect = [c for c in floats if c not in finite]
    if suspect:
        non_finite = frame.select((~pl.col(c).is_finite()).sum() for c in suspect).row(0)
        finite += [c for c, n in zip(suspect, non_finite, strict=True) if not n]
    target = dict(file.target)
    for column, dtype in file.schema.items():
        if target.get(column) == pl.String and isinstance(dtype, pl.Categorical | pl.Enum):
            target[column] = dtype
    if len(finite) == len(floats) and all(file.schema.get(c) == t for c, t in target.items()):
        # Nothing to cast, fill or flag (a batch read as the plan reads it is returned as is).
        columns = [*file.target, *keep]
        return frame if frame.columns == columns else frame.select(columns)
    exprs = conform(
        target, dict(file.schema), dict(file.hive), invalid_flags=True, all_finite=finite
    )
    flags = [INVALID_PREFIX + c for c in plan.count_invalid if c not in finite]
    return frame.lazy().select(*exprs, *keep).select(*file.target, *flags, *keep).collect()
