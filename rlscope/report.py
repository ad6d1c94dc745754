"""Results as frozen dataclasses, and their strict-JSON form."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rlscope._version import __version__
from rlscope.spec import Finding, severity_rank


def run_provenance(meta: dict[str, Any]) -> dict[str, str]:
    """run.json `provenance` ({topic: one sentence}, how the importer derived fields), with the
    correctness rule (`correct_unknown`, else `correct_source`) under `correct` when it has
    none; `correct` first."""
    raw = meta.get("provenance")
    out = {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}
    if "correct" not in out and meta.get("correct_unknown"):
        out["correct"] = f"unknown: {meta['correct_unknown']}"
    elif "correct" not in out and meta.get("correct_source"):
        out["correct"] = f"correct = {meta['correct_source']}"
    return {k: out[k] for k in sorted(out, key=lambda k: k != "correct")}


@dataclass(frozen=True)
class Logged:
    """The trainer's own logged value of a metric rlscope recomputed (steps-table column)."""

    column: str
    value: float | None
    steps: tuple[int, ...]
    values: tuple[float | None, ...]


@dataclass(frozen=True)
class MetricResult:
    """One metric over a run: its per-step series and the summary over the final window."""

    id: str
    layer: str
    title: str
    value: float | None
    steps: tuple[int, ...]
    values: tuple[float | None, ...]
    source: str = ""
    notes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    logged: Logged | None = None
    # The metric's declared healthy band (low, high; None = open) and better direction.
    band: tuple[float | None, float | None] | None = None
    better: str = ""
    unit: str = ""  # "share": a proportion in [0, 1]
    task: str = ""  # a task outcome's short name (compare leads with it)
    scale_from: tuple[str, ...] = ()  # run.json fields that set its scale
    part: str = ""  # "critic" for PPO's value function, "" for the policy (rlscope.spec.Part)

    def outside_band(self) -> bool:
        """The final-window value lies outside the declared healthy band."""
        return bool(band_distance(self.value, self.band))


class _OfAPart(Protocol):
    @property
    def part(self) -> str: ...


M = TypeVar("M", bound=_OfAPart)

#: How a report heads the rows of a part of the model other than the policy (rlscope.spec.Part).
PART_HEADINGS = {"critic": "critic (PPO's value function)"}


def policy_first(metrics: Sequence[M]) -> list[M]:
    """A layer's metrics with the policy's first, then each other part's together (stable)."""
    return sorted(metrics, key=lambda m: m.part)


def band_distance(
    value: float | None, band: tuple[float | None, float | None] | None
) -> float | None:
    """How far `value` lies outside `band` (0 inside it); None without a value or a band."""
    if band is None or value is None:
        return None
    low, high = band
    if low is not None and value < low:
        return low - value
    if high is not None and value > high:
        return value - high
    return 0.0


@dataclass(frozen=True)
class Skipped:
    """A metric or rule that could not be computed, and why."""

    metric: str  # the metric's or the finding's id
    reason: str
    layer: str = ""
    kind: str = "metric"  # or "finding"
    failed: bool = False  # a rule that raised: rlscope's bug, not the run's missing inputs
    needs_steps: int | None = None  # a rule that judges from this many steps: not yet judged


@dataclass(frozen=True)
class MissingInput:
    """Findings not checked for want of the same input, and what to log (or set) to have them."""

    # "a tokens table", "tokens.rollout_logprob", "run.json max_tool_calls"; none: see `reason`
    needs: tuple[str, ...]
    findings: tuple[str, ...]
    reason: str = ""  # why, when no input the run lacks would do (a family with no member)

    def line(self) -> str:
        """`log a tokens table to judge 2 more findings: kl-stalled, clip-too-low`."""
        ids = ", ".join(self.findings)
        if not self.needs:
            return f"{self.reason}: {ids}"
        logged = [n for n in self.needs if not n.startswith("run.json ")]
        meta = [n for n in self.needs if n.startswith("run.json ")]
        todo = [f"log {' and '.join(logged)}"] if logged else []
        todo += [f"set {' and '.join(meta)}"] if meta else []
        count = len(self.findings)
        more = f"{count} more finding{'' if count == 1 else 's'}"
        return f"{' and '.join(todo)} to judge {more}: {ids}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "needs": list(self.needs),
            "findings": list(self.findings),
            "reason": self.reason or None,
            "text": self.line(),
        }


