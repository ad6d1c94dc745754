"""Windows of a run's steps: the one final window (summaries, verdicts, gates, charts), trends."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

#: The final window: the last 10% of a series' steps, at least MIN_STEPS of them (all of them
#: when there are fewer). The minimum makes a 2-20 step run's summary a mean, not one noisy
#: step, and it is the same window the findings judge, so the value shown is the value judged.
FINAL_FRACTION = 0.1
MIN_STEPS = 3
#: First and last windows of a trend (first fifth vs last fifth).
TREND_FRACTION = 0.2

T = TypeVar("T")


def window_size(n: int, fraction: float = FINAL_FRACTION, minimum: int = MIN_STEPS) -> int:
    """Steps in a window of `fraction` of `n` steps, at least `minimum`, at most `n`."""
    return min(n, max(minimum, math.ceil(fraction * n)))


def final_window(values: Sequence[T]) -> list[T]:
    """The final window of a series (already reduced to its defined values)."""
    return list(values[len(values) - window_size(len(values)) :])
