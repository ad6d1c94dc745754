"""Plans registered metrics so each table is scanned once, then collects every series."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.reader import INVALID_PREFIX, Run, invalid_warnings, scan_error, valid_rollout
from rlscope.registry import METRICS, Metric, Variant, load_all, split_column
from rlscope.report import Logged, MetricResult, Skipped
from rlscope.text import TextSettings
from rlscope.trajectory import decline_shape

#: Per-step entropy quantiles come from a histogram with log-spaced bins: bin b covers
#: [E0·(e^(b/K) - 1), E0·(e^((b+1)/K) - 1)), i.e. a width of (H + E0)/K at entropy H — relative
#: precision 1/K above E0, absolute E0/K below. ~600 bins span 0-25 nats, so the histogram's
#: size depends on the number of steps, never on the number of tokens.
ENTROPY_BINS_PER_EFOLD = 100
ENTROPY_BIN_OFFSET = 0.05
ENTROPY_MAX_BIN = 1000
GROUP_KEYS = ("split", "step", "prompt_id")
ROLLOUT_KEYS = (*GROUP_KEYS, "rollout_id")
PROBE_KEYS = ("rollout_id", "step", "split", "intervention", "fraction")
ROWS = "__rows__"  # row-count partial of the level that counts a table's data problems
FINAL_WINDOW_FRACTION = 0.1
#: Rows per streaming morsel of the per-rollout text query (Polars' default is ~100k rows:
#: with long responses and their word lists, that is what sets the peak memory).
TEXT_MORSEL_ROWS = 10_000


def entropy_bin() -> pl.Expr:
    scaled = (pl.col("entropy").cast(pl.Float64).clip(0.0) / ENTROPY_BIN_OFFSET).log1p()
    return (
        (scaled * ENTROPY_BINS_PER_EFOLD)
        .floor()
        .clip(0, ENTROPY_MAX_BIN)
        .cast(pl.Int32)
        .alias("entropy_bin")
    )


def entropy_bin_midpoint(bin_index: pl.Expr) -> pl.Expr:
    """The entropy at the middle of a bin (inverse of `entropy_bin`)."""
    centre = (bin_index.cast(pl.Float64) + 0.5) / ENTROPY_BINS_PER_EFOLD
    return ENTROPY_BIN_OFFSET * (centre.exp() - 1.0)


@dataclass
class Context:
    """What a metric's series function may read besides its aggregated frame."""

    run: Run
    pass_k: int | None = None
    text: TextSettings = field(default_factory=TextSettings)
    # The collected partial aggregates, (table, level) -> frame (for metric summaries).
    aggregates: dict[tuple[str, str], pl.DataFrame] = field(default_factory=dict)


@dataclass(frozen=True)
class Computed:
    """The engine's output: results for the report, per-step frames for rules, what was skipped."""

    results: dict[str, MetricResult]
    frames: dict[str, pl.DataFrame]
    skipped: tuple[Skipped, ...]
    aggregates: dict[tuple[str, str], pl.DataFrame]  # (table, level) -> partial aggregates
    context: Context
    # Data problems met while scanning (NaN/inf counts, tokens without a rollout).
    warnings: tuple[str, ...] = ()


def choose_variant(metric: Metric, run: Run) -> Variant | str:
    """The first variant the run can feed, or the reason none can."""
    reasons = []
    for variant in metric.variants:
        columns = [split_column(variant.table, c) for c in variant.requires]
        missing = [(t, c) for t, c in columns if not run.has(t, c)]
        missing_meta = [m for m in variant.needs_meta if run.meta.get(m) is None]
        if not missing and not missing_meta:
            return variant
        if variant.table not in run.tables:
            reasons.append(f"no {variant.table} table")
        else:
            parts = [f"{t}.{c}" for t, c in missing]
            parts += [f"run.json {m}" for m in missing_meta]
            reasons.append("needs " + ", ".join(parts))
    return "; or ".join(dict.fromkeys(reasons))


def plan(metrics: Iterable[Metric], run: Run) -> tuple[dict[str, Variant], list[Skipped]]:
    chosen: dict[str, Variant] = {}
    skipped: list[Skipped] = []
    for metric in metrics:
        variant = choose_variant(metric, run)
        if isinstance(variant, str):
            skipped.append(Skipped(metric.id, variant))
        else:
            chosen[metric.id] = variant
    return chosen, skipped


