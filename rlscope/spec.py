"""The vocabulary of metrics and findings (Metric, Rule, Finding…); imports nothing of rlscope."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

if TYPE_CHECKING:  # Polars only for types: `rlscope --help` and `explain` import this module
    import polars as pl

#: The six layers of diagnosis (ids are public API).
Layer = Literal["L1", "L2", "L3", "L4", "L5", "L6"]
LAYERS: dict[str, str] = {
    "L1": "Training stability",
    "L2": "Policy behaviour",
    "L3": "Learning signal",
    "L4": "Exploration",
    "L5": "Generalisation",
    "L6": "Reasoning quality",
}
Severity = Literal["info", "warn", "critical"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
#: "share": a proportion in [0, 1]; "" otherwise.
Unit = Literal["", "share"]
#: The model a metric is of: the policy (""), or PPO's learned value function.
Part = Literal["", "critic"]
#: Which direction of a metric is healthier; "" when a band (or nothing) says.
Better = Literal["", "up", "down"]
#: How a finding's evidence `steps` read: a window (its first and last step) or each step named.
Marks = Literal["window", "points"]
#: The tables of format v1 a metric can be computed from.
Table = Literal["steps", "rollouts", "tokens", "probes"]

#: The aggregation level each table's partials are computed at (one scan per table and level).
#: steps: one row per step; rollouts: one row per (split, step, prompt_id) group, or with level
#: "rollout" one row per rollout (elementwise text features, no text kept); tokens: one row per
#: step (and per step and entropy bin, or per step and segment); probes: one row per probe,
#: joined with its rollout's step, split and answer.
TABLE_LEVELS: tuple[Table, ...] = get_args(Table)

#: A metric's series function: (its aggregated frame, the MetricContext) -> a lazy per-step
#: frame. The context is rlscope.context.MetricContext (typed `Any` here so that this module
#: stays below it).
SeriesFn: TypeAlias = "Callable[[pl.LazyFrame, Any], pl.LazyFrame]"
PartialsFn: TypeAlias = "Callable[[Any], Mapping[str, pl.Expr]]"
SummaryFn: TypeAlias = "Callable[[pl.DataFrame, Any], dict[str, Any]]"
#: A family's members for a run (rlscope.reader.Run): one metric per run-specific name.
FamilyFn: TypeAlias = "Callable[[Any], list[Metric]]"


def severity_rank(severity: str) -> int:
    """0 info, 1 warn, 2 critical; `never` ranks above everything."""
    ranks: tuple[str, ...] = SEVERITIES
    return ranks.index(severity) if severity in ranks else len(ranks)


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
    one scan; a name means the same expression everywhere), or a function of the MetricContext
    (run.json, text settings) returning them; `series` turns the aggregated frame into a lazy
    per-step frame with columns `step`, `value` and any component columns (`extra_<name>` ones
    are summarised in the JSON). `requires` names columns of `table`, or of another table as
    `table.column`.
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
    # "ids" tokens per (step, rollout_id) (with `len`, its rows),
    # "rollout" rollouts one row per rollout.
    level: str = ""
    # Level "rollout" only: intermediate columns computed in order before the partials (each may
    # use the ones before it) and dropped after, so that work shared by several features, like
    # splitting a response into words, is done once per rollout.
    prelude: Mapping[str, pl.Expr] | PartialsFn = field(default_factory=dict)

    def resolve_partials(self, ctx: Any) -> Mapping[str, pl.Expr]:
        """The partials, given the run and settings (some depend on run.json or the tags)."""
        return self.partials(ctx) if callable(self.partials) else self.partials

    def resolve_prelude(self, ctx: Any) -> Mapping[str, pl.Expr]:
        return self.prelude(ctx) if callable(self.prelude) else self.prelude


@dataclass(frozen=True)
class Metric:
    """A self-describing metric: id, layer, doc, and the variants that can compute it."""

    id: str
    layer: Layer
    title: str
    doc: str
    healthy: str
    variants: tuple[Variant, ...]
    # One line for the docs' metrics table (generated from the catalog: rlscope.docs).
    brief: str = ""
    # "share": a proportion in [0, 1] (checked by the property tests); "" otherwise.
    unit: Unit = ""
    # Which direction is better, for status colours and comparisons: "up" or "down" only where
    # one is unambiguous (task outcomes; error rates), else "" (a band, or nothing, says).
    better: Better = ""
    # A task outcome (pass@1, pass@k, reward, eval accuracy), by the short name compare's
    # verdict gives it: the verdict leads with it. "" = not a task outcome.
    task: str = ""
    # run.json fields that set the metric's scale (the mean reward: the reward functions and
    # their weights): compare judges a run on it only where these equal the baseline's.
    scale_from: tuple[str, ...] = ()
    references: str = ""
    # Steps-table columns in which trainers log the same quantity (first found is used): when
    # rlscope recomputes the metric from rollouts or tokens, both are shown and compared.
    logged_as: tuple[str, ...] = ()
    # Extra JSON fields from the per-step frame (distributions, curves, trends).
    summary: SummaryFn | None = None
    # Report whether the series' decline is smooth or a cliff (`decline` in the JSON).
    trajectory: bool = False
    # The healthy range of the final-window value, (low, high), None = open: where it is
    # declared, a value outside it is shown as such, and compare judges runs by their distance
    # to it (an error rate with a band keeps its direction inside it too).
    band: tuple[float | None, float | None] | None = None
    # A family template (id ending `.*`, e.g. `signal.reward.*`): the function of the run that
    # returns its members, one metric per run-specific name (e.g. per reward function).
    members: FamilyFn | None = None
    # Which model the metric is of, where a run trains more than the policy: "" (the policy) or
    # "critic" (PPO's value function); reports show a layer's critic rows together after its
    # policy rows.
    part: Part = ""

    @property
    def is_template(self) -> bool:
        return self.members is not None

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
            "task": self.task or None,
            "scale_from": list(self.scale_from),
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
#: the vocabulary stays below the rules) and yields its findings.
RuleFn: TypeAlias = "Callable[[Any], Iterator[Finding]]"


@dataclass(frozen=True)
class Explained:
    """A finding another rule explains: the mechanism, and what the consequence's evidence must
    say for it to hold (evidence key -> value; e.g. dead groups that are all wrong)."""

    mechanism: str
    when: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        condition = ", ".join(f"{k} = {v}" for k, v in self.when.items())
        return self.mechanism + (f" (when its {condition})" if condition else "")

    def holds(self, finding: Finding) -> bool:
        return all(finding.evidence.get(k) == v for k, v in self.when.items())


@dataclass(frozen=True)
class Rule:
    """A diagnosis: reads metric series, yields findings; thresholds are data in `params`."""

    id: str
    layer: Layer
    title: str
    doc: str
    remedy: str
    metrics: tuple[str, ...]
    params: Mapping[str, Param]
    check: RuleFn
    severity: Severity = "warn"
    # One line for the docs' findings table: when it fires (generated: rlscope.docs).
    brief: str = ""
    # Metrics whose frames only supply the example rollouts a finding names: computed with the
    # rule, never judged by it (a rule reads computed results only, it never scans the run).
    examples_from: tuple[str, ...] = ()
    marks: Marks = "window"
    # Metrics a finding quotes as context (what changed where it began): computed with the
    # rule, never judged by it.
    context: tuple[str, ...] = ()
    # Findings this one explains when both fire and this one's onset comes first (the report
    # files the consequence under its cause): consequence id -> how.
    explains: Mapping[str, Explained] = field(default_factory=dict)
    # Of `metrics` (any of which makes the rule read the run), those it cannot judge without,
    # every one: without one the finding is skipped as not judged, saying what it needs, not
    # passed as healthy.
    requires: tuple[str, ...] = ()

    @property
    def computes(self) -> tuple[str, ...]:
        """Every metric the rule needs computed: what it judges, then its examples' sources
        and its context."""
        return (*self.metrics, *self.examples_from, *self.context)

    def explain(self) -> str:
        lines = [f"{self.id}  ({self.layer}, finding, default severity {self.severity})", ""]
        lines += [self.title, "", self.doc, "", f"What to try: {self.remedy}", ""]
        lines.append(f"Reads: {', '.join(self.metrics)}")
        if self.requires:
            lines.append(f"Judged only with every one of: {', '.join(self.requires)}")
        if self.examples_from:
            lines.append(f"Example rollouts from: {', '.join(self.examples_from)}")
        if self.context:
            lines.append(f"Quotes as context: {', '.join(self.context)}")
        if self.explains:
            lines += ["", "Explains, when it began first:"]
            lines += [f"  {other}: {how.describe()}" for other, how in self.explains.items()]
            lines.append("")
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
            "requires": list(self.requires),
            "examples_from": list(self.examples_from),
            "context": list(self.context),
            "explains": {
                other: {"mechanism": how.mechanism, "when": dict(how.when)}
                for other, how in self.explains.items()
            },
            "steps_are": self.marks,
            "thresholds": {n: {"default": p.default, "doc": p.doc} for n, p in self.params.items()},
        }


@dataclass(frozen=True)
class Finding:
    """A diagnosis: what is wrong, how sure, and the evidence behind it.

    `evidence` is the JSON form, in the order the rule gave it: the rule's own numbers plus the
    shared keys, which are checked when the finding is made (`check_evidence`) and read through
    the typed properties below, never by key elsewhere."""

    id: str
    severity: Severity
    layer: Layer
    message: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    remedy: str = ""  # what to try (the rule's)
    marks: Marks = "window"  # how `steps` read (the rule's)
    # The first step at which judging the run's prefix raises it, and the step before (None:
    # from the first step judged); set by the evaluation (rlscope.evaluation.onsets).
    onset: int | None = None
    last_good: int | None = None
    # The findings that explain this one (their rule `explains` it and they began first).
    caused_by: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_evidence(self.id, self.evidence)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metric ids (or globs) the finding judged."""
        return tuple(self.evidence.get("metrics") or ())

    @property
    def steps(self) -> tuple[int, ...]:
        """The steps the evidence points at (a window's first and last, or each step named)."""
        return tuple(int(s) for s in self.evidence.get("steps") or ())

    @property
    def rollout_ids(self) -> tuple[int, ...]:
        """The rollouts the evidence names: `rollout_ids`, and those inside `rollouts` (step ->
        list of {rollout_id, ...}); sorted, unique."""
        ids = {int(v) for v in self.evidence.get("rollout_ids") or ()}
        nested: Mapping[Any, Sequence[Mapping[str, Any]]] = self.evidence.get("rollouts") or {}
        ids.update(int(item["rollout_id"]) for group in nested.values() for item in group)
        return tuple(sorted(ids))

    def names(self, metric_id: str) -> bool:
        return metric_id in self.metrics

    @property
    def began(self) -> int | None:
        """The step the problem began: the evidence's `began` where the rule can tell (a
        collapse's step, before the evidence sufficed), else the onset."""
        began = self.evidence.get("began")
        return int(began) if began is not None else self.onset

    def when(self) -> str:
        """When it began and was first raised: `since step 2 (raised from step 35; last good
        step 34)`; empty without an onset."""
        if self.onset is None:
            return ""
        began = self.began if self.began is not None else self.onset
        raised = [f"raised from step {self.onset}"] if self.onset != began else []
        if self.last_good is not None:
            raised.append(f"last good step {self.last_good}")
        return f"since step {began}" + (f" ({'; '.join(raised)})" if raised else "")


