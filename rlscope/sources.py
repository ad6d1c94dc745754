"""The run's tables as sources: each reads its part of the plan into per-level partials."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import polars as pl
import pyarrow as pa

from rlscope.context import MetricContext
from rlscope.errors import RlscopeError
from rlscope.exactsum import ENGINE
from rlscope.reader import (
    FILE_INDEX,
    INVALID_PREFIX,
    Run,
    check_from_index,
    invalid_warnings,
    scan_error,
    valid_rollout,
)
from rlscope.spec import Variant
from rlscope.steplocal import (
    FileIndex,
    TableRead,
    TableStore,
    file_index,
    read_probes,
    read_step_local,
)
from rlscope.steplocal import fingerprint as steplocal_fingerprint
from rlscope.text import MINHASH_PREFIX
from rlscope.tokenscan import ROWS, Mapper, PartialStore, ScanStats, TokenPlan, scan_tokens
from rlscope.windows import window_size

GROUP_KEYS = ("split", "step", "prompt_id")
ROLLOUT_KEYS = (*GROUP_KEYS, "rollout_id")
#: The rollouts in a group (the same partial as the metrics' `n`).
GROUP_SIZE = {"n": pl.len().cast(pl.Int64)}
PROBE_KEYS = ("rollout_id", "step", "split", "intervention", "fraction")
#: The rollouts table's two levels: a row per prompt group, and a row per rollout.
GROUP_LEVEL = ("rollouts", "")
ROLLOUT_LEVEL = ("rollouts", "rollout")
LEVELS = (GROUP_LEVEL, ROLLOUT_LEVEL)
#: Computed.aggregates' key of the groups of each size per split and step (`group_sizes`).
SIZES_LEVEL = ("rollouts", "sizes")
SIZES_SCHEMA = {"split": pl.String, "step": pl.Int64, "n": pl.Int64, "groups": pl.Int64}
#: A series with no step.
EMPTY_SERIES = pl.DataFrame(schema={"step": pl.Int64, "value": pl.Float64})
#: Rollouts per range of steps of the per-rollout level (text features are computed and
#: reduced one range at a time; 250k-rollout ranges held 0.2 GiB more at the same speed).
ROLLOUT_CHUNK = 100_000
#: Rollouts per range of steps of the per-group level (its per-group extremes keep the query
#: off the streaming engine: ~400 bytes a rollout; 5M rollouts in 100k ranges took 2.2 s,
#: in 250k ranges 1.4 s and 0.09 GiB, in 500k 1.2 s and 0.2 GiB).
GROUP_CHUNK = 250_000
#: Rollouts per range of steps whose group sizes are counted at once (keys only: the
#: group-by of 5M rollouts' keys in one query held 0.12 GiB).
SIZES_CHUNK = 1_000_000
#: Train rollouts of the final window's latest steps that findings pick example rollouts from
#: (a handful each): they are read again on every analysis, so they are capped.
RECENT_ROLLOUTS = 20_000
#: Rows per streaming morsel of the per-rollout text query (Polars' default is ~100k rows:
#: with long responses and their word lists, that is what sets the peak memory; 10k rows held
#: 0.1 GiB more than 2k for one range, at the same speed).
TEXT_MORSEL_ROWS = 2_000


@dataclass(frozen=True)
class TablePlan:
    """What the sources are asked: each (table, level)'s variants, each chosen metric's next
    variant (or why there is none), and how to read (the caches, the per-file indexes, the
    token scan's progress and mapper)."""

    run: Run
    context: MetricContext
    by_level: Mapping[tuple[str, str], list[Variant]]
    chosen: Mapping[str, Variant]
    following: Mapping[str, Variant | str]
    cache: PartialStore | None = None
    index: Mapping[str, FileIndex] = field(default_factory=dict)
    progress: Callable[[int, int], None] | None = None
    mapper: Mapper | None = None

    @property
    def store(self) -> TableStore | None:
        """Where the steps, rollouts and probes tables' per-file results are kept."""
        return self.cache if isinstance(self.cache, TableStore) else None


@dataclass(frozen=True)
class SourceRead:
    """A source's answer: partial aggregates by (table, level), each with its step; the float
    columns whose NaN/inf values were counted along, by level (their counts and the rows of a
    null step ride in the frame until `checked`); the series it computed itself; its warnings;
    and how much of the table it read."""

    table: str
    aggregates: dict[tuple[str, str], pl.DataFrame]
    counted: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    series: dict[str, pl.DataFrame] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    read: TableRead | None = None
    scan: ScanStats | None = None


def file_indexes(run: Run, store: TableStore | None) -> tuple[dict[str, FileIndex], list[str]]:
    """What is known of each rollouts and probes file (see rlscope.steplocal; cached with a
    store), read once for the rollouts check, the orphan checks, the probes and the final
    window's files; and the rollouts check's warnings when the run was opened without it."""
    unchecked = not run.rollouts_checked and "rollouts" in run.tables
    if store is None and not unchecked:
        return {}, []
    tables: list[str] = [t for t in ("rollouts", "probes") if t in run.tables]
    index = {table: file_index(run, table, store) for table in tables}
    if not unchecked:
        return index, []
    probes = index["probes"].frames if "probes" in index else None
    return index, check_from_index(run, index["rollouts"].frames, probes)


def token_levels(by_level: Iterable[tuple[str, str]]) -> list[str]:
    """The token scan's levels: the step level always (it counts rows and NaN/inf per step)."""
    levels = [level for table, level in sorted(by_level) if table == "tokens"]
    return levels if not levels or "" in levels else ["", *levels]


def tokens_source(plan: TablePlan) -> SourceRead | None:
    """Every token level in one scan of the token files (see rlscope.tokenscan), and the
    token rows whose rollout is not in the rollouts table."""
    run = plan.run
    levels = token_levels(plan.by_level)
    if not levels:
        return None
    variants = {level: plan.by_level.get(("tokens", level), []) for level in levels}
    tokens = plan_tokens(run, variants, plan.context)
    try:
        frames, stats = scan_tokens(
            run, tokens, cache=plan.cache, progress=plan.progress, mapper=plan.mapper
        )
        ids = frames.get("ids") if tokens.ids else None
        orphans = orphan_warning(run, ids, plan.index.get("rollouts")) if ids is not None else None
    except (pl.exceptions.PolarsError, pa.ArrowException, OSError) as exc:
        raise scan_error(run, ["tokens"], "reading tokens", exc) from None
    return SourceRead(
        "tokens",
        {("tokens", level): frames[level] for level in levels},
        {("tokens", ""): list(tokens.count_invalid)},
        warnings=[orphans] if orphans else [],
        scan=stats,
    )


def probes_source(plan: TablePlan) -> SourceRead | None:
    """A row per probe with its rollout's step, split and answer, each file's rows cached."""
    run = plan.run
    if ("probes", "") not in plan.by_level or "probes" not in run.tables:
        return None
    partials = merged_partials(plan.by_level["probes", ""], plan.context)
    rows, read = read_probes(
        run,
        lambda part: aggregate_query(part, "probes", "", partials),
        store=plan.store,
        fingerprint=steplocal_fingerprint(
            run, "probes", [partials, probes_query, _schema(run, "rollouts")]
        ),
        probes=plan.index.get("probes"),
        rollouts=plan.index.get("rollouts"),
    )
    return SourceRead("probes", {("probes", ""): rows}, read=read)


def steps_source(plan: TablePlan) -> SourceRead | None:
    """The steps table aggregated per step, each file's aggregates cached, with the NaN/inf
    counts of the float columns the partials read (they ride along the scan)."""
    run, ctx = plan.run, plan.context
    if ("steps", "") not in plan.by_level or "steps" not in run.tables:
        return None
    variants = plan.by_level["steps", ""]
    partials = merged_partials(variants, ctx)
    prelude = merged_partials(variants, ctx, prelude=True)
    counted = _float_columns_used(run, "steps", partials)

    def frames_of(part: Run) -> dict[str, pl.DataFrame]:
        query = aggregate_query(part, "steps", "", partials, counted, prelude)
        return {"level": collect([query], "reading steps", part, ["steps"])[0]}

    fingerprint = steplocal_fingerprint(run, "steps", [partials, prelude, counted])
    frames, read = read_step_local(
        run, "steps", ["level"], frames_of, store=plan.store, fingerprint=fingerprint
    )
    return SourceRead(
        "steps", {("steps", ""): frames["level"]}, {("steps", ""): counted}, read=read
    )


def rollouts_source(plan: TablePlan) -> SourceRead | None:
    """The rollouts table: its group sizes first (pass@k's k is the modal one), then the
    series of its two levels (`RolloutSeries`) and the final window's rows that findings
    name example rollouts from; each file's results cached."""
    run, ctx = plan.run, plan.context
    if "rollouts" not in run.tables or not any(level in plan.by_level for level in LEVELS):
        return None
    index = plan.index.get("rollouts")
    found, sizes_read = read_step_local(
        run,
        "rollouts",
        ["sizes"],
        lambda part: {"sizes": group_sizes(part)},
        store=plan.store,
        fingerprint=steplocal_fingerprint(run, "rollouts", [group_sizes, valid_rollout()]),
        index=index,
    )
    sizes = found.get("sizes", pl.DataFrame(schema=SIZES_SCHEMA))
    ctx.pass_k = resolve_pass_k(run, sizes)
    rollout_series = RolloutSeries.of(plan)
    series, read = read_step_local(
        run,
        "rollouts",
        list(rollout_series.series),
        partial(rollout_series.frames, ctx=ctx),
        store=plan.store,
        fingerprint=rollout_series.fingerprint(run, ctx),
        index=index,
    )
    if sizes_read.files_read > read.files_read:  # the sizes' cache was damaged
        read = sizes_read
    aggregates = {SIZES_LEVEL: sizes}
    recent = rollout_series.recent(run, _train_steps(sizes), index)
    if recent is not None:
        aggregates[ROLLOUT_LEVEL] = recent
    return SourceRead("rollouts", aggregates, series=series, read=read)


#: Every table's source, in the order they are read: tokens first, as the scan hands its
#: decode buffers back when done, so the peak is the larger of the phases, not their sum (1B
#: tokens: 0.96 -> 0.75 GiB). A new table is one more source.
SOURCES: tuple[Callable[[TablePlan], SourceRead | None], ...] = (
    tokens_source,
    probes_source,
    steps_source,
    rollouts_source,
)


def checked(reads: Iterable[SourceRead]) -> tuple[dict[tuple[str, str], pl.DataFrame], list[str]]:
    """The sources' aggregates as the series read them: the NaN/inf counts and the rows of a
    null step that rode along turned into warnings (with the sources' own) and dropped."""
    aggregates: dict[tuple[str, str], pl.DataFrame] = {}
    warnings: list[str] = []
    for read in reads:
        warnings += read.warnings
        for key, frame in read.aggregates.items():
            if key in read.counted:
                columns = read.counted[key]
                if columns:
                    sums = frame.select(pl.col(INVALID_PREFIX + c).sum() for c in columns).row(0)
                    warnings += invalid_warnings(key[0], dict(zip(columns, sums, strict=True)))
                no_step = int(frame.filter(pl.col("step").is_null())[ROWS].sum())
                if no_step:
                    warnings.append(
                        f"{key[0]}: {no_step:,} row(s) with a null step are left out of the metrics"
                    )
                frame = frame.drop(ROWS, *(INVALID_PREFIX + c for c in columns))
            aggregates[key] = frame.filter(pl.col("step").is_not_null())
    return aggregates, warnings


def merged_partials(
    variants: Iterable[Variant], ctx: MetricContext, *, prelude: bool = False
) -> dict[str, pl.Expr]:
    """Every variant's partials (or preludes) by name; one name means one expression."""
    merged: dict[str, pl.Expr] = {}
    for variant in variants:
        found = variant.resolve_prelude(ctx) if prelude else variant.resolve_partials(ctx)
        for name, expr in found.items():
            if name in merged and not merged[name].meta.eq(expr):
                raise ValueError(f"partial {name!r} is declared with two different expressions")
            merged[name] = expr
    return merged


def aggregate_query(
    run: Run,
    table: str,
    level: str,
    partials: dict[str, pl.Expr],
    count_invalid: Iterable[str] | None = None,
    prelude: dict[str, pl.Expr] | None = None,
    steps: tuple[int, int] | None = None,
) -> pl.LazyFrame:
    """One scan of `table` (steps, rollouts or probes; tokens go through `tokenscan`),
    aggregated to `level` with every requested partial, plus the number of NaN/inf values of
    each `count_invalid` column (partials named `__invalid__<column>`) and the row count
    (`__rows__`) when given (the steps table); rollouts only of `steps` (first, last) when
    given.

    Two levels are not aggregations: rollouts' "rollout" level (one row per rollout: the
    partials are elementwise features, e.g. of the text, which is dropped once they are
    computed) and probes (one row per probe, with its rollout's step, split and answer, and
    the probes file's FILE_INDEX)."""
    exprs = [expr.alias(name) for name, expr in partials.items()]
    if table == "probes":
        return probes_query(run, file_index=True).select(FILE_INDEX, *PROBE_KEYS, *exprs)
    if table == "rollouts" and level == "rollout":
        lf = run.scan("rollouts").filter(valid_rollout())
        if steps is not None:
            lf = lf.filter(pl.col("step").is_between(*steps))
        for name, expr in (prelude or {}).items():
            lf = lf.with_columns(expr.alias(name))
        return lf.select(*ROLLOUT_KEYS, *exprs)
    flags = [INVALID_PREFIX + c for c in count_invalid or ()]
    lf = run.scan(table, invalid_flags=bool(flags))
    exprs += [pl.col(f).cast(pl.Int64).sum().alias(f) for f in flags]
    if table == "rollouts":
        # What is left out is counted in the reader's warnings.
        lf = lf.filter(valid_rollout())
        if steps is not None:
            lf = lf.filter(pl.col("step").is_between(*steps))
        # Sorted: a group-by's order is its threads', and the series sum over these rows.
        return lf.group_by(GROUP_KEYS).agg(exprs).sort(GROUP_KEYS, nulls_last=True)
    if count_invalid is not None:
        exprs.append(pl.len().alias(ROWS))  # for the count of rows with a null step
    return lf.group_by("step").agg(exprs).sort("step", nulls_last=True)


def plan_tokens(run: Run, by_level: dict[str, list[Variant]], ctx: MetricContext) -> TokenPlan:
    """The token scan's plan: every level's partials, the step level's prelude, the float
    columns whose NaN/inf values are counted, and the rollout ids when there are rollouts."""
    partials = {level: merged_partials(variants, ctx) for level, variants in by_level.items()}
    every = {f"{level}:{n}": e for level, exprs in partials.items() for n, e in exprs.items()}
    prelude = merged_partials(by_level.get("", []), ctx, prelude=True)
    invalid = _float_columns_used(run, "tokens", every)
    return TokenPlan(partials, prelude, tuple(invalid), ids="rollouts" in run.tables)


def _float_columns_used(run: Run, table: str, partials: dict[str, pl.Expr]) -> list[str]:
    """Float columns the partials read: the ones whose NaN/inf count costs no extra I/O."""
    used: set[str] = set()
    for expr in partials.values():
        used.update(expr.meta.root_names())
    schema = run.tables[table].schema
    return [c for c, t in schema.items() if c in used and isinstance(t, pl.Float32 | pl.Float64)]


def probes_query(run: Run, *, file_index: bool = False) -> pl.LazyFrame:
    """Probes joined with their rollout's step, split and answer (`original_answer`, null when
    the rollouts table has no answer column). Probes carry no step: the step range applies
    through their rollout. Probes of unknown rollouts are counted in the reader's warnings.
    With `file_index`, the probes file's FILE_INDEX.

    The probed ids are read first, and the rollouts filtered to them as they stream: the
    join's table is the probed rollouts', not every rollout's (5M responses: 0.34 -> 0.06 GiB)."""
    answer = pl.col("answer") if run.has("rollouts", "answer") else pl.lit(None, pl.String)
    probes = replace(run, step_range=(None, None)).scan("probes", file_index=file_index)
    try:
        probed = probes.select(pl.col("rollout_id").unique()).collect()["rollout_id"]
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["probes"], "reading probes", exc) from None
    rollouts = (
        run.scan("rollouts")
        .filter(valid_rollout() & pl.col("rollout_id").is_in(probed.implode()))
        .select("rollout_id", "step", "split", answer.alias("original_answer"))
    )
    return probes.join(rollouts, on="rollout_id", how="inner")


