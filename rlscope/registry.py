"""Metric and Rule declarations and the one registry that holds them (ids are public API)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from rlscope.reader import Run
from rlscope.report import Finding
from rlscope.text import TextSettings

#: The aggregation level each table's partials are computed at (one scan per table and level).
#: steps: one row per step; rollouts: one row per (split, step, prompt_id) group, or with level
#: "rollout" one row per rollout (elementwise text features, no text kept); tokens: one row per
#: step (and per step and entropy bin, or per step and segment); probes: one row per probe,
#: joined with its rollout's step, split and answer.
TABLE_LEVELS = ("steps", "rollouts", "tokens", "probes")


@dataclass
class Context:
    """What a metric's series function may read besides its aggregated frame."""

    run: Run
    pass_k: int | None = None
    text: TextSettings = field(default_factory=TextSettings)
    # The collected partial aggregates, (table, level) -> frame (for metric summaries).
    aggregates: dict[tuple[str, str], pl.DataFrame] = field(default_factory=dict)


SeriesFn = Callable[[pl.LazyFrame, "Context"], pl.LazyFrame]
PartialsFn = Callable[["Context"], Mapping[str, pl.Expr]]
SummaryFn = Callable[[pl.DataFrame, "Context"], dict[str, Any]]


def split_column(table: str, column: str) -> tuple[str, str]:
    """`rollouts.answer` -> ("rollouts", "answer"); a bare name belongs to `table`."""
    if "." in column:
        other, name = column.split(".", 1)
        if other in TABLE_LEVELS:
            return other, name
    return table, column


@dataclass(frozen=True)
class Variant:
    """One way of computing a metric from one table.

    `partials` are named aggregations at the table's level (merged with every other metric's into
    one scan; a name means the same expression everywhere), or a function of the Context (run.json,
    text settings) returning them; `series` turns the aggregated frame into a lazy per-step frame
    with columns `step`, `value` and any component columns (`extra_<name>` ones are summarised in
    the JSON). `requires` names columns of `table`, or of another table as `table.column`.
    """

    table: str
    requires: tuple[str, ...]
    series: SeriesFn
    partials: Mapping[str, pl.Expr] | PartialsFn = field(default_factory=dict)
    source: str = ""
    needs_meta: tuple[str, ...] = ()
    # Why the series can be empty although the columns exist (shown in `skipped`).
    empty_reason: str = ""
    # Aggregation level within the table: "" is the table's own (see TABLE_LEVELS);
    # "entropy_bins" is tokens per (step, entropy bin), "segments" tokens per (step, segment),
    # "rollout" rollouts one row per rollout.
    level: str = ""
    # Level "rollout" only: intermediate columns computed in order before the partials (each may
    # use the ones before it) and dropped after, so that work shared by several features, like
    # splitting a response into words, is done once per rollout.
    prelude: Mapping[str, pl.Expr] | PartialsFn = field(default_factory=dict)

    def resolve_partials(self, ctx: Context) -> Mapping[str, pl.Expr]:
        """The partials, given the run and settings (some depend on run.json or the tags)."""
        return self.partials(ctx) if callable(self.partials) else self.partials

    def resolve_prelude(self, ctx: Context) -> Mapping[str, pl.Expr]:
        return self.prelude(ctx) if callable(self.prelude) else self.prelude


@dataclass(frozen=True)
class Metric:
    """A self-describing metric: id, layer, doc, and the variants that can compute it."""

    id: str
    layer: str
    title: str
    doc: str
    healthy: str
    variants: tuple[Variant, ...]
    # One line for the README's metric table (generated from the catalog: rlscope.docs).
    brief: str = ""
    # "share": a proportion in [0, 1] (checked by the property tests); "" otherwise.
    unit: str = ""
    # Which direction is better, for status colours and comparisons: "up", "down" or "" (band).
    better: str = ""
    references: str = ""
    # Steps-table columns in which trainers log the same quantity (first found is used): when
    # rlscope recomputes the metric from rollouts or tokens, both are shown and compared.
    logged_as: tuple[str, ...] = ()
    # Extra JSON fields from the per-step frame (distributions, curves, trends).
    summary: SummaryFn | None = None
    # Report whether the series' decline is smooth or a cliff (`decline` in the JSON).
    trajectory: bool = False
    # The healthy range of the final-window value, (low, high), None = open: where it is
    # declared, a value outside it is shown as such (a metric with a band has no `better`).
    band: tuple[float | None, float | None] | None = None

    def explain(self) -> str:
        lines = [f"{self.id}  ({self.layer}, metric)", "", self.title, "", self.doc, ""]
        lines.append(f"Healthy: {self.healthy}")
        if self.band is not None:
            low, high = self.band
            lines.append(
                "Healthy band: "
                + (f"{low:g}" if low is not None else "-inf")
                + " to "
                + (f"{high:g}" if high is not None else "+inf")
            )
        if self.unit == "share":
            lines.append("Range: a share in [0, 1]")
        lines.append("Computed from:")
        for variant in self.variants:
            cols = ", ".join(".".join(split_column(variant.table, c)) for c in variant.requires)
            meta = f" + run.json {', '.join(variant.needs_meta)}" if variant.needs_meta else ""
            lines.append(f"  - {cols}{meta}" + (f"  [{variant.source}]" if variant.source else ""))
        if self.logged_as:
            lines.append(f"Compared with the trainer's logged: {', '.join(self.logged_as)}")
        if self.references:
            lines += ["", f"Sources: {self.references}"]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The metric's documentation as JSON (`rlscope metrics|explain --format json`)."""
        return {
            "kind": "metric",
            "id": self.id,
            "layer": self.layer,
            "title": self.title,
            "brief": self.brief,
            "doc": self.doc,
            "healthy": self.healthy,
            "band": list(self.band) if self.band is not None else None,
            "unit": self.unit or None,
            "better": self.better or None,
            "computed_from": [
                {
                    "table": v.table,
                    "columns": [".".join(split_column(v.table, c)) for c in v.requires],
                    "run_json": list(v.needs_meta),
                    "source": v.source,
                }
                for v in self.variants
            ],
            "logged_as": list(self.logged_as),
            "references": self.references,
        }


