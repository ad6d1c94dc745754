"""L1 findings: KL stalled or running away, gradient spikes, low entropy fighting the clip."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import polars as pl

from rlscope.registry import Param, rule
from rlscope.report import Finding
from rlscope.rules.base import (
    MIN_TREND_STEPS,
    RuleContext,
    compare_windows,
    final_mean,
    pct,
    rolling_median,
    window_size,
)


@rule(
    "kl-stalled",
    layer="L1",
    title="KL to the reference stays ~0 and the policy is not improving",
    doc="The policy has barely moved from the reference model (final-window token-mean KL "
    "below `kl_max`) and pass@1 (or mean reward) has not risen significantly between the first "
    "and last fifth of the run (z-score below `z`). Small KL alone is fine when the policy "
    "improves; small KL with no improvement means the updates do nothing: learning rate too "
    "low, advantages ~0 (dead prompts), a KL penalty or clip that is too tight, or a "
    "frozen/detached policy.",
    remedy="check the effective learning rate and that gradients reach the policy; check "
    "signal.zero_std_frac; lower the KL coefficient (β) or raise the clip range.",
    metrics=("stability.kl", "signal.pass_at_1"),
    params={
        "kl_max": Param(1e-3, "final-window KL (nats/token) below which KL counts as ~0"),
        "z": Param(2.0, "a pass@1 rise with z-score above this counts as improvement"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge a trend"),
    },
)
def kl_stalled(ctx: RuleContext) -> Iterator[Finding]:
    kl = ctx.series("stability.kl")
    progress = ctx.series("signal.pass_at_1") or ctx.series("signal.reward")
    p = ctx.params
    if kl is None or progress is None or min(len(kl), len(progress)) < p["min_steps"]:
        return
    level = final_mean(kl)
    trend = compare_windows(progress)
    if level < p["kl_max"] and trend.z < p["z"]:
        yield ctx.finding(
            f"KL to the reference is {level:.2g} nats/token at the end and pass@1 moved "
            f"{trend.delta:+.3f} (z = {trend.z:.1f}): the policy is not learning.",
            final_kl=level,
            pass_at_1_first=trend.first,
            pass_at_1_last=trend.last,
            steps=[trend.first_steps[0], trend.last_steps[1]],
        )


@rule(
    "kl-runaway",
    layer="L1",
    title="KL to the reference is accelerating",
    doc="KL grows faster and faster: splitting the run into thirds, the last third's mean KL is "
    "at least `growth_ratio` times the middle third's and its increase at least `accel_ratio` "
    "times the previous increase (a convex, exponential-like curve; linear and saturating "
    "growth stay silent). The policy is drifting away from the base model, which usually ends "
    "in lost general ability, reward hacking or divergence.",
    remedy="raise the KL coefficient (β) or add a KL loss; lower the learning rate; check the "
    "reward for hacking (inspect the highest-reward rollouts of the last steps).",
    metrics=("stability.kl",),
    params={
        "growth_ratio": Param(2.5, "last-third mean KL / middle-third mean KL"),
        "accel_ratio": Param(2.5, "last-third increase / middle-third increase"),
        "min_steps": Param(12, "fewest steps to judge the shape"),
    },
    severity="critical",
)
def kl_runaway(ctx: RuleContext) -> Iterator[Finding]:
    kl = ctx.series("stability.kl")
    p = ctx.params
    if kl is None or len(kl) < p["min_steps"]:
        return
    thirds = np.array_split(kl.values, 3)
    k1, k2, k3 = (float(t.mean()) for t in thirds)
    if k2 <= 0 or k3 <= 0:
        return
    rise_mid, rise_last = k2 - k1, k3 - k2
    accelerating = rise_last >= p["accel_ratio"] * max(rise_mid, 0.0)
    if k3 >= p["growth_ratio"] * k2 and accelerating:
        yield ctx.finding(
            f"KL is accelerating: mean {k1:.3g} → {k2:.3g} → {k3:.3g} nats/token over the three "
            f"thirds of the run (×{k3 / k2:.1f} in the last third).",
            thirds=[k1, k2, k3],
            steps=[int(kl.steps[0]), int(kl.steps[-1])],
        )


@rule(
    "grad-spike",
    layer="L1",
    title="Gradient-norm spikes",
    doc="Steps whose gradient norm is a multiplicative outlier: at least `ratio` times the "
    "rolling median and `robust_z` robust standard deviations above it in log space (median and "
    "MAD over a centred window of ~10% of the run). In sparse-reward runs a spike usually comes "
    "from one rollout of extreme reward; each spike lists the step's rollouts furthest from the "
    "step's mean reward.",
    remedy="inspect the listed rollouts (reward bug, parser edge case, hacked reward); clip "
    "rewards or advantages; lower the learning rate or tighten gradient clipping.",
    metrics=("stability.grad_norm",),
    params={
        "ratio": Param(4.0, "spike = grad norm at least this many times the rolling median"),
        "robust_z": Param(6.0, "and this many robust sigmas above it (log space)"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
)
def grad_spike(ctx: RuleContext) -> Iterator[Finding]:
    grad = ctx.series("stability.grad_norm")
    p = ctx.params
    if grad is None or len(grad) < p["min_steps"]:
        return
    positive = grad.values > 0
    steps, values = grad.steps[positive], grad.values[positive]
    if len(values) < p["min_steps"]:
        return
    logs = np.log(values)
    window = max(9, (len(values) // 10) | 1)
    median = rolling_median(logs, window)
    mad = rolling_median(np.abs(logs - median), window) * 1.4826
    ratio = np.exp(logs - median)
    z = np.where(mad > 0, (logs - median) / np.where(mad > 0, mad, 1.0), np.inf)
    spikes = np.flatnonzero((ratio >= p["ratio"]) & (z >= p["robust_z"]))
    if len(spikes) == 0:
        return
    spike_steps = [int(steps[i]) for i in spikes]
    extreme = _extreme_rollouts(ctx, spike_steps[:10])
    worst = max(spikes, key=lambda i: ratio[i])
    yield ctx.finding(
        f"{len(spikes)} gradient-norm spike(s), the largest ×{ratio[worst]:.0f} the rolling "
        f"median at step {int(steps[worst])}"
        + (
            f"; most extreme rollout there: {extreme[int(steps[worst])][0]['rollout_id']}"
            if extreme.get(int(steps[worst]))
            else ""
        )
        + ".",
        steps=spike_steps,
        ratios=[float(ratio[i]) for i in spikes],
        grad_norm=[float(values[i]) for i in spikes],
        rollouts=extreme,
    )


def _extreme_rollouts(ctx: RuleContext, steps: list[int], top: int = 3) -> dict[int, list]:
    """For each step, the train rollouts whose reward is furthest from the step's mean."""
    if not steps:
        return {}
    reward = pl.col("reward").cast(pl.Float64)
    frame = (
        ctx.run.scan("rollouts")
        .filter(pl.col("step").is_in(steps) & (pl.col("split") == "train"))
        .select("step", "rollout_id", "prompt_id", reward)
        .with_columns((reward - reward.mean().over("step")).abs().alias("distance"))
        .sort(["step", "distance"], descending=[False, True])
        .group_by("step", maintain_order=True)
        .head(top)
        .collect()
    )
    out: dict[int, list] = {}
    for row in frame.iter_rows(named=True):
        out.setdefault(int(row["step"]), []).append(
            {
                "rollout_id": row["rollout_id"],
                "prompt_id": row["prompt_id"],
                "reward": row["reward"],
            }
        )
    return out