def orphan_warning(run: Run, ids: pl.DataFrame, rollouts: FileIndex | None = None) -> str | None:
    """The warning for token rows whose rollout_id is not in the rollouts table, given the
    token rows per (step, rollout_id) (the token scan's "ids" level); the rollouts' ids from
    their `rollouts` index when given, else read."""
    if rollouts is not None:
        known = rollouts.files_of_ids(ids.select("rollout_id").unique()).lazy()
    else:
        unranged = replace(run, step_range=(None, None))
        known = unranged.scan("rollouts").select("rollout_id").unique()
    orphans = (
        ids.lazy()
        .join(known.select("rollout_id"), on="rollout_id", how="anti", nulls_equal=False)
        .select(pl.col("rollout_id").n_unique().alias("ids"), pl.col("len").sum().alias("rows"))
        .collect()
    )
    rows, n_ids = orphans["rows"][0] or 0, orphans["ids"][0]
    if not rows:
        return None
    return (
        f"tokens: {rows:,} row(s) with {n_ids:,} rollout_id value(s) that are not in the "
        "rollouts table (still used in the token metrics)"
    )


def resolve_pass_k(run: Run, sizes: pl.DataFrame | None) -> int | None:
    """k for pass@k: run.json group_size, else the modal train group size (the larger of a
    tie) of the `group_sizes`."""
    if run.meta.get("group_size"):
        return int(run.meta["group_size"])
    if sizes is None:
        return None
    counts = sizes.filter(pl.col("split") == "train").group_by("n").agg(pl.col("groups").sum())
    if counts.height == 0:
        return None
    return int(counts.filter(pl.col("groups") == pl.col("groups").max()).select(pl.max("n")).item())