def _merged_partials(
    variants: Iterable[Variant], ctx: Context, *, prelude: bool = False
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
) -> pl.LazyFrame:
    """One scan of `table`, aggregated to `level` with every requested partial, plus the number
    of NaN/inf values of each `count_invalid` column (partials named `__invalid__<column>`) and
    the row count (`__rows__`), when given (the first level of a table other than rollouts).

    Two levels are not aggregations: rollouts' "rollout" level (one row per rollout: the
    partials are elementwise features, e.g. of the text, which is dropped once they are
    computed) and probes (one row per probe, with its rollout's step, split and answer)."""
    exprs = [expr.alias(name) for name, expr in partials.items()]
    if table == "probes":
        return probes_query(run).select(*PROBE_KEYS, *exprs)
    if table == "rollouts" and level == "rollout":
        lf = run.scan("rollouts").filter(valid_rollout())
        for name, expr in (prelude or {}).items():
            lf = lf.with_columns(expr.alias(name))
        return lf.select(*ROLLOUT_KEYS, *exprs)
    flags = [INVALID_PREFIX + c for c in count_invalid or ()]
    lf = run.scan(table, invalid_flags=bool(flags))
    exprs += [pl.col(f).cast(pl.Int64).sum().alias(f) for f in flags]
    if table != "rollouts" and count_invalid is not None:
        exprs.append(pl.len().alias(ROWS))  # for the count of rows with a null step
    if table == "rollouts":
        keys: list[Any] = list(GROUP_KEYS)
        lf = lf.filter(valid_rollout())  # what is left out is counted in the reader's warnings
    elif level == "entropy_bins":
        # Kept apart from the per-step sums: few columns per (step, bin) group keeps it small.
        keys = ["step", entropy_bin()]
        if not flags:
            lf = lf.filter(pl.col("entropy").is_not_null())
        # else rows without entropy land in a null bin, dropped after collection (compute).
    elif level == "segments":
        keys = ["step", pl.col("segment").cast(pl.String)]
        if not flags:
            lf = lf.filter(pl.col("segment").is_not_null())
    else:
        keys = ["step"]
    return lf.group_by(keys).agg(exprs)


def _float_columns_used(run: Run, table: str, partials: dict[str, pl.Expr]) -> list[str]:
    """Float columns the partials read: the ones whose NaN/inf count costs no extra I/O."""
    used: set[str] = set()
    for expr in partials.values():
        used.update(expr.meta.root_names())
    schema = run.tables[table].schema
    return [c for c, t in schema.items() if c in used and isinstance(t, pl.Float32 | pl.Float64)]


def probes_query(run: Run) -> pl.LazyFrame:
    """Probes joined with their rollout's step, split and answer (`original_answer`, null when
    the rollouts table has no answer column). Probes carry no step: the step range applies
    through their rollout. Probes of unknown rollouts are counted in the reader's warnings."""
    answer = pl.col("answer") if run.has("rollouts", "answer") else pl.lit(None, pl.String)
    rollouts = (
        run.scan("rollouts")
        .filter(valid_rollout())
        .select("rollout_id", "step", "split", answer.alias("original_answer"))
    )
    probes = replace(run, step_range=(None, None)).scan("probes")
    return probes.join(rollouts, on="rollout_id", how="inner")


def orphan_tokens_query(run: Run) -> pl.LazyFrame:
    """Token rows whose rollout_id is not in the rollouts table. Costs one extra pass over the
    tokens' `rollout_id` column only (one int64 per token; the other columns are not read) and
    a hash table the size of the number of rollouts; folding it into the per-step aggregation
    would need a join of every token row."""
    ids = replace(run, step_range=(None, None)).scan("rollouts").select("rollout_id").unique()
    return (
        run.scan("tokens")
        .group_by("rollout_id")
        .agg(pl.len().alias("rows"))
        .join(ids, on="rollout_id", how="anti", nulls_equal=False)
        .select(pl.len().alias("ids"), pl.col("rows").sum().alias("rows"))
    )


def resolve_pass_k(run: Run, groups: pl.DataFrame | None) -> int | None:
    """k for pass@k: run.json group_size, else the modal train group size."""
    if run.meta.get("group_size"):
        return int(run.meta["group_size"])
    if groups is None or groups.height == 0 or "n" not in groups.columns:
        return None
    sizes = groups.filter(pl.col("split") == "train")["n"]
    if sizes.len() == 0:
        return None
    return int(sizes.mode().sort().item(-1))