def check_evidence(finding: str, evidence: Mapping[str, Any]) -> None:
    """The shared evidence keys have their one shape (a TypeError names the finding and key)."""

    def fail(key: str, shape: str) -> None:
        raise TypeError(f"finding {finding}: evidence {key!r} must be {shape}")

    if not all(isinstance(m, str) for m in evidence.get("metrics") or ()):
        fail("metrics", "a list of metric ids")
    for key in ("steps", "rollout_ids"):
        values = evidence.get(key) or ()
        if not isinstance(values, list | tuple) or not all(_is_int(v) for v in values):
            fail(key, "a list of integers")
    if evidence.get("began") is not None and not _is_int(evidence["began"]):
        fail("began", "an integer step")
    nested = evidence.get("rollouts")
    if nested is not None and not (
        isinstance(nested, Mapping)
        and all(
            isinstance(group, list | tuple)
            and all(isinstance(i, Mapping) and _is_int(i.get("rollout_id")) for i in group)
            for group in nested.values()
        )
    ):
        fail("rollouts", "a mapping of step to lists of {rollout_id, ...}")


def _is_int(value: Any) -> bool:
    return hasattr(value, "__index__") and not isinstance(value, bool)


class Declarations:
    """The metrics, families and rules one layer module declares, in order: the catalog
    (rlscope.catalog) collects every layer module's `DECLARED`. Nothing global is mutated."""

    def __init__(self) -> None:
        self.metrics: list[Metric] = []
        self.rules: list[Rule] = []

    def metric(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def family(self, template: Metric, members: FamilyFn) -> Metric:
        """A family of per-run metrics: `template.id` ends in `.*` and documents them."""
        if not template.id.endswith(".*"):
            raise ValueError(f"family id {template.id} must end in .*")
        return self.metric(replace(template, members=members))

    def rule(
        self,
        id: str,
        *,
        layer: Layer,
        title: str,
        doc: str,
        remedy: str,
        metrics: tuple[str, ...],
        params: Mapping[str, Param] | None = None,
        severity: Severity = "warn",
        brief: str = "",
        examples_from: tuple[str, ...] = (),
        marks: Marks = "window",
        context: tuple[str, ...] = (),
        explains: Mapping[str, Explained] | None = None,
        requires: tuple[str, ...] = (),
    ) -> Callable[[RuleFn], RuleFn]:
        """Declare the decorated function as the check of the rule `id`."""

        if not set(requires) <= set(metrics):
            raise ValueError(f"{id}: requires {requires} must be among its metrics {metrics}")

        def wrap(fn: RuleFn) -> RuleFn:
            rule = Rule(
                id,
                layer,
                title,
                doc,
                remedy,
                metrics,
                params or {},
                fn,
                severity,
                brief,
                examples_from,
                marks,
                context,
                dict(explains or {}),
                requires,
            )
            self.rules.append(rule)
            return fn

        return wrap