@dataclass(frozen=True)
class RolloutSeries:
    """The series of the rollouts table's two levels, per group (GROUP_LEVEL) and per rollout
    (ROLLOUT_LEVEL), and of the later variants they can fall back to from the same partials:
    computed over ranges of whole steps, so neither level is ever held whole."""

    group_partials: dict[str, pl.Expr]
    partials: dict[str, pl.Expr]  # per rollout
    prelude: dict[str, pl.Expr]  # per rollout, dropped once the partials are computed
    # Frame name ("series:<id>", or "fallback:<id>" for the next variant) -> variant.
    series: dict[str, Variant]

    @classmethod
    def of(cls, plan: TablePlan) -> RolloutSeries:
        ctx = plan.context
        computed = {level: merged_partials(plan.by_level.get(level, []), ctx) for level in LEVELS}
        chosen = plan.chosen
        series = {f"series:{i}": v for i, v in chosen.items() if (v.table, v.level) in LEVELS}
        for metric_id, nxt in plan.following.items():
            if (
                not isinstance(nxt, str)
                and (nxt.table, nxt.level) in LEVELS
                and set(nxt.resolve_partials(ctx)) <= set(computed[nxt.table, nxt.level])
            ):
                series[f"fallback:{metric_id}"] = nxt
        prelude = merged_partials(plan.by_level.get(ROLLOUT_LEVEL, []), ctx, prelude=True)
        return cls(computed[GROUP_LEVEL], computed[ROLLOUT_LEVEL], prelude, series)

    def frames(self, run: Run, ctx: MetricContext) -> dict[str, pl.DataFrame]:
        """Every series' per-step frame, over ranges of whole steps of at most GROUP_CHUNK
        (per-group series) or ROLLOUT_CHUNK (per-rollout) rollouts: a range's groups or
        rollouts are computed, every series of that level (all are per step) is run on them,
        and they are dropped, so the memory is one range's whatever the number of responses."""
        parts: dict[str, list[pl.DataFrame]] = {name: [] for name in self.series}
        for level, limit in ((GROUP_LEVEL, GROUP_CHUNK), (ROLLOUT_LEVEL, ROLLOUT_CHUNK)):
            names = [n for n, v in self.series.items() if (v.table, v.level) == level]
            for lo_hi in rollout_step_ranges(run, limit) if names else []:
                if level == GROUP_LEVEL:
                    query = aggregate_query(run, "rollouts", "", self.group_partials, steps=lo_hi)
                    source = collect([query], "reading rollouts", run, ["rollouts"])[0]
                else:
                    source = self._rows(run, lo_hi, self.partials)
                series = [self.series[n].series(source.lazy(), ctx) for n in names]
                for name, frame in zip(names, collect(series, "computing metrics"), strict=True):
                    parts[name].append(frame)
        return {
            n: pl.concat(p, how="diagonal_relaxed") if p else EMPTY_SERIES for n, p in parts.items()
        }

    def fingerprint(self, run: Run, ctx: MetricContext) -> str:
        """What a rollouts file's cached series depend on (pass@k's k among them)."""
        described: list[Any] = [self.group_partials, self.partials, self.prelude, ctx.text]
        described += [ctx.pass_k, [(n, v.series) for n, v in self.series.items()]]
        return steplocal_fingerprint(run, "rollouts", described)

    def recent(
        self, run: Run, train_steps: pl.DataFrame, index: FileIndex | None = None
    ) -> pl.DataFrame | None:
        """The rows of the final window's train steps that findings name example rollouts
        from (the latest RECENT_ROLLOUTS at most), without the MinHash signature; `train_steps`
        holds the train rollouts per step (`step`, `len`); with the rollouts' `index`, only
        the files holding those steps are read. None without per-rollout partials."""
        steps = train_steps.sort("step")
        if steps.height == 0 or not self.partials:
            return None
        window = steps.tail(window_size(steps.height))
        latest = window.filter(pl.col("len").reverse().cum_sum().reverse() <= RECENT_ROLLOUTS)
        first = int((latest if latest.height else window.tail(1))["step"][0])
        partials = {n: e for n, e in self.partials.items() if not n.startswith(MINHASH_PREFIX)}
        last = int(steps["step"][-1])
        if index is not None:
            run = run.only("rollouts", index.files_with_steps(first, last) or [0])
        rows = self._rows(run, (first, last), partials)
        return rows.filter(pl.col("split") == "train")

    def _rows(
        self, run: Run, steps: tuple[int, int] | None, partials: dict[str, pl.Expr]
    ) -> pl.DataFrame:
        query = aggregate_query(
            run, "rollouts", "rollout", partials, prelude=self.prelude, steps=steps
        )
        collected = collect(
            [query], "reading rollouts", run, ["rollouts"], TEXT_MORSEL_ROWS, streaming=True
        )
        return collected[0].sort(ROLLOUT_KEYS, nulls_last=True)  # the series sum in this order


