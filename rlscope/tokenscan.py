"""One read per token file: every token-level partial, cached per file, merged by summation.

The token table is most of a run's bytes (a row per generated token), so it is read by this
module alone, one file at a time and once per `analyze`: each file (in batches of row groups)
is reduced to small per-step partial aggregates — the per-step sums, the per-(step, entropy
bin) histogram, the per-(step, segment) sums and the per-(step, rollout_id) token counts that
find tokens without a rollout — which are all sums, so merging files (or batches, or machines)
is a group-by-sum. A batch sorted by step is reduced step by step without hashing rows, and the
segment and rollout levels from the runs of rows of one (rollout, segment), a row per run. That
makes three things cheap:

* memory: a batch of at most `BATCH_ROWS` rows is in memory at a time (per worker), whatever the
  run's size; what is kept is per step, never per token;
* re-analysis: each file's partials are cached in the user cache dir (one pack per run and
  plan), keyed by the file's path, size, mtime and inode, so re-analysing a growing run reads
  only the files that are new since the last time;
* scaling out: `chunk_partials` is a pure function of (files, plan), so any map over chunks of
  files (a process pool, Ray, Dask) can run it, with `merge` on the driver (README "Scaling
  out").
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlscope._version import __version__
from rlscope.reader import INVALID_PREFIX, Run, conform

#: Per-step entropy quantiles come from a histogram with log-spaced bins: bin b covers
#: [E0·(e^(b/K) - 1), E0·(e^((b+1)/K) - 1)), i.e. a width of (H + E0)/K at entropy H — relative
#: precision 1/K above E0, absolute E0/K below. ~600 bins span 0-25 nats, so the histogram's
#: size depends on the number of steps, never on the number of tokens.
ENTROPY_BINS_PER_EFOLD = 100
ENTROPY_BIN_OFFSET = 0.05
ENTROPY_MAX_BIN = 1000
ROWS = "__rows__"  # token rows per step (the step level), for the null-step warning
#: Rows read and reduced at a time (whole row groups, or slices of a larger one).
BATCH_ROWS = 1_200_000
#: A batch whose rows form at most this many runs of one step, of this many rows on average, is
#: reduced run by run (a plain select per run); otherwise (unsorted or small batches) by a
#: group-by on the step.
MAX_STEP_RUNS = 32
MIN_STEP_RUN_ROWS = 50_000
#: Small files are reduced together, up to this many bytes of Parquet per chunk of work.
CHUNK_BYTES = 16 * 2**20
#: Chunks reduced at once, each worker holding one batch: reads and Polars use every core
#: anyway, but a third worker fills the gaps while the others are between batches (measured on
#: 2 cores: ~10% faster than 2 workers, ~0.07 GiB more).
WORKERS = 3
#: Queries handed to one `pl.collect_all`: its cost grows with the square of their number
#: (polars 2.1: 4000 small queries take 14 s at once, 1 s in slices of 32), and a run of many
#: small files makes thousands.
COLLECT_SLICE = 32
#: Level -> its group keys. "ids" counts token rows per (step, rollout_id): merged over files,
#: it finds tokens whose rollout is not in the rollouts table.
LEVEL_KEYS: dict[str, tuple[str, ...]] = {
    "": ("step",),
    "entropy_bins": ("step", "entropy_bin"),
    "segments": ("step", "segment"),
    "ids": ("step", "rollout_id"),
}
_KEY_TYPES = {
    "step": pl.Int64,
    "entropy_bin": pl.Int32,
    "segment": pl.String,
    "rollout_id": pl.Int64,
}
#: The one partial of the entropy_bins level: tokens per (step, bin).
BIN_COUNT = pl.col("entropy").count().cast(pl.Int64)
FILE_ID = "__file_id__"  # a cached file's id within its run's pack
FILE = "__file__"  # a file's index within a chunk
#: The partial aggregations the merge (a sum) is exact for; a token partial must end in one.
_ADDITIVE = ("sum()", "count()", "len()", "n_unique()")
_TRAILING_CAST = re.compile(r"\.(strict_)?cast\([^()]*\)$")


def entropy_bins(entropy: pl.Series) -> np.ndarray:
    """Each entropy's bin, floor(K·ln(1 + max(H, 0)/E0)) capped at ENTROPY_MAX_BIN, for a
    series without nulls. In numpy, in float64, in place in one buffer (fresh memory costs a
    page fault per 4 KiB): a third of the cost of the same Polars expression."""
    scaled = np.maximum(entropy.to_numpy(), 0.0, dtype=np.float64)
    np.divide(scaled, ENTROPY_BIN_OFFSET, out=scaled)
    np.log1p(scaled, out=scaled)
    np.multiply(scaled, ENTROPY_BINS_PER_EFOLD, out=scaled)
    np.minimum(scaled, ENTROPY_MAX_BIN, out=scaled)
    return scaled.astype(np.int32)  # truncation = floor (>= 0)


def entropy_bin_midpoint(bin_index: pl.Expr) -> pl.Expr:
    """The entropy at the middle of a bin (inverse of `entropy_bins`)."""
    centre = (bin_index.cast(pl.Float64) + 0.5) / ENTROPY_BINS_PER_EFOLD
    return ENTROPY_BIN_OFFSET * (centre.exp() - 1.0)


def is_additive(expr: pl.Expr) -> bool:
    """Whether a partial is a sum, a count or a distinct count (merged over files by summing;
    a distinct count is then exact only for values that stay within one file)."""
    text = str(expr)
    while (stripped := _TRAILING_CAST.sub("", text)) != text:
        text = stripped
    return text.endswith(_ADDITIVE)


@dataclass(frozen=True)
class TokenPlan:
    """What to compute over each token file: partials per level ("" is per step; each level's
    keys are in LEVEL_KEYS), elementwise intermediates shared by the step partials, and the
    float columns whose NaN/inf values are counted."""

    partials: Mapping[str, Mapping[str, pl.Expr]]
    prelude: Mapping[str, pl.Expr] = field(default_factory=dict)
    count_invalid: tuple[str, ...] = ()
    ids: bool = False  # also count rows per (step, rollout_id)

    def __post_init__(self) -> None:
        for level, exprs in self.partials.items():
            if level not in LEVEL_KEYS or level == "ids":
                raise ValueError(f"unknown token level {level!r}")
            if level == "entropy_bins" and [e.meta.eq(BIN_COUNT) for e in exprs.values()] != [True]:
                raise ValueError("the entropy_bins level is a histogram: one partial, BIN_COUNT")
            for name, expr in exprs.items():
                if not is_additive(expr):
                    raise ValueError(
                        f"token partial {name!r} must be a sum, count or n_unique (merged "
                        f"over files by summation): {expr}"
                    )

    @property
    def levels(self) -> tuple[str, ...]:
        """The levels computed: always the step level (row and NaN/inf counts), then the
        plan's others."""
        others = [level for level in self.partials if level != ""]
        return ("", *others, *(("ids",) if self.ids else ()))

    def columns(self, schema: Mapping[str, pl.DataType]) -> list[str]:
        """The token columns the plan reads (in the table's order)."""
        used = {"step", *self.count_invalid}
        for exprs in (*self.partials.values(), self.prelude):
            for expr in exprs.values():
                used.update(expr.meta.root_names())
        if "entropy_bins" in self.partials:
            used.add("entropy")
        if "segments" in self.partials:
            used.add("segment")
        if self.ids:
            used.add("rollout_id")
        return [c for c in schema if c in used]

    def fingerprint(self, schema: Mapping[str, pl.DataType]) -> str:
        """Changes whenever a cached file partial could differ: rlscope's version, the
        expressions, the binning and the unified types of the columns read."""
        parts = [__version__, repr(sorted(self.count_invalid)), str(self.ids)]
        parts += [f"{ENTROPY_BINS_PER_EFOLD}/{ENTROPY_BIN_OFFSET}/{ENTROPY_MAX_BIN}"]
        for level in sorted(self.partials):
            parts += [f"{level}:{n}={e}" for n, e in sorted(self.partials[level].items())]
        parts += [f"prelude:{n}={e}" for n, e in self.prelude.items()]
        parts += [f"{c}:{schema[c]}" for c in self.columns(schema)]
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class TokenFile:
    """One token file as the plan reads it: its path, the types it has and hive values."""

    path: Path
    schema: Mapping[str, pl.DataType]  # the file's own column types
    target: Mapping[str, pl.DataType]  # the unified types (of the columns read)
    hive: Mapping[str, str]
    stat: tuple[int, int, int]  # (size, mtime_ns, inode) at open