@dataclass(frozen=True)
class RunInfo:
    """What was read: the run's identity, counts and tables."""

    path: str
    run_id: str
    algorithm: str
    n_steps: int
    first_step: int | None
    last_step: int | None
    n_rollouts: int
    n_groups: int
    n_tokens: int
    tables: tuple[str, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    n_eval_rollouts: int = 0  # of n_rollouts, those of eval splits
    # Token files in the run, and how many were read now (the rest: cached partials).
    token_files: int = 0
    token_files_read: int = 0
    # Steps, rollouts and probes: (files, files read now); the rest came from the cache.
    table_files: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def provenance(self) -> dict[str, str]:
        """How the importer derived fields ({topic: one sentence}; run.json `provenance`)."""
        return run_provenance(self.meta)


@dataclass(frozen=True)
class Report:
    """Everything `analyze` found about one run."""

    run: RunInfo
    metrics: dict[str, MetricResult]
    findings: tuple[Finding, ...]
    skipped: tuple[Skipped, ...]
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # Metrics a rule read and judged: only these are `ok` when no finding names them.
    judged: tuple[str, ...] = ()
    # The override file used, if any (Config.summary): its source and what it changed.
    config: dict[str, Any] | None = None
    # The findings in `skipped` for want of inputs, grouped by what would let them judge.
    inputs_missing: tuple[MissingInput, ...] = ()

    def status(self, metric: MetricResult) -> tuple[str, str] | None:
        """What the report says of a metric, as (label, kind): the worst finding naming it
        (kind = its severity), `ok` when a rule judged it and found nothing, `outside healthy
        range` when no rule judged it but its value is outside its declared band; else None
        (nothing checked it, so nothing is claimed)."""
        named = [f for f in self.findings if f.names(metric.id)]
        if named:
            worst = max(named, key=lambda f: severity_rank(f.severity))
            return worst.id, worst.severity
        if metric.outside_band():
            return "outside healthy range", "outside"
        if metric.id in self.judged:
            return "ok", "ok"
        return None

    def causal_groups(self) -> list[tuple[Finding, list[Finding]]]:
        """The findings as (root cause, what it explains), in report order (the evaluation
        places each consequence after its cause)."""
        groups: list[tuple[Finding, list[Finding]]] = []
        for finding in self.findings:
            members = {groups[-1][0].id, *(f.id for f in groups[-1][1])} if groups else set()
            if finding.caused_by and members & set(finding.caused_by):
                groups[-1][1].append(finding)
            else:
                groups.append((finding, []))
        return groups

    def worst_severity(self) -> str | None:
        if not self.findings:
            return None
        return max(self.findings, key=lambda f: severity_rank(f.severity)).severity

    def breaches(self, fail_on: str) -> list[Finding]:
        """Findings at or above `fail_on` (`never` matches none)."""
        if fail_on == "never":
            return []
        return [f for f in self.findings if severity_rank(f.severity) >= severity_rank(fail_on)]

    def to_dict(self) -> dict[str, Any]:
        from rlscope.schema import SCHEMA_VERSION

        run = self.run
        return {
            "rlscope_version": __version__,
            "schema_version": SCHEMA_VERSION,
            "run": {
                "path": run.path,
                "run_id": run.run_id,
                "algorithm": run.algorithm,
                "steps": run.n_steps,
                "first_step": run.first_step,
                "last_step": run.last_step,
                "rollouts": run.n_rollouts,
                "eval_rollouts": run.n_eval_rollouts,
                "groups": run.n_groups,
                "tokens": run.n_tokens,
                "token_files": {"total": run.token_files, "read": run.token_files_read},
                "table_files": {
                    table: {"total": total, "read": read}
                    for table, (total, read) in run.table_files.items()
                },
                "tables": list(run.tables),
                "meta": json_safe(run.meta),
                "provenance": run.provenance,
            },
            "metrics": {
                m.id: {
                    "layer": m.layer,
                    **({"part": m.part} if m.part else {}),
                    "title": m.title,
                    "value": json_safe(m.value),
                    "source": m.source,
                    "notes": list(m.notes),
                    "series": {"step": list(m.steps), "value": json_safe(list(m.values))},
                    "status": (self.status(m) or (None,))[0],
                    **({"band": list(m.band)} if m.band is not None else {}),
                    **json_safe(m.extra),
                    **(
                        {
                            "logged": {
                                "column": m.logged.column,
                                "value": json_safe(m.logged.value),
                                "series": {
                                    "step": list(m.logged.steps),
                                    "value": json_safe(list(m.logged.values)),
                                },
                            }
                        }
                        if m.logged is not None
                        else {}
                    ),
                }
                for m in self.metrics.values()
            },
            "findings": [finding_dict(f) for f in self.findings],
            "skipped": [{"metric": s.metric, "reason": s.reason} for s in self.skipped],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "config": self.config,
            "inputs_missing": [m.to_dict() for m in self.inputs_missing],
        }


def finding_dict(finding: Finding) -> dict[str, Any]:
    """A finding as the report's JSON has it."""
    return {
        "id": finding.id,
        "severity": finding.severity,
        "layer": finding.layer,
        "message": finding.message,
        "remedy": finding.remedy,
        "onset": finding.onset,
        "last_good": finding.last_good,
        "caused_by": list(finding.caused_by),
        "evidence": json_safe(finding.evidence),
    }


def json_safe(value: Any) -> Any:
    """Replace NaN/inf by None and numpy scalars by Python ones, recursively (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, str | bytes):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
