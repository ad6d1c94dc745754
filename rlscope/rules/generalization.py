"""L5 findings: out-of-distribution accuracy falling behind in-distribution."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import polars as pl

from rlscope.metrics.generalization import FAILED_OOD_EXAMPLES
from rlscope.rules.base import ONE_SIDED_95, RuleContext, column_mean, listed_examples
from rlscope.spec import Declarations, Finding, Param
from rlscope.windows import TREND_FRACTION, window_size

#: This layer's findings, in order (collected by rlscope.catalog).
DECLARED = Declarations()


def _counts(frame: pl.DataFrame, column: str) -> np.ndarray | None:
    """The eval sizes of a window's steps, None when any is unknown (a logged eval without
    its set's size)."""
    counts = frame[column].cast(pl.Float64)
    if counts.null_count():
        return None
    return np.maximum(counts.to_numpy(), 1.0)


def _window(frame: pl.DataFrame) -> tuple[float, float] | None:
    """Mean gap of the window's eval steps and its standard error: the larger of the binomial
    error (from the eval counts) and the step-to-step scatter; the scatter alone when the
    eval sizes are unknown, and None (no error to judge by) when that leaves one eval."""
    gap = frame["value"].to_numpy()
    acc_id, acc_ood = frame["extra_id"].to_numpy(), frame["extra_ood"].to_numpy()
    n_id, n_ood = _counts(frame, "n_id"), _counts(frame, "n_ood")
    var = 0.0
    if n_id is not None and n_ood is not None:
        binomial = acc_id * (1 - acc_id) / n_id + acc_ood * (1 - acc_ood) / n_ood
        var = float(binomial.mean()) / len(gap)
    elif len(gap) < 2:
        return None
    if len(gap) > 1:
        var = max(var, float(gap.var(ddof=1)) / len(gap))
    return float(gap.mean()), math.sqrt(var)


def _accuracy(frame: pl.DataFrame, column: str, counts: str) -> tuple[float, float]:
    """Mean accuracy of the window's eval steps and its standard error (the larger of the
    binomial error, where the eval sizes are known, and the step-to-step scatter)."""
    acc = frame[column].to_numpy().astype(np.float64)
    n = _counts(frame, counts)
    var = float((acc * (1 - acc) / n).mean()) / len(acc) if n is not None else 0.0
    if len(acc) > 1:
        var = max(var, float(acc.var(ddof=1)) / len(acc))
    return float(acc.mean()), math.sqrt(var)


@DECLARED.rule(
    "ood-gap",
    brief=(
        "final ID − OOD gap ≥ 0.1 and widened by ≥ 0.05, significantly against binomial and "
        "step-to-step noise, *and* OOD itself stalled or fell (its rise, one-sided 95% bound, "
        "below 30% of ID's): OOD that keeps improving more slowly is partial transfer, not a "
        "finding"
    ),
    layer="L5",
    title="Out-of-distribution accuracy falls behind",
    doc="At the eval steps with both `eval_id` and `eval_ood` rollouts: the ID − OOD accuracy "
    "gap of the last fifth of eval steps is at least `min_gap`, and it widened by at least "
    "`min_widening` since the first fifth, significantly (z >= `z`, with the larger of the "
    "binomial error of the eval accuracies and the step-to-step scatter as noise). Judged from "
    "`min_evals` eval steps. And OOD accuracy itself stalls or falls: the upper end of the "
    "one-sided 95% interval of its rise is below `transfer_max` times ID's rise. OOD that "
    "keeps improving, only more slowly than ID (half as fast, say), is ordinary partial "
    "transfer, not a failure to generalise; the "
    "seed's L5 question (§5, HGPO's ID vs OOD) is whether the policy learns patterns that "
    "carry over, and OOD stalling while ID rises says it does not. The message says whether "
    "OOD is flat or falling. Noise from binomial eval counts and the step-to-step scatter, so "
    "it holds at any eval size and frequency. Evals logged by the trainer (TRL's eval sets: "
    "generalization.eval_id/eval_ood from the steps table) count their completions where the "
    "set's size is logged; where it is not, the scatter alone, and a window of one eval is "
    "not judged (the error is unknown; the evidence says which).",
    remedy="add diverse or harder prompts to the training mix; stop at the checkpoint where the "
    "gap was smallest; regularise more (KL); check for prompt overlap between train and eval_id "
    "(a leak inflates ID accuracy).",
    metrics=("generalization.ood_gap",),
    params={
        "min_gap": Param(0.1, "final ID − OOD accuracy gap"),
        "min_widening": Param(0.05, "growth of the gap from the first to the last fifth"),
        "z": Param(2.0, "significance of the widening (z-score)"),
        "min_evals": Param(4, "fewest eval steps to judge"),
        "transfer_max": Param(
            0.3, "OOD rising less than this share of ID's rise (one-sided 95% bound) stalls"
        ),
    },
)
def ood_gap(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    frame = ctx.frame("generalization.ood_gap")
    if frame is None:
        return
    frame = frame.filter(pl.col("value").is_not_null()).sort("step")
    if frame.height < p["min_evals"]:
        return
    w = window_size(frame.height, TREND_FRACTION, minimum=1)
    head, tail = _window(frame.head(w)), _window(frame.tail(w))
    if head is None or tail is None:
        return  # eval sizes unknown and one eval a window: no sampling error to judge by
    (first, se_first), (last, se_last) = head, tail
    widening = last - first
    se = math.hypot(se_first, se_last)
    z = widening / se if se > 0 else math.inf
    if last < p["min_gap"] or widening < p["min_widening"] or z < p["z"]:
        return
    (ood_first, ood_se_a), (ood, ood_se_b) = (
        _accuracy(part, "extra_ood", "n_ood") for part in (frame.head(w), frame.tail(w))
    )
    id_rise = column_mean(frame.tail(w)["extra_id"]) - column_mean(frame.head(w)["extra_id"])
    ood_rise, ood_se = ood - ood_first, math.hypot(ood_se_a, ood_se_b)
    if id_rise <= 0 or ood_rise + ONE_SIDED_95 * ood_se >= p["transfer_max"] * id_rise:
        return  # OOD still improves (or may) with ID: partial transfer
    trend = "falling" if ood_rise < -ONE_SIDED_95 * ood_se else "flat"
    steps = frame["step"].to_list()
    acc_id = column_mean(frame.tail(w)["extra_id"])
    yield ctx.finding(
        f"OOD accuracy is {trend} ({ood_first:.2f} → {ood:.2f}) while ID rose: it trails ID "
        f"by {last:.2f} at the last evals (ID {acc_id:.2f}), up from {first:.2f} at the first "
        f"(z = {z:.1f}).",
        gap_first=first,
        gap_last=last,
        ood=[ood_first, ood],
        ood_trend=trend,
        z=z,
        sampling_error=(
            "binomial (eval sizes) and step-to-step scatter"
            if frame["n_id"].null_count() + frame["n_ood"].null_count() == 0
            else "step-to-step scatter only (eval sizes unknown)"
        ),
        steps=[int(steps[0]), int(steps[-1])],
        rollout_ids=listed_examples(frame.tail(1), FAILED_OOD_EXAMPLES),
    )