@dataclass(frozen=True)
class ScanStats:
    """How much of the token table an analysis read: files reduced now vs taken from cache."""

    files: int = 0
    files_read: int = 0
    rows: int = 0  # token rows in the step range
    rows_read: int = 0  # token rows read now (the rest came from the cache)


def token_files(run: Run, plan: TokenPlan) -> list[TokenFile]:
    table = run.tables["tokens"]
    columns = plan.columns(table.schema)
    target = {c: table.schema[c] for c in columns}
    hive = table.file_hive or tuple({} for _ in table.files)
    return [
        TokenFile(path, schema, target, values, stat)
        for path, schema, values, stat in zip(
            table.files, table.file_schemas, hive, table.file_stats, strict=True
        )
    ]


def _batches(file: TokenFile) -> Iterator[pl.DataFrame]:
    """The file's columns that the plan reads, BATCH_ROWS rows at a time."""
    present = [c for c in file.target if c in file.schema]
    parquet = pq.ParquetFile(file.path)
    with parquet:
        rows = parquet.metadata.num_rows
        if rows == 0:
            return
        # Even batches: 1.25M rows as two of 625k, not 1.2M and a 50k tail of its own.
        size = -(-rows // -(-rows // BATCH_ROWS))
        for batch in parquet.iter_batches(batch_size=size, columns=present):
            yield pl.from_arrow(pa.Table.from_batches([batch]))  # type: ignore[misc]


def _step_runs(frame: pl.DataFrame) -> list[tuple[int, int]] | None:
    """(offset, length) of each run of one step value; None when the runs are too many or too
    short for a query per run to beat one group-by (small or unsorted batches)."""
    step = frame["step"]
    if step.null_count() or not frame.height:
        return None
    starts = _run_starts(step.to_numpy())
    if starts.size > MAX_STEP_RUNS or frame.height < MIN_STEP_RUN_ROWS * starts.size:
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
    invalid = [
        (pl.col(flag).sum() if flag in lf.collect_schema() else pl.lit(0))
        .cast(pl.Int64)
        .alias(flag)
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
    if plan.ids and "ids" not in done:
        # Runs of one rollout_id first: a rollout's tokens are usually contiguous, so the
        # group-by sees a row per rollout rather than a row per token.
        runs = lf.select(*keys, pl.col("rollout_id").rle_id().alias("run"), "rollout_id")
        runs = runs.group_by(*keys, "run").agg(pl.col("rollout_id").first(), pl.len())
        queries["ids"] = runs.group_by(*keys, "rollout_id").agg(pl.col("len").sum())
    return queries


#: The shapes of segments-level partial that `_run_levels` computes from runs of rows: per run
#: a length, a float sum or a count (added up per segment), and distinct rollouts over runs.
_RUN_SHAPES: tuple[tuple[str, Callable[[str], pl.Expr]], ...] = (
    ("len", lambda _: pl.len().cast(pl.Int64)),
    ("len", lambda _: pl.len()),
    ("rollouts", lambda _: pl.col("rollout_id").n_unique()),
    ("sum", lambda column: pl.col(column).cast(pl.Float64).sum()),
    ("count", lambda column: pl.col(column).count().cast(pl.Int64)),
    ("count", lambda column: pl.col(column).count()),
)
_RUN_ROLLOUT, _RUN_LEN, _RUN_SEGMENT = "__run_rollout__", "__run_len__", "__run_segment__"


def _run_shape(expr: pl.Expr) -> tuple[str, str] | None:
    """(kind, column) of a segments-level partial `_run_levels` can compute, else None."""
    roots = expr.meta.root_names()
    column = roots[0] if len(roots) == 1 else ""
    for kind, shape in _RUN_SHAPES:
        if expr.meta.eq(shape(column)):
            return kind, column
    return None


def _run_levels(frame: pl.DataFrame, plan: TokenPlan) -> dict[str, pl.LazyFrame]:
    """The ids and segments levels of rows without group keys, from the runs of rows of one
    (rollout, segment): a rollout's tokens are contiguous, so the per-row work is a few
    vectorised passes and the grouping is over a row per run, not per token. A level this
    can't compute (a null rollout_id, a segment partial of another shape) is left out, for
    `_level_queries`."""
    rollout = frame["rollout_id"]
    if not frame.height or rollout.null_count():
        return {}
    shapes = {name: _run_shape(e) for name, e in plan.partials.get("segments", {}).items()}
    by_segment = "segments" in plan.partials and None not in shapes.values()
    if not (by_segment or plan.ids):
        return {}
    ids = rollout.to_numpy()
    keys = [ids]
    segment = frame["segment"] if by_segment else None
    if segment is not None:
        categorical = isinstance(segment.dtype, pl.Categorical | pl.Enum)
        codes = segment.to_physical() if categorical else segment.rle_id()
        if codes.null_count():
            keys.append(segment.is_null().to_numpy())
            codes = codes.fill_null(0)
        keys.append(codes.to_numpy())
    starts = _run_starts(*keys)
    lengths = np.diff(starts, append=frame.height)
    runs = pl.LazyFrame({_RUN_ROLLOUT: ids[starts], _RUN_LEN: lengths})
    levels: dict[str, pl.LazyFrame] = {}
    if plan.ids:
        levels["ids"] = runs.group_by(pl.col(_RUN_ROLLOUT).alias("rollout_id")).agg(
            pl.col(_RUN_LEN).sum().alias("len")
        )
    if segment is not None:
        per_run, exprs = [pl.Series(_RUN_SEGMENT, segment.gather(starts))], []
        for name, (kind, column) in shapes.items():  # type: ignore[misc]
            if kind == "len":
                exprs.append(pl.col(_RUN_LEN).sum().alias(name))
            elif kind == "rollouts":
                exprs.append(pl.col(_RUN_ROLLOUT).n_unique().alias(name))
            else:
                values = _per_run(kind, frame[column], starts, lengths)
                per_run.append(pl.Series(name, values))
                exprs.append(pl.col(name).sum())
        levels["segments"] = (
            runs.with_columns(per_run)
            .filter(pl.col(_RUN_SEGMENT).is_not_null())
            .group_by(_RUN_SEGMENT)
            .agg(exprs)
            .select(pl.col(_RUN_SEGMENT).cast(pl.String).alias("segment"), *shapes)
        )
    return levels


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
) -> dict[str, pl.LazyFrame]:
    """Every level of conformed rows grouped by `keys` (["step"], or [FILE, "step"] for
    several files at once): small or unsorted batches."""
    queries = _level_queries(frame.lazy(), plan, keys)
    if "entropy_bins" in plan.partials:
        (name,) = plan.partials["entropy_bins"]
        binned = _non_null(frame.select(*keys, "entropy"), "entropy")
        codes = pl.Series("entropy_bin", entropy_bins(binned["entropy"]))
        queries["entropy_bins"] = (
            binned.lazy()
            .select(*keys, codes)
            .group_by(*keys, "entropy_bin")
            .agg(pl.len().cast(pl.Int64).alias(name))
        )
    return queries


def _step_levels(piece: pl.DataFrame, plan: TokenPlan) -> dict[str, pl.LazyFrame]:
    """Every level of one step's run of conformed rows, each with that step as a column: a
    plain select (no hashing of every row's step), the run levels of `_run_levels` and the
    entropy histogram as a bincount."""
    queries = _run_levels(piece, plan)
    queries |= _level_queries(piece.lazy(), plan, [], done=queries)
    if "entropy_bins" in plan.partials:
        (name,) = plan.partials["entropy_bins"]
        entropy = _non_null(piece.select("entropy"), "entropy")["entropy"]
        tally = np.bincount(entropy_bins(entropy), minlength=ENTROPY_MAX_BIN + 1)
        found = np.flatnonzero(tally)
        queries["entropy_bins"] = pl.LazyFrame(
            {"entropy_bin": found.astype(np.int32), name: tally[found].astype(np.int64)}
        )
    step = pl.lit(piece["step"][0], pl.Int64).alias("step")
    return {level: query.select(step, pl.all()) for level, query in queries.items()}


def _non_null(frame: pl.DataFrame, column: str) -> pl.DataFrame:
    return frame.filter(pl.col(column).is_not_null()) if frame[column].null_count() else frame


def _collect(queries: list[dict[str, pl.LazyFrame]]) -> dict[str, pl.DataFrame]:
    """Levels' queries (of several pieces of rows) collected at once, each level's pieces
    concatenated."""
    flat = [(level, query) for levels in queries for level, query in levels.items()]
    parts: dict[str, list[pl.DataFrame]] = {}
    for (level, _), frame in zip(flat, collect_all([q for _, q in flat]), strict=True):
        parts.setdefault(level, []).append(frame)
    return {level: pl.concat(frames, how="vertical_relaxed") for level, frames in parts.items()}


def collect_all(queries: list[pl.LazyFrame]) -> list[pl.DataFrame]:
    """`pl.collect_all` in slices of COLLECT_SLICE queries: linear in their number."""
    return [
        frame
        for start in range(0, len(queries), COLLECT_SLICE)
        for frame in pl.collect_all(queries[start : start + COLLECT_SLICE])
    ]


def _reduce_rows(frame: pl.DataFrame, plan: TokenPlan) -> dict[str, pl.DataFrame]:
    """One file's conformed rows reduced: run by run of one step when the rows are sorted by
    step (much cheaper than hashing every row's step), else grouped."""
    runs = _step_runs(frame)
    if runs is None:
        return _collect([_grouped_levels(frame, plan, ["step"])])
    return _collect([_step_levels(frame.slice(offset, n), plan) for offset, n in runs])


def _conformed(frame: pl.DataFrame, file: TokenFile, plan: TokenPlan) -> pl.DataFrame:
    """A batch with the unified types and NaN/inf as null, flagged per counted column. Float
    columns found all finite (the usual case; one cheap reduction tells) skip the per-row
    rewrite and carry no flag column; a categorical segment stays categorical (grouped as is)."""
    floats = [c for c, t in file.schema.items() if c in file.target and t.is_float()]
    # A finite sum means no NaN or inf (either makes the sum NaN or inf); a non-finite one
    # (or an overflow) is checked row by row.
    sums = frame.select(pl.col(c).sum() for c in floats).row(0) if floats else ()
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
        return frame.select(*file.target)  # nothing to cast, fill or flag
    exprs = conform(
        target, dict(file.schema), dict(file.hive), invalid_flags=True, all_finite=finite
    )
    flags = [INVALID_PREFIX + c for c in plan.count_invalid if c not in finite]
    return frame.lazy().select(exprs).select(*file.target, *flags).collect()


def chunks(files: list[TokenFile]) -> list[list[TokenFile]]:
    """Consecutive files grouped up to CHUNK_BYTES each: the unit of work of the map stage."""
    out: list[list[TokenFile]] = []
    size = 0
    for file in files:
        if not out or size + file.stat[0] > CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(file)
        size += file.stat[0]
    return out


def chunk_partials(files: list[TokenFile], plan: TokenPlan) -> list[dict[str, pl.DataFrame]]:
    """The map stage: each file of a chunk reduced to every level's partials (a frame per
    level, keyed by LEVEL_KEYS). Batches of small files are reduced together, keyed by file
    too, so many small files cost about what one large one does. Pure: depends on the files'
    contents and the plan only."""
    parts: list[dict[str, list[pl.DataFrame]]] = [{lv: [] for lv in plan.levels} for _ in files]
    pending: list[tuple[int, pl.DataFrame]] = []
    pending_rows = 0

    def reduce_pending() -> None:
        nonlocal pending_rows
        if len(pending) == 1:
            index, frame = pending[0]
            for level, result in _reduce_rows(frame, plan).items():
                parts[index][level].append(result)
        else:
            rows = _tagged(pending)  # flag columns only where a file has NaN/inf
            levels = _collect([_grouped_levels(rows, plan, [FILE, "step"])])
            for level, result in levels.items():
                for (index,), piece in result.partition_by(FILE, as_dict=True).items():
                    parts[int(index)][level].append(piece.drop(FILE))
        pending.clear()
        pending_rows = 0

    for index, file in enumerate(files):
        for batch in _batches(file):
            # A batch large enough for the run-by-run path is reduced alone; small ones (of
            # small files) are pooled up to BATCH_ROWS.
            alone = batch.height >= MIN_STEP_RUN_ROWS
            if alone and pending:
                reduce_pending()
            pending.append((index, _conformed(batch, file, plan)))
            pending_rows += batch.height
            if alone or pending_rows >= BATCH_ROWS:
                reduce_pending()
    if pending:
        reduce_pending()
    return _summed(parts, plan)


def file_partials(file: TokenFile, plan: TokenPlan) -> dict[str, pl.DataFrame]:
    """The map stage for one file (see `chunk_partials`)."""
    return chunk_partials([file], plan)[0]


def merge(
    partials: Iterable[Mapping[str, pl.DataFrame]], plan: TokenPlan
) -> dict[str, pl.DataFrame]:
    """The reduce stage: files' (or workers') partials summed per key. Associative and
    commutative, so any grouping of files gives the same frames (up to float rounding)."""
    parts: dict[str, list[pl.DataFrame]] = {level: [] for level in plan.levels}
    for one in partials:
        for level in plan.levels:
            parts[level].append(one[level])
    return _summed([parts], plan)[0]


def value_columns(level: str, plan: TokenPlan) -> list[str]:
    if level == "ids":
        return ["len"]
    names = list(plan.partials.get(level, {}))
    if level == "":
        names = [ROWS, *(INVALID_PREFIX + c for c in plan.count_invalid), *names]
    return names


def _summed(
    parts: Sequence[Mapping[str, list[pl.DataFrame]]], plan: TokenPlan
) -> list[dict[str, pl.DataFrame]]:
    """Each element's frames (a file's, or every file's) summed per key of their level, sorted
    by key. One query per level, tagged by element, whatever the number of elements: a chunk of
    thousands of small files costs a few group-bys, not a query per file."""
    queries = []
    for level in plan.levels:
        keys = LEVEL_KEYS[level]
        values = value_columns(level, plan)
        frames = [(index, f) for index, one in enumerate(parts) for f in one[level] if f.height]
        if not frames:
            schema = {FILE: pl.Int32} | {k: _KEY_TYPES[k] for k in keys}
            queries.append(pl.LazyFrame(schema=schema | {v: pl.Float64 for v in values}))
            continue
        # Concatenated eagerly (cheap for small frames), then widened in one select: a lazy
        # select per frame would cost more to plan than to run. Keys are unified first (a
        # categorical segment in one file, an enum in another have no common type).
        rows = _tagged([(index, _key_typed(f, keys)) for index, f in frames])
        queries.append(
            rows.lazy()
            .select(
                FILE,
                *keys,
                *(_widen(v, rows.schema[v]) for v in values),
            )
            .group_by(FILE, *keys)
            .agg(pl.col(v).sum() for v in values)
            .sort(FILE, *keys, nulls_last=True)
        )
    summed: list[dict[str, pl.DataFrame]] = [{} for _ in parts]
    for level, frame in zip(plan.levels, collect_all(queries), strict=True):
        pieces = frame.partition_by(FILE, as_dict=True, include_key=False, maintain_order=True)
        empty = frame.clear().drop(FILE)
        for index, one in enumerate(summed):
            one[level] = pieces.get((index,), empty)
    return summed


def _tagged(frames: list[tuple[int, pl.DataFrame]]) -> pl.DataFrame:
    """(index, frame) pairs as one frame (a column missing from a frame is null there), each
    row tagged in FILE with its frame's index."""
    rows = pl.concat([f for _, f in frames], how="diagonal_relaxed")
    index = np.repeat([i for i, _ in frames], [f.height for _, f in frames])
    return rows.with_columns(pl.Series(FILE, index, pl.Int32))


def _key_typed(frame: pl.DataFrame, keys: tuple[str, ...]) -> pl.DataFrame:
    odd = [k for k in keys if frame.schema[k] != _KEY_TYPES[k]]
    return frame.with_columns(pl.col(k).cast(_KEY_TYPES[k]) for k in odd) if odd else frame


def _widen(name: str, dtype: pl.DataType) -> pl.Expr:
    """Partials are summed as Int64 (counts) or Float64 (sums): no overflow, no float32 drift."""
    if dtype.is_integer() or dtype == pl.Boolean:
        return pl.col(name).cast(pl.Int64)
    return pl.col(name).cast(pl.Float64)


class PartialStore(Protocol):
    """Where file partials are kept between analyses (rlscope.cache.PartialCache): `load` says
    which files it holds and leaves their merged partials in `loaded`; `store` adds new ones."""

    loaded: dict[str, pl.DataFrame]

    def load(
        self, run: Run, files: list[TokenFile], plan: TokenPlan, fingerprint: str
    ) -> list[bool]: ...

    def store(
        self,
        run: Run,
        fingerprint: str,
        new: list[tuple[TokenFile, Mapping[str, pl.DataFrame]]],
        plan: TokenPlan,
    ) -> None: ...


#: Any `map`: the builtin, `Executor.map`, or a distributed engine's map over the chunks of
#: files (Ray, Dask; README "Scaling out"). It must return one result per chunk, in order.
Mapper = Callable[[Callable[[list[TokenFile]], list[dict[str, pl.DataFrame]]], list], Iterable]


def scan_tokens(
    run: Run,
    plan: TokenPlan,
    *,
    cache: PartialStore | None = None,
    progress: Callable[[int, int], None] | None = None,
    mapper: Mapper | None = None,
) -> tuple[dict[str, pl.DataFrame], ScanStats]:
    """Every level of the plan over the run's token files: cached partials where a file is
    unchanged, `chunk_partials` of the others (mapped by `mapper`, by default over WORKERS
    threads), merged; then the run's step range applied."""
    files = token_files(run, plan)
    fingerprint = plan.fingerprint(run.tables["tokens"].schema)
    cached = (
        cache.load(run, files, plan, fingerprint) if cache is not None else [False] * len(files)
    )
    todo = chunks([f for f, hit in zip(files, cached, strict=True) if not hit])
    results: list[Mapping[str, pl.DataFrame]] = [cache.loaded] if cache and cache.loaded else []
    new: list[tuple[TokenFile, Mapping[str, pl.DataFrame]]] = []
    done, rows_read = sum(cached), 0
    if progress is not None:
        progress(done, len(files))
    reduce_chunk = partial(chunk_partials, plan=plan)
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for chunk, partials in zip(todo, (mapper or pool.map)(reduce_chunk, todo), strict=True):
            for file, one in zip(chunk, partials, strict=True):
                rows_read += int(one[""][ROWS].sum())
                results.append(one)
                if cache is not None:
                    new.append((file, one))
            done += len(chunk)
            if progress is not None:
                progress(done, len(files))
    # Arrow's allocator keeps the freed decode buffers for reuse; hand them back, so that what
    # `analyze` reads next (with Polars' allocator) does not stack on top of them.
    pa.default_memory_pool().release_unused()
    if cache is not None:
        cache.store(run, fingerprint, new, plan)
    merged = merge(results, plan)
    lo, hi = run.step_range
    for level, frame in merged.items():
        if lo is not None:
            frame = frame.filter(pl.col("step") >= lo)
        if hi is not None:
            frame = frame.filter(pl.col("step") <= hi)
        merged[level] = frame
    stats = ScanStats(
        files=len(files),
        files_read=len(files) - sum(cached),
        rows=int(merged[""][ROWS].sum()),
        rows_read=rows_read,
    )
    return merged, stats
