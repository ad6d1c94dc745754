"""Findings: rules that turn metric series into diagnoses, and the loop that runs them."""

from __future__ import annotations

from rlscope.config import Config
from rlscope.engine import Computed
from rlscope.reader import Run
from rlscope.registry import RULES, load_all
from rlscope.report import Finding, Skipped, severity_rank
from rlscope.rules.base import RuleContext


def evaluate(computed: Computed, run: Run, config: Config) -> tuple[list[Finding], list[Skipped]]:
    """Run every enabled rule; a rule whose metrics are all missing is reported as skipped."""
    load_all()
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    for rule in RULES.values():
        override = config.findings.get(rule.id, {})
        if override.get("enabled", True) is False:
            continue
        if not any(m in computed.results for m in rule.metrics):
            skipped.append(Skipped(rule.id, "needs " + " or ".join(rule.metrics)))
            continue
        params = {
            name: float(override.get(name, param.default)) for name, param in rule.params.items()
        }
        severity = override.get("severity")
        ctx = RuleContext(
            rule, params, severity, computed.results, computed.frames, run, computed.aggregates
        )
        findings.extend(rule.check(ctx))
    findings.sort(key=lambda f: (-severity_rank(f.severity), f.layer, f.id))
    return findings, skipped
