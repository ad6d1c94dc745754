"""Building blocks shared by the metric modules: casts, safe ratios, per-step sums."""

from __future__ import annotations

from collections.abc import Mapping
from math import comb

import polars as pl

from rlscope.context import MetricContext
from rlscope.spec import PartialsFn, SeriesFn, Variant


def f64(name: str) -> pl.Expr:
    """A column as Float64, so sums of float32 or int32 inputs neither lose precision nor wrap."""
    return pl.col(name).cast(pl.Float64)


def safe_div(num: pl.Expr, den: pl.Expr) -> pl.Expr:
    """num / den, null (not inf or NaN) where den is 0 or null."""
    return pl.when(den > 0).then(num / den).otherwise(None)


def train(frame: pl.LazyFrame) -> pl.LazyFrame:
    return frame.filter(pl.col("split") == "train")


def example_partial(name: str, where: pl.Expr) -> tuple[str, pl.Expr]:
    """A rollouts group partial: the smallest id of the group's rollouts matching `where` (null
    when none). Per step, `examples(name)` gathers them: the rollouts a finding names as
    evidence come out of the one scan, not a second one."""
    return name, pl.col("rollout_id").filter(where.fill_null(False)).min()


def examples(name: str) -> pl.Expr:
    """Per step (in a group_by("step").agg), the example ids of `example_partial(name, …)`,
    sorted: one per group that has one."""
    return pl.col(name).drop_nulls().sort().alias(name)


def step_sums(frame: pl.LazyFrame, names: list[str], *, groups: bool = False) -> pl.LazyFrame:
    """Sum partial columns per step (train groups only, for the rollouts level)."""
    if groups:
        frame = train(frame)
    return frame.group_by("step").agg([pl.col(n).sum() for n in names])


def ratio_variant(
    table: str,
    requires: tuple[str, ...],
    num: tuple[str, pl.Expr],
    den: tuple[str, pl.Expr],
    *,
    source: str = "",
    needs_meta: tuple[str, ...] = (),
) -> Variant:
    """A metric whose per-step value is Σnum / Σden over the step's rows (a mean or a share)."""
    (num_name, num_expr), (den_name, den_expr) = num, den
    groups = table == "rollouts"

    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        sums = step_sums(frame, [num_name, den_name], groups=groups)
        return sums.select("step", safe_div(pl.col(num_name), pl.col(den_name)).alias("value"))

    return Variant(
        table, requires, series, {num_name: num_expr, den_name: den_expr}, source, needs_meta
    )


def step_column(column: str, *, source: str = "", share: bool = False) -> Variant:
    """A metric read straight from the steps table (mean over duplicate rows of one step); a
    `share` logged outside [0, 1] is corrupt and left out (null at that step)."""

    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        return frame.select("step", pl.col(f"steps_{column}").alias("value"))

    value = f64(column)
    if share:
        value = pl.when(value.is_between(0.0, 1.0)).then(value)
    partials: Mapping[str, pl.Expr] = {f"steps_{column}": value.mean()}
    return Variant("steps", (column,), series, partials, source or f"steps.{column} as logged")


def custom(
    table: str,
    requires: tuple[str, ...],
    series: SeriesFn,
    partials: Mapping[str, pl.Expr] | PartialsFn,
    *,
    source: str = "",
    needs_meta: tuple[str, ...] = (),
    empty_reason: str = "",
) -> Variant:
    return Variant(table, requires, series, partials, source, needs_meta, empty_reason)


#: A per-rollout metric's component: what it was measured over at the step (its denominator).
UNITS = "extra_units"


def per_rollout(
    requires: tuple[str, ...],
    partials: Mapping[str, pl.Expr] | PartialsFn,
    num: str,
    den: str | None = None,
    *,
    source: str = "",
    empty_reason: str = "",
    defined_if: str | None = None,
    components: Mapping[str, tuple[str, str]] | None = None,
    prelude: Mapping[str, pl.Expr] | PartialsFn | None = None,
) -> Variant:
    """A metric over the per-rollout level (train rollouts): per step Σnum / Σden, or the mean of
    `num` over the rollouts where it is defined (den None); null at steps where the boolean
    feature `defined_if` is false for every rollout. `components` name extra ratios
    (name -> (num, den)) reported as `extra_<name>`."""

    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        value = pl.col(num).cast(pl.Float64)
        aggs = [value.sum().alias("num")]
        aggs.append((pl.col(den).cast(pl.Float64).sum() if den else value.count()).alias("den"))
        if defined_if is not None:
            aggs.append(pl.col(defined_if).any().alias("defined"))
        for name, (a, b) in (components or {}).items():
            aggs.append(safe_div(f64(a).sum(), f64(b).sum()).alias(f"extra_{name}"))
        sums = train(frame).group_by("step").agg(aggs)
        out = safe_div(pl.col("num"), pl.col("den"))
        if defined_if is not None:
            out = pl.when(pl.col("defined")).then(out)
        # what a share was measured over (its denominator: rollouts, tagged rollouts): its
        # sampling error, for the rules (rules.base.final_level)
        return sums.select(
            "step", out.alias("value"), pl.col("^extra_.*$"), pl.col("den").alias(UNITS)
        )

    return Variant(
        "rollouts",
        requires,
        series,
        partials,
        source,
        empty_reason=empty_reason,
        level="rollout",
        prelude=prelude or {},
    )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased estimator 1 - C(n-c, k) / C(n, k), exactly (needs n >= k)."""
    return 1.0 - comb(n - c, k) / comb(n, k)