@dataclass(frozen=True)
class Param:
    """A rule threshold: its default and what it means (overridable in config)."""

    default: float
    doc: str


#: A rule's check: takes a rules.base.RuleContext (typed where each rule is defined, so that
#: the registry stays below the rules) and yields its findings.
RuleFn = Callable[[Any], Iterator[Finding]]


@dataclass(frozen=True)
class Rule:
    """A diagnosis: reads metric series, yields findings; thresholds are data in `params`."""

    id: str
    layer: str
    title: str
    doc: str
    remedy: str
    metrics: tuple[str, ...]
    params: Mapping[str, Param]
    check: RuleFn
    severity: str = "warn"
    # One line for the README's findings table: when it fires (generated: rlscope.docs).
    brief: str = ""

    def explain(self) -> str:
        lines = [f"{self.id}  ({self.layer}, finding, default severity {self.severity})", ""]
        lines += [self.title, "", self.doc, "", f"What to try: {self.remedy}", ""]
        lines.append(f"Reads: {', '.join(self.metrics)}")
        if self.params:
            lines.append(f"Thresholds (override under [findings.{self.id}] in rlscope.toml):")
            for name, param in self.params.items():
                lines.append(f"  {name} = {param.default:g}  — {param.doc}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The finding's documentation as JSON (`rlscope metrics|explain --format json`)."""
        return {
            "kind": "finding",
            "id": self.id,
            "layer": self.layer,
            "severity": self.severity,
            "title": self.title,
            "brief": self.brief,
            "doc": self.doc,
            "remedy": self.remedy,
            "reads": list(self.metrics),
            "thresholds": {n: {"default": p.default, "doc": p.doc} for n, p in self.params.items()},
        }


METRICS: dict[str, Metric] = {}
RULES: dict[str, Rule] = {}
#: Metric families: a prefix (`signal.reward.`) -> a function of the run returning its members
#: (one metric per run-specific name, e.g. per reward function), documented by the metric
#: registered under the prefix + `*`.
FamilyFn = Callable[[Any], list[Metric]]
FAMILIES: dict[str, FamilyFn] = {}


def register_metric(metric: Metric) -> Metric:
    if metric.id in METRICS:
        raise ValueError(f"duplicate metric id {metric.id}")
    METRICS[metric.id] = metric
    return metric


def register_family(template: Metric, members: FamilyFn) -> Metric:
    """Register a family of per-run metrics: `template.id` ends in `*` and documents them."""
    if not template.id.endswith(".*"):
        raise ValueError(f"family id {template.id} must end in .*")
    FAMILIES[template.id[:-1]] = members
    return register_metric(template)


def family_members(run: Any, template_id: str) -> list[Metric]:
    """The metrics of the family `template_id` (`signal.reward.*`) this run has (e.g. one per
    reward function it logs)."""
    return FAMILIES[template_id[:-1]](run)


def is_template(metric: Metric) -> bool:
    return metric.id.endswith(".*")


def rule(
    id: str,
    *,
    layer: str,
    title: str,
    doc: str,
    remedy: str,
    metrics: tuple[str, ...],
    params: Mapping[str, Param] | None = None,
    severity: str = "warn",
    brief: str = "",
) -> Callable[[RuleFn], RuleFn]:
    """Register a rule function under a stable id."""

    def wrap(fn: RuleFn) -> RuleFn:
        if id in RULES:
            raise ValueError(f"duplicate rule id {id}")
        RULES[id] = Rule(id, layer, title, doc, remedy, metrics, params or {}, fn, severity, brief)
        return fn

    return wrap
