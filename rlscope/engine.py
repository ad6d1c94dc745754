"""Plans registered metrics so each table is scanned once, then collects every series."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import polars as pl
import pyarrow as pa

from rlscope.catalog import Catalog, default_catalog
from rlscope.context import MetricContext
from rlscope.errors import RlscopeError
from rlscope.reader import INVALID_PREFIX, Run, invalid_warnings, scan_error, valid_rollout
from rlscope.report import Logged, MetricResult, Skipped
from rlscope.spec import Metric, Variant, split_column
from rlscope.text import TextSettings
from rlscope.tokenscan import ROWS, Mapper, PartialStore, ScanStats, TokenPlan, scan_tokens
from rlscope.trajectory import decline_shape
from rlscope.windows import final_window

GROUP_KEYS = ("split", "step", "prompt_id")
ROLLOUT_KEYS = (*GROUP_KEYS, "rollout_id")
#: The rollouts in a group (the same partial as the metrics' `n`).
GROUP_SIZE = {"n": pl.len().cast(pl.Int64)}
PROBE_KEYS = ("rollout_id", "step", "split", "intervention", "fraction")
#: Why a metric is skipped in a run with a steps table and no rollouts table.
STEPS_ONLY = "no rollouts table: the trainer logged step metrics only"
#: Rows per streaming morsel of the per-rollout text query (Polars' default is ~100k rows:
#: with long responses and their word lists, that is what sets the peak memory).
TEXT_MORSEL_ROWS = 10_000


@dataclass(frozen=True)
class Computed:
    """The engine's output: results for the report, per-step frames for rules, what was skipped."""

    results: dict[str, MetricResult]
    frames: dict[str, pl.DataFrame]
    skipped: tuple[Skipped, ...]
    aggregates: dict[tuple[str, str], pl.DataFrame]  # (table, level) -> partial aggregates
    context: MetricContext
    # Data problems met while scanning (NaN/inf counts, tokens without a rollout).
    warnings: tuple[str, ...] = ()
    tokens: ScanStats = field(default_factory=ScanStats)  # what the token scan read


def choose_variant(metric: Metric, run: Run, first: int = 0) -> Variant | str:
    """The first variant (from index `first` on) the run can feed, or the reason none can."""
    reasons = []
    for variant in metric.variants[first:]:
        columns = [split_column(variant.table, c) for c in variant.requires]
        missing = [(t, c) for t, c in columns if not run.has(t, c)]
        missing_meta = [m for m in variant.needs_meta if run.meta.get(m) is None]
        if not missing and not missing_meta:
            return variant
        if variant.table not in run.tables and "rollouts" not in run.tables:
            reasons.append(STEPS_ONLY)
        elif variant.table not in run.tables:
            reasons.append(f"no {variant.table} table")
        else:
            parts = [f"{t}.{c}" for t, c in missing]
            parts += [f"run.json {m}" for m in missing_meta]
            why = run.meta.get("correct_unknown") if ("rollouts", "correct") in missing else None
            reasons.append("needs " + ", ".join(parts) + (f" ({why})" if why else ""))
    return "; or ".join(dict.fromkeys(reasons))


def plan(
    metrics: Iterable[Metric], run: Run, first: Mapping[str, int] | None = None
) -> tuple[dict[str, Variant], list[Skipped]]:
    """Each metric's variant (the first the run can feed, from index `first[id]` on)."""
    chosen: dict[str, Variant] = {}
    skipped: list[Skipped] = []
    for metric in metrics:
        variant = choose_variant(metric, run, (first or {}).get(metric.id, 0))
        if isinstance(variant, str):
            skipped.append(Skipped(metric.id, variant, metric.layer))
        else:
            chosen[metric.id] = variant
    return chosen, skipped


