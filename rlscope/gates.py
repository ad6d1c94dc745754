"""CI gates: per-metric bounds read from TOML, evaluated with the findings into a CheckResult."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlscope.catalog import Catalog, default_catalog
from rlscope.config import Config, _read, load_config
from rlscope.errors import RlscopeError
from rlscope.report import Report, json_safe
from rlscope.spec import SEVERITIES, Finding, severity_rank
from rlscope.store import StorePath, list_folder, location
from rlscope.tokenscan import Mapper

FAIL_LEVELS = (*SEVERITIES, "never")
DEFAULT_FAIL_ON = "critical"
#: Gate keys. Absolute: `min`, `max` (the metric's value must lie within). Relative to the
#: baseline run's value b: `max_drop` / `max_rise` as a fraction of |b| (value >= b - max_drop·|b|,
#: value <= b + max_rise·|b|), `max_drop_abs` / `max_rise_abs` in the metric's own units.
BOUNDS = ("min", "max", "max_drop", "max_rise", "max_drop_abs", "max_rise_abs")
RELATIVE = ("max_drop", "max_rise", "max_drop_abs", "max_rise_abs")
GATE_KEYS = (*BOUNDS, "severity")


@dataclass(frozen=True)
class Gate:
    """One metric's bounds (None = unset) and the severity of breaching them."""

    metric: str
    bounds: dict[str, float]
    severity: str = "critical"

    @property
    def relative(self) -> bool:
        return any(k in RELATIVE for k in self.bounds)


@dataclass(frozen=True)
class GateSpec:
    """Gates and `fail_on` from one file, and that file's [findings] overrides."""

    gates: tuple[Gate, ...] = ()
    fail_on: str | None = None
    source: str | None = None
    config: Config = field(default_factory=Config)


@dataclass(frozen=True)
class GateResult:
    """One bound of one gate, evaluated: the limit it implies and whether the value is within."""

    metric: str
    rule: str  # a key of BOUNDS
    setting: float  # the number in the gates file
    limit: float  # the value the metric is compared with
    value: float | None
    baseline: float | None
    severity: str
    passed: bool  # the value is within the limit
    breach: bool  # outside it at a severity at or above fail_on: the check fails
    message: str

    @property
    def status(self) -> str:
        """What happened, in words: `ok`, `below min`, `above max`, `dropped too far`, `rose
        too far` (a gate whose severity is below --fail-on is outside but does not fail)."""
        if self.passed:
            return "ok"
        if self.rule in ("min", "max"):
            return "below min" if self.rule == "min" else "above max"
        return "dropped too far" if self.rule.startswith("max_drop") else "rose too far"


@dataclass(frozen=True)
class CheckResult:
    """A run checked against gates and findings."""

    report: Report
    baseline: Report | None
    gates: tuple[GateResult, ...]
    fail_on: str
    source: str | None
    config: Config
    # The catalog the run was analysed with: its rules are the finding cases of CI formats.
    catalog: Catalog = field(default_factory=default_catalog)

    @property
    def last_step(self) -> int | None:
        return self.report.run.last_step

    @property
    def breached_gates(self) -> list[GateResult]:
        return [g for g in self.gates if g.breach]

    @property
    def breached_findings(self) -> list[Finding]:
        return self.report.breaches(self.fail_on)

    @property
    def failed(self) -> bool:
        return bool(self.breached_gates or self.breached_findings)

    def finding_cases(self) -> list[tuple[str, str, Finding | None, str | None]]:
        """Per rule of the catalog: (id, layer, its worst finding or None, why it was not run)."""
        skipped = {s.metric: s.reason for s in self.report.skipped}
        cases: list[tuple[str, str, Finding | None, str | None]] = []
        for rule in self.catalog.rules.values():
            hits = [f for f in self.report.findings if f.id == rule.id]
            worst = max(hits, key=lambda f: severity_rank(f.severity)) if hits else None
            reason = skipped.get(rule.id)
            if self.config.findings.get(rule.id, {}).get("enabled", True) is False:
                reason = f"disabled in {self.config.source}"
            cases.append((rule.id, rule.layer, worst, reason))
        return cases

    def to_dict(self) -> dict[str, Any]:
        run = self.report.run
        return {
            "passed": not self.failed,
            "fail_on": self.fail_on,
            "gates_source": self.source,
            "run": {
                "path": run.path,
                "run_id": run.run_id,
                "last_step": run.last_step,
                "provenance": run.provenance,
            },
            "baseline": (
                {
                    "path": self.baseline.run.path,
                    "run_id": self.baseline.run.run_id,
                    "last_step": self.baseline.run.last_step,
                }
                if self.baseline is not None
                else None
            ),
            "gates": [
                json_safe(
                    {
                        "metric": g.metric,
                        "rule": g.rule,
                        "setting": g.setting,
                        "limit": g.limit,
                        "value": g.value,
                        "baseline": g.baseline,
                        "severity": g.severity,
                        "status": g.status,
                        "within_limit": g.passed,
                        "fails_check": g.breach,
                        "message": g.message,
                    }
                )
                for g in self.gates
            ],
            "findings": [
                {
                    "id": f.id,
                    "severity": f.severity,
                    "layer": f.layer,
                    "message": f.message,
                    "fails_check": f in self.breached_findings,
                }
                for f in self.report.findings
            ],
            "report": self.report.to_dict(),
        }