def compute(
    run: Run, metric_ids: Iterable[str] | None = None, *, text: TextSettings | None = None
) -> Computed:
    """Compute the requested metrics (all registered ones by default) over a run."""
    load_all()
    context = Context(run, text=text or TextSettings())
    if metric_ids is None:
        metrics = list(METRICS.values())
    else:
        unknown = [m for m in metric_ids if m not in METRICS]
        if unknown:
            raise RlscopeError(
                f"unknown metric id(s): {', '.join(unknown)}", hint="`rlscope metrics` lists them"
            )
        metrics = [METRICS[m] for m in metric_ids]
    chosen, skipped = plan(metrics, run)
    logged = _logged_columns(chosen, run)

    by_level: dict[tuple[str, str], list[Variant]] = {}
    for variant in chosen.values():
        by_level.setdefault((variant.table, variant.level), []).append(variant)
    if logged:
        partials = {
            f"logged:{c}": pl.col(c).cast(pl.Float64).mean() for c in dict.fromkeys(logged.values())
        }
        by_level.setdefault(("steps", ""), []).append(Variant("steps", (), _no_series, partials))
    levels = sorted(by_level)
    queries = []
    counted: dict[tuple[str, str], list[str]] = {}
    for table, level in levels:
        partials = _merged_partials(by_level[table, level], context)
        # NaN/inf counts ride along the first scan of each table (rollouts: the reader counts
        # them over all rows, before rows are left out; probes are few and not aggregated).
        if table not in ("rollouts", "probes") and not any(t == table for t, _ in counted):
            counted[table, level] = _float_columns_used(run, table, partials)
        prelude = _merged_partials(by_level[table, level], context, prelude=True)
        queries.append(
            aggregate_query(run, table, level, partials, counted.get((table, level)), prelude)
        )
    tables = list(dict.fromkeys(table for table, _ in levels))
    with_orphans = "tokens" in tables and "rollouts" in run.tables
    if with_orphans:
        queries.append(orphan_tokens_query(run))
    what = "reading " + ", ".join(tables)
    # The per-rollout text query runs alone, in small morsels: a morsel of long responses and
    # their word lists is what bounds its memory (the other scans keep Polars' default).
    text_query = (
        levels.index(("rollouts", "rollout")) if ("rollouts", "rollout") in levels else None
    )
    if text_query is not None:
        text_frame = _collect([queries.pop(text_query)], what, run, tables, TEXT_MORSEL_ROWS)
    collected = _collect(queries, what, run, tables)
    if text_query is not None:
        collected.insert(text_query, text_frame[0])
    run.check_unchanged()  # every file read is the one listed at open
    warnings: list[str] = []
    if with_orphans:
        orphans = collected.pop()
        if orphans["rows"][0]:
            warnings.append(
                f"tokens: {orphans['rows'][0]:,} row(s) with {orphans['ids'][0]:,} rollout_id "
                "value(s) that are not in the rollouts table (still used in the token metrics)"
            )
    aggregates = {}
    for key, frame in zip(levels, collected, strict=True):
        if key in counted:
            columns = counted[key]
            if columns:
                sums = frame.select(pl.col(INVALID_PREFIX + c).sum() for c in columns).row(0)
                warnings += invalid_warnings(key[0], dict(zip(columns, sums, strict=True)))
            no_step = int(frame.filter(pl.col("step").is_null())[ROWS].sum())
            if no_step:
                warnings.append(
                    f"{key[0]}: {no_step:,} row(s) with a null step are left out of the metrics"
                )
            frame = frame.drop(ROWS, *(INVALID_PREFIX + c for c in columns))
            if key[1] in ("entropy_bins", "segments"):
                frame = frame.filter(pl.col(frame.columns[1]).is_not_null())
        aggregates[key] = frame.filter(pl.col("step").is_not_null())

    context.pass_k = resolve_pass_k(run, aggregates.get(("rollouts", "")))
    context.aggregates = aggregates
    ids = list(chosen)
    series_queries = [
        chosen[i].series(aggregates[chosen[i].table, chosen[i].level].lazy(), context) for i in ids
    ]
    frames = dict(zip(ids, _collect(series_queries, "computing metrics"), strict=True))

    results: dict[str, MetricResult] = {}
    for metric_id in ids:
        metric, variant = METRICS[metric_id], chosen[metric_id]
        frame = frames[metric_id].sort("step")
        frames[metric_id] = frame
        values = _floats(frame["value"])
        steps = [int(s) for s in frame["step"].to_list()]
        if not any(v is not None for v in values):
            skipped.append(Skipped(metric_id, _empty_reason(frame, variant)))
            continue
        notes = tuple(
            note
            for column, note in run.derived_columns(variant.table).items()
            if column in variant.requires
        )
        results[metric_id] = MetricResult(
            id=metric_id,
            layer=metric.layer,
            title=metric.title,
            value=final_window_mean(values),
            steps=tuple(steps),
            values=tuple(values),
            source=variant.source or ", ".join(f"{variant.table}.{c}" for c in variant.requires),
            notes=notes,
            extra=_extra(metric, frame, context),
            logged=_logged_result(logged.get(metric_id), aggregates.get(("steps", ""))),
        )
    return Computed(results, frames, tuple(skipped), aggregates, context, tuple(warnings))


