"""L1 findings: KL stalled or running away, gradient spikes, low entropy fighting the clip."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import polars as pl

from rlscope.metrics.signal import ACC_SQ, REWARD_EXTREMES
from rlscope.metrics.stability import VALUE_LOSS_COLUMNS
from rlscope.rules.base import (
    DRIVER_RATIO,
    DRIVERS,
    LEVEL_Z,
    MIN_TREND_STEPS,
    RESPONSES,
    SETTINGS,
    SHIFT_BEFORE,
    UPDATE_NAMES,
    Change,
    Fall,
    RuleContext,
    Series,
    Windows,
    changed_at,
    compare_windows,
    final_level,
    final_mean,
    final_se,
    final_steps,
    fold,
    halfway_step,
    level_severity,
    level_shifts,
    pass_at_1_frame,
    pass_at_1_trend,
    pct,
    sequential_fall,
    setting_jumps,
    step_noise,
    t_quantile,
)
from rlscope.spec import Declarations, Explained, Finding, Param, Severity
from rlscope.windows import MIN_STEPS, window_size

#: This layer's findings, in order (collected by rlscope.catalog).
DECLARED = Declarations()


#: A KL that ran away before the task outcome fell explains the fall.
DRIFT_EXPLAINS_COLLAPSE = Explained(
    "a policy driven far from its reference loses what the reference could do: the drift "
    "came first, the task outcome fell after it"
)


@DECLARED.rule(
    "kl-stalled",
    brief="KL surely ~0 at the end (final window + 2 SE < 1e-3) and pass@1 not improving",
    layer="L1",
    title="KL to the reference stays ~0 and the policy is not improving",
    doc="The policy has barely moved from the reference model (final-window token-mean KL "
    "below `kl_max`) and pass@1 (or mean reward) has not risen significantly between the first "
    "and last fifth of the run (z-score below `z`). Small KL alone is fine when the policy "
    "improves; small KL with no improvement means the updates do nothing: learning rate too "
    "low, advantages ~0 (dead prompts), a KL penalty or clip that is too tight, or a "
    "frozen/detached policy (seed §2: KL too low = nothing new learned). A KL that is exactly 0 "
    "at every step was not measured (verl >= 0.7 logs actor/kl_loss = 0.0 with the KL loss "
    "off): the rule stays silent rather than read it as evidence. The improvement test uses "
    "the windows' step-to-step scatter, so it holds at any batch size and run length. The KL "
    "must be surely ~0, not merely small: its final window plus two standard errors is below "
    "`kl_max`, so a KL of a few thousandths moving in its own noise is not read as ~0. And it "
    "is judged from `min_steps` steps: every run's KL starts at 0 and grows with the square of "
    "the distance the weights have moved (more slowly under a learning-rate warm-up), so the "
    "first steps of any healthy run look stalled.",
    remedy="check the effective learning rate and that gradients reach the policy; check "
    "signal.zero_std_frac; lower the KL coefficient (β) or raise the clip range.",
    metrics=("stability.kl", "signal.pass_at_1"),
    params={
        "kl_max": Param(1e-3, "final-window KL (nats/token) surely below which KL counts as ~0"),
        "z": Param(2.0, "a pass@1 rise with z-score above this counts as improvement"),
        "min_steps": Param(20, "fewest steps to judge (the KL of every run's first steps is ~0)"),
    },
)
def kl_stalled(ctx: RuleContext) -> Iterator[Finding]:
    kl = ctx.series("stability.kl")
    accuracy = ctx.series("signal.pass_at_1")
    progress = accuracy or ctx.series("signal.reward")
    p = ctx.params
    if kl is None or progress is None or min(len(kl), len(progress)) < p["min_steps"]:
        return
    if not np.any(kl.values != 0):
        return  # exactly 0 at every step: a disabled KL loss logging 0.0, not a measured KL
    level = final_mean(kl)
    trend = (pass_at_1_trend(ctx) if accuracy is not None else None) or compare_windows(progress)
    stalled = level + 2 * final_se(kl) < p["kl_max"]
    if stalled and trend.z < p["z"]:
        yield ctx.finding(
            f"KL to the reference is {level:.2g} nats/token at the end and pass@1 moved "
            f"{trend.delta:+.3f} (z = {trend.z:.1f}): the policy is not learning.",
            final_kl=level,
            pass_at_1_first=trend.first,
            pass_at_1_last=trend.last,
            steps=[trend.first_steps[0], trend.last_steps[1]],
        )


@DECLARED.rule(
    "kl-runaway",
    brief="KL convex: last third ≥ 2.5× the middle third and accelerating (critical from 0.5 "
    "nats/token)",
    layer="L1",
    title="KL to the reference is accelerating",
    doc="KL grows faster and faster: splitting the run into thirds, the last third's mean KL is "
    "at least `growth_ratio` times the middle third's and its increase at least `accel_ratio` "
    "times the previous increase (a convex, exponential-like curve; linear and saturating "
    "growth stay silent). The policy is drifting away from the base model, which usually ends "
    "in lost general ability, reward hacking or divergence (seed §2: the KL's absolute value "
    "has no standard, the *shape* of its curve tells). Ratios of the run's own thirds, so they "
    "hold at any run length and KL scale. A ratio of thirds of a KL that sits in its noise is "
    "not a shape: the last third's rise must also be `z` standard errors above the middle "
    "third's (each third's standard error from its step-to-step scatter, never below the "
    "series' own, see compare_windows), and the last third must reach `min_level`: below "
    "0.01 nats/token the policy gives its own tokens on average within 1% of the reference's "
    "log-probability, a drift whose curve shape says nothing yet (k1 estimates of such a KL "
    "even go negative). The shape says where the KL is going, its level how far it has gone: "
    "critical only once the last third reaches `critical_level` (0.5 nats/token: the "
    "reference gives the policy's own tokens ~40% less probability, token after token, "
    "kl-high's reason), a warning below it. A KL whose rise starts late, as PPO's does while "
    "its critic warms up, is convex at first and saturates later (measured on a genuine CPU "
    "PPO loop: 0 for 20 steps, then 0.26 nats/token by step 50, flat after). So the shape "
    "alone is a warning only while the task outcome is not improving (pass@1, else the mean "
    "reward, first vs last fifth, z ≥ `progress_z`): a KL that accelerates while the policy "
    "gets better is learning's drift (as kl-stalled reads a KL of ~0 by the same progress), "
    "an `info` to watch; one that accelerates with nothing to show for it is drift, or a "
    "reward the policy games. The genuine PPO loop's healthy runs (3 seeds) accelerate at "
    "many prefixes while their score rises 0.5 → 0.88. Likewise while the learning rate "
    "warms up by its schedule (its last third ×1.5 its first, no jump outside the schedule): "
    "each step is larger than the last, so the drift accelerates by design (a genuine TRL run "
    "with 10 warm-up steps: KL 0.01 → 0.6 over steps 10–17, then back to 0.07). The last "
    "third's level must be surely past `min_level` (its mean less two standard errors): a k1 "
    "KL of 0.02 that scatters by as much, negative at some steps, has no shape yet. Judged "
    "from `min_steps` steps: the policy starts as its reference, so a run's first steps grow "
    "the KL from 0 and thirds of that growth are convex by construction (a genuine PPO loop: "
    "0.007 → 0.007 → "
    "0.02 nats/token over steps 1–15, then flat). Only the level can say the run is already "
    "broken: critical from `critical_level`, improving or not.",
    remedy="raise the KL coefficient (β) or add a KL loss; lower the learning rate; check the "
    "reward for hacking (inspect the highest-reward rollouts of the last steps).",
    explains={"performance-regression": DRIFT_EXPLAINS_COLLAPSE},
    metrics=("stability.kl",),
    context=("signal.pass_at_1", "signal.reward"),
    params={
        "growth_ratio": Param(2.5, "last-third mean KL / middle-third mean KL"),
        "accel_ratio": Param(2.5, "last-third increase / middle-third increase"),
        "min_level": Param(0.01, "last-third mean KL (nats/token) below which no shape counts"),
        "critical_level": Param(0.5, "last-third mean KL (nats/token) for a critical finding"),
        "z": Param(3.0, "z-score of the last third's rise over the middle third's"),
        "progress_z": Param(2.0, "a task-outcome rise with this z-score is progress (info)"),
        "min_steps": Param(
            20, "fewest steps to judge the shape (a run's first steps grow the KL from 0)"
        ),
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
    if k2 <= 0 or k3 < p["min_level"]:
        return
    rise_mid, rise_last = k2 - k1, k3 - k2
    accelerating = rise_last >= p["accel_ratio"] * max(rise_mid, 0.0)
    noise = step_noise(kl.values) ** 2
    ses = [math.sqrt(max(float(np.var(t, ddof=1)), noise) / len(t)) for t in thirds]
    beyond_noise = rise_last > p["z"] * math.hypot(ses[1], ses[2])
    # the last third's level must be surely past min_level, not merely its mean: a k1 KL of
    # 0.02 whose steps scatter by as much (and go negative) has no shape yet
    sure_level = k3 - 2 * ses[2] >= p["min_level"]
    if k3 >= p["growth_ratio"] * k2 and accelerating and beyond_noise and sure_level:
        accuracy = ctx.series("signal.pass_at_1")
        progress = accuracy or ctx.series("signal.reward")
        trend = (pass_at_1_trend(ctx) if accuracy is not None else None) or (
            compare_windows(progress) if progress is not None and len(progress) >= 3 else None
        )
        improving = trend is not None and trend.rising(p["progress_z"])
        severity: Severity = "critical" if k3 >= p["critical_level"] else "warn"
        message = (
            f"KL is accelerating: mean {k1:.3g} → {k2:.3g} → {k3:.3g} nats/token over the three "
            f"thirds of the run (×{k3 / k2:.1f} in the last third)"
        )
        warming = _lr_warming_up(ctx, kl)
        if improving and severity == "warn":
            assert trend is not None
            severity = "info"
            message += (
                f", while {'pass@1' if accuracy is not None else 'the mean reward'} rose "
                f"{trend.first:.3g} → {trend.last:.3g} (z = {trend.z:.1f}): a drift that buys "
                "progress, to watch"
            )
        elif warming is not None and severity == "warn":
            severity = "info"
            message += (
                f", while the learning rate warmed up ×{warming:.2g} by its schedule: the "
                "drift accelerates because the steps grow, to watch"
            )
        yield ctx.finding(
            message + ".",
            severity=severity,
            warming_up=warming is not None,
            thirds=[k1, k2, k3],
            improving=improving,
            steps=[int(kl.steps[0]), int(kl.steps[-1])],
        )


#: A learning rate whose last third of a window is this many times its first is warming up.
WARMUP_RATIO = 1.5


def _lr_warming_up(ctx: RuleContext, over: Series) -> float | None:
    """The factor by which the logged learning rate rose from the first to the last third of
    `over`'s steps by its schedule (no jump outside it: rules.base.setting_jumps), when at
    least WARMUP_RATIO; else None."""
    lr = ctx.series("stability.lr")
    if lr is None or setting_jumps(lr, "stability.lr"):
        return None
    thirds = np.array_split(over.steps, 3)
    means = [lr.values[(lr.steps >= t[0]) & (lr.steps <= t[-1])] for t in (thirds[0], thirds[2])]
    if not all(len(m) for m in means) or means[0].mean() <= 0:
        return None
    factor = float(means[1].mean() / means[0].mean())
    return factor if factor >= WARMUP_RATIO else None


@DECLARED.rule(
    "kl-high",
    brief="final-window KL ≥ 0.5 nats/token (critical ≥ 1.0)",
    layer="L1",
    title="KL to the reference is very high",
    doc="Final-window token-mean KL to the reference at least `warn_at` nats per token "
    "(critical at `critical_at`). The seed (§2): too high means the policy has drifted far "
    "from the pretrained model and may lose its base abilities; the KL's shape matters more "
    "than its level, but the level has a floor of meaning: a per-token KL of 0.5 nats means "
    "the reference gives the policy's own tokens on average ~40% less probability, token after "
    "token — a different model. LLM RL with a KL penalty or loss typically stays at 1e-3 to "
    "1e-1 nats/token (TRL logs k3 as `kl`, verl low_var_kl). A token-mean over thousands of "
    "tokens a step has negligible sampling error; the window mean absorbs single spikes.",
    remedy="lower the learning rate; raise the KL coefficient (β) or switch the KL loss on; "
    "check the reference model is the policy's own starting checkpoint.",
    explains={"performance-regression": DRIFT_EXPLAINS_COLLAPSE},
    metrics=("stability.kl",),
    params={
        "warn_at": Param(0.5, "final-window KL (nats/token) for a warning"),
        "critical_at": Param(1.0, "final-window KL (nats/token) for a critical finding"),
        "min_steps": Param(3, "fewest steps to judge"),
    },
)
def kl_high(ctx: RuleContext) -> Iterator[Finding]:
    found = final_level(ctx, "stability.kl")
    if found is not None:
        yield ctx.finding(
            f"KL to the reference is {found.level:.3g} nats/token over the last steps: the "
            "policy has drifted far from its starting model.",
            severity=found.severity,
            final_kl=found.level,
            steps=found.window,
        )


MISMATCH_EXPLAINS_COLLAPSE = Explained(
    "samples the trainer takes for its own policy's come from another (the sampling engine's): "
    "the uncorrected gradient is biased, and the bias grew before the task outcome fell"
)


def _mismatch_se(ctx: RuleContext, kl: Series, tokens: float) -> float:
    """The final-window mean's standard error: from its step-to-step scatter once there are 3
    steps; before, from the steps' own rollouts (each rollout's tokens one draw, Student-t
    widened for few rollouts: `t_quantile`), else from their tokens (each step's token-level
    error × √T, as if a sequence's T tokens were one draw: they are correlated, and no more
    than that); infinite when none is known (one or two steps of a logged mean)."""
    if len(kl) >= MIN_STEPS:
        return final_se(kl)
    frame = ctx.frame("stability.mismatch_kl")
    if frame is None:
        return math.inf
    judged = frame.filter(pl.col("value").is_not_null()).sort("step")
    for column in ("extra_rollout_se", "extra_token_se"):
        if column not in judged.columns:
            continue
        own = judged[column].to_numpy().astype(np.float64)
        if len(own) != len(kl) or np.isnan(own).any():
            continue
        se = math.sqrt(float(np.sum(own**2))) / len(own)
        if column == "extra_token_se":
            return se * math.sqrt(max(tokens, 1.0))
        # the rollouts' scatter is itself estimated, from few draws when they are few
        dof = int(judged["extra_rollouts"].sum()) - len(own)
        return se * t_quantile(LEVEL_Z, dof) / LEVEL_Z
    return math.inf


@DECLARED.rule(
    "train-inference-mismatch",
    brief="sampler vs trainer log-probs: a sequence's mismatch KL (token k3 × response length) "
    "past 0.35 nats (a sequence-level importance correction keeps < 50% of the batch; "
    "critical < 5%), or rising ×2 beyond its noise",
    layer="L1",
    title="The sampling engine and the trainer disagree on the policy",
    doc="The rollouts are sampled by an inference engine (vLLM, SGLang) and trained on by the "
    "trainer (FSDP, Megatron) with the same weights, but different kernels, precision and "
    "reductions give the sampled tokens different probabilities: the update is off-policy "
    "without saying so. The papers see this gap rise for hundreds of steps before a collapse "
    "(Liu, Li et al. 2025, 'When Speed Kills Stability'; Yao et al. 2025 on truncated "
    "importance sampling). Judged on stability.mismatch_kl (the token-mean k3 estimate of "
    "KL(π_sampler ‖ π_trainer); without it, TRL's logged mean |Δ log p| m, converted as "
    "k ≈ (π/4)·m², the relation for small centred differences). Level: what matters is a "
    "whole sequence's divergence, the per-token KL times the final-window mean response "
    "length T (behavior.response_len; in words when the trainer logged no token counts, an "
    "underestimate): the χ² divergence of sequence probabilities is about e^{2kT} − 1 for a "
    "small per-token divergence, so a sequence-level importance correction keeps an effective "
    "sample share of e^{−2kT} of the batch (Kong's effective sample size 1/(1+χ²)), and the "
    "bias of not correcting is bounded by the total variation, √(kT/2) by Pinsker. A warning "
    "when that share is below `warn_ess` (kT ≥ 0.35), critical below `critical_ess` "
    "(kT ≥ 1.5: the trainer learns from another policy's samples). Per-token KL does not "
    "depend on the vocabulary, and T carries the sequence length, so the bounds hold for any "
    "model and task; the level is judged two standard errors deep, so a small batch does not "
    "fire on noise: the final window's step-to-step scatter from 3 steps on; before, the "
    "error the step's own rollouts give (the scatter of their token sums, each sequence one "
    "draw: its tokens share a prompt and a policy state, so they are correlated; Student-t "
    "widened for few rollouts), so with the tokens a level is judged from the first step "
    "(a logged mean, with no tokens, from the third; tokens without rollout ids, from their "
    "token-level error × √T, as if a sequence's T tokens were one draw). On the scorecard's "
    "perturbed-sampler run (32 rollouts of 12 tokens a step, 0.05 nats/token) that names the "
    "mismatch at its first step, where the × √T bound waited for the second. Growth (from "
    "`min_trend_steps`): "
    "the last fifth's "
    "KL at least `rise_factor` times the first fifth's and `z` standard errors above it "
    "(the series' own step-to-step noise, Student-t widened for short runs), once kT reaches "
    "`min_seq_kl`: a warning, critical when the level is past `warn_ess` too. This is not the "
    "KL to the reference (stability.kl, kl-high): that one is how far training moved the "
    "policy, and it should grow; this one is how far two implementations of the same policy "
    "disagree, and it should stay near 0.",
    remedy="correct it: truncated or masked importance sampling on the sampler/trainer ratio "
    "(verl algorithm.rollout_correction rollout_is / rollout_rs, TRL "
    "vllm_importance_sampling_correction); shrink it: compute the lm-head (logits) in fp32 in "
    "both, use the same attention backend and precision in the sampler and the trainer; make "
    "sure the sampler's weights are synced after every update (a stale sampler is a large gap); "
    "when it rises, lower the learning rate before the run collapses.",
    explains={"performance-regression": MISMATCH_EXPLAINS_COLLAPSE},
    metrics=("stability.mismatch_kl", "stability.mismatch_abs_logp"),
    context=("behavior.response_len",),
    params={
        "warn_ess": Param(0.5, "effective sample share e^(−2kT) below which to warn"),
        "critical_ess": Param(0.05, "effective sample share e^(−2kT) for a critical finding"),
        "rise_factor": Param(2.0, "last-fifth / first-fifth mismatch KL for a rise"),
        "z": Param(3.0, "z-score of the rise against the series' own noise"),
        "min_seq_kl": Param(0.05, "a sequence's mismatch KL (nats) below which no rise counts"),
        "min_trend_steps": Param(MIN_TREND_STEPS, "fewest steps to judge a rise"),
        "min_steps": Param(1, "fewest steps to judge the level"),
    },
    severity="warn",
)
def train_inference_mismatch(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    kl, how = ctx.series("stability.mismatch_kl"), "k3"
    if kl is None:
        abs_logp = ctx.series("stability.mismatch_abs_logp")
        if abs_logp is None:
            return
        kl = Series(abs_logp.steps, math.pi / 4 * abs_logp.values**2)
        how = "≈ (π/4)·mean|Δ log p|²"
    length = ctx.series("behavior.response_len")
    if len(kl) < p["min_steps"] or length is None or len(length) == 0:
        return
    tokens = final_mean(length)
    per_token, se = final_mean(kl), _mismatch_se(ctx, kl, tokens)
    seq_kl = per_token * tokens
    bounds = {
        "warn_at": -math.log(p["warn_ess"]) / 2,
        "critical_at": -math.log(p["critical_ess"]) / 2,
    }
    level = level_severity(seq_kl, bounds, se * tokens)
    w = compare_windows(kl)
    rising = (
        len(kl) >= p["min_trend_steps"]
        and w.rising(p["z"])
        and w.last >= p["rise_factor"] * max(w.first, 0.0)
        and w.last * tokens >= p["min_seq_kl"]
    )
    if level is None and not rising:
        return
    severity: Severity = "critical" if level == "critical" or (rising and level) else "warn"
    ess = math.exp(-2 * seq_kl)
    message = (
        f"The sampler and the trainer disagree: mismatch KL {per_token:.3g} nats/token ({how}) "
        f"over the last steps × {tokens:.0f} tokens = {seq_kl:.3g} nats a sequence, so a "
        f"sequence-level importance correction keeps {pct(ess)} of the batch"
    )
    if rising:
        message += (
            f"; it rose ×{w.last / max(w.first, 1e-12):.1f} from {w.first:.3g} (z = {w.z:.1f})"
        )
    yield ctx.finding(
        message + ".",
        severity=severity,
        per_token=per_token,
        estimator=how,
        tokens=tokens,
        sequence_kl=seq_kl,
        ess=ess,
        rising=rising,
        first=w.first,
        last=w.last,
        z=w.z,
        steps=[w.first_steps[0], w.last_steps[1]],
    )


@DECLARED.rule(
    "grad-spike",
    brief=(
        "grad norm ≥ 4× the median of the steps before it and 6 robust σ above them; a warning "
        "from ×10 (after the trainer's clip); names the step's most extreme rollouts"
    ),
    layer="L1",
    title="Gradient-norm spikes",
    doc="Steps whose gradient norm is a multiplicative outlier against the steps before it: at "
    "least `ratio` times their median and `robust_z` robust standard deviations above it in "
    "log space (median and MAD of the preceding ~10% of the run, at least 9 steps and at "
    "least `min_baseline` of them). Judged against the steps before, never after: a level "
    "shift that follows a spike does not hide it (it is said as such: three or more flagged "
    "steps in a row are a jump that stayed), and a step judged on a prefix of the run is "
    "judged the same on the whole run. In sparse-reward runs a spike usually comes from one "
    "rollout of extreme reward (seed §6); each spike lists the step's rollouts furthest from "
    "the step's mean reward (among each prompt group's highest and lowest, so the furthest is "
    "exact; from signal.reward's components, not a second scan). Severity by what reaches the "
    "optimizer: the logged norm is the one before clipping, so where run.json gives the "
    "trainer's `max_grad_norm` the spike's effective size is min(norm, clip) over the "
    "baseline. Under Adam (β1 = 0.9) one step of a gradient k× its usual size moves the "
    "momentum by about 0.1·(k − 1) of its own size: below ×`warn_ratio` (10) the update "
    "grows by less than it does from step to step, an `info`; from there it about doubles, a "
    "warning. Multiplicative and robust (median/MAD in log space) so it holds at any gradient "
    "scale; the baseline is a share of the run, so at any run length.",
    remedy="inspect the listed rollouts (reward bug, parser edge case, hacked reward); clip "
    "rewards or advantages; lower the learning rate or tighten gradient clipping.",
    metrics=("stability.grad_norm",),
    examples_from=("signal.reward",),
    params={
        "ratio": Param(4.0, "spike = grad norm at least this many times the baseline median"),
        "robust_z": Param(6.0, "and this many robust sigmas above it (log space)"),
        "warn_ratio": Param(10.0, "a warning from this effective ratio (after the clip) on"),
        "min_baseline": Param(5, "fewest preceding steps a step is judged against"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
    marks="points",
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
    median, z = _trailing_baseline(np.log(values), int(p["min_baseline"]))
    ratio = values / median
    flagged = (ratio >= p["ratio"]) & (z >= p["robust_z"])
    if not flagged.any():
        return
    episodes = _runs(np.flatnonzero(flagged))
    spikes = [int(run[0]) for run in episodes]  # where each outlier episode began
    clip = _positive(ctx.meta.get("max_grad_norm"))
    effective = np.minimum(values, clip) / median if clip else ratio
    worst = max(spikes, key=lambda i: ratio[i])
    severity: Severity = "warn" if max(effective[i] for i in spikes) >= p["warn_ratio"] else "info"
    spike_steps = [int(steps[i]) for i in spikes]
    extreme = _extreme_rollouts(ctx, spike_steps[:10])
    message = (
        f"{len(spikes)} gradient-norm spike(s), the largest ×{ratio[worst]:.0f} the median of "
        f"the steps before it at step {int(steps[worst])}"
    )
    if extreme.get(int(steps[worst])):
        message += f"; most extreme rollout there: {extreme[int(steps[worst])][0]['rollout_id']}"
    stayed = [run for run in episodes if len(run) >= 3]
    shift = None
    if stayed:
        run = stayed[0]
        shift = {"step": int(steps[run[0]]), "ratio": float(np.median(ratio[run[1:]]))}
        message += (
            f"; from step {shift['step']} the norm stayed ×{shift['ratio']:.1f} above its "
            "earlier level (a level shift)"
        )
    if clip:
        message += f"; the trainer clips at {clip:g}: ×{effective[worst]:.1f} reached the optimizer"
    yield ctx.finding(
        message + ".",
        severity=severity,
        steps=spike_steps,
        ratios=[float(ratio[i]) for i in spikes],
        grad_norm=[float(values[i]) for i in spikes],
        baseline=[float(median[i]) for i in spikes],
        effective_ratio=float(effective[worst]),
        max_grad_norm=clip,
        level_shift=shift,
        rollouts=extreme,
    )


def _trailing_baseline(logs: np.ndarray, min_baseline: int) -> tuple[np.ndarray, np.ndarray]:
    """Per point, the median of the points before it (as a value, from log space) and the
    point's robust z against them: (log − median) / (1.4826 · MAD) over the preceding
    max(9, ~10% of the series) points; NaN median and z = -inf where fewer than
    `min_baseline` precede it. Depends only on earlier points: the same on any prefix."""
    n = len(logs)
    window = max(9, (n // 10) | 1)
    median = np.full(n, np.nan)
    z = np.full(n, -np.inf)
    for i in range(min_baseline, n):
        before = logs[max(0, i - window) : i]
        centre = float(np.median(before))
        mad = float(np.median(np.abs(before - centre))) * 1.4826
        median[i] = math.exp(centre)
        above = logs[i] - centre
        z[i] = above / mad if mad > 0 else (math.inf if above > 0 else 0.0)
    return median, z


def _runs(indices: np.ndarray) -> list[np.ndarray]:
    """Consecutive indices in runs: [3, 4, 5, 9] -> [[3, 4, 5], [9]]."""
    return np.split(indices, np.flatnonzero(np.diff(indices) > 1) + 1)


def _positive(value: Any) -> float | None:
    """A positive finite number from run.json, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _extreme_rollouts(ctx: RuleContext, steps: list[int]) -> dict[int, list[dict[str, Any]]]:
    """For each step, the train rollouts of extreme reward, furthest from the step's mean first
    (signal.reward's `reward_extremes`, computed in the one scan)."""
    frame = ctx.frame("signal.reward")
    if frame is None or REWARD_EXTREMES not in frame.columns:
        return {}
    rows = frame.filter(pl.col("step").is_in(steps)).sort("step")
    return {
        int(row["step"]): row[REWARD_EXTREMES]
        for row in rows.select("step", REWARD_EXTREMES).to_dicts()
        if row[REWARD_EXTREMES]
    }