def load_gates(
    path: str | os.PathLike[str] | None = None,
    *,
    search_from: Path | None = None,
    catalog: Catalog | None = None,
) -> GateSpec:
    """Gates from `path`, else ./rlscope.toml, else [tool.rlscope] of ./pyproject.toml (as for
    the findings overrides, which are read from the same file); metric and finding ids are
    checked against `catalog` (rlscope's own by default)."""
    catalog = catalog or default_catalog()
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise RlscopeError(f"{file}: gates file not found")
        data = _read(file)
        table = data.get("tool", {}).get("rlscope", data)
        return _parse(file, table, load_config(file, catalog=catalog), catalog)
    here = search_from or Path.cwd()
    if (here / "rlscope.toml").is_file():
        file = here / "rlscope.toml"
        return _parse(file, _read(file), load_config(search_from=here, catalog=catalog), catalog)
    pyproject = here / "pyproject.toml"
    if pyproject.is_file():
        table = _read(pyproject).get("tool", {}).get("rlscope")
        if table is not None:
            config = load_config(search_from=here, catalog=catalog)
            return _parse(pyproject, table, config, catalog)
    return GateSpec()


def _number(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RlscopeError(f"{where}: {key} must be a number, not {value!r}")
    return float(value)


def _parse(file: Path, table: Any, config: Config, catalog: Catalog) -> GateSpec:
    if not isinstance(table, dict):
        raise RlscopeError(f"{file}: [tool.rlscope] must be a table")
    fail_on = table.get("fail_on")
    if fail_on is not None and fail_on not in FAIL_LEVELS:
        raise RlscopeError(f"{file}: fail_on = {fail_on!r}: choose one of {', '.join(FAIL_LEVELS)}")
    raw = table.get("gates", {})
    if not isinstance(raw, dict):
        raise RlscopeError(f"{file}: [gates] must be a table of metric ids")
    gates = []
    for metric_id, spec in raw.items():
        where = f'{file}: [gates."{metric_id}"]'
        if metric_id not in catalog.metrics:
            hint = catalog.hint(metric_id, rules=False)
            raise RlscopeError(f"{where}: unknown metric id", hint=hint)
        if not isinstance(spec, dict):
            raise RlscopeError(f"{where} must be a table (e.g. min = 0.3)")
        bounds: dict[str, float] = {}
        severity = "critical"
        for key, value in spec.items():
            if key == "severity":
                if value not in SEVERITIES:
                    raise RlscopeError(f"{where}: severity must be one of {', '.join(SEVERITIES)}")
                severity = value
            elif key in BOUNDS:
                bounds[key] = _number(where, key, value)
                if key in RELATIVE and bounds[key] < 0:
                    raise RlscopeError(f"{where}: {key} must be >= 0")
            else:
                raise RlscopeError(
                    f"{where}: unknown key `{key}`", hint=f"known keys: {', '.join(GATE_KEYS)}"
                )
        if not bounds:
            raise RlscopeError(f"{where}: no bound set", hint=f"set one of {', '.join(BOUNDS)}")
        if "min" in bounds and "max" in bounds and bounds["min"] > bounds["max"]:
            raise RlscopeError(f"{where}: min is above max")
        gates.append(Gate(metric_id, bounds, severity))
    return GateSpec(tuple(gates), fail_on, str(file), config)


def _limit(rule: str, setting: float, baseline: float | None) -> float:
    if rule in ("min", "max"):
        return setting
    assert baseline is not None
    scale = abs(baseline) if rule in ("max_drop", "max_rise") else 1.0
    return baseline - setting * scale if "drop" in rule else baseline + setting * scale


def _missing(spec: GateSpec, report: Report, metric_id: str, role: str) -> RlscopeError:
    reasons = {s.metric: s.reason for s in report.skipped}
    reason = reasons.get(metric_id, "not computed")
    return RlscopeError(
        f'{spec.source}: [gates."{metric_id}"]: the {role} run {report.run.path} cannot compute '
        f"{metric_id}: {reason}",
        hint="a gate on a metric without its inputs is a configuration error, not a pass; "
        "remove the gate or log the inputs",
    )


def evaluate_gates(
    spec: GateSpec, report: Report, baseline: Report | None, fail_on: str
) -> tuple[GateResult, ...]:
    """Every bound of every gate against `report` (and `baseline` for relative bounds)."""
    results = []
    for gate in spec.gates:
        metric = report.metrics.get(gate.metric)
        if metric is None or metric.value is None:
            raise _missing(spec, report, gate.metric, "checked")
        base_value = None
        if gate.relative:
            if baseline is None:
                rel = ", ".join(k for k in gate.bounds if k in RELATIVE)
                raise RlscopeError(
                    f'{spec.source}: [gates."{gate.metric}"]: {rel} is relative to a baseline',
                    hint="pass --baseline RUN",
                )
            base = baseline.metrics.get(gate.metric)
            if base is None or base.value is None:
                raise _missing(spec, baseline, gate.metric, "baseline")
            base_value = base.value
        value = metric.value
        for rule, setting in gate.bounds.items():
            limit = _limit(rule, setting, base_value)
            low_bound = rule == "min" or "drop" in rule
            passed = value >= limit if low_bound else value <= limit
            relation = ">=" if low_bound else "<="
            what = f"{gate.metric} = {value:.6g}, must be {relation} {limit:.6g}"
            if rule not in ("min", "max"):
                assert base_value is not None
                unit = (
                    f"{setting:g} × |baseline|"
                    if rule in ("max_drop", "max_rise")
                    else (f"{setting:g}")
                )
                what += f" ({rule} {unit} from the baseline's {base_value:.6g})"
            else:
                what += f" ({rule})"
            breach = not passed and severity_rank(gate.severity) >= severity_rank(fail_on)
            results.append(
                GateResult(
                    gate.metric,
                    rule,
                    setting,
                    limit,
                    value,
                    base_value,
                    gate.severity,
                    passed,
                    breach,
                    ("ok: " if passed else "breached: ") + what,
                )
            )
    return tuple(results)


def check(
    path: str | os.PathLike[str],
    *,
    baseline: str | os.PathLike[str] | None = None,
    gates: GateSpec | None = None,
    fail_on: str | None = None,
    steps: tuple[int | None, int | None] = (None, None),
    from_format: str | None = None,
    import_options: Mapping[str, Any] | None = None,
    catalog: Catalog | None = None,
    mapper: Mapper | None = None,
) -> CheckResult:
    """Analyse `path` (and `baseline`) with the gates file's finding overrides, then evaluate
    its gates; `fail_on` (default: the file's, else critical) applies to gates and findings.
    With `from_format`, both are a trainer's output, imported as `analyze` does."""
    from rlscope.analysis import analyze_each

    catalog = catalog or default_catalog()
    spec = gates if gates is not None else load_gates(catalog=catalog)
    level = fail_on or spec.fail_on or DEFAULT_FAIL_ON
    if level not in FAIL_LEVELS:
        raise RlscopeError(f"--fail-on {level!r}: choose one of {', '.join(FAIL_LEVELS)}")
    report, *rest = analyze_each(
        [path, *([baseline] if baseline is not None else [])],
        steps=steps,
        config=spec.config,
        from_format=from_format,
        import_options=import_options,
        catalog=catalog,
        mapper=mapper,
    )
    base = rest[0] if rest else None
    results = evaluate_gates(spec, report, base, level)
    return CheckResult(report, base, results, level, spec.source, spec.config, catalog)


def snapshot_key(path: str | os.PathLike[str]) -> tuple[tuple[str, int, int], ...]:
    """The run directory's visible files (name, size, mtime): it changes when a file arrives."""
    root = location(path)
    if isinstance(root, StorePath):
        listed = [(o.path.relative_to(root), o) for o in list_folder(root, recursive=True) or []]
        return tuple(
            (str(rel), o.size, o.mtime_ns)
            for rel, o in listed
            if not any(part.startswith((".", "_")) for part in rel.parts)
        )
    entries = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
        for name in filenames:
            if name.startswith((".", "_")):
                continue
            file = Path(dirpath, name)
            try:
                stat = file.stat()
            except OSError:
                continue
            entries.append((str(file.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(entries))


def watch(
    run_check: Callable[[], CheckResult],
    path: str | os.PathLike[str],
    *,
    interval: float,
    on_result: Callable[[CheckResult], None],
    sleep: Callable[[float], None] = time.sleep,
    max_polls: int | None = None,
) -> CheckResult:
    """Check, then poll `path` every `interval` seconds and check again whenever a file has
    arrived, reporting each result, until a check fails (that result is returned) or after
    `max_polls` polls (the last result). KeyboardInterrupt propagates to the caller."""
    result = run_check()
    on_result(result)
    seen = snapshot_key(path)
    polls = 0
    while not result.failed and (max_polls is None or polls < max_polls):
        sleep(interval)
        polls += 1
        current = snapshot_key(path)
        if current == seen:
            continue
        seen = current
        result = run_check()
        on_result(result)
    return result
