"""How a series declined over training: smoothly, or in a cliff."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

#: A cliff: at least this share of the total decline happens within CLIFF_WINDOW of the steps.
CLIFF_SHARE = 0.5
CLIFF_WINDOW = 0.1
#: Changes smaller than this share of the starting level are "flat".
FLAT_SHARE = 0.1


def decline_shape(steps: Sequence[int], values: Sequence[float]) -> dict[str, Any]:
    """`shape` is `cliff` when at least half of the decline (start = first 10% of the steps,
    end = last 10%, both means) happens within a window of 10% of the steps (of a 3-point
    rolling median, so one noisy step is no cliff), `smooth` when it is spread out, `flat` when
    the series moved less than 10% of its start, `rising` when it grew by more."""
    y = np.asarray(values, dtype=np.float64)
    n = len(y)
    if n < 5:
        return {"shape": None, "reason": "fewer than 5 steps"}
    edge = max(1, math.ceil(0.1 * n))
    start, end = float(y[:edge].mean()), float(y[-edge:].mean())
    scale = max(abs(start), 1e-12)
    out: dict[str, Any] = {"start": start, "end": end}
    if abs(end - start) < FLAT_SHARE * scale:
        return {"shape": "flat", **out}
    if end > start:
        return {"shape": "rising", **out}
    smooth = np.array([np.median(y[max(0, i - 1) : i + 2]) for i in range(n)])
    width = max(1, math.ceil(CLIFF_WINDOW * n))
    drops = smooth[:-width] - smooth[width:]
    # Equal drops up to float summation order are a tie, won by the first (the same steps on
    # every analysis of the same data).
    i = int(np.argmax(np.round(drops / scale, 9)))
    share = float(drops[i] / (start - end))
    return {
        "shape": "cliff" if share >= CLIFF_SHARE else "smooth",
        **out,
        "steepest_share": min(share, 1.0),
        "steepest_steps": [int(steps[i]), int(steps[i + width])],
    }
