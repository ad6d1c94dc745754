"""Runs every enabled rule of the catalog over computed metrics: the findings of a run."""

from __future__ import annotations

from fnmatch import fnmatchcase

from rlscope.catalog import RULES
from rlscope.config import Config
from rlscope.engine import Computed
from rlscope.reader import Run
from rlscope.report import Finding, Skipped, severity_rank
from rlscope.rules.base import RuleContext


def evaluate(
    computed: Computed, run: Run, config: Config
) -> tuple[list[Finding], list[Skipped], tuple[str, ...]]:
    """Run every enabled rule; a rule whose metrics are all missing is reported as skipped.
    Also returns the metrics some rule judged (read and had the data for), in results order:
    only those may be shown as `ok`."""
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    judged: set[str] = set()
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
        judged.update(
            m for m in computed.results if any(fnmatchcase(m, pattern) for pattern in rule.metrics)
        )
    findings.sort(key=lambda f: (-severity_rank(f.severity), f.layer, f.id))
    return findings, skipped, tuple(m for m in computed.results if m in judged)