def group_sizes(run: Run) -> pl.DataFrame:
    """The groups of each size per split and step (`split`, `step`, `n`, `groups`), valid
    rollouts only: what the header counts, pass@k's k and the train rollouts per step come
    from, without keeping a row per group (counted in ranges of whole steps of at most
    SIZES_CHUNK rollouts: the group-by's table is a range's groups)."""
    parts = []
    for steps in rollout_step_ranges(run, SIZES_CHUNK):
        rows = run.scan("rollouts").filter(valid_rollout())
        query = (
            (rows if steps is None else rows.filter(pl.col("step").is_between(*steps)))
            .group_by(GROUP_KEYS)
            .agg(**GROUP_SIZE)
            .group_by("split", "step", "n")
            .agg(pl.len().cast(pl.Int64).alias("groups"))
        )
        parts += collect([query], "reading rollouts", run, ["rollouts"], streaming=True)
    return pl.concat(parts) if parts else pl.DataFrame(schema=SIZES_SCHEMA)


def _train_steps(sizes: pl.DataFrame) -> pl.DataFrame:
    """Train rollouts per step (`step`, `len`) from the `group_sizes`."""
    return (
        sizes.filter(pl.col("split") == "train")
        .group_by("step")
        .agg((pl.col("n") * pl.col("groups")).sum().alias("len"))
    )