#: entropy-clip-conflict's thresholds (also the defaults of rules that reuse its judgement).
CONFLICT_PARAMS = {
    "entropy_max": Param(0.3, "final-window entropy (nats/token) at or below this is low"),
    "entropy_ratio": Param(0.35, "or final / initial entropy at or below this"),
    "clip_frac_min": Param(0.1, "final-window clip fraction at or above this is high"),
    "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
}


@DECLARED.rule(
    "entropy-clip-conflict",
    brief=(
        "entropy low (≤ 0.3 nats, or ≤ 35% of its start) while ≥ 10% of tokens are clipped: "
        "judged on levels"
    ),
    layer="L1",
    title="Low entropy with a high clip fraction",
    doc="In the final window token entropy is low — at most `entropy_max` nats, or at most "
    "`entropy_ratio` of its initial level — while the PPO clip fraction is at least "
    "`clip_frac_min`. The seed's table (§2): 'entropy low but clip fraction high is classic "
    "instability: the policy has converged to a narrow mode while updates keep pulling it "
    "away, two forces fighting'. It is a state, so it is judged on levels, not on how far "
    "entropy fell: a run that starts low and clips heavily from the start is in it too. Healthy "
    "LLM RL clips well under 2% of tokens (ε = 0.2); a tenth of all tokens at the trust-region "
    "edge means each update overshoots. The clip fraction is a share over the window's tokens "
    "(thousands per step), so its sampling error is negligible at any batch size. A fully "
    "on-policy run (one update per batch) has clip fraction 0 and never triggers this.",
    remedy="lower the learning rate or the number of PPO epochs / mini-batches per batch; "
    "protect high-entropy tokens (Clip-Cov / KL-Cov, clip-higher); add an entropy bonus.",
    metrics=("behavior.entropy", "stability.clip_frac"),
    requires=("behavior.entropy", "stability.clip_frac"),
    params=CONFLICT_PARAMS,
    severity="critical",
)
def entropy_clip_conflict(ctx: RuleContext) -> Iterator[Finding]:
    state = _low_entropy_high_clip(ctx)
    if state is not None:
        start, end, clip_end, last_step = state
        yield ctx.finding(
            f"Entropy is {end:.3g} nats at the end ({pct(end / start)} of its start) while "
            f"{pct(clip_end)} of tokens are clipped: updates are fighting a collapsed policy.",
            entropy_start=start,
            entropy_end=end,
            clip_frac_end=clip_end,
            steps=[last_step],
        )


