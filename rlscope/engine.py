"""Plans registered metrics so each table is scanned once, then collects every series."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.reader import Run
from rlscope.registry import METRICS, Metric, Variant, load_all
from rlscope.report import MetricResult, Skipped

#: Token entropy is binned at this many bins per nat for the per-step quantiles: exact to
#: 1/ENTROPY_BINS_PER_NAT nats (bin width), with memory independent of the number of tokens.
ENTROPY_BINS_PER_NAT = 200
ENTROPY_MAX_NATS = 25.0
GROUP_KEYS = ("split", "step", "prompt_id")
FINAL_WINDOW_FRACTION = 0.1


def entropy_bin() -> pl.Expr:
    return (
        (pl.col("entropy").cast(pl.Float64) * ENTROPY_BINS_PER_NAT)
        .floor()
        .clip(0, ENTROPY_MAX_NATS * ENTROPY_BINS_PER_NAT)
        .cast(pl.Int32)
        .alias("entropy_bin")
    )


@dataclass
class Context:
    """What a metric's series function may read besides its aggregated frame."""

    run: Run
    meta: dict[str, Any]
    pass_k: int | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Computed:
    """The engine's output: results for the report, per-step frames for rules, what was skipped."""

    results: dict[str, MetricResult]
    frames: dict[str, pl.DataFrame]
    skipped: tuple[Skipped, ...]
    aggregates: dict[str, pl.DataFrame]
    context: Context


def choose_variant(metric: Metric, run: Run) -> Variant | str:
    """The first variant the run can feed, or the reason none can."""
    reasons = []
    for variant in metric.variants:
        missing = [c for c in variant.requires if not run.has(variant.table, c)]
        missing_meta = [m for m in variant.needs_meta if run.meta.get(m) is None]
        if not missing and not missing_meta:
            return variant
        if variant.table not in run.tables:
            reasons.append(f"no {variant.table} table")
        else:
            parts = [f"{variant.table}.{c}" for c in missing]
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


def _merged_partials(variants: Iterable[Variant], meta: dict[str, Any]) -> dict[str, pl.Expr]:
    merged: dict[str, pl.Expr] = {}
    for variant in variants:
        for name, expr in variant.resolve_partials(meta).items():
            if name in merged and not merged[name].meta.eq(expr):
                raise ValueError(f"partial {name!r} is declared with two different expressions")
            merged[name] = expr
    return merged


def aggregate_query(run: Run, table: str, partials: dict[str, pl.Expr]) -> pl.LazyFrame:
    """The one scan of `table`, aggregated to its level with every requested partial."""
    lf = run.scan(table)
    exprs = [expr.alias(name) for name, expr in partials.items()]
    if table == "rollouts":
        keys: list[Any] = list(GROUP_KEYS)
        lf = lf.filter(pl.col("reward").is_not_null())  # counted in the reader's warnings
    elif table == "tokens" and "entropy" in run.tables["tokens"].columns:
        keys = ["step", entropy_bin()]
    else:
        keys = ["step"]
    return lf.group_by(keys).agg(exprs)


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


def compute(run: Run, metric_ids: Iterable[str] | None = None) -> Computed:
    """Compute the requested metrics (all registered ones by default) over a run."""
    load_all()
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

    by_table: dict[str, list[Variant]] = {}
    for variant in chosen.values():
        by_table.setdefault(variant.table, []).append(variant)
    tables = sorted(by_table)
    queries = [aggregate_query(run, t, _merged_partials(by_table[t], run.meta)) for t in tables]
    aggregates = dict(zip(tables, _collect(queries, "reading " + ", ".join(tables)), strict=True))

    context = Context(run, run.meta, resolve_pass_k(run, aggregates.get("rollouts")))
    ids = list(chosen)
    series_queries = [chosen[i].series(aggregates[chosen[i].table].lazy(), context) for i in ids]
    frames = dict(zip(ids, _collect(series_queries, "computing metrics"), strict=True))

    results: dict[str, MetricResult] = {}
    for metric_id in ids:
        metric, variant = METRICS[metric_id], chosen[metric_id]
        frame = frames[metric_id].sort("step")
        frames[metric_id] = frame
        values = [
            None if v is None or not math.isfinite(v) else float(v)
            for v in frame["value"].cast(pl.Float64).to_list()
        ]
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
            extra=_extra(metric_id, frame, context),
        )
    return Computed(results, frames, tuple(skipped), aggregates, context)


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


def _extra(metric_id: str, frame: pl.DataFrame, context: Context) -> dict[str, Any]:
    """Metric-specific JSON: columns prefixed `extra_` carry their final-window summaries."""
    extra: dict[str, Any] = {}
    components = {c: c.removeprefix("extra_") for c in frame.columns if c.startswith("extra_")}
    if components:
        extra["components"] = {
            name: final_window_mean(
                [
                    None if v is None or not math.isfinite(v) else float(v)
                    for v in frame[col].cast(pl.Float64).to_list()
                ]
            )
            for col, name in components.items()
        }
    if metric_id == "signal.pass_at_k":
        extra["k"] = context.pass_k
    return extra


def _collect(queries: list[pl.LazyFrame], what: str) -> list[pl.DataFrame]:
    if not queries:
        return []
    try:
        return pl.collect_all(queries)
    except (pl.exceptions.ComputeError, pl.exceptions.SchemaError, OSError) as exc:
        raise RlscopeError(
            f"failed while {what}: {exc}",
            hint="`rlscope validate RUN` checks every file's schema; a file may be corrupt",
        ) from None
