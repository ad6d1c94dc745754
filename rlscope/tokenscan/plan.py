"""The token scan's plan (what to reduce at which level), its files, the entropy bins."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np
import polars as pl

from rlscope._version import __version__
from rlscope.exactsum import ordered_sum
from rlscope.reader import Run
from rlscope.store import RunPath

#: Per-step entropy quantiles come from a histogram with log-spaced bins: bin b covers
#: [E0·(e^(b/K) - 1), E0·(e^((b+1)/K) - 1)), i.e. a width of (H + E0)/K at entropy H — relative
#: precision 1/K above E0, absolute E0/K below. ~600 bins span 0-25 nats, so the histogram's
#: size depends on the number of steps, never on the number of tokens.
ENTROPY_BINS_PER_EFOLD = 100
ENTROPY_BIN_OFFSET = 0.05
ENTROPY_MAX_BIN = 1000
ROWS = "__rows__"  # token rows per step (the step level), for the null-step warning
#: Level -> its group keys. "ids" counts token rows per (step, rollout_id) (`len`): merged over
#: files, it finds tokens whose rollout is not in the rollouts table; it also carries the
#: metrics' per-rollout sums (a step's error with a sequence's tokens as one draw).
LEVEL_KEYS: dict[str, tuple[str, ...]] = {
    "": ("step",),
    "entropy_bins": ("step", "entropy_bin"),
    "advantage_tiers": ("step", "adv_tier"),
    "segments": ("step", "segment"),
    "ids": ("step", "rollout_id"),
}
_KEY_TYPES = {
    "step": pl.Int64,
    "entropy_bin": pl.Int32,
    "adv_tier": pl.Int32,
    "segment": pl.String,
    "rollout_id": pl.Int64,
}
#: |advantage| floors: a token's tier is how many of them its |advantage| is above (0 to 5), so
#: that the tokens above each floor (their count, Σ a², largest |a|) are sums over tiers, and a
#: step's noise floor can be chosen from its own scale once its files are merged.
ADVANTAGE_TIERS = (0.0, 1e-12, 1e-9, 1e-6, 1e-3)
FILE_ID = "__file_id__"  # a cached file's id within its run's pack
FILE = "__file__"  # a file's index within a chunk
#: The partial aggregations the merge (a sum) is exact for; a token partial must end in one.
_ADDITIVE = ("sum()", "count()", "len()", "n_unique()")
#: A token partial named with this prefix is a maximum, merged over files by taking the largest.
MAX_PREFIX = "max__"
_TRAILING_CAST = re.compile(r"\.(strict_)?cast\([^()]*\)$")


#: Rows binned at a time by `histogram_tally`: the block's float64 scratch (512 KiB) stays in
#: the core's cache through the passes over it.
BIN_BLOCK_ROWS = 65_536


def _bins_into(values: np.ndarray, scaled: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """Each entropy's bin, floor(K·ln(1 + max(H, 0)/E0)) capped at ENTROPY_MAX_BIN, computed in
    place in `scaled` (float64: fresh memory costs a page fault per 4 KiB) and truncated into
    `bins`: a third of the cost of the same Polars expression."""
    np.maximum(values, 0.0, out=scaled)
    np.divide(scaled, ENTROPY_BIN_OFFSET, out=scaled)
    np.log1p(scaled, out=scaled)
    np.multiply(scaled, ENTROPY_BINS_PER_EFOLD, out=scaled)
    np.minimum(scaled, ENTROPY_MAX_BIN, out=scaled)
    np.copyto(bins, scaled, casting="unsafe")  # truncation = floor (>= 0)
    return bins


def _tiers_into(values: np.ndarray, scaled: np.ndarray, bins: np.ndarray) -> np.ndarray:
    """Each value's tier (ADVANTAGE_TIERS), |value| computed in `scaled`, returned in `bins`."""
    np.abs(values, out=scaled)
    np.greater(scaled, ADVANTAGE_TIERS[0], out=bins, casting="unsafe")
    for floor in ADVANTAGE_TIERS[1:]:  # a compare per floor: half searchsorted's time
        bins += scaled > floor
    return bins


