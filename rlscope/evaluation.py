"""Runs every enabled rule of the catalog over computed metrics: the findings of a run, each
with its onset, filed under the findings that explain it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase

from rlscope._version import __version__
from rlscope.catalog import Catalog, default_catalog
from rlscope.config import Config
from rlscope.engine import Computed, upto
from rlscope.reader import Run
from rlscope.report import MissingInput, Skipped
from rlscope.rules.base import RuleContext
from rlscope.spec import Finding, Metric, Rule, severity_rank, split_column

#: Prefixes judged on a grid before bisecting (onsets): a rule is judged about
#: ONSET_GRID + log2(steps / ONSET_GRID) times per finding, whatever the run length.
ONSET_GRID = 32


@dataclass(frozen=True)
class Evaluation:
    """The findings of a run, the rules that could not judge it, the metrics some rule judged
    (read and had the data for; in results order: only those may be shown as `ok`) and the
    warnings of rules that failed."""

    findings: list[Finding]
    skipped: list[Skipped]
    judged: tuple[str, ...]
    warnings: list[str]


def evaluate(
    computed: Computed,
    config: Config,
    catalog: Catalog | None = None,
    *,
    with_onsets: bool = True,
) -> Evaluation:
    """Run every enabled rule of the catalog (rlscope's own by default); a rule whose metrics
    are all missing is reported as skipped. A rule that raises is rlscope's bug, never the end
    of the analysis: it is reported as skipped (`failed`) with the error, and a warning asks
    for a report; the other rules judge as usual. Each finding gets its onset (`onsets`;
    not `with_onsets`: none, hence no causes either) and the findings that explain it
    (`file_causes`), roots first."""
    catalog = catalog or default_catalog()
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    warnings: list[str] = []
    judged: set[str] = set()
    available: Mapping[str, Metric] = {}  # the run's metrics, for the prefixes of onsets
    for rule in catalog.rules.values():
        if config.findings.get(rule.id, {}).get("enabled", True) is False:
            continue
        reads = _reads(rule, computed)
        lacking = _lacking(rule, computed)
        if not reads or lacking:
            reason = "needs " + (" and ".join(lacking) if lacking else " or ".join(rule.metrics))
            skipped.append(Skipped(rule.id, reason, rule.layer, "finding"))
            continue
        try:
            found = judge(rule, computed, config)
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
        short = _too_short(rule, computed, config, reads)
        if not found and short is not None:
            skipped.append(
                Skipped(
                    rule.id,
                    f"judged from {short[0]} steps, the run has {short[1]} so far",
                    rule.layer,
                    "finding",
                    needs_steps=short[0],
                )
            )
            continue
        if found and with_onsets:
            available = available or catalog.for_run(computed.context.run)
            found = onsets(rule, found, computed, config, available)
        findings.extend(found)
        judged.update(reads)
    return Evaluation(
        file_causes(findings, catalog.rules),
        skipped,
        tuple(m for m in computed.results if m in judged),
        warnings,
    )


def evaluate_prefix(
    computed: Computed,
    last_step: int,
    config: Config,
    catalog: Catalog | None = None,
    *,
    with_onsets: bool = False,
) -> Evaluation:
    """The judgement of the run's prefix up to `last_step` (as `--steps :last_step` gives it,
    see engine.upto) from what was computed for the whole run: no scan."""
    catalog = catalog or default_catalog()
    available = catalog.for_run(computed.context.run)
    prefix = upto(computed, last_step, computed.results, available)
    return evaluate(prefix, config, catalog, with_onsets=with_onsets)


def _reads(rule: Rule, computed: Computed) -> list[str]:
    """The computed metrics a rule judges (its metric globs)."""
    return [m for m in computed.results if any(fnmatchcase(m, pattern) for pattern in rule.metrics)]


def _lacking(rule: Rule, computed: Computed) -> list[str]:
    """The metrics (globs) a rule requires that the run did not compute."""
    return [p for p in rule.requires if not any(fnmatchcase(m, p) for m in computed.results)]


def _too_short(
    rule: Rule, computed: Computed, config: Config, reads: Sequence[str]
) -> tuple[int, int] | None:
    """(steps the rule judges from, steps its metrics have) when a rule with a `min_steps`
    parameter has fewer: it did not judge (a run in progress, a short `--steps` range), which
    is not the same as judging it healthy."""
    if "min_steps" not in rule.params:
        return None
    override = config.findings.get(rule.id, {})
    needed = math.ceil(float(override.get("min_steps", rule.params["min_steps"].default)))
    have = max(len(computed.results[m].steps) for m in reads)
    return (needed, have) if have < needed else None


def judge(rule: Rule, computed: Computed, config: Config) -> list[Finding]:
    """One rule's findings on computed metrics, with the config's thresholds and severity."""
    override = config.findings.get(rule.id, {})
    params = {name: float(override.get(name, param.default)) for name, param in rule.params.items()}
    ctx = RuleContext(
        rule,
        params,
        override.get("severity"),
        computed.results,
        computed.frames,
        computed.aggregates,
        computed.context.run.meta,
    )
    return list(rule.check(ctx))


def onsets(
    rule: Rule,
    found: Sequence[Finding],
    computed: Computed,
    config: Config,
    available: Mapping[str, Metric],
) -> list[Finding]:
    """`found` (the rule's findings on the whole run) with their onset: the first step at which
    judging the run's prefix raises the finding, and the step before (its last good step),
    as `--steps :s` would judge it (engine.upto). The onset is where the last stretch of
    prefixes that raise it begins: prefixes on a grid of ONSET_GRID, walked back from the end
    to the last that does not raise it, then bisected to adjacent steps, so judging up to the
    onset raises it and judging up to the step before does not. From the first step judged,
    no last good step. `available`: the catalog's metrics for the run."""
    reads = _reads(rule, computed)
    steps = sorted({s for m in reads for s in computed.results[m].steps})
    ids = [*reads, *(m for m in (*rule.examples_from, *rule.context) if m in computed.results)]
    raised: dict[int, bool] = {}

    def raises(i: int) -> bool:
        if i not in raised:
            try:
                prefix = upto(computed, steps[i], ids, available)
                raised[i] = any(f.id == rule.id for f in judge(rule, prefix, config))
            except Exception:  # a prefix the rule cannot judge does not raise it
                raised[i] = False
        return raised[i]

    if not steps or not raises(len(steps) - 1):
        return list(found)
    last = len(steps) - 1
    grid = sorted({round(k * last / ONSET_GRID) for k in range(ONSET_GRID + 1)})
    good, bad = None, last
    for i in reversed(grid[:-1]):
        if not raises(i):
            good = i
            break
        bad = i
    if good is not None:
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (good, middle) if raises(middle) else (middle, bad)
    onset, last_good = steps[bad], (steps[good] if good is not None else None)
    return [replace(f, onset=onset, last_good=last_good) for f in found]


def file_causes(findings: Sequence[Finding], rules: Mapping[str, Rule]) -> list[Finding]:
    """Each finding with the findings that explain it (`caused_by`), ordered for reading: root
    causes first (by severity, then the step they began: what broke first leads), each
    followed by what it explains. A finding explains another when its rule `explains` it, the
    other's evidence matches, and it began first (`Finding.began`); at the same step, only if
    the other's rule does not explain it back."""

    def explains(cause: Finding, finding: Finding) -> bool:
        how = rules[cause.id].explains.get(finding.id)
        if cause.id == finding.id or how is None or not how.holds(finding):
            return False
        if cause.began is None or finding.began is None:
            return False
        mutual = cause.id in rules[finding.id].explains
        return cause.began < finding.began or (cause.began == finding.began and not mutual)

    caused = [
        replace(f, caused_by=tuple(sorted({c.id for c in findings if explains(c, f)})))
        for f in findings
    ]

    explained = {f.id: sum(f.id in c.caused_by for c in caused) for f in caused}

    def key(f: Finding) -> tuple[int, float, int, str, str]:
        # At one severity and step, the finding that accounts for most leads.
        began = f.began if f.began is not None else float("inf")
        return (-severity_rank(f.severity), began, -explained[f.id], f.layer, f.id)

    ordered: list[Finding] = []

    def place(finding: Finding) -> None:
        ordered.append(finding)
        for other in sorted(caused, key=key):
            if finding.id in other.caused_by and all(o is not other for o in ordered):
                place(other)  # under the first of its causes to be shown

    for finding in sorted(caused, key=key):
        if not finding.caused_by:
            place(finding)
    for finding in sorted(caused, key=key):  # causes all explained in turn: shown as found
        if all(o is not finding for o in ordered):
            place(finding)
    return ordered


#: How a table the run lacks is named in `MissingInput.needs`.
TABLE_NEEDS = {
    "steps": "a steps table",
    "rollouts": "a rollouts table",
    "tokens": "a tokens table",
    "probes": "a probes table (`rlscope probe`)",
}


def missing_inputs(
    skipped: Sequence[Skipped], computed: Computed, catalog: Catalog | None = None
) -> tuple[MissingInput, ...]:
    """The findings skipped for want of inputs, grouped by the input that would let each be
    judged: the fewest inputs that feed one of its metrics, chosen greedily so that one input
    (a tokens table) covers as many findings as it can. A finding no missing input would
    enable (its metrics were not asked for, or came out empty) keeps its reason."""
    catalog = catalog or default_catalog()
    run = computed.context.run
    options: dict[str, list[frozenset[str]]] = {}
    reasons: dict[str, list[str]] = {}
    for skip in skipped:
        rule = catalog.rules.get(skip.metric)
        if skip.kind != "finding" or skip.failed or skip.needs_steps is not None or rule is None:
            continue
        # what it lacks of what it requires, else any of what it reads
        patterns = _lacking(rule, computed) or rule.metrics
        metrics = [
            m for m in catalog.metrics.values() if any(fnmatchcase(m.id, p) for p in patterns)
        ]
        needs = [need for m in metrics for need in _variant_needs(m, run)]
        if needs and all(needs):
            options[rule.id] = sorted(needs, key=len)
        else:
            reasons.setdefault(_why_not_judged(rule, metrics, computed, bool(needs)), []).append(
                rule.id
            )
    groups: list[MissingInput] = []
    left = dict(options)
    while left:
        counts: dict[frozenset[str], list[str]] = {}
        for finding, needs in left.items():
            for need in dict.fromkeys(needs):
                counts.setdefault(need, []).append(finding)
        need, findings = max(counts.items(), key=lambda kv: (len(kv[1]), -len(kv[0])))
        groups.append(MissingInput(_ordered(need), tuple(findings)))
        left = {f: n for f, n in left.items() if f not in findings}
    groups += [MissingInput((), tuple(ids), reason) for reason, ids in reasons.items()]
    return tuple(groups)


def _variant_needs(metric: Metric, run: Run) -> list[frozenset[str]]:
    """Per variant of `metric`, the inputs `run` lacks for it (empty: the run can feed it)."""
    tables, meta = run.tables, run.meta
    out = []
    for variant in metric.variants:
        need: set[str] = set()
        for table, column in (split_column(variant.table, c) for c in variant.requires):
            if table not in tables:
                need.add(TABLE_NEEDS.get(table, f"a {table} table"))
            elif not run.has(table, column):
                need.add(f"{table}.{column}")
        if variant.table not in tables:
            need.add(TABLE_NEEDS.get(variant.table, f"a {variant.table} table"))
        if need & {TABLE_NEEDS["tokens"], TABLE_NEEDS["probes"]} and "rollouts" not in tables:
            need.add(TABLE_NEEDS["rollouts"])  # tokens and probes belong to rollouts
        need |= {f"run.json {m}" for m in variant.needs_meta if meta.get(m) is None}
        out.append(frozenset(need))
    return out


def _ordered(need: frozenset[str]) -> tuple[str, ...]:
    """Tables first (in format order), then columns, then run.json fields."""
    order = list(TABLE_NEEDS.values())
    return tuple(
        sorted(
            need,
            key=lambda n: (
                (0, order.index(n))
                if n in order
                else (2, 0)
                if n.startswith("run.json")
                else (1, 0),
                n,
            ),
        )
    )


def _why_not_judged(rule: Rule, metrics: list[Metric], computed: Computed, feedable: bool) -> str:
    """Why a rule whose inputs the run has (or that no input names) did not judge."""
    if not feedable and metrics and all(m.is_template for m in metrics):
        return "needs " + ", ".join(f"{m.id} ({m.title})" for m in metrics)
    empty = [s for s in computed.skipped if any(fnmatchcase(s.metric, p) for p in rule.metrics)]
    if empty:
        return f"{empty[0].metric}: {empty[0].reason}"
    return "needs " + " or ".join(rule.metrics) + " (not computed in this analysis)"