def _merged_partials(
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
) -> pl.LazyFrame:
    """One scan of `table` (steps, rollouts or probes; tokens go through `tokenscan`),
    aggregated to `level` with every requested partial, plus the number of NaN/inf values of
    each `count_invalid` column (partials named `__invalid__<column>`) and the row count
    (`__rows__`) when given (the steps table).

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
    if table == "rollouts":
        # What is left out is counted in the reader's warnings.
        return lf.filter(valid_rollout()).group_by(GROUP_KEYS).agg(exprs)
    if count_invalid is not None:
        exprs.append(pl.len().alias(ROWS))  # for the count of rows with a null step
    return lf.group_by("step").agg(exprs)


def token_plan(
    run: Run, text: TextSettings | None = None, catalog: Catalog | None = None
) -> TokenPlan:
    """The token scan's plan for every metric of the catalog the run can feed (what `compute`
    reads of the tokens table), e.g. to map its files on other workers."""
    ctx = MetricContext(run, text=text or TextSettings())
    chosen, _ = plan((catalog or default_catalog()).for_run(run).values(), run)
    by_level: dict[str, list[Variant]] = {"": []}
    for variant in chosen.values():
        if variant.table == "tokens":
            by_level.setdefault(variant.level, []).append(variant)
    return _token_plan(run, by_level, ctx)


def _token_plan(run: Run, by_level: dict[str, list[Variant]], ctx: MetricContext) -> TokenPlan:
    """The token scan's plan: every level's partials, the step level's prelude, the float
    columns whose NaN/inf values are counted, and the rollout ids when there are rollouts."""
    partials = {level: _merged_partials(variants, ctx) for level, variants in by_level.items()}
    every = {f"{level}:{n}": e for level, exprs in partials.items() for n, e in exprs.items()}
    prelude = _merged_partials(by_level.get("", []), ctx, prelude=True)
    invalid = _float_columns_used(run, "tokens", every)
    return TokenPlan(partials, prelude, tuple(invalid), ids="rollouts" in run.tables)


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


def orphan_warning(run: Run, ids: pl.DataFrame) -> str | None:
    """The warning for token rows whose rollout_id is not in the rollouts table, given the
    token rows per (step, rollout_id) (the token scan's "ids" level)."""
    known = replace(run, step_range=(None, None)).scan("rollouts").select("rollout_id").unique()
    orphans = (
        ids.lazy()
        .join(known, on="rollout_id", how="anti", nulls_equal=False)
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
    run: Run,
    metric_ids: Iterable[str] | None = None,
    *,
    text: TextSettings | None = None,
    cache: PartialStore | None = None,
    progress: Callable[[int, int], None] | None = None,
    mapper: Mapper | None = None,
    first_variant: Mapping[str, int] | None = None,
    catalog: Catalog | None = None,
) -> Computed:
    """Compute the requested metrics (all of the catalog's, rlscope's own by default, that the
    run can feed) over a run. With `cache`,
    token files' partial aggregates are reused where the file is unchanged (and stored);
    `progress` gets (token files done, token files) as the token scan goes; `mapper` maps the
    per-file token reduction over the files to read (see `tokenscan.Mapper`).

    A metric whose variant gives no value at any step falls back to its next variant the run
    can feed (e.g. tool-response length from the text tags when the tokens table has no
    tool_response tokens because they are loss-masked), computed in one more pass over only
    those metrics; `first_variant` (id -> variant index) is how that pass is asked."""
    context = MetricContext(run, text=text or TextSettings())
    catalog = catalog or default_catalog()
    available = catalog.for_run(run)
    metrics = (
        list(available.values()) if metric_ids is None else catalog.select(metric_ids, available)
    )
    chosen, skipped = plan(metrics, run, first_variant)
    logged = _logged_columns(chosen, run, available)

    by_level: dict[tuple[str, str], list[Variant]] = {}
    for variant in chosen.values():
        by_level.setdefault((variant.table, variant.level), []).append(variant)
    if ("rollouts", "") in by_level:  # group sizes, always: the header counts rollouts by them
        by_level["rollouts", ""].append(Variant("rollouts", (), _no_series, GROUP_SIZE))
    if logged:
        partials = {
            f"logged:{c}": pl.col(c).cast(pl.Float64).mean() for c in dict.fromkeys(logged.values())
        }
        by_level.setdefault(("steps", ""), []).append(Variant("steps", (), _no_series, partials))
    levels = sorted(by_level)
    token_levels = [level for table, level in levels if table == "tokens"]
    if token_levels and "" not in token_levels:
        token_levels.insert(0, "")  # the token scan always counts rows and NaN/inf per step
    levels = [key for key in levels if key[0] != "tokens"]
    queries = []
    counted: dict[tuple[str, str], list[str]] = {}
    for table, level in levels:
        partials = _merged_partials(by_level[table, level], context)
        # NaN/inf counts ride along the steps scan (rollouts: the reader counts them over all
        # rows, before rows are left out; probes are few and not aggregated).
        if table == "steps":
            counted[table, level] = _float_columns_used(run, table, partials)
        prelude = _merged_partials(by_level[table, level], context, prelude=True)
        queries.append(
            aggregate_query(run, table, level, partials, counted.get((table, level)), prelude)
        )
    warnings: list[str] = []
    scan_stats = ScanStats()
    token_frames: dict[str, pl.DataFrame] = {}
    # Tokens first: the scan hands its decode buffers back when done, so the peak is the larger
    # of the two phases, not their sum (1B tokens: 0.96 -> 0.75 GiB).
    if token_levels:
        token_plan = _token_plan(
            run, {lvl: by_level.get(("tokens", lvl), []) for lvl in token_levels}, context
        )
        try:
            token_frames, scan_stats = scan_tokens(
                run, token_plan, cache=cache, progress=progress, mapper=mapper
            )
            orphans = orphan_warning(run, token_frames.pop("ids")) if token_plan.ids else None
        except (pl.exceptions.PolarsError, pa.ArrowException, OSError) as exc:
            raise scan_error(run, ["tokens"], "reading tokens", exc) from None
        counted["tokens", ""] = list(token_plan.count_invalid)
        warnings += [orphans] if orphans else []
    tables = list(dict.fromkeys(table for table, _ in levels))
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
    for level in token_levels:
        levels.append(("tokens", level))
        collected.append(token_frames[level])
    run.check_unchanged()  # every file read is the one listed at open
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
        aggregates[key] = frame.filter(pl.col("step").is_not_null())

    context.pass_k = resolve_pass_k(run, aggregates.get(("rollouts", "")))
    context.aggregates = aggregates
    ids = list(chosen)
    series_queries = [
        chosen[i].series(aggregates[chosen[i].table, chosen[i].level].lazy(), context) for i in ids
    ]
    frames = dict(zip(ids, _collect(series_queries, "computing metrics"), strict=True))

    results: dict[str, MetricResult] = {}
    fallback: dict[str, int] = {}
    for metric_id in ids:
        metric, variant = available[metric_id], chosen[metric_id]
        frame = frames[metric_id].sort("step")
        frames[metric_id] = frame
        values = _floats(frame["value"])
        steps = [int(s) for s in frame["step"].to_list()]
        if not any(v is not None for v in values):
            source = aggregates[variant.table, variant.level]
            reason = _empty_reason(frame, variant, source)
            after = metric.variants.index(variant) + 1
            nxt = choose_variant(metric, run, after)
            found = None if isinstance(nxt, str) else _from_aggregates(nxt, aggregates, context)
            if isinstance(nxt, str):
                skipped.append(Skipped(metric_id, reason, metric.layer))
                continue
            if found is None:  # its partials were not computed in this pass: one more pass
                skipped.append(Skipped(metric_id, reason, metric.layer))
                fallback[metric_id] = metric.variants.index(nxt)
                continue
            variant, frame = nxt, found
            frames[metric_id] = frame
            values = _floats(frame["value"])
            steps = [int(s) for s in frame["step"].to_list()]
            if not any(v is not None for v in values):
                reason = _empty_reason(frame, variant, source)
                skipped.append(Skipped(metric_id, reason, metric.layer))
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
            band=metric.band,
            better=metric.better,
            unit=metric.unit,
        )
    computed = Computed(
        results, frames, tuple(skipped), aggregates, context, tuple(warnings), scan_stats
    )
    if fallback:
        again = compute(
            run, list(fallback), text=text, cache=cache, first_variant=fallback, catalog=catalog
        )
        computed = _merged(computed, again, list(available))
    return computed


