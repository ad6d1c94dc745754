"""The catalog: every metric and rule, collected once from the layer modules (only here)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache
from types import MappingProxyType
from typing import Any

from rlscope.errors import RlscopeError, did_you_mean
from rlscope.spec import Declarations, Metric, Rule

#: Catalog order is layer order (L1 first): metrics, then rules.
LAYER_MODULES = ("stability", "behavior", "signal", "exploration", "generalization", "reasoning")
LAYER_PATTERN = re.compile(r"L[1-6]")


@dataclass(frozen=True)
class Catalog:
    """The metrics and rules rlscope knows, by id (frozen). Compute, evaluation, comparison,
    config and gates take one (renderers read what results carry); `default_catalog()` is
    rlscope's own."""

    metrics: Mapping[str, Metric]
    rules: Mapping[str, Rule]

    @classmethod
    def of(cls, declarations: Iterable[Declarations]) -> Catalog:
        """The catalog of these declarations, in order; a duplicate id is a ValueError."""
        metrics: dict[str, Metric] = {}
        rules: dict[str, Rule] = {}
        for declared in declarations:
            for metric in declared.metrics:
                if metric.id in metrics:
                    raise ValueError(f"duplicate metric id {metric.id}")
                metrics[metric.id] = metric
            for rule in declared.rules:
                if rule.id in rules:
                    raise ValueError(f"duplicate rule id {rule.id}")
                rules[rule.id] = rule
        return cls(MappingProxyType(metrics), MappingProxyType(rules))

    def extended(self, *declarations: Declarations) -> Catalog:
        """This catalog plus more declarations (a team's own metrics and rules) after it."""
        own = Declarations()
        own.metrics.extend(self.metrics.values())
        own.rules.extend(self.rules.values())
        return Catalog.of([own, *declarations])

    def lookup(self, id: str) -> Metric | Rule | None:
        """A metric, finding or family (a member id like `signal.reward.acc` gives its
        template)."""
        found = self.metrics.get(id) or self.rules.get(id)
        if found is None:
            found = next(
                (
                    m
                    for m in self.metrics.values()
                    if m.is_template and id.startswith(m.id[:-1]) and len(id) > len(m.id) - 1
                ),
                None,
            )
        return found

    def hint(self, id: str, *, rules: bool = True, metrics: bool = True) -> str:
        """The did-you-mean line for an unknown id (closest metric or finding ids)."""
        ids = [*(self.metrics if metrics else ()), *(self.rules if rules else ())]
        kinds = "finding ids" if not metrics else "metric ids" if not rules else "ids"
        return did_you_mean(id, ids, f"`rlscope metrics` lists the {kinds}")

    def share_metrics(self) -> list[str]:
        """Ids of the metrics whose values are shares in [0, 1]."""
        return [m.id for m in self.metrics.values() if m.unit == "share"]

    def for_run(self, run: Any) -> dict[str, Metric]:
        """Every metric this run (rlscope.reader.Run) could have: the declared ones, each family
        template replaced by its members for this run (e.g. `signal.reward.<name>` per reward
        function), in catalog order."""
        found: dict[str, Metric] = {}
        for metric in self.metrics.values():
            members = metric.members(run) if metric.members is not None else [metric]
            found.update((m.id, m) for m in members)
        return found

    def select(self, patterns: Iterable[str], available: Mapping[str, Metric]) -> list[Metric]:
        """The metrics of `available` (a run's, `for_run`) that `patterns` name, in the order
        named: an id, a layer (`L3`), or a glob (`signal.*`; a family template `signal.reward.*`
        is one too). A known id the run cannot have selects nothing (it is skipped with its
        reason); a name that matches nothing the catalog knows is an RlscopeError with the
        closest ids."""
        chosen: dict[str, Metric] = {}
        for pattern in patterns:
            if LAYER_PATTERN.fullmatch(pattern):
                hits = [m for m in available.values() if m.layer == pattern]
            elif any(c in pattern for c in "*?["):
                hits = [m for m in available.values() if fnmatchcase(m.id, pattern)]
                if not hits and pattern not in self.metrics:
                    raise RlscopeError(
                        f"--metrics {pattern!r} matches no metric",
                        hint="`rlscope metrics` lists the ids; layers are L1 … L6",
                    )
            elif pattern in available:
                hits = [available[pattern]]
            elif pattern in self.metrics:
                hits = []
            else:
                hint = did_you_mean(
                    pattern, [*self.metrics, *available], "`rlscope metrics` lists them"
                )
                raise RlscopeError(f"unknown metric id: {pattern}", hint=hint)
            chosen.update((m.id, m) for m in hits)
        return list(chosen.values())


@cache
def default_catalog() -> Catalog:
    """rlscope's catalog: every layer module's declarations (imported here and only here)."""
    modules = [importlib.import_module(f"rlscope.metrics.{name}") for name in LAYER_MODULES]
    modules += [importlib.import_module(f"rlscope.rules.{name}") for name in LAYER_MODULES]
    return Catalog.of(module.DECLARED for module in modules)
