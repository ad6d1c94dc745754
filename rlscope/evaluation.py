"""Runs every enabled rule of the catalog over computed metrics: the findings of a run."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from rlscope._version import __version__
from rlscope.catalog import Catalog, default_catalog
from rlscope.config import Config
from rlscope.engine import Computed
from rlscope.report import Skipped
from rlscope.rules.base import RuleContext
from rlscope.spec import Finding, severity_rank


@dataclass(frozen=True)
class Evaluation:
    """The findings of a run, the rules that could not judge it, the metrics some rule judged
    (read and had the data for; in results order: only those may be shown as `ok`) and the
    warnings of rules that failed."""

    findings: list[Finding]
    skipped: list[Skipped]
    judged: tuple[str, ...]
    warnings: list[str]


def evaluate(computed: Computed, config: Config, catalog: Catalog | None = None) -> Evaluation:
    """Run every enabled rule of the catalog (rlscope's own by default); a rule whose metrics
    are all missing is reported as skipped. A rule that raises is rlscope's bug, never the end
    of the analysis: it is reported as skipped (`failed`) with the error, and a warning asks
    for a report; the other rules judge as usual."""
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    warnings: list[str] = []
    judged: set[str] = set()
    for rule in (catalog or default_catalog()).rules.values():
        override = config.findings.get(rule.id, {})
        if override.get("enabled", True) is False:
            continue
        reads = [
            m for m in computed.results if any(fnmatchcase(m, pattern) for pattern in rule.metrics)
        ]
        if not reads:
            reason = "needs " + " or ".join(rule.metrics)
            skipped.append(Skipped(rule.id, reason, rule.layer, "finding"))
            continue
        params = {
            name: float(override.get(name, param.default)) for name, param in rule.params.items()
        }
        severity = override.get("severity")
        ctx = RuleContext(
            rule,
            params,
            severity,
            computed.results,
            computed.frames,
            computed.aggregates,
            computed.context.run.meta,
        )
        try:
            findings.extend(list(rule.check(ctx)))
        except Exception as exc:  # one rule's bug must not end the analysis
            error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            skipped.append(
                Skipped(rule.id, f"rlscope failed ({error})", rule.layer, "finding", True)
            )
            warnings.append(
                f"{rule.id}: rlscope failed to judge this run ({error}); the other findings "
                f"stand. Please report it (rlscope {__version__}, with `--format json` output)"
            )
            continue
        judged.update(reads)
    findings.sort(key=lambda f: (-severity_rank(f.severity), f.layer, f.id))
    return Evaluation(
        findings, skipped, tuple(m for m in computed.results if m in judged), warnings
    )