def rollout_step_ranges(run: Run, limit: int) -> list[tuple[int, int] | None]:
    """Ranges (first, last step) of whole steps of at most `limit` valid rollouts each, that the
    rollouts' levels are computed in one at a time, so their memory is a range's whatever the
    run's size; [None] (every step at once, the rollouts per step not counted) when the files
    hold at most `limit` rows."""
    known = run.tables["rollouts"].file_rows  # from the footers read at open, if any
    if known and sum(known) <= limit:
        return [None]
    counts = collect(
        [run.scan("rollouts").filter(valid_rollout()).group_by("step").len().sort("step")],
        "reading rollouts",
        run,
        ["rollouts"],
        streaming=True,
    )[0]
    return [*_step_ranges(counts["step"].to_list(), counts["len"].to_list(), limit)]


def _step_ranges(steps: list[int], counts: list[int], limit: int) -> list[tuple[int, int]]:
    """Consecutive (first, last) step ranges of sorted `steps` holding at most `limit` rows
    each (a step with more is a range of its own)."""
    ranges: list[tuple[int, int]] = []
    rows = 0
    for step, n in zip(steps, counts, strict=True):
        if ranges and rows + n <= limit:
            ranges[-1] = (ranges[-1][0], step)
            rows += n
        else:
            ranges.append((step, step))
            rows = n
    return ranges