def _low_entropy_high_clip(ctx: RuleContext) -> tuple[float, float, float, int] | None:
    """(initial entropy, final entropy, final clip fraction, last step) when entropy is low and
    the clip fraction high by entropy-clip-conflict's thresholds (its defaults when the calling
    rule has none), else None."""
    entropy, clip = ctx.series("behavior.entropy"), ctx.series("stability.clip_frac")
    defaults = {k: v.default for k, v in CONFLICT_PARAMS.items()}
    p = {**defaults, **{k: v for k, v in ctx.params.items() if k in defaults}}
    if entropy is None or clip is None or min(len(entropy), len(clip)) < p["min_steps"]:
        return None
    start = float(np.mean(entropy.values[: window_size(len(entropy), 0.05, 1)]))
    end, clip_end = final_mean(entropy), final_mean(clip)
    if start <= 0 or not math.isfinite(start):
        return None
    low = end <= p["entropy_max"] or end / start <= p["entropy_ratio"]
    if low and clip_end >= p["clip_frac_min"]:
        return start, end, clip_end, int(entropy.steps[-1])
    return None


@DECLARED.rule(
    "clip-too-high",
    brief="final-window clip fraction ≥ 15% (critical ≥ 30%), unless entropy-clip-conflict says it",
    layer="L1",
    title="Clip fraction too high: updates too aggressive",
    doc="Final-window PPO clip fraction at least `warn_at` (critical at `critical_at`). The "
    "seed's clip-fraction table (§2): too high = updates too aggressive, cut off en masse. With "
    "ε = 0.2 a token is clipped only when one update moved its probability ratio past 1 ± ε "
    "in the advantage's direction; healthy LLM RL clips well under 2% of tokens (verl "
    "pg_clipfrac, TRL clip_ratio/region_mean), so a sixth of all tokens means the policy moves "
    "far within one batch (learning rate, too many mini-batches or epochs per batch, stale "
    "rollouts in async training) and most of the batch's gradient is discarded. A share over "
    "thousands of tokens a step has negligible sampling error at any batch size, so it is "
    "judged from the first step. When entropy "
    "is also low, entropy-clip-conflict (critical) says it and this stays silent.",
    remedy="lower the learning rate; fewer PPO epochs or mini-batches per batch; check for "
    "stale (off-policy) rollouts; check that old_logprob is the behaviour policy's.",
    metrics=("stability.clip_frac",),
    params={
        "warn_at": Param(0.15, "final-window clip fraction for a warning"),
        "critical_at": Param(0.3, "final-window clip fraction for a critical finding"),
        "min_steps": Param(1, "fewest steps to judge"),
    },
)
def clip_too_high(ctx: RuleContext) -> Iterator[Finding]:
    found = final_level(ctx, "stability.clip_frac")
    if found is None or _low_entropy_high_clip(ctx) is not None:
        return
    yield ctx.finding(
        f"{pct(found.level)} of tokens are clipped over the last steps: each update moves the "
        "policy far past the trust region.",
        severity=found.severity,
        clip_frac_end=found.level,
        steps=found.window,
    )


