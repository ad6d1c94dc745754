"""The catalog: every metric and rule, registered by importing the layer modules (only here)."""

from __future__ import annotations

import importlib

from rlscope.registry import FAMILIES, METRICS, RULES, Metric, Rule

#: Read the registries from here, not from rlscope.registry: importing this module is what
#: registers every metric and rule.
__all__ = ["LAYER_MODULES", "METRICS", "RULES", "lookup", "share_metrics"]

#: Registry order is layer order (L1 first): metrics, then rules.
LAYER_MODULES = ("stability", "behavior", "signal", "exploration", "generalization", "reasoning")

for _name in LAYER_MODULES:
    importlib.import_module(f"rlscope.metrics.{_name}")
for _name in LAYER_MODULES:
    importlib.import_module(f"rlscope.rules.{_name}")


def share_metrics() -> list[str]:
    """Ids of the metrics whose values are shares in [0, 1]."""
    return [m.id for m in METRICS.values() if m.unit == "share"]


def lookup(id: str) -> Metric | Rule | None:
    """A metric, finding or family (a member id like `signal.reward.acc` gives its template)."""
    found = METRICS.get(id) or RULES.get(id)
    if found is None:
        prefix = next((p for p in FAMILIES if id.startswith(p) and len(id) > len(p)), None)
        found = METRICS.get(prefix + "*") if prefix else None
    return found