def _from_aggregates(
    variant: Variant, aggregates: dict[tuple[str, str], pl.DataFrame], ctx: MetricContext
) -> pl.DataFrame | None:
    """A fallback variant's per-step frame from the partials this pass already computed (the
    text features are all computed together, so a text fallback usually costs no scan), or
    None when they were not."""
    source = aggregates.get((variant.table, variant.level))
    if source is None or not set(variant.resolve_partials(ctx)) <= set(source.columns):
        return None
    return variant.series(source.lazy(), ctx).collect().sort("step")


def _merged(main: Computed, again: Computed, order: list[str]) -> Computed:
    """`main` with the metrics `again` recomputed from a later variant (in catalog order)."""
    results = {**main.results, **again.results}
    redone = set(again.results) | {s.metric for s in again.skipped}
    return replace(
        main,
        results={m: results[m] for m in order if m in results},
        frames={**main.frames, **again.frames},
        skipped=tuple(s for s in main.skipped if s.metric not in redone) + again.skipped,
        aggregates={**again.aggregates, **main.aggregates},
        warnings=tuple(dict.fromkeys(main.warnings + again.warnings)),
    )


def _empty_reason(frame: pl.DataFrame, variant: Variant, source: pl.DataFrame) -> str:
    if variant.empty_reason:
        return variant.empty_reason
    if variant.table == "rollouts" and variant.level == "" and "n" in source.columns:
        sizes = source.filter(pl.col("split") == "train")["n"]
        if sizes.len() and sizes.max() == 1:
            return (
                "every train group has one rollout (e.g. PPO with a critic): this metric needs "
                "several rollouts of one prompt"
            )
    if frame.height == 0:
        return f"no {variant.table} rows (for train rollouts, in the step range)"
    return "undefined at every step (e.g. no variation to measure, or no valid values)"


