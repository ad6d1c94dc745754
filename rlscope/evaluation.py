"""Runs every enabled rule of the catalog over computed metrics: the findings of a run."""

from __future__ import annotations

from fnmatch import fnmatchcase

from rlscope.catalog import Catalog, default_catalog
from rlscope.config import Config
from rlscope.engine import Computed
from rlscope.report import Skipped
from rlscope.rules.base import RuleContext
from rlscope.spec import Finding, severity_rank


def evaluate(
    computed: Computed, config: Config, catalog: Catalog | None = None
) -> tuple[list[Finding], list[Skipped], tuple[str, ...]]:
    """Run every enabled rule of the catalog (rlscope's own by default); a rule whose metrics
    are all missing is reported as skipped. Also returns the metrics some rule judged (read and
    had the data for), in results order: only those may be shown as `ok`."""
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    judged: set[str] = set()
    for rule in (catalog or default_catalog()).rules.values():
        override = config.findings.get(rule.id, {})
        if override.get("enabled", True) is False:
            continue
        if not any(m in computed.results for m in rule.metrics):
            reason = "needs " + " or ".join(rule.metrics)
            skipped.append(Skipped(rule.id, reason, rule.layer, "finding"))
            continue
        params = {
            name: float(override.get(name, param.default)) for name, param in rule.params.items()
        }
        severity = override.get("severity")
        ctx = RuleContext(
            rule, params, severity, computed.results, computed.frames, computed.aggregates
        )
        findings.extend(rule.check(ctx))
        judged.update(
            m for m in computed.results if any(fnmatchcase(m, pattern) for pattern in rule.metrics)
        )
    findings.sort(key=lambda f: (-severity_rank(f.severity), f.layer, f.id))
    return findings, skipped, tuple(m for m in computed.results if m in judged)
