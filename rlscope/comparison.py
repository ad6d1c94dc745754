"""`compare`: several runs side by side — deltas to a baseline, bootstrap intervals, findings."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlscope import windows
from rlscope._version import __version__
from rlscope.catalog import Catalog, default_catalog
from rlscope.config import Config
from rlscope.errors import RlscopeError
from rlscope.report import Report, band_distance, json_safe
from rlscope.spec import severity_rank
from rlscope.tokenscan import Mapper
from rlscope.windows import FINAL_FRACTION, MIN_STEPS

ALIGNS = ("step", "progress")
#: The bootstrap: resamples, confidence level and seed (fixed: the same runs give the same output).
BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95
SEED = 0
#: A difference this small relative to the values (float summation order) is no difference.
FLOAT_TOLERANCE = 1e-9
#: Fewest per-step values resampled from each run's final window.
MIN_WINDOW_POINTS = MIN_STEPS


@dataclass(frozen=True)
class RunMetric:
    """One metric in one run: summary, aligned series, and the difference to the baseline run."""

    value: float | None
    steps: tuple[int, ...]
    x: tuple[float, ...]  # the alignment axis: steps, or the fraction of training (0..1)
    values: tuple[float | None, ...]
    delta: float | None = None  # value - baseline value (None for the baseline itself)
    # CONFIDENCE interval of the difference of final-window means (bootstrap over steps).
    interval: tuple[float, float] | None = None
    # "better", "worse" (the interval excludes 0; by the metric's direction, or for a metric
    # with a healthy band by the distance to it), "noise" (it does not), "differs" (excludes 0,
    # and neither a direction nor the band tells which is healthier), "" (baseline, no
    # interval, or `unlike`).
    verdict: str = ""
    # The metric's scale_from fields (run.json) on which this run differs from the baseline:
    # its value is on another scale (other reward weights), so it gets no verdict.
    unlike: tuple[str, ...] = ()


@dataclass(frozen=True)
class MetricComparison:
    """One metric across the runs; `runs[i]` is None where run i could not compute it."""

    id: str
    layer: str
    title: str
    better: str  # "up", "down" or "" (no preferred direction)
    runs: tuple[RunMetric | None, ...]
    missing: tuple[str | None, ...]  # per run, why it is missing (None where present)
    healthiest: int | None  # index of the healthier run, when the difference exceeds the noise
    summary: str  # one line: which run is healthier and why, or why none is called
    band: tuple[float | None, float | None] | None = None  # the healthy band, if declared
    task: str = ""  # a task outcome's short name: the verdict leads with it
    scale_from: tuple[str, ...] = ()  # run.json fields that set its scale
    part: str = ""  # "critic" for PPO's value function (rlscope.spec.Part)


@dataclass(frozen=True)
class FindingRow:
    """One finding id across the runs: its severity in each (None where it did not fire)."""

    id: str
    layer: str
    severities: tuple[str | None, ...]
    messages: tuple[str | None, ...]

    @property
    def only_in(self) -> int | None:
        """The index of the one run that has it, when exactly one of several runs does."""
        marked = [i for i, s in enumerate(self.severities) if s is not None]
        return marked[0] if len(marked) == 1 and len(self.severities) > 1 else None


@dataclass(frozen=True)
class TaskOutcome:
    """A task outcome metric (pass@1, pass@k, reward, eval accuracy) in one run against the
    baseline: the two final-window values and the verdict ("worse", "better", "noise", or
    "unlike": on another scale than the baseline's, not compared)."""

    metric: str
    baseline: float | None
    value: float | None
    verdict: str
    name: str = ""  # the catalog's short name (the metric id when empty)
    unlike: tuple[str, ...] = ()  # for "unlike": the run.json fields that differ

    def short(self) -> str:
        name = self.name or self.metric
        if self.baseline is None or self.value is None:
            return name
        return f"{name} {self.baseline:.3g} → {self.value:.3g}"

    def to_dict(self) -> dict[str, Any]:
        return json_safe({**vars(self), "unlike": list(self.unlike)})


def leading(metrics: Iterable[MetricComparison]) -> list[MetricComparison]:
    """The order of the verdicts and tables: task outcomes first — those measured against
    correctness (pass@1, pass@k, eval accuracy), then those on a scale of the run's own (the
    mean reward) — then every other metric, each in catalog order."""
    return sorted(metrics, key=lambda m: (not m.task, bool(m.scale_from)))


@dataclass(frozen=True)
class RunVerdict:
    """One run against the baseline, overall: the task outcome first, then the metrics
    significantly worse or better (by their direction, or their distance to a healthy band),
    those that differ (neither tells which is healthier), and findings the baseline lacks."""

    index: int
    label: str
    worse: tuple[str, ...]  # task outcomes first
    better: tuple[str, ...]
    differs: tuple[str, ...]
    new_findings: tuple[tuple[str, str], ...]  # (finding id, severity)
    task: tuple[TaskOutcome, ...] = ()

    @property
    def regressed(self) -> bool:
        return bool(self.worse)

    def line(self) -> str:
        """`run 2 (lr) vs baseline: task outcome worse (pass@1 0.93 → 0.09); 2 other metrics
        worse (a, b), 1 better (c), 4 differ (no direction or band says which is healthier);
        new findings: x (warn)` — the task outcome first, whatever else is better. Worse and
        better count only metrics with a direction or a healthy band (where it tells the runs
        apart); the others that differ significantly are counted apart."""
        task_ids = {t.metric for t in self.task}
        head = []
        for verdict in ("worse", "better"):
            called = [t.short() for t in self.task if t.verdict == verdict]
            if called:
                head.append(f"task outcome {verdict} ({', '.join(called)})")
        compared = [t for t in self.task if t.verdict != "unlike"]
        if compared and not head:
            head.append("task outcome within noise")
        for t in self.task:
            if t.verdict == "unlike":
                head.append(f"{t.name or t.metric} not compared ({', '.join(t.unlike)} differ)")
        worse = [m for m in self.worse if m not in task_ids]
        better = [m for m in self.better if m not in task_ids]
        other = "other metrics " if self.task else ""
        parts = [f"{len(worse)} {other}worse" + (f" ({', '.join(worse)})" if worse else "")]
        if better:
            parts.append(f"{len(better)} better ({', '.join(better)})")
        if self.differs:
            parts.append(
                f"{len(self.differs)} differ (no direction or band says which is healthier)"
            )
        text = f"run {self.index + 1} ({self.label}) vs baseline: "
        text += "; ".join([*head, ", ".join(parts)])
        if self.new_findings:
            text += "; new findings: " + ", ".join(f"{i} ({s})" for i, s in self.new_findings)
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.index,
            "label": self.label,
            "regressed": self.regressed,
            "task": [t.to_dict() for t in self.task],
            "worse": list(self.worse),
            "better": list(self.better),
            "differs": list(self.differs),
            "new_findings": [{"id": i, "severity": s} for i, s in self.new_findings],
        }