#: What a histogram level can aggregate per (step, bin): its column's count, sum of squares
#: (float64), and the largest magnitude of the step's values (a MAX_PREFIX partial: the step's,
#: on each of its bins; per bin, np.maximum.at cost 5x the rest of the advantage tiers).
HistogramKind = Literal["count", "squares", "max_abs"]


@dataclass(frozen=True)
class Histogram:
    """A level of tokens per (step, bin of one column's value), reduced in numpy: `into` maps a
    block of a batch's non-null values to bin indexes in [0, size), through float64 scratch."""

    column: str
    key: str
    size: int
    into: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

    def partial(self, kind: HistogramKind) -> pl.Expr:
        """The expression a partial of this kind is declared as (what Polars would compute)."""
        values = pl.col(self.column)
        if kind == "count":
            return values.count().cast(pl.Int64)
        if kind == "squares":
            return (values.cast(pl.Float64) ** 2).sum()
        return values.cast(pl.Float64).abs().max()

    def kind(self, expr: pl.Expr) -> HistogramKind | None:
        kinds: tuple[HistogramKind, ...] = ("count", "squares", "max_abs")
        return next((k for k in kinds if expr.meta.eq(self.partial(k))), None)


#: The histogram levels: entropy bins (behavior.entropy_p80's quantile), advantage tiers
#: (stability.advantage_extreme's noise floors: five Polars filters a token cost half the
#: step level's time, a bincount a tenth).
HISTOGRAMS = {
    "entropy_bins": Histogram("entropy", "entropy_bin", ENTROPY_MAX_BIN + 1, _bins_into),
    "advantage_tiers": Histogram("advantage", "adv_tier", len(ADVANTAGE_TIERS) + 1, _tiers_into),
}
#: The one partial of the entropy_bins level: tokens per (step, bin).
BIN_COUNT = HISTOGRAMS["entropy_bins"].partial("count")


def histogram_tally(
    histogram: Histogram,
    values: np.ndarray,
    kinds: Mapping[str, HistogramKind],
    group: np.ndarray | None = None,
    groups: int = 1,
) -> dict[str, np.ndarray]:
    """Each partial (name -> kind) per (group, bin), flat (group · size + bin), over `values`
    (no nulls; `group`: each value's group index, else one group). The bins are computed a
    block at a time through one small float64 scratch buffer (the passes over a batch run in
    cache, not in memory: a third less CPU in a scan at 100M tokens), the tallies in one pass
    over the batch: a group's float sum is then its rows' in order from 0, the same bits
    whichever rows come before it (a file reduced alone or pooled with others)."""
    width = groups * histogram.size
    index = np.empty(values.size, np.intp)
    block = min(values.size, BIN_BLOCK_ROWS) or 1
    scaled = np.empty(block)
    for start in range(0, values.size, block):
        part = values[start : start + block]
        histogram.into(part, scaled[: part.size], index[start : start + part.size])
    if group is not None:
        index += group * histogram.size
    tallies: dict[str, np.ndarray] = {}
    for name, kind in kinds.items():
        if kind == "count":
            tallies[name] = np.bincount(index, minlength=width).astype(np.int64)
        elif kind == "squares":
            squares = np.square(values, dtype=np.float64)
            tallies[name] = np.bincount(index, weights=squares, minlength=width)
        else:
            tallies[name] = np.repeat(_group_max_abs(values, group, groups), histogram.size)
    return tallies


def _group_max_abs(values: np.ndarray, group: np.ndarray | None, groups: int) -> np.ndarray:
    """The largest |value| of each group (-inf for an empty one), from its runs of rows."""
    largest = np.full(groups, -np.inf)
    if not values.size:
        return largest
    if group is None:
        largest[0] = np.abs(values).max()
        return largest
    starts = np.concatenate(([0], np.flatnonzero(np.diff(group)) + 1))
    np.maximum.at(largest, group[starts], np.maximum.reduceat(np.abs(values), starts))
    return largest