def _schema(run: Run, table: str) -> dict[str, pl.DataType]:
    return dict(run.tables[table].schema) if table in run.tables else {}


def collect(
    queries: list[pl.LazyFrame],
    what: str,
    run: Run | None = None,
    tables: Iterable[str] = (),
    morsel_rows: int | None = None,
    *,
    streaming: bool = False,
) -> list[pl.DataFrame]:
    """The queries' frames, on the in-memory engine (its sums do not depend on which thread
    finishes first: see rlscope.exactsum), or `streaming` (in morsels of `morsel_rows` rows
    when given) where rows are many and counted or not summed (rollouts' counts, text
    features)."""
    if not queries:
        return []
    try:
        with pl.Config(streaming_chunk_size=morsel_rows):
            # No common-subplan elimination: for two queries over one table it caches the
            # shared scan in memory, i.e. it would materialise the token table.
            return pl.collect_all(
                queries,
                optimizations=pl.QueryOptFlags(comm_subplan_elim=False),
                engine="streaming" if streaming else ENGINE,
            )
    except (pl.exceptions.PolarsError, OSError) as exc:
        if run is not None:
            # Names the file removed/rewritten since the open, or the unreadable file/column.
            raise scan_error(run, tables, what, exc) from None
        raise RlscopeError(
            f"failed while {what}: {exc}",
            hint="`rlscope validate RUN` checks every file's schema; a file may be corrupt",
        ) from None