@dataclass(frozen=True)
class Comparison:
    """Runs compared metric by metric against the first (the baseline)."""

    reports: tuple[Report, ...]
    labels: tuple[str, ...]  # unique display names: run_id, or run_id#i when two share one
    align: str
    metrics: dict[str, MetricComparison]
    findings: tuple[FindingRow, ...]

    def verdicts(self) -> list[RunVerdict]:
        """Each run after the baseline, overall (`compare --fail-on-regression` fails when one
        is worse on a metric with a direction)."""
        out = []
        for index in range(1, len(self.reports)):

            def named(verdict: str, i: int = index) -> tuple[str, ...]:
                return tuple(
                    m.id
                    for m in leading(self.metrics.values())
                    if (run := m.runs[i]) is not None and run.verdict == verdict
                )

            base_findings = {f.id for f in self.reports[0].findings}
            new = tuple(
                (row.id, severity)
                for row in self.findings
                if (severity := row.severities[index]) is not None and row.id not in base_findings
            )
            task = tuple(
                TaskOutcome(
                    m.id,
                    base.value,
                    run.value,
                    "unlike" if run.unlike else run.verdict or "noise",
                    m.task,
                    run.unlike,
                )
                for m in leading(self.metrics.values())
                if m.task and (base := m.runs[0]) is not None and (run := m.runs[index]) is not None
            )
            label = self.labels[index]
            out.append(
                RunVerdict(
                    index, label, named("worse"), named("better"), named("differs"), new, task
                )
            )
        return out

    @property
    def regressed(self) -> bool:
        return any(v.regressed for v in self.verdicts())

    def to_dict(self) -> dict[str, Any]:
        from rlscope.schema import SCHEMA_VERSION

        return {
            "rlscope_version": __version__,
            "schema_version": SCHEMA_VERSION,
            "baseline": 0,
            "align": self.align,
            "verdicts": [v.to_dict() for v in self.verdicts()],
            "bootstrap": {
                "resamples": BOOTSTRAP_RESAMPLES,
                "confidence": CONFIDENCE,
                "seed": SEED,
                "window": f"last {FINAL_FRACTION:.0%} of each run's steps, at least "
                f"{MIN_WINDOW_POINTS}",
            },
            "runs": [
                {
                    "label": label,
                    "path": r.run.path,
                    "run_id": r.run.run_id,
                    "provenance": r.run.provenance,
                    "steps": r.run.n_steps,
                    "first_step": r.run.first_step,
                    "last_step": r.run.last_step,
                }
                for label, r in zip(self.labels, self.reports, strict=True)
            ],
            "metrics": {
                m.id: {
                    "layer": m.layer,
                    **({"part": m.part} if m.part else {}),
                    "title": m.title,
                    "better": m.better,
                    "band": list(m.band) if m.band is not None else None,
                    "task": m.task or None,
                    "scale_from": list(m.scale_from),
                    "healthiest": m.healthiest,
                    "summary": m.summary,
                    "runs": [
                        _run_metric_dict(run, missing)
                        for run, missing in zip(m.runs, m.missing, strict=True)
                    ],
                }
                for m in self.metrics.values()
            },
            "findings": [
                {
                    "id": f.id,
                    "layer": f.layer,
                    "severities": list(f.severities),
                    "messages": list(f.messages),
                    "only_in": f.only_in,
                }
                for f in self.findings
            ],
        }