@DECLARED.rule(
    "clip-too-low",
    brief=(
        "clip fraction < 1e-4 in a run with off-policy updates (PPO KL ≠ 0 or some clipping) and "
        "no significant progress; silent on on-policy runs (clip ≡ 0 by construction)"
    ),
    layer="L1",
    title="Clip fraction ~0 in an off-policy run that is not learning",
    doc="The run updates off-policy (the policy that is updated differs from the one that "
    "sampled: mean |PPO KL| above `ppo_kl_min`, or some step clipped tokens), yet its "
    "final-window clip fraction is below `clip_max` and neither pass@1 nor the reward rose "
    "significantly (z < `z`) between the first and last fifth. The seed's clip-fraction table "
    "(§2): too low = updates too small, learning slow. Mechanism: with several updates per batch "
    "a working optimiser moves some ratios past 1 ± ε; none moving, with no progress, means the "
    "steps are too small (learning rate, gradient clipping, advantages ~0). A single on-policy "
    "update per batch (TRL's default num_iterations = 1, verl with one mini-batch and one epoch) "
    "has ratio ≡ 1 and clip fraction exactly 0 by construction: the rule needs positive evidence "
    "of off-policy updates and stays silent without it. Progress is judged with the windows' "
    "step-to-step scatter, so it holds at any batch size.",
    remedy="raise the learning rate (check warm-up and the schedule); check gradient clipping "
    "and that advantages are not ~0 (signal.zero_std_frac); check that gradients reach the "
    "policy.",
    metrics=("stability.clip_frac", "stability.ppo_kl", "signal.pass_at_1", "signal.reward"),
    params={
        "clip_max": Param(1e-4, "final-window clip fraction below this is ~0"),
        "ppo_kl_min": Param(1e-6, "mean |PPO KL| above this shows off-policy updates"),
        "z": Param(2.0, "a rise with z-score above this is progress"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
)
def clip_too_low(ctx: RuleContext) -> Iterator[Finding]:
    clip = ctx.series("stability.clip_frac")
    p = ctx.params
    if clip is None or len(clip) < p["min_steps"]:
        return
    ppo_kl = ctx.series("stability.ppo_kl")
    drift = float(np.mean(np.abs(ppo_kl.values))) if ppo_kl is not None and len(ppo_kl) else 0.0
    off_policy = drift > p["ppo_kl_min"] or bool(np.any(clip.values > 0))
    level = final_mean(clip)
    if not off_policy or level >= p["clip_max"]:
        return
    progress = ctx.series("signal.pass_at_1") or ctx.series("signal.reward")
    if progress is None or len(progress) < p["min_steps"]:
        return
    trend = compare_windows(progress)
    if trend.rising(p["z"]):
        return
    yield ctx.finding(
        f"Only {level:.2g} of tokens are clipped over the last steps although the updates are "
        f"off-policy (mean |PPO KL| {drift:.2g}), and progress moved {trend.delta:+.3g} "
        f"(z = {trend.z:.1f}): the updates are too small to learn.",
        clip_frac_end=level,
        ppo_kl_mean_abs=drift,
        progress=[trend.first, trend.last],
        steps=[trend.first_steps[0], trend.last_steps[1]],
    )


@DECLARED.rule(
    "lr-zero",
    brief="learning rate 0 over the whole final window (critical when 0 at every step)",
    layer="L1",
    title="The learning rate is zero: the optimizer does not move the weights",
    doc="The logged learning rate (stability.lr) is exactly 0 at every step of the final "
    "window (the last tenth of the steps, at least 3), or critical, at every step of the run. "
    "An optimizer step changes the weights by the learning rate times the normalised gradient, "
    "so those steps cost a full rollout and backward pass and learn nothing: a warmup longer "
    "than the run, a decay that reaches 0 before the last step, or lr = 0 in the config. The "
    "rate is logged, not estimated, so there is no sampling error; a schedule that decays to 0 "
    "only at its very last step leaves the rest of the window above 0 and stays silent, at any "
    "run length. Judged from the second step: transformers' linear warm-up logs 0 at its first "
    "step and a rate above 0 at the next, so two steps at 0 are sure.",
    remedy="check the scheduler (warmup steps vs total steps, decay end) and the configured "
    "learning rate; check that the logged rate is the policy optimizer's.",
    metrics=("stability.lr",),
    params={
        "min_steps": Param(
            2, "fewest steps to judge (a linear warm-up logs 0 at its first step only)"
        )
    },
)
def lr_zero(ctx: RuleContext) -> Iterator[Finding]:
    lr = ctx.series("stability.lr")
    if lr is None or len(lr) < ctx.params["min_steps"]:
        return
    zero = lr.values == 0.0
    first = final_steps(lr)
    if not zero[lr.steps >= first].all():
        return
    never = bool(zero.all())
    stopped = int(lr.steps[np.flatnonzero(~zero)[-1] + 1]) if not never else int(lr.steps[0])
    yield ctx.finding(
        (
            "The learning rate is 0 at every logged step: the run never updated the weights."
            if never
            else f"The learning rate is 0 from step {stopped} on: the last "
            f"{int((lr.steps >= stopped).sum())} steps trained nothing."
        ),
        severity="critical" if never else None,
        steps=[stopped, int(lr.steps[-1])],
    )


@DECLARED.rule(
    "divergence",
    brief="critical: a NaN or infinite policy loss or grad norm at any step; names the steps",
    layer="L1",
    title="Loss or gradient norm became NaN or infinite",
    doc="At least one step logged a non-finite loss or gradient norm (stability.nonfinite). A "
    "NaN gradient norm means the update itself was NaN, or was skipped by a loss scaler: "
    "either way optimisation broke at that step, and parameters written after a NaN update "
    "are garbage. There is no threshold to calibrate: one such step is one too many, at any "
    "run length or batch size. The finding names the steps.",
    remedy="inspect the rollouts of the first listed step (extreme rewards, empty responses, "
    "log-prob overflow); lower the learning rate; check mixed precision (bf16 logits, loss "
    "scaling) and gradient clipping; resume from the last checkpoint before the step.",
    metrics=("stability.nonfinite",),
    severity="critical",
    marks="points",
)
def divergence(ctx: RuleContext) -> Iterator[Finding]:
    found = _nonfinite_steps(ctx, critic=False)
    if found is None:
        return
    steps, which = found
    shown = ", ".join(map(str, steps[:10])) + (", …" if len(steps) > 10 else "")
    yield ctx.finding(
        f"{len(steps)} step(s) logged a NaN or infinite {' or '.join(which) or 'value'}: "
        f"step {shown}. Optimisation broke there.",
        steps=steps,
        nonfinite_steps=steps,
    )


def _nonfinite_steps(ctx: RuleContext, *, critic: bool) -> tuple[list[int], list[str]] | None:
    """The steps that logged a NaN or ±inf value loss (`critic`) or policy loss or gradient norm
    (not `critic`), and which columns did; None if none did."""
    frame = ctx.frame("stability.nonfinite")
    if frame is None or frame.height == 0:
        return None
    columns = [
        c
        for c in frame.columns
        if c.startswith("extra_") and (c.removeprefix("extra_") in VALUE_LOSS_COLUMNS) == critic
    ]
    if not columns:
        return None
    bad = frame.filter(pl.any_horizontal(pl.col(c).fill_null(0) > 0 for c in columns)).sort("step")
    if bad.height == 0:
        return None
    which = [c.removeprefix("extra_") for c in columns if (bad[c].fill_null(0) > 0).any()]
    return [int(s) for s in bad["step"].to_list()], which


#: What a collapse of the task outcome explains when it began first (rlscope.evaluation files
#: these findings under it): the mechanism of each.
COLLAPSE_EXPLAINS = {
    "dead-prompts": Explained(
        "a policy that lost its skill answers every rollout of a prompt wrong: all-wrong groups "
        "with zero σ follow the collapse, the prompts did not get harder",
        {"side": "too hard"},
    ),
    "truncation": Explained(
        "collapsed policies degenerate (a token or phrase repeated) and run into the length cap"
    ),
    "format-violations": Explained(
        "the output that replaced the skill no longer follows the format"
    ),
    "repetition": Explained("degenerate output after a collapse repeats itself"),
    "kl-high": Explained(
        "the degenerate output that replaced the skill is improbable under the reference "
        "model: the KL is high because the policy broke"
    ),
    "diversity-collapse": Explained(
        "a collapsed policy gives the same degenerate answer to every sample of a prompt"
    ),
    "auxiliary-reward-dominates": Explained(
        "when every rollout fails the task, only the other reward terms still vary within "
        "a group and carry the advantage"
    ),
}


@DECLARED.rule(
    "performance-regression",
    brief=(
        "critical: pass@1 falls below the run's own level, sure by a sequential test (a "
        "healthy run raises it with probability < alpha = 1%), or pass@1 (else reward) falls "
        "≥ 0.03, z ≤ −3, first to last tenth; names the step it began and what changed there"
    ),
    layer="L1",
    title="The policy got worse at its task",
    doc="Two tests, the first that holds. (1) Step by step, a sequential test of pass@1 "
    "against the run's own level so far (rules.base.sequential_fall: the pooled level of the "
    "10 steps before a fall begins, each step's error from its prompt groups' spread, the "
    "reference's own error included): a fall is sure when the log-likelihood ratio of a level "
    "0.05, 0.15 or 0.3 lower crosses a threshold from the fall's start's share of `alpha`. "
    "The shares sum to `alpha` over every start, shift and prefix, so a healthy run of any "
    "length raises it with probability at most `alpha` (1%) under the sampling model (a level "
    "that does not fall; a run whose accuracy rises is further from a false alarm); half of "
    "`alpha` goes to the 11 steps from each jump of a learning rate outside its schedule "
    "(update-change), so a fall right after one is sure sooner. A policy broken by its first "
    "update is sure at step 2 (one step of 8 prompts measures its level), a collapse after a "
    "jump within 1–3 steps of its start; a steps-only log (TensorBoard, MLflow) counts its "
    "responses as units and is never judged on less than its own step-to-step noise. The fall "
    "is reported while it lasts. (2) pass@1 (or, without correctness, the mean reward) fell "
    "to the last tenth of the run by "
    "at least `min_fall` (pass@1, absolute) and significantly (z <= -`z`), from the first "
    "tenth or from the run's start: its first step, the rollouts of the policy before RL "
    "changed it. The start is judged too because a policy that breaks in its first updates (a"
    " learning rate far too high) has already collapsed inside the first tenth, and a "
    "first-vs-last comparison sees nothing. pass@1 is judged on its evidence, not its number "
    "of steps: each window pools its prompt groups, its standard error the spread of the "
    "groups' accuracies over their number (prompts are the sampling unit, their difficulty "
    "included), so the first step alone weighs what its groups measured, six points of 256 "
    "completions each (a TRL run that generates once every few optimizer steps) are judged, "
    "and a long series of 4-prompt steps is not over-trusted. The mean reward, with no "
    "per-step sampling error, is judged on the step-to-step scatter of at least `min_steps` "
    "steps (never less than the series' own), its start being the first 3 steps, since one "
    "value has no spread of its own. The finding names the step the fall began (the first "
    "whose median of 3 is past half-way from the baseline to the last tenth: a collapse's "
    "step) and what changed at that step: the learning rate, a KL jump or a gradient-norm "
    "jump of ×2 or more (rules.base.DRIVERS). RL on a reward should not make the policy worse"
    " at that reward: a sustained fall means the updates are destructive (learning rate too "
    "high, KL too loose, a reward or advantage bug) — the seed's L1 question 'is the "
    "optimisation working' answered no. What follows from a collapse (all-wrong groups, "
    "degenerate output at the length cap, broken format) is filed under it.",
    remedy="lower the learning rate and resume from the last good checkpoint (before the step "
    "the fall began); raise the KL coefficient; check the reward function and the advantage "
    "sign on a few rollouts.",
    metrics=("signal.pass_at_1", "signal.reward"),
    params={
        "min_fall": Param(0.03, "pass@1 fall (absolute) that counts"),
        "z": Param(3.0, "z-score of the fall"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
        "alpha": Param(
            0.01, "sequential test: most probability of a false alarm over a whole healthy run"
        ),
    },
    severity="critical",
    context=tuple(DRIVERS),
    explains=COLLAPSE_EXPLAINS,
)
def performance_regression(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    fall = _sequential_fall(ctx)
    if fall is not None:
        yield _sequential_finding(ctx, fall)
        return
    accuracy = ctx.series("signal.pass_at_1")
    measure = accuracy or ctx.series("signal.reward")
    name = "pass@1" if accuracy is not None else "mean reward"
    if measure is None:
        return
    if accuracy is not None:
        trends = [
            pass_at_1_trend(ctx, 0.1, p["min_steps"], first, fall=True) for first in (None, 1)
        ]
    elif len(measure) >= p["min_steps"]:
        # One value has no spread of its own: the start is its first MIN_STEPS steps.
        trends = [compare_windows(measure, 0.1, first) for first in (None, MIN_STEPS)]
    else:
        return
    falls = [
        t
        for t in trends
        if t is not None and (t.delta <= -p["min_fall"] or name != "pass@1") and t.falling(p["z"])
    ]
    if not falls:
        return
    trend = min(falls, key=lambda t: t.z)
    began = halfway_step(measure, trend.first, trend.last)
    changes = changed_at(ctx, began)
    start = trend is trends[1]
    span = trend.first_steps
    where = (
        f"from {trend.first:.3g} "
        + (f"at step {span[0]}" if span[0] == span[1] else f"over steps {span[0]}–{span[1]}")
        + (", the run's start," if start else "")
    )
    yield ctx.finding(
        f"{name} {'collapsed' if start else 'fell'} {where} to {trend.last:.3g} over steps "
        f"{trend.last_steps[0]}–{trend.last_steps[1]} (z = {trend.z:.1f}); it fell past half-way "
        f"at step {began}" + _what_changed(changes),
        first=trend.first,
        last=trend.last,
        measure=name,
        baseline="start" if start else "first tenth",
        began=began,
        changed={m: list(v) for m, v in changes.items()},
        steps=[trend.first_steps[0], trend.last_steps[1]],
    )


#: The falls of pass@1 (absolute) the sequential test is tuned to: a fall of any size is
#: detected by one of them about as soon as by the best single test (at the cost of a
#: threshold log(3) higher).
FALL_SHIFTS = (0.05, 0.15, 0.3)


def _sequential_fall(ctx: RuleContext) -> Fall | None:
    """pass@1's fall below the run's own level, sure by the sequential test (rules.base
    .sequential_fall) at the rule's `alpha`, where its frame carries the prompt groups."""
    frame = pass_at_1_frame(ctx, fall=True)
    if frame is None:
        return None
    primed = sorted(c.step for c in _setting_jumps(ctx))
    fall = sequential_fall(frame, "groups", ACC_SQ, ctx.params["alpha"], FALL_SHIFTS, primed)
    if fall is None or fall.before - fall.after < ctx.params["min_fall"]:
        return None
    return fall


def _sequential_finding(ctx: RuleContext, fall: Fall) -> Finding:
    changes = changed_at(ctx, fall.began)
    ref = fall.reference
    where = f"step {ref[0]}" if ref[0] == ref[1] else f"steps {ref[0]}–{ref[1]}"
    return ctx.finding(
        f"pass@1 fell from {fall.before:.3g} ({where}) to {fall.after:.3g} from step "
        f"{fall.began} on, sure at step {fall.sure} (a sequential test against the run's own "
        f"level: a healthy run raises it with probability under {pct(ctx.params['alpha'])})"
        + _what_changed(changes),
        first=fall.before,
        last=fall.after,
        measure="pass@1",
        baseline="level so far",
        began=fall.began,
        sure=fall.sure,
        changed={m: list(v) for m, v in changes.items()},
        steps=[ref[0], fall.sure],
    )


def _setting_jumps(ctx: RuleContext) -> list[Change]:
    """Every logged setting's jumps outside its schedule (rules.base.setting_jumps)."""
    jumps = []
    for metric_id in SETTINGS:
        series = ctx.series(metric_id)
        if series is not None:
            jumps += setting_jumps(series, metric_id)
    return sorted(jumps, key=lambda c: (c.step, c.metric))


#: A change of what drives the update explains what broke after it.
CHANGE_EXPLAINS = {
    rule: Explained(mechanism)
    for rule, mechanism in (
        ("performance-regression", "the update changed first; the task outcome fell after it"),
        ("kl-high", "a larger step moves the policy further from its reference"),
        ("kl-runaway", "a larger step moves the policy further from its reference"),
        ("grad-spike", "a policy knocked off its course gives larger, rarer gradients"),
        ("divergence", "a step far too large can overflow the loss or its gradient"),
        ("entropy-collapse", "a larger step sharpens the policy faster"),
        ("diversity-collapse", "a larger step sharpens the policy: a prompt's samples converge"),
        ("value-divergence", "a critic stepping far too far loses its fit of the returns"),
        ("critic-not-learning", "a critic stepping far too far loses its fit of the returns"),
    )
}


@DECLARED.rule(
    "update-change",
    brief="a learning rate jumps outside its schedule, or the KL, clip fraction, entropy or "
    "length shift step-wise beyond their noise; names the step and the factor",
    layer="L1",
    title="What drives the update changed at a step",
    doc="A step change in what drives the policy update, named at the step it happened, before "
    "the task outcome shows it. (1) A logged learning rate (stability.lr, or the critic's, "
    "stability.critic_lr) that jumps outside its schedule: to at least ×2 its highest value so "
    "far, by a step at least 3 times the schedule's last steps (rules.base.setting_jumps). A "
    "linear or exponential warm-up moves by steps like its previous ones, a cosine, linear or "
    "step decay goes down and a warm restart returns to a level the run had: none is a change. "
    "The learning rate is logged, not estimated: a jump is sure at the step it is logged. (2) A "
    "sustained step change of a response of the optimisation against its own settled level: "
    "the median of the 3 steps from a step against the median of the 10 before, on a log "
    "scale, at least `z` times the 10 steps' own noise and at least a factor that no genuine "
    "healthy run reaches (rules.base.RESPONSES: a KL rising ×10 to 0.1 nats/token or more, a "
    "clip fraction rising ×3 to 5% or more, the token entropy ×2 and the response length ×1.5 "
    "either way); a falling KL or clip fraction breaks nothing. A KL growing from 0 in a run's "
    "first steps has no settled level (the 10 steps' halves differ by ×2 or more); a DAPO "
    "run's length growth is gradual; a single spike does not move a median of 3. The gradient "
    "norm is quoted, not judged alone: healthy Dr. GRPO runs shift it ×8 for several steps. "
    "What moved with the change (the KL, gradient norm, clip fraction, entropy, length ×2 or "
    "more over its 3 steps) is quoted. Found by the seed's L1 question (is the optimisation "
    "working) asked at each step: a learning rate ×10 from a mistyped resume, a scheduler "
    "restarted at the wrong step, a KL coefficient dropped by a config change. The collapse "
    "it causes (performance-regression, kl-high, ...) is filed under it.",
    remedy="check what changed at that step (the scheduler, a resume from a checkpoint with "
    "another config, the optimizer state); resume from the checkpoint before it with the "
    "intended settings.",
    metrics=(*SETTINGS, *RESPONSES),
    params={"z": Param(5.0, "z-score of a response's shift against its own noise (log scale)")},
    context=("stability.grad_norm",),
    explains=CHANGE_EXPLAINS,
)
def update_change(ctx: RuleContext) -> Iterator[Finding]:
    changes = _setting_jumps(ctx)
    for metric_id, response in RESPONSES.items():
        series = ctx.series(metric_id)
        if series is not None:
            changes += level_shifts(series, metric_id, response, ctx.params["z"])
    if not changes:
        return
    first = min(changes, key=lambda c: (c.step, c.metric not in SETTINGS, c.metric))
    quoted = _moved_with(ctx, first)
    said = "; ".join(f"the {UPDATE_NAMES[c.metric]} {c.before:.2g} → {c.after:.2g}" for c in quoted)
    if first.metric in SETTINGS:
        what = (
            f"The {UPDATE_NAMES[first.metric]} jumped ×{first.factor:.3g} at step {first.step} "
            f"({first.before:.2g} → {first.after:.2g}), outside its schedule"
        )
    else:
        what = (
            f"The {UPDATE_NAMES[first.metric]} shifted ×{first.factor:.2g} at step {first.step} "
            f"({first.before:.2g} → {first.after:.2g}, the median of steps {first.step}–"
            f"{first.until} against the 10 before), beyond its own noise"
        )
    later = [c for c in changes if c is not first and c.metric in SETTINGS]
    yield ctx.finding(
        what
        + (f"; over steps {first.step}–{first.step + 2}: {said}" if said else "")
        + (f"; later: {', '.join(_jump_text(c) for c in later[:3])}" if later else "")
        + ".",
        began=first.step,
        metrics=sorted({c.metric for c in (first, *quoted, *later)}),
        changed={c.metric: [c.before, c.after] for c in (first, *quoted)},
        changes=[[c.metric, c.step, c.before, c.after] for c in changes],
        steps=[first.step, first.until],
    )


def _jump_text(change: Change) -> str:
    return f"{UPDATE_NAMES[change.metric]} ×{change.factor:.3g} at step {change.step}"


def _moved_with(ctx: RuleContext, change: Change) -> list[Change]:
    """What else moved ×DRIVER_RATIO or more over the change's step and the 2 after (medians,
    against the 10 steps before), once those 3 steps are logged."""
    moved = []
    for metric_id in UPDATE_NAMES:
        series = ctx.series(metric_id)
        if metric_id == change.metric or metric_id in SETTINGS or series is None:
            continue
        steps, values = series.steps, series.values
        before = values[(steps < change.step) & (steps >= change.step - SHIFT_BEFORE)]
        after = values[(steps >= change.step) & (steps <= change.step + 2)]
        if not len(before) or len(after) < 3:  # one step after is no level
            continue
        a, b = float(np.median(before)), float(np.median(after))
        if fold(a, b) >= DRIVER_RATIO:
            moved.append(
                Change(metric_id, change.step, a, b, int(steps[steps <= change.step + 2][-1]))
            )
    return moved


def _what_changed(changes: Mapping[str, tuple[float, float]]) -> str:
    said = " and ".join(f"the {DRIVERS[m]} went {a:.2g} → {b:.2g}" for m, (a, b) in changes.items())
    return f", where {said}." if said else "."


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


@DECLARED.rule(
    "logged-metric-mismatch",
    brief=(
        "the trainer's logged value (steps table) and rlscope's recomputation differ by > 10% on "
        "≥ half the steps"
    ),
    layer="L1",
    title="The trainer's logged metric disagrees with rlscope's recomputation",
    doc="For each metric rlscope recomputes from rollouts or tokens and the trainer also logged "
    "(entropy, KL, clip fraction, PPO KL, reward, zero-σ share, truncation, mean length), the two "
    "per-step series are aligned on step; a step disagrees when |recomputed - logged| > "
    "`abs_tol` + `rel_tol`·max(|recomputed|, |logged|). The finding fires when at least "
    "`min_share` of the aligned steps (and at least `min_steps`) disagree. Trainers have shipped "
    "wrong metrics (verl entropy with dynamic batch size before 0.4.1, a clip_ratio on one TRL "
    "version), and micro-batch averaging with equal weights instead of per token shifts them a "
    "little: the tolerance absorbs the latter. Only like is compared with like: a logged "
    "token-based length or clip ratio is never compared with word counts (importers rename "
    "such columns), and a batch-level TRL frac_reward_zero_std (scale_rewards='batch') is not "
    "compared with the group share. A share of steps, so it holds at any run length.",
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
    mismatches: dict[str, dict[str, Any]] = {}
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


def _warming_up(loss: Series, trend: Windows, p: Mapping[str, float]) -> bool:
    """The value loss falls from the first to the last fifth (`trend`, z ≥ `z`, by `min_fall`)
    in the windows' means and medians: a blow-up of a few steps moves a mean, not a median."""
    medians = [
        float(np.median(loss.values[(loss.steps >= a) & (loss.steps <= b)]))
        for a, b in (trend.first_steps, trend.last_steps)
    ]
    return (
        trend.falling(p["z"])
        and trend.last <= (1 - p["min_fall"]) * trend.first
        and medians[1] <= (1 - p["min_fall"]) * medians[0]
    )


@DECLARED.rule(
    "critic-not-learning",
    brief="PPO critic: explained variance surely below 0.05 over the last steps while neither "
    "it rises nor the value loss falls; or a learnt critic's explained variance halving",
    layer="L1",
    title="The critic does not learn: advantages are noise",
    doc="PPO with a learned critic (GAE): the advantages are the returns minus the critic's "
    "values, so a critic that explains nothing of the returns (stability.explained_variance "
    "≤ 0) turns every advantage into the returns' noise and the policy drifts on it for many "
    "steps before the reward shows it (a frozen critic, a critic learning rate of 0 or far too "
    "low, a value head that is not trained). Critical when the final window's explained "
    "variance is surely below `max_ev` (its mean plus two standard errors of its step-to-step "
    "scatter: the sampling error of a variance ratio on a step's tokens shows up as that "
    "scatter, so the bound holds at any batch size) and the critic shows no sign of learning: "
    "its explained variance is not rising (first vs last fifth: by at least `min_rise` and "
    "z ≥ `z`, Student-t widened for short runs; a frozen head's 1e-4 drifting by 1e-5 is "
    "significant against its zero noise but is no learning) and its value loss "
    "(stability.value_loss, when logged) is not falling (by `min_fall` of it, z ≥ `z`, in the "
    "windows' means and in their medians). A critic that is still warming up has a falling "
    "value loss: it is not judged; nor is a converging policy's, whose returns' spread and so "
    "the critic's loss keep shrinking while its explained variance drifts to ~0 (the genuine "
    "healthy PPO loop past step 60). A blow-up is no warm-up: a critic whose learning rate is "
    "far too high can reach a value loss of 52 at its first update and then sit at ~0.04 with "
    "an explained variance within ±0.02 of 0; its few blown-up steps move the first fifth's "
    "mean, not its median, so it is judged once they are under half of that fifth. Judged "
    "from `min_steps` steps: a new value head can explain nothing for ~20 steps with a loss "
    "that does not visibly fall (the genuine PPO loop, seeds 0–3: explained variance first "
    "above 0.1 between steps 10 and 25). A warning "
    "when a critic that had learnt (a first-fifth explained variance of at least `learnt_ev`) "
    "loses half of it, significantly. Calibrated on genuine PPO runs in verl's format "
    "(tests/genuine/ppo-critic): the frozen critic's explained variance is 0.0000 at "
    "every step with a flat value loss; the healthy critic's is 0 for its first ~15 steps "
    "while its value loss falls 0.16 → 0.05, then 0.1–0.6.",
    remedy="check the critic is trained (its learning rate, that its optimizer steps, that the "
    "value head is not frozen); raise the critic learning rate or its warm-up "
    "(verl critic.optim.lr, critic_warmup); check the returns' scale (reward normalisation) "
    "and the value clip (cliprange_value) are not too tight.",
    metrics=("stability.explained_variance",),
    context=("stability.value_loss", "stability.critic_lr"),
    params={
        "max_ev": Param(0.05, "explained variance surely below this: the critic explains nothing"),
        "learnt_ev": Param(0.2, "first-fifth explained variance of a critic that had learnt"),
        "min_rise": Param(0.02, "explained-variance rise (first to last fifth) that is learning"),
        "min_fall": Param(0.1, "share of the value loss lost (first to last fifth): learning"),
        "z": Param(2.0, "significance of a rise, a fall (z-score)"),
        "min_steps": Param(20, "fewest steps to judge (a new value head's warm-up)"),
    },
    severity="critical",
)
def critic_not_learning(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    ev = ctx.series("stability.explained_variance")
    if ev is None or len(ev) < p["min_steps"]:
        return
    level, se = final_mean(ev), final_se(ev)
    trend = compare_windows(ev)
    steps = [int(ev.steps[0]), int(ev.steps[-1])]
    rising = trend.rising(p["z"]) and trend.delta >= p["min_rise"]
    if level + 2 * se < p["max_ev"] and not rising:
        loss = ctx.series("stability.value_loss")
        loss_trend = compare_windows(loss) if loss is not None and len(loss) >= 3 else None
        if loss is not None and loss_trend is not None and _warming_up(loss, loss_trend, p):
            return  # warming up: the value loss still falls
        lr = ctx.series("stability.critic_lr")
        frozen = lr is not None and len(lr) > 0 and not np.any(lr.values > 0)
        yield ctx.finding(
            f"The critic explains {level:.3g} of the returns' variance over the last steps "
            f"(explained variance, ± {se:.2g}), and it is not learning: its explained variance "
            "is not rising"
            + (" and its value loss is not falling" if loss_trend is not None else "")
            + ": the advantages are the returns' noise."
            + (
                " Its learning rate is 0 at every step (logged): it cannot learn." if frozen else ""
            ),
            level=level,
            se=se,
            critic_lr_zero=frozen,
            value_loss=[loss_trend.first, loss_trend.last] if loss_trend is not None else None,
            steps=steps,
        )
    elif trend.first >= p["learnt_ev"] and trend.falling(p["z"]) and trend.last < trend.first / 2:
        yield ctx.finding(
            f"The critic is unlearning: explained variance {trend.first:.3g} → {trend.last:.3g} "
            f"(first to last fifth, z = {trend.z:.1f}).",
            severity="warn",
            level=level,
            se=se,
            first=trend.first,
            last=trend.last,
            steps=steps,
        )


@DECLARED.rule(
    "value-divergence",
    brief="PPO critic: value loss up an order of magnitude or more (first to last fifth, "
    "beyond its noise on a log scale), or NaN/inf at any step",
    layer="L1",
    title="The critic's value loss diverges",
    doc="PPO with a learned critic: the value loss (stability.value_loss) of the last fifth of "
    "the run is at least 10^`orders` times the first fifth's, significantly (z ≥ `z` on the "
    "log10 of the loss, against its own step-to-step noise, Student-t widened for short runs), "
    "or it was logged as NaN or ±inf at some step (stability.nonfinite; at any run length one "
    "such step is one too many: the critic's weights are garbage after it). "
    "The value loss is a squared error in the returns' units, so a ratio of its own windows "
    "holds at any reward scale, batch size and run length, and a log scale makes a spike of a "
    "few steps count as the few steps it is. A critic whose error grows by orders of magnitude "
    "(a learning rate far too high, a return scale that exploded) gives advantages made of its "
    "own noise, and its gradients can take the shared backbone with it. Measured on a genuine "
    "CPU PPO loop whose critic learning rate jumps from 3e-3 to 3 at step 30: the value loss "
    "goes 0.13 → 2e5 and settles near 2 (×10 the first fifth) with an explained variance "
    "of −10 to −30.",
    remedy="lower the critic learning rate (verl critic.optim.lr) or clip its gradient "
    "(critic.grad_clip); tighten the value clip (cliprange_value); normalise the rewards or "
    "returns; check the critic's warm-up schedule.",
    explains={
        "critic-not-learning": Explained(
            "a critic whose error grew by orders of magnitude explains none of the returns: "
            "the divergence came first"
        )
    },
    metrics=("stability.value_loss", "stability.nonfinite"),
    context=("stability.explained_variance",),
    params={
        "orders": Param(1.0, "orders of magnitude the value loss grew, first to last fifth"),
        "z": Param(3.0, "z-score of the rise on a log10 scale"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
    severity="critical",
)
def value_divergence(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    nonfinite = _nonfinite_steps(ctx, critic=True)
    if nonfinite is not None:
        steps, which = nonfinite
        shown = ", ".join(map(str, steps[:10])) + (", …" if len(steps) > 10 else "")
        yield ctx.finding(
            f"The critic's value loss ({', '.join(which)}) was NaN or infinite at "
            f"{len(steps)} step(s): step {shown}.",
            nonfinite_steps=steps,
            steps=[steps[0], steps[-1]],
        )
        return
    loss = ctx.series("stability.value_loss")
    if loss is None or len(loss) < p["min_steps"]:
        return
    positive = loss.values > 0
    if positive.sum() < p["min_steps"]:
        return
    logged = Series(loss.steps[positive], np.log10(loss.values[positive]))
    trend = compare_windows(logged)
    if not (trend.delta >= p["orders"] and trend.rising(p["z"])):
        return
    ev = ctx.series("stability.explained_variance")
    yield ctx.finding(
        f"The critic's value loss grew ×{10**trend.delta:.3g}: {10**trend.first:.3g} over the "
        f"first steps → {10**trend.last:.3g} over the last (z = {trend.z:.1f} on a log scale)"
        + (
            f"; its explained variance ends at {final_mean(ev):.3g}"
            if ev is not None and len(ev)
            else ""
        )
        + ".",
        first=10**trend.first,
        last=10**trend.last,
        z=trend.z,
        steps=[trend.first_steps[0], trend.last_steps[1]],
    )


#: Relative change of β between two steps below which it counts as unchanged (pinned).
BETA_UNCHANGED = 1e-9


@DECLARED.rule(
    "kl-coef-runaway",
    brief="adaptive KL coefficient β still raised over the last 5 steps at ≥ ×4 its starting "
    "value (critical ≥ ×10), or pinned at a clamp after such a rise",
    layer="L1",
    title="The adaptive KL controller cannot pull the KL back",
    doc="An adaptive KL controller (Ziegler et al. 2019; verl core_algos.py "
    "`AdaptiveKLController`, OpenRLHF the same) multiplies β each step by "
    "1 + clip(KL/target − 1, ±0.2)·n/horizon: it raises β exactly when the KL is above its "
    "target, at most by a fixed factor a step. So a β raised over the last `rising_steps` "
    "steps (net, and at most of them: a KL estimate near its target dips below it for a step) "
    "is a KL that stayed above target, and a β that reached "
    "`growth` times its starting value is a penalty that had to be made that many times "
    "stronger than the one the run was configured with (critical at `critical_growth`: more than "
    "an order of magnitude), and still does not hold the target: "
    "the target is below the KL the policy needs for its task, or something else (a learning "
    "rate too high) drives the KL faster than the penalty pulls. Left alone, β grows "
    "geometrically until the penalty outweighs the task reward and the policy is pulled back "
    "to the reference, undoing what it learnt. A β raised to a value and then held exactly "
    "there for `rising_steps` steps is pinned at a clamp (an implementation that bounds β): "
    "the controller has no more room. β is the controller's own state, with no sampling "
    "error; the bounds are ratios of it to its own start, so they hold at any batch size, "
    "horizon and run length (a larger n/horizon gets there in fewer steps, which is the same "
    "controller saying the same thing). A fixed β, or one that fell below its start and came "
    "back (the controller settling), is never judged. Measured on a genuine CPU PPO loop "
    "with verl's controller (n/horizon = 0.32): a target of 1e-6 takes β ×4 by step 47 and "
    "×10 by step 61, after which the task score falls from 0.9 to 0.55; with a target of 0.1 "
    "the controller first lowers β to ×0.14 and is still below its start at step 60.",
    remedy="set the KL target to a KL the task needs (verl algorithm.kl_ctrl.target_kl; look "
    "at the KL where the reward still rose), or use a fixed β (kl_ctrl.type=fixed); lower the "
    "learning rate if the KL rises faster than the controller can follow; check the reference "
    "model is the policy's starting checkpoint.",
    explains={
        "performance-regression": Explained(
            "the KL penalty grew until it outweighed the task reward and pulled the policy back "
            "to the reference: the coefficient ran away first, the task outcome fell after"
        )
    },
    metrics=("stability.kl_coef",),
    context=("stability.kl",),
    params={
        "growth": Param(4.0, "β over its starting value for a warning"),
        "critical_growth": Param(10.0, "β over its starting value for a critical finding"),
        "rising_steps": Param(5, "β raised (or held at its clamp) over the last steps"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
    severity="warn",
)
def kl_coef_runaway(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    beta = ctx.series("stability.kl_coef")
    if beta is None or len(beta) < max(p["min_steps"], p["rising_steps"] + 1):
        return
    values = beta.values
    start, last = float(values[0]), float(values[-1])
    if start <= 0 or last < p["growth"] * start:
        return
    recent = values[-int(p["rising_steps"]) - 1 :]
    tail = np.diff(recent) / recent[:-1]
    pinned = bool(np.all(np.abs(tail) <= BETA_UNCHANGED)) and last >= float(values.max())
    # Still climbing: raised at most of the last steps (a KL estimate near its target can
    # dip below it for a step) and above where it was.
    climbing = last > recent[0] and 2 * int((tail > BETA_UNCHANGED).sum()) > tail.size
    if not (pinned or climbing):
        return
    # The stretch since β last stood at or below its starting value.
    below = np.flatnonzero(values <= start)
    begin = int(below[-1]) if below.size else 0
    span = [int(beta.steps[begin]), int(beta.steps[-1])]
    per_step = (last / float(values[begin])) ** (1 / max(len(values) - 1 - begin, 1))
    kl = ctx.series("stability.kl")
    kl_note = ""
    if kl is not None:
        inside = (kl.steps >= span[0]) & (kl.steps <= span[1])
        if inside.sum() >= 2:
            shown = kl.values[inside]
            kl_note = f"; the KL over that stretch {shown[0]:.3g} → {shown[-1]:.3g} nats/token"
    how = (
        f"then held at {last:.3g} for the last {int(p['rising_steps'])} steps (pinned at its clamp)"
        if pinned
        else f"still raised at most steps (×{per_step:.3g} a step on average since step "
        f"{span[0]}, when it was last at its start)"
    )
    yield ctx.finding(
        f"The KL coefficient β went {start:.3g} → {last:.3g} (×{last / start:.3g} its starting "
        f"value), {how}: the KL stayed above the controller's target{kl_note}.",
        severity="critical" if last >= p["critical_growth"] * start else "warn",
        start=start,
        last=last,
        growth=last / start,
        per_step=per_step,
        pinned=pinned,
        steps=span,
    )


@DECLARED.rule(
    "advantage-explosion",
    brief="a step's largest |advantage| ≥ 2 × √(2 ln 2n) standard deviations (the extreme-value "
    "bound of n tokens); names the steps",
    layer="L1",
    title="A few tokens carry the batch's advantage",
    doc="stability.advantage_extreme: the largest |advantage| of the step in standard "
    "deviations (RMS) of its tokens' advantages. Of n independent standard-normal values the "
    "largest |z| is about √(2 ln 2n), and P(max |z| > c·√(2 ln 2n)) ≤ (2n)^(1 − c²): with "
    "c = `factor` = 2, one chance in (2n)³ a step, so no run length makes a false alarm "
    "likely, and tokens of one sequence sharing an advantage only lower the maximum. "
    "Advantages are not normal, but a value that far out is not a tail: it is one reward "
    "(a reward model's outlier, a parsing bug scoring 100), a critic's value far off on a few "
    "states, or a group whose normaliser is ~0 (std + ε with ε tiny), and the clipped "
    "objective does not bound it: those tokens take the update. For GRPO's group-normalised "
    "advantages, the largest possible in a group of G is (G − 1)/√G (one success among "
    "G − 1 failures), so the bound is never below `factor` times it (run.json group_size). "
    "n is the step's tokens whose advantage is above float noise (1% of the step's RMS "
    "advantage, to the decade: a zero-σ group's (r − μ)/(σ + ε) is rounding, not a signal, and "
    "one such group alone has no spread to measure); where it is not known (verl's logged max "
    "and min) `assumed_tokens`, a generous count that makes the bound larger.",
    remedy="find the step's extreme rollouts (rlscope show) and check their rewards (clip or "
    "normalise the reward model's output, fix the parser), the critic's values there (value "
    "clip, critic warm-up), and the advantage normaliser's ε; clip advantages if the "
    "estimator allows it.",
    metrics=("stability.advantage_extreme",),
    params={
        "factor": Param(2.0, "multiple of the extreme-value bound √(2 ln 2n) that is explosive"),
        "assumed_tokens": Param(1e8, "tokens a step when the count is not known"),
        "min_steps": Param(1, "fewest steps to judge"),
    },
    severity="warn",
    marks="points",
)
def advantage_explosion(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    frame = ctx.frame("stability.advantage_extreme")
    if frame is None or frame.height == 0:
        return
    frame = frame.filter(pl.col("value").is_not_null()).sort("step")
    n = (
        frame["extra_n"].fill_null(p["assumed_tokens"]).to_numpy()
        if "extra_n" in frame.columns
        else np.full(frame.height, p["assumed_tokens"])
    )
    bound = p["factor"] * np.sqrt(2 * np.log(2 * np.maximum(n, 1)))
    group = ctx.meta.get("group_size")
    if isinstance(group, int) and group > 1:
        bound = np.maximum(bound, p["factor"] * (group - 1) / math.sqrt(group))
    ratio = frame["value"].to_numpy()
    beyond = np.flatnonzero(ratio > bound)
    if beyond.size == 0:
        return
    step_of = frame["step"].to_numpy()
    steps = [int(step_of[i]) for i in beyond]
    worst = int(beyond[np.argmax(ratio[beyond] / bound[beyond])])
    shown = ", ".join(map(str, steps[:10])) + (", …" if len(steps) > 10 else "")
    yield ctx.finding(
        f"At {len(steps)} step(s) the largest |advantage| was far beyond what the batch's "
        f"size explains: {ratio[worst]:.3g} standard deviations at step "
        f"{int(step_of[worst])} (bound {bound[worst]:.3g}); step {shown}.",
        worst=float(ratio[worst]),
        bound=float(bound[worst]),
        extreme_steps=steps,
        steps=steps,
    )


@DECLARED.rule(
    "gradient-vanishing",
    brief="gradient norm down ≥ 2 orders of magnitude from its early level (beyond its noise on "
    "a log scale) while rewards still differ and the reward is not rising",
    layer="L1",
    title="The gradient no longer reaches the weights",
    doc="stability.grad_norm_rel: the last fifth's gradient norm is at least 10^`orders` below "
    "the first fifth's, significantly (z ≤ −`z` on log10, against its own step-to-step noise, "
    "Student-t widened for short runs), while the learning signal exists — the groups' "
    "rewards still differ (signal.group_std's final window above `min_sigma`; runs with "
    "groups of one have no σ_G and are judged on the gradient and the reward alone) — and the "
    "reward (pass@1, else the mean reward) is not rising (z < `z`). A gradient norm is the "
    "size of the update before the optimizer scales it: the advantages are there, so a "
    "gradient that shrank a hundredfold means they no longer reach the weights (saturated "
    "softmax or entropy ~0 so log-probabilities no longer move, a loss scaler stuck low, a "
    "detached or frozen module, an advantage normaliser that divides by a huge spread). A "
    "run that converged has no spread left (σ_G ~0: dead-prompts' case, not this one) or a "
    "reward still rising. Ratios of the run's own windows on a log scale hold at any model "
    "size, loss aggregation and batch; healthy runs' norms drift within an order of "
    "magnitude (the shared fixtures: ×0.3 to ×3).",
    remedy="check the entropy (behavior.entropy: a policy near-deterministic has no gradient "
    "left), the loss scaler and mixed precision, that every module that should train has "
    "requires_grad, and the advantages' scale; raise the temperature or add an entropy bonus "
    "if the policy has collapsed.",
    metrics=("stability.grad_norm_rel",),
    context=("signal.group_std", "signal.pass_at_1", "signal.reward"),
    params={
        "orders": Param(2.0, "orders of magnitude the gradient norm fell, first to last fifth"),
        "z": Param(3.0, "z-score of the fall on a log10 scale; of a reward rise that excuses it"),
        "min_sigma": Param(1e-3, "final-window σ_G above which the rewards still differ"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
    severity="warn",
)
def gradient_vanishing(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    rel = ctx.series("stability.grad_norm_rel")
    if rel is None or len(rel) < p["min_steps"]:
        return
    positive = rel.values > 0
    if positive.sum() < p["min_steps"]:
        return
    trend = compare_windows(Series(rel.steps[positive], np.log10(rel.values[positive])))
    if not (trend.delta <= -p["orders"] and trend.falling(p["z"])):
        return
    sigma = ctx.series("signal.group_std")
    sigma_level = final_mean(sigma) if sigma is not None and len(sigma) else None
    if sigma_level is not None and sigma_level <= p["min_sigma"]:
        return  # no signal left: dead prompts, or a converged run
    outcome = ctx.series("signal.pass_at_1") or ctx.series("signal.reward")
    if (
        outcome is not None
        and len(outcome) >= p["min_steps"]
        and compare_windows(outcome).rising(p["z"])
    ):
        return  # still improving: the smaller gradient is convergence
    yield ctx.finding(
        f"The gradient norm fell ×{10**-trend.delta:.3g} below its early level (first to last "
        f"fifth, z = {trend.z:.1f} on a log scale)"
        + (
            f" while the groups' rewards still differ (σ_G {sigma_level:.3g})"
            if sigma_level is not None
            else ""
        )
        + " and the reward is not rising: the learning signal no longer reaches the weights.",
        first=10**trend.first,
        last=10**trend.last,
        group_std=sigma_level,
        steps=[trend.first_steps[0], trend.last_steps[1]],
    )