@rule(
    "entropy-clip-conflict",
    layer="L1",
    title="Low entropy with a high clip fraction",
    doc="At the end of the run entropy has fallen to at most `entropy_ratio` of its initial "
    "value while the PPO clip fraction is at least `clip_frac_min`: the policy has converged to "
    "a narrow mode while each update keeps pushing tokens out of the trust region — the seed's "
    "'classic instability', two forces fighting. (A fully on-policy run has clip fraction 0 and "
    "never triggers this.)",
    remedy="lower the learning rate or the number of PPO epochs per batch; protect high-entropy "
    "tokens (Clip-Cov / KL-Cov, clip-higher); add an entropy bonus.",
    metrics=("behavior.entropy", "stability.clip_frac"),
    params={
        "entropy_ratio": Param(0.35, "final entropy / initial entropy at or below this is low"),
        "clip_frac_min": Param(0.1, "final-window clip fraction at or above this is high"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
    severity="critical",
)
def entropy_clip_conflict(ctx: RuleContext) -> Iterator[Finding]:
    entropy, clip = ctx.series("behavior.entropy"), ctx.series("stability.clip_frac")
    p = ctx.params
    if entropy is None or clip is None or min(len(entropy), len(clip)) < p["min_steps"]:
        return
    start = float(np.mean(entropy.values[: window_size(len(entropy), 0.02, 1)]))
    end, clip_end = final_mean(entropy), final_mean(clip)
    if start <= 0 or not math.isfinite(start):
        return
    if end / start <= p["entropy_ratio"] and clip_end >= p["clip_frac_min"]:
        yield ctx.finding(
            f"Entropy is down to {pct(end / start)} of its start ({end:.3g} nats) while "
            f"{pct(clip_end)} of tokens are clipped: updates are fighting a collapsed policy.",
            entropy_start=start,
            entropy_end=end,
            clip_frac_end=clip_end,
            steps=[int(entropy.steps[-1])],
        )


LOGGED_METRICS = (
    "stability.kl",
    "stability.clip_frac",
    "stability.ppo_kl",
    "behavior.entropy",
    "behavior.response_len",
    "behavior.truncation_rate",
    "signal.reward",
    "signal.zero_std_frac",
)


@rule(
    "logged-metric-mismatch",
    layer="L1",
    title="The trainer's logged metric disagrees with rlscope's recomputation",
    doc="For each metric rlscope recomputes from rollouts or tokens and the trainer also logged "
    "(entropy, KL, clip fraction, PPO KL, reward, zero-σ share, truncation, mean length), the two "
    "per-step series are aligned on step; a step disagrees when |recomputed - logged| > "
    "`abs_tol` + `rel_tol`·max(|recomputed|, |logged|). The finding fires when at least "
    "`min_share` of the aligned steps (and at least `min_steps`) disagree. Trainers have shipped "
    "wrong metrics (verl entropy with dynamic batch size before 0.4.1, a clip_ratio on one TRL "
    "version), and micro-batch averaging with equal weights instead of per token shifts them a "
    "little: the tolerance absorbs the latter.",
    remedy="check which side is right: rlscope's doc (`rlscope explain ID`) states its formula; "
    "compare with the trainer version's code; check that the logged tokens and rollouts are the "
    "full batch (not a sample) and that the step numbering matches.",
    metrics=LOGGED_METRICS,
    params={
        "rel_tol": Param(0.1, "relative tolerance per step"),
        "abs_tol": Param(1e-4, "absolute tolerance per step"),
        "min_share": Param(0.5, "share of aligned steps that must disagree"),
        "min_steps": Param(3, "fewest aligned steps to compare"),
    },
)
def logged_metric_mismatch(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    mismatches = {}
    for metric_id in LOGGED_METRICS:
        result = ctx.results.get(metric_id)
        if result is None or result.logged is None:
            continue
        logged = dict(zip(result.logged.steps, result.logged.values, strict=True))
        pairs = [
            (v, logged[s])
            for s, v in zip(result.steps, result.values, strict=True)
            if v is not None and logged.get(s) is not None
        ]
        if len(pairs) < p["min_steps"]:
            continue
        ours, theirs = np.array(pairs, dtype=np.float64).T
        tolerance = p["abs_tol"] + p["rel_tol"] * np.maximum(np.abs(ours), np.abs(theirs))
        share = float(np.mean(np.abs(ours - theirs) > tolerance))
        if share >= p["min_share"]:
            mismatches[metric_id] = {
                "logged_column": result.logged.column,
                "recomputed_median": float(np.median(ours)),
                "logged_median": float(np.median(theirs)),
                "share_of_steps": share,
                "steps_compared": len(pairs),
            }
    if mismatches:
        parts = [
            f"{m} ({e['logged_column']} logged {e['logged_median']:.4g} vs "
            f"{e['recomputed_median']:.4g} recomputed, {pct(e['share_of_steps'])} of "
            f"{e['steps_compared']} steps)"
            for m, e in mismatches.items()
        ]
        steps = [s for m in mismatches for s in ctx.results[m].steps]
        yield ctx.finding(
            "Logged and recomputed values disagree: " + "; ".join(parts) + ".",
            mismatches=mismatches,
            metrics=list(mismatches),
            steps=[min(steps), max(steps)],
        )