def entropy_bin_midpoint(bin_index: pl.Expr) -> pl.Expr:
    """The entropy at the middle of a bin (the inverse of the entropy_bins level's binning)."""
    centre = (bin_index.cast(pl.Float64) + 0.5) / ENTROPY_BINS_PER_EFOLD
    return ENTROPY_BIN_OFFSET * (centre.exp() - 1.0)


def merged(name: str, dtype: pl.DataType | None = None) -> pl.Expr:
    """How the partial `name` merges over files: the largest for a MAX_PREFIX one, else a sum,
    of a float one (`dtype`) in an order of its values, not of the files'."""
    if name.startswith(MAX_PREFIX):
        return pl.col(name).max()
    return (
        ordered_sum(pl.col(name)) if dtype is not None and dtype.is_float() else pl.col(name).sum()
    )


def _aggregation(expr: pl.Expr) -> str:
    text = str(expr)
    while (stripped := _TRAILING_CAST.sub("", text)) != text:
        text = stripped
    return text


def is_additive(expr: pl.Expr) -> bool:
    """Whether a partial is a sum, a count or a distinct count (merged over files by summing;
    a distinct count is then exact only for values that stay within one file)."""
    return _aggregation(expr).endswith(_ADDITIVE)


#: The shapes of segments-level partial computed from runs of rows of one (rollout, segment):
#: per run a length, a float sum or a count (added up per segment), and distinct rollouts.
_RUN_SHAPES: tuple[tuple[str, Callable[[str], pl.Expr]], ...] = (
    ("len", lambda _: pl.len().cast(pl.Int64)),
    ("len", lambda _: pl.len()),
    ("rollouts", lambda _: pl.col("rollout_id").n_unique()),
    ("sum", lambda column: pl.col(column).cast(pl.Float64).sum()),
    ("count", lambda column: pl.col(column).count().cast(pl.Int64)),
    ("count", lambda column: pl.col(column).count()),
)


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
            if level not in LEVEL_KEYS:
                raise ValueError(f"unknown token level {level!r}")
            if level == "ids" and any(n == "len" or n.startswith(MAX_PREFIX) for n in exprs):
                raise ValueError("the ids level's partials are sums (its own `len` is its rows)")
            if level in HISTOGRAMS:
                self.histogram_kinds(level)  # raises for a partial of another shape
                continue
            for name, expr in exprs.items():
                if name.startswith(MAX_PREFIX):
                    if not _aggregation(expr).endswith("max()"):
                        raise ValueError(f"token partial {name!r} must be a max(): {expr}")
                elif not is_additive(expr):
                    raise ValueError(
                        f"token partial {name!r} must be a sum, count or n_unique (merged "
                        f"over files by summation), or named {MAX_PREFIX}… and a max(): {expr}"
                    )

    @cached_property
    def segment_run_shapes(self) -> dict[str, tuple[str, str]] | None:
        """Each segments-level partial as (kind, column) of a shape the token scan computes
        from runs of rows of one (rollout, segment) (`_RUN_SHAPES`); None when there is no
        segments level or a partial has another shape (then it is grouped row by row)."""
        if "segments" not in self.partials:
            return None
        shapes = {}
        for name, expr in self.partials["segments"].items():
            roots = expr.meta.root_names()
            column = roots[0] if len(roots) == 1 else ""
            kinds = [kind for kind, shape in _RUN_SHAPES if expr.meta.eq(shape(column))]
            if not kinds:
                return None
            shapes[name] = (kinds[0], column)
        return shapes

    def histogram_kinds(self, level: str) -> dict[str, HistogramKind]:
        """A histogram level's partials by kind (`Histogram.partial`)."""
        histogram, kinds = HISTOGRAMS[level], {}
        for name, expr in self.partials[level].items():
            kind = histogram.kind(expr)
            if kind is None or (kind == "max_abs") != name.startswith(MAX_PREFIX):
                raise ValueError(
                    f"the {level} level is a histogram of {histogram.column}: {name!r} must be "
                    f"its count, sum of squares or (named {MAX_PREFIX}…) largest magnitude"
                )
            kinds[name] = kind
        return kinds

    @cached_property
    def ids_run_sums(self) -> dict[str, tuple[str, pl.Expr]] | None:
        """Each ids-level partial as (kind, the per-row expression it aggregates), kind "sum"
        or "count", for the token scan to sum over runs of rows of one rollout; None when a
        partial has another shape (then it is grouped row by row)."""
        shapes = {}
        for name, expr in self.partials.get("ids", {}).items():
            (inner, *rest) = expr.meta.pop()
            kinds = [k for k in ("sum", "count") if not rest and expr.meta.eq(getattr(inner, k)())]
            if not kinds:
                return None
            shapes[name] = (kinds[0], inner)
        return shapes

    @property
    def levels(self) -> tuple[str, ...]:
        """The levels computed: always the step level (row and NaN/inf counts), then the
        plan's others."""
        others = [level for level in self.partials if level not in ("", "ids")]
        return ("", *others, *(("ids",) if self.has_ids else ()))

    @property
    def has_ids(self) -> bool:
        """Whether the ids level is computed: for the orphan check or a metric's partials."""
        return self.ids or "ids" in self.partials

    def columns(self, schema: Mapping[str, pl.DataType]) -> list[str]:
        """The token columns the plan reads (in the table's order)."""
        used = {"step", *self.count_invalid}
        for exprs in (*self.partials.values(), self.prelude):
            for expr in exprs.values():
                used.update(expr.meta.root_names())
        used.update(HISTOGRAMS[level].column for level in self.partials if level in HISTOGRAMS)
        if "segments" in self.partials:
            used.add("segment")
        if self.has_ids:
            used.add("rollout_id")
        return [c for c in schema if c in used]

    def fingerprint(self, schema: Mapping[str, pl.DataType]) -> str:
        """Changes whenever a cached file partial could differ: rlscope's version, the
        expressions, the binning and the unified types of the columns read."""
        parts = [__version__, repr(sorted(self.count_invalid)), str(self.ids)]
        parts += [f"{ENTROPY_BINS_PER_EFOLD}/{ENTROPY_BIN_OFFSET}/{ENTROPY_MAX_BIN}"]
        parts += [repr(ADVANTAGE_TIERS)]
        for level in sorted(self.partials):
            parts += [f"{level}:{n}={e}" for n, e in sorted(self.partials[level].items())]
        parts += [f"prelude:{n}={e}" for n, e in self.prelude.items()]
        parts += [f"{c}:{schema[c]}" for c in self.columns(schema)]
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class TokenFile:
    """One token file as the plan reads it: its path, the types it has and hive values."""

    path: RunPath
    schema: Mapping[str, pl.DataType]  # the file's own column types
    target: Mapping[str, pl.DataType]  # the unified types (of the columns read)
    hive: Mapping[str, str]
    stat: tuple[int, int, int]  # (size, mtime_ns, inode) at open
    #: A piece of a large file: these row groups only (None: the whole file). The map stage
    #: reduces pieces; a file's partials are the sum of its pieces'.
    row_groups: tuple[int, ...] | None = None
    rows: int | None = None  # the whole file's, from its footer at open (None: not known)


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
    rows: tuple[int | None, ...] = table.file_rows or tuple(None for _ in table.files)
    return [
        TokenFile(path, schema, target, values, stat, rows=n)
        for path, schema, values, stat, n in zip(
            table.files, table.file_schemas, hive, table.file_stats, rows, strict=True
        )
    ]