def _run_metric_dict(run: RunMetric | None, missing: str | None) -> dict[str, Any]:
    if run is None:
        return {"value": None, "skipped": missing}
    return json_safe(
        {
            "value": run.value,
            "delta": run.delta,
            "interval": list(run.interval) if run.interval else None,
            "verdict": run.verdict,
            "unlike": list(run.unlike),
            "series": {"step": list(run.steps), "x": list(run.x), "value": list(run.values)},
        }
    )


def compare(
    paths: Sequence[str | os.PathLike[str]],
    *,
    metrics: Iterable[str] | None = None,
    align: str = "step",
    steps: tuple[int | None, int | None] = (None, None),
    config: Config | None = None,
    from_format: str | None = None,
    import_options: Mapping[str, Any] | None = None,
    catalog: Catalog | None = None,
    mapper: Mapper | None = None,
) -> Comparison:
    """Analyse each run (read-only) and compare them against the first. With `from_format`,
    each path is a trainer's output, imported as `analyze` does; `mapper` as `analyze`'s."""
    from rlscope.analysis import analyze_each

    if len(paths) < 2:
        raise RlscopeError("compare needs at least two runs (the first is the baseline)")
    reports = analyze_each(
        paths,
        steps=steps,
        metrics=list(metrics) if metrics is not None else None,
        config=config,
        from_format=from_format,
        import_options=import_options,
        catalog=catalog,
        mapper=mapper,
    )
    return compare_reports(reports, align=align, catalog=catalog)


def compare_reports(
    reports: Sequence[Report], *, align: str = "step", catalog: Catalog | None = None
) -> Comparison:
    """Compare already computed reports (the first is the baseline), metrics in the catalog's
    order (rlscope's own by default)."""
    catalog = catalog or default_catalog()
    if align not in ALIGNS:
        raise RlscopeError(f"align {align!r}: choose step or progress")
    ids = list(dict.fromkeys(i for r in reports for i in r.metrics))
    skipped = [{s.metric: s.reason for s in r.skipped} for r in reports]
    order = {m: n for n, m in enumerate(catalog.metrics)}
    ids.sort(key=lambda i: order.get(i, len(order)))
    compared: dict[str, MetricComparison] = {}
    for metric_id in ids:
        present = [r.metrics.get(metric_id) for r in reports]
        first = next(m for m in present if m is not None)
        better, band = first.better, first.band
        base = present[0]
        base_meta = reports[0].run.meta
        runs: list[RunMetric | None] = []
        for index, result in enumerate(present):
            if result is None:
                runs.append(None)
                continue
            x = _aligned(result.steps, reports[index], align)
            run = RunMetric(result.value, result.steps, x, result.values)
            if index > 0 and base is not None:
                meta = reports[index].run.meta
                unlike = tuple(
                    k for k in first.scale_from if not _same(meta.get(k), base_meta.get(k))
                )
                run = _versus(run, base.values, result.values, base.value, better, band, unlike)
            runs.append(run)
        missing = tuple(
            None if m is not None else skipped[i].get(metric_id, "not computed")
            for i, m in enumerate(present)
        )
        healthiest, summary = _healthiest(runs, better, band)
        compared[metric_id] = MetricComparison(
            metric_id,
            first.layer,
            first.title,
            better,
            tuple(runs),
            missing,
            healthiest,
            summary,
            band,
            first.task,
            first.scale_from,
            first.part,
        )

    finding_ids = list(dict.fromkeys(f.id for r in reports for f in r.findings))
    rows = []
    for finding_id in finding_ids:
        severities: list[str | None] = []
        messages: list[str | None] = []
        rule = catalog.rules.get(finding_id)
        layer = rule.layer if rule is not None else ""
        for report in reports:
            hits = [f for f in report.findings if f.id == finding_id]
            worst = max(hits, key=lambda f: severity_rank(f.severity)) if hits else None
            severities.append(worst.severity if worst else None)
            messages.append(worst.message if worst else None)
            layer = worst.layer if worst else layer
        rows.append(FindingRow(finding_id, layer, tuple(severities), tuple(messages)))
    return Comparison(tuple(reports), run_labels(reports), align, compared, tuple(rows))


