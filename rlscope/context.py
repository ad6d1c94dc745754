"""What a metric's series function may read besides its aggregated frame (MetricContext)."""

from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from rlscope.reader import Run
from rlscope.text import TextSettings


@dataclass
class MetricContext:
    """What a metric's series function may read besides its aggregated frame."""

    run: Run
    pass_k: int | None = None
    text: TextSettings = field(default_factory=TextSettings)
    # The collected partial aggregates, (table, level) -> frame (for metric summaries).
    aggregates: dict[tuple[str, str], pl.DataFrame] = field(default_factory=dict)
