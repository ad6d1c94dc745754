"""Plans the registered metrics, reads each table's part through its source, then every series."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import polars as pl

from rlscope.catalog import Catalog, default_catalog
from rlscope.context import MetricContext
from rlscope.exactsum import ENGINE
from rlscope.reader import Run
from rlscope.report import Logged, MetricResult, Skipped
from rlscope.sources import (
    GROUP_LEVEL,
    LEVELS,
    ROLLOUT_LEVEL,
    SIZES_LEVEL,
    SIZES_SCHEMA,
    SOURCES,
    SourceRead,
    TablePlan,
    checked,
    collect,
    file_indexes,
    plan_tokens,
    resolve_pass_k,
)
from rlscope.spec import Metric, Variant, split_column
from rlscope.steplocal import TableRead, TableStore
from rlscope.text import TextSettings
from rlscope.tokenscan import Mapper, PartialStore, ScanStats, TokenPlan
from rlscope.trajectory import decline_shape
from rlscope.windows import final_window

__all__ = ["GROUP_LEVEL", "ROLLOUT_LEVEL", "SIZES_LEVEL", "Computed", "compute", "upto"]

#: Why a metric is skipped in a run with a steps table and no rollouts table.
STEPS_ONLY = "no rollouts table: the trainer logged step metrics only"


@dataclass(frozen=True)
class Computed:
    """The engine's output: results for the report, per-step frames for rules, what was skipped."""

    results: dict[str, MetricResult]
    frames: dict[str, pl.DataFrame]
    skipped: tuple[Skipped, ...]
    # (table, level) -> partial aggregates: the tokens', steps' and probes' levels, the
    # rollouts' SIZES_LEVEL and the final window's per-rollout rows (ROLLOUT_LEVEL).
    aggregates: dict[tuple[str, str], pl.DataFrame]
    context: MetricContext
    # Data problems met while scanning (NaN/inf counts, tokens without a rollout).
    warnings: tuple[str, ...] = ()
    tokens: ScanStats = field(default_factory=ScanStats)  # what the token scan read
    tables: dict[str, TableRead] = field(default_factory=dict)  # steps, rollouts: files read


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
    return plan_tokens(run, by_level, ctx)


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
    run can feed) over a run: the plan, each table read by its source (rlscope.sources), the
    series, the results. With `cache`, the files' partial aggregates are reused where a file is
    unchanged (and stored); `progress` gets (token files done, token files) as the token scan
    goes; `mapper` maps the per-file token reduction over the files to read (see
    `tokenscan.Mapper`).

    A metric whose variant gives no value at any step falls back to its next variant the run
    can feed (e.g. tool-response length from the text tags when the tokens table has no
    tool_response tokens because they are loss-masked), computed in one more pass over only
    those metrics; `first_variant` (id -> variant index) is how that pass is asked."""
    # k from run.json until the rollouts' group sizes say more (rlscope.sources.rollouts_source)
    context = MetricContext(run, resolve_pass_k(run, None), text=text or TextSettings())
    catalog = catalog or default_catalog()
    available = catalog.for_run(run)
    metrics = (
        list(available.values()) if metric_ids is None else catalog.select(metric_ids, available)
    )
    chosen, skipped = plan(metrics, run, first_variant)
    logged = _logged_columns(chosen, run, available)
    following = {
        i: choose_variant(available[i], run, available[i].variants.index(v) + 1)
        for i, v in chosen.items()
    }
    index, warnings = file_indexes(run, cache if isinstance(cache, TableStore) else None)
    tables = TablePlan(
        run, context, _by_level(chosen, logged), chosen, following, cache, index, progress, mapper
    )
    reads = [read for source in SOURCES if (read := source(tables)) is not None]
    run.check_unchanged()  # every file read is the one listed at open
    aggregates, found = checked(reads)
    context.aggregates = aggregates
    frames, alternates = _series(chosen, aggregates, reads, context)
    results, fallback = _results(
        chosen, following, frames, alternates, logged, available, context, skipped
    )
    computed = Computed(
        results,
        frames,
        tuple(skipped),
        aggregates,
        context,
        tuple(warnings + found),
        next((read.scan for read in reads if read.scan is not None), ScanStats()),
        {read.table: read.read for read in reads if read.read is not None},
    )
    if fallback:
        again = compute(
            run, list(fallback), text=text, cache=cache, first_variant=fallback, catalog=catalog
        )
        computed = _merged(computed, again, list(available))
    return computed


def _by_level(
    chosen: Mapping[str, Variant], logged: Mapping[str, str]
) -> dict[tuple[str, str], list[Variant]]:
    """The chosen variants by (table, level), with the steps' means of the trainer's own
    values of metrics rlscope recomputes (`logged`)."""
    by_level: dict[tuple[str, str], list[Variant]] = {}
    for variant in chosen.values():
        by_level.setdefault((variant.table, variant.level), []).append(variant)
    if logged:
        partials = {
            f"logged:{c}": pl.col(c).cast(pl.Float64).mean() for c in dict.fromkeys(logged.values())
        }
        by_level.setdefault(("steps", ""), []).append(Variant("steps", (), _no_series, partials))
    return by_level


def _series(
    chosen: Mapping[str, Variant],
    aggregates: Mapping[tuple[str, str], pl.DataFrame],
    reads: Iterable[SourceRead],
    context: MetricContext,
) -> tuple[dict[str, pl.DataFrame], dict[str, pl.DataFrame]]:
    """Every chosen metric's per-step frame, and the frames of the next variants the sources
    computed along (a rollouts metric's fallback); in the plan's order."""
    ids = [i for i in chosen if (chosen[i].table, chosen[i].level) not in LEVELS]
    queries = [
        chosen[i].series(aggregates[chosen[i].table, chosen[i].level].lazy(), context) for i in ids
    ]
    frames = dict(zip(ids, collect(queries, "computing metrics"), strict=True))
    alternates: dict[str, pl.DataFrame] = {}
    for read in reads:
        for name, frame in read.series.items():
            kind, metric_id = name.split(":", 1)
            if kind == "series":
                frames[metric_id] = frame
            else:
                alternates[metric_id] = frame.sort("step")
    return {i: frames[i] for i in chosen if i in frames}, alternates


def _results(
    chosen: Mapping[str, Variant],
    following: Mapping[str, Variant | str],
    frames: dict[str, pl.DataFrame],
    alternates: Mapping[str, pl.DataFrame],
    logged: Mapping[str, str],
    available: Mapping[str, Metric],
    context: MetricContext,
    skipped: list[Skipped],
) -> tuple[dict[str, MetricResult], dict[str, int]]:
    """Each metric's result from its frame (sorted in place in `frames`), or from its next
    variant's when its own has no value at any step; a metric with neither is added to
    `skipped`. Also the metrics whose next variant needs one more pass (id -> its index)."""
    run, aggregates = context.run, context.aggregates
    sizes = aggregates.get(SIZES_LEVEL, pl.DataFrame(schema=SIZES_SCHEMA))
    results: dict[str, MetricResult] = {}
    fallback: dict[str, int] = {}
    for metric_id, frame in list(frames.items()):
        metric, variant = available[metric_id], chosen[metric_id]
        frame = frames[metric_id] = frame.sort("step")
        values = _floats(frame["value"])
        if not any(v is not None for v in values):
            reason = _empty_reason(frame, variant, sizes)
            nxt = following[metric_id]
            if isinstance(nxt, str):
                skipped.append(Skipped(metric_id, reason, metric.layer))
                continue
            found = (
                alternates.get(metric_id)
                if (nxt.table, nxt.level) in LEVELS
                else _from_aggregates(nxt, aggregates, context)
            )
            if found is None:  # its partials were not computed in this pass: one more pass
                skipped.append(Skipped(metric_id, reason, metric.layer))
                fallback[metric_id] = metric.variants.index(nxt)
                continue
            variant, frame = nxt, found
            frames[metric_id] = frame
            values = _floats(frame["value"])
            if not any(v is not None for v in values):
                skipped.append(
                    Skipped(metric_id, _empty_reason(frame, variant, sizes), metric.layer)
                )
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
            steps=tuple(int(s) for s in frame["step"].to_list()),
            values=tuple(values),
            source=variant.source or ", ".join(f"{variant.table}.{c}" for c in variant.requires),
            notes=notes,
            extra=_extra(metric, frame, context),
            logged=_logged_result(logged.get(metric_id), aggregates.get(("steps", ""))),
            band=metric.band,
            better=metric.better,
            unit=metric.unit,
            task=metric.task,
            scale_from=metric.scale_from,
            part=metric.part,
        )
    return results, fallback


def upto(
    computed: Computed,
    last_step: int,
    metric_ids: Iterable[str],
    available: Mapping[str, Metric],
) -> Computed:
    """`computed` as `--steps :last_step` gives it, for the metrics `metric_ids` (of
    `available`, the catalog's metrics for the run): their series and frames cut after
    `last_step`, their summaries and extras recomputed; the aggregates cut too. Every series is
    a function of its own step's rows, so this is what a fresh analysis of the prefix computes,
    without reading the run again (tests/test_prefix.py holds it to that)."""
    results: dict[str, MetricResult] = {}
    frames: dict[str, pl.DataFrame] = {}
    for metric_id in metric_ids:
        result, frame = computed.results.get(metric_id), computed.frames.get(metric_id)
        if result is None or frame is None or metric_id not in available:
            continue
        frame = frame.filter(pl.col("step") <= last_step)
        values = _floats(frame["value"])
        if not any(v is not None for v in values):
            continue
        logged = result.logged
        if logged is not None:
            kept = [i for i, s in enumerate(logged.steps) if s <= last_step]
            cut = tuple(logged.values[i] for i in kept)
            logged = Logged(
                logged.column,
                final_window_mean(list(cut)),
                tuple(logged.steps[i] for i in kept),
                cut,
            )
        results[metric_id] = replace(
            result,
            value=final_window_mean(values),
            steps=tuple(int(s) for s in frame["step"].to_list()),
            values=tuple(values),
            extra=_extra(available[metric_id], frame, computed.context),
            logged=logged,
        )
        frames[metric_id] = frame
    aggregates = {
        key: frame.filter(pl.col("step") <= last_step) if "step" in frame.columns else frame
        for key, frame in computed.aggregates.items()
    }
    return replace(computed, results=results, frames=frames, aggregates=aggregates)


def _from_aggregates(
    variant: Variant, aggregates: dict[tuple[str, str], pl.DataFrame], ctx: MetricContext
) -> pl.DataFrame | None:
    """A fallback variant's per-step frame from the partials this pass already computed (the
    text features are all computed together, so a text fallback usually costs no scan), or
    None when they were not."""
    source = aggregates.get((variant.table, variant.level))
    if source is None or not set(variant.resolve_partials(ctx)) <= set(source.columns):
        return None
    return variant.series(source.lazy(), ctx).collect(engine=ENGINE).sort("step")


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


def _empty_reason(frame: pl.DataFrame, variant: Variant, sizes: pl.DataFrame) -> str:
    """Why a variant gave no value at any step (`sizes`: the run's `group_sizes`)."""
    if variant.empty_reason:
        return variant.empty_reason
    if (variant.table, variant.level) == GROUP_LEVEL:
        train = sizes.filter(pl.col("split") == "train")["n"]
        if train.len() and train.max() == 1:
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