def _same(a: Any, b: Any) -> bool:
    """Two run.json values are the same (a list in any order: reward functions)."""
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(str, a)) == sorted(map(str, b))
    return bool(a == b)


def run_labels(reports: Sequence[Report]) -> tuple[str, ...]:
    """Display names: the run_id, with `#i` appended where two runs share one."""
    names = [r.run.run_id for r in reports]
    return tuple(n if names.count(n) == 1 else f"{n}#{i + 1}" for i, n in enumerate(names))


def _aligned(steps: tuple[int, ...], report: Report, align: str) -> tuple[float, ...]:
    if align == "step":
        return tuple(float(s) for s in steps)
    first, last = report.run.first_step, report.run.last_step
    if first is None or last is None or last == first:
        return tuple(0.0 for _ in steps)
    return tuple((s - first) / (last - first) for s in steps)


def final_window(values: Sequence[float | None]) -> list[float]:
    """The per-step values the bootstrap resamples: the final window of the defined ones."""
    return windows.final_window([v for v in values if v is not None and math.isfinite(v)])


def bootstrap_difference(
    base: Sequence[float], other: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[float, float] | None:
    """CONFIDENCE percentile interval of mean(other) - mean(base), each resampled with
    replacement (fixed seed); None when either has fewer than MIN_WINDOW_POINTS values."""
    if len(base) < MIN_WINDOW_POINTS or len(other) < MIN_WINDOW_POINTS:
        return None
    rng = np.random.default_rng(SEED)
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(other, dtype=np.float64)
    means_a = a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
    means_b = b[rng.integers(0, b.size, size=(resamples, b.size))].mean(axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(means_b - means_a, [tail, 1 - tail])
    return float(low), float(high)


def _versus(
    run: RunMetric,
    base_values: Sequence[float | None],
    values: Sequence[float | None],
    base_value: float | None,
    better: str,
    band: tuple[float | None, float | None] | None = None,
    unlike: tuple[str, ...] = (),
) -> RunMetric:
    delta = run.value - base_value if run.value is not None and base_value is not None else None
    interval = bootstrap_difference(final_window(base_values), final_window(values))
    verdict = ""
    if interval is not None and not unlike:
        low, high = interval
        scale = max((abs(v) for v in (*base_values, *values) if v is not None), default=0.0)
        if low <= 0 <= high or max(abs(low), abs(high)) <= FLOAT_TOLERANCE * scale:
            verdict = "noise"  # (a difference in the last bits of two equal series is none)
        elif better:
            up = low > 0
            verdict = "better" if up == (better == "up") else "worse"
        else:
            verdict = _by_band(run.value, base_value, band)
    return RunMetric(run.value, run.steps, run.x, run.values, delta, interval, verdict, unlike)


def _by_band(
    value: float | None, base: float | None, band: tuple[float | None, float | None] | None
) -> str:
    """A significant difference of a metric with no direction: healthier by the distance of
    its final-window value to the healthy band (both inside, or equally far: it differs)."""
    ours, theirs = band_distance(value, band), band_distance(base, band)
    if ours is None or theirs is None or math.isclose(ours, theirs, abs_tol=1e-12):
        return "differs"
    return "better" if ours < theirs else "worse"


def _healthiest(
    runs: Sequence[RunMetric | None],
    better: str,
    band: tuple[float | None, float | None] | None = None,
) -> tuple[int | None, str]:
    if not better and band is None:
        return None, "no preferred direction"
    if runs[0] is None:
        return None, "the baseline cannot compute it"
    others = [(i, r) for i, r in enumerate(runs) if i > 0 and r is not None]
    if not others:
        return None, "no other run computes it"
    unlike = sorted({k for _, r in others for k in r.unlike})
    others = [(i, r) for i, r in others if not r.unlike]
    if not others:
        return None, f"not comparable: run.json {', '.join(unlike)} differ from the baseline's"
    if all(r.interval is None for _, r in others):
        return None, f"too few steps for an interval (< {MIN_WINDOW_POINTS})"
    why = (
        f"{'higher' if better == 'up' else 'lower'} is healthier"
        if better
        else "closer to its healthy band"
    )
    improved = [(i, r) for i, r in others if r.verdict == "better"]
    if improved:
        if better:
            sign = 1 if better == "up" else -1
            best = max(improved, key=lambda ir: sign * (ir[1].delta or 0.0))[0]
        else:
            best = min(improved, key=lambda ir: band_distance(ir[1].value, band) or 0.0)[0]
        return best, f"run {best + 1} ({why})"
    if all(r.verdict == "worse" for _, r in others):
        return 0, f"the baseline ({why})"
    if any(r.verdict == "differs" for _, r in others):
        return None, "as close to its healthy band"
    return None, "within run-to-run noise"
