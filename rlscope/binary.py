"""What a 0/1 reward's logged per-step mean and standard deviation can be, and what they cannot."""

from __future__ import annotations

import polars as pl

#: std² / (p(1 − p)) of a 0/1 reward with mean p over n completions is n / (n − 1) (torch's
#: unbiased std, TRL's `nanstd`): between 1 and 4/3 for batches of 4 or more. A reward with any
#: value strictly between its extremes has less (Bhatia–Davis), a 0/s reward with s ≠ 1 other
#: ratios (below 1 for s < 1, at least 2 for s > 1).
BINARY_RATIO = (0.995, 4 / 3 + 0.005)
#: How far a logged mean may pass 0 or 1, or a logged std pass 0 where the mean is 0 or 1, and
#: still be float rounding (TRL logs float32 means of float32 rewards).
TOLERANCE = 1e-6


def bernoulli_ratio(mean: pl.Expr, std: pl.Expr) -> pl.Expr:
    """std² / (p(1 − p)): n / (n − 1) for a 0/1 reward over n completions (null at p = 0, 1)."""
    return pl.when((mean > 0) & (mean < 1)).then(std**2 / (mean * (1 - mean)))


def outside_unit_range(mean: pl.Expr, std: pl.Expr) -> pl.Expr:
    """Steps whose logged mean and unbiased std no rewards in [0, 1] can give, over a batch of 4
    or more: the mean outside [0, 1], a spread at a mean of 0 or 1 (every value then on that
    bound), or std² above p(1 − p) · 4/3 (Bhatia–Davis: values in [0, 1] with mean p have a
    variance of at most p(1 − p), and the unbiased std adds n / (n − 1) ≤ 4/3). Such a step
    had some reward outside [0, 1]: for a reward that is 0/1 elsewhere, a verifier returning
    another scale."""
    lo, hi = 0.0 - TOLERANCE, 1.0 + TOLERANCE
    on_bound = (mean.abs() <= TOLERANCE) | ((mean - 1.0).abs() <= TOLERANCE)
    return (
        (mean < lo)
        | (mean > hi)
        | (on_bound & (std > TOLERANCE))
        | (bernoulli_ratio(mean, std) > BINARY_RATIO[1]).fill_null(False)
    )