def _empty_reason(frame: pl.DataFrame, variant: Variant) -> str:
    if variant.empty_reason:
        return variant.empty_reason
    if frame.height == 0:
        return f"no {variant.table} rows (for train rollouts, in the step range)"
    return "undefined at every step (e.g. no variation to measure, or no valid values)"


def final_window_mean(values: list[float | None]) -> float | None:
    """Summary value: mean over the last 10% of the metric's (non-null) steps, at least one."""
    valid = [v for v in values if v is not None]
    if not valid:
        return None
    n = max(1, math.ceil(FINAL_WINDOW_FRACTION * len(valid)))
    return sum(valid[-n:]) / n


def _floats(series: pl.Series) -> list[float | None]:
    """A column as Python floats, None where null, NaN or infinite."""
    return [
        None if v is None or not math.isfinite(v) else float(v)
        for v in series.cast(pl.Float64).to_list()
    ]


def _logged_columns(chosen: dict[str, Variant], run: Run) -> dict[str, str]:
    """Metric id -> the steps-table column holding the trainer's own value of a metric that
    rlscope recomputes from rollouts or tokens."""
    if "steps" not in run.tables:
        return {}
    columns = run.tables["steps"].columns
    logged = {}
    for metric_id, variant in chosen.items():
        if variant.table == "steps":
            continue
        found = next((c for c in METRICS[metric_id].logged_as if c in columns), None)
        if found is not None:
            logged[metric_id] = found
    return logged


def _no_series(frame: pl.LazyFrame, ctx: Context) -> pl.LazyFrame:
    raise AssertionError("the logged-columns variant only contributes partials")


def _logged_result(column: str | None, steps: pl.DataFrame | None) -> Logged | None:
    if column is None or steps is None:
        return None
    frame = steps.select("step", pl.col(f"logged:{column}")).drop_nulls().sort("step")
    values = _floats(frame[f"logged:{column}"])
    return Logged(
        column,
        final_window_mean(values),
        tuple(int(s) for s in frame["step"].to_list()),
        tuple(values),
    )


def _extra(metric: Metric, frame: pl.DataFrame, context: Context) -> dict[str, Any]:
    """Metric-specific JSON: columns prefixed `extra_` carry their final-window summaries; a
    metric's `summary` adds its own fields; `trajectory` metrics say how they declined."""
    extra: dict[str, Any] = {}
    components = {c: c.removeprefix("extra_") for c in frame.columns if c.startswith("extra_")}
    if components:
        extra["components"] = {
            name: final_window_mean(_floats(frame[col])) for col, name in components.items()
        }
    if metric.summary is not None:
        extra.update(metric.summary(frame, context))
    if metric.trajectory:
        defined = frame.filter(pl.col("value").is_finite())
        extra["decline"] = decline_shape(
            defined["step"].to_list(), defined["value"].cast(pl.Float64).to_list()
        )
    return extra


def _collect(
    queries: list[pl.LazyFrame],
    what: str,
    run: Run | None = None,
    tables: Iterable[str] = (),
    morsel_rows: int | None = None,
) -> list[pl.DataFrame]:
    if not queries:
        return []
    try:
        with pl.Config(streaming_chunk_size=morsel_rows):
            # No common-subplan elimination: for two queries over one table it caches the
            # shared scan in memory, i.e. it would materialise the token table.
            return pl.collect_all(queries, optimizations=pl.QueryOptFlags(comm_subplan_elim=False))
    except (pl.exceptions.PolarsError, OSError) as exc:
        if run is not None:
            # Names the file removed/rewritten since the open, or the unreadable file/column.
            raise scan_error(run, tables, what, exc) from None
        raise RlscopeError(
            f"failed while {what}: {exc}",
            hint="`rlscope validate RUN` checks every file's schema; a file may be corrupt",
        ) from None