def final_window_mean(values: list[float | None]) -> float | None:
    """Summary value: mean over the final window (rlscope.windows) of the non-null steps."""
    window = final_window([v for v in values if v is not None])
    return sum(window) / len(window) if window else None


def _floats(series: pl.Series) -> list[float | None]:
    """A column as Python floats, None where null, NaN or infinite."""
    return [
        None if v is None or not math.isfinite(v) else float(v)
        for v in series.cast(pl.Float64).to_list()
    ]


def _logged_columns(
    chosen: dict[str, Variant], run: Run, available: Mapping[str, Metric]
) -> dict[str, str]:
    """Metric id -> the steps-table column holding the trainer's own value of a metric that
    rlscope recomputes from rollouts or tokens."""
    if "steps" not in run.tables:
        return {}
    columns = run.tables["steps"].columns
    logged = {}
    for metric_id, variant in chosen.items():
        if variant.table == "steps":
            continue
        if run.lengths_in_words and "response_len" in variant.requires:
            continue  # word counts are not compared with a trainer's token-based lengths
        found = next((c for c in available[metric_id].logged_as if c in columns), None)
        if found is not None:
            logged[metric_id] = found
    return logged


def _no_series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    raise AssertionError("a partials-only variant has no series")


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


def _extra(metric: Metric, frame: pl.DataFrame, context: MetricContext) -> dict[str, Any]:
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
