"""L3 findings: dead prompts, concentrated reward, mode collapse."""

from __future__ import annotations

from collections.abc import Iterator

import polars as pl

from rlscope.registry import Param, rule
from rlscope.report import Finding
from rlscope.rules.base import (
    MIN_TREND_STEPS,
    RuleContext,
    compare_windows,
    final_mean,
    level_severity,
    pct,
    window_size,
)


@rule(
    "dead-prompts",
    layer="L3",
    title="Most prompt groups carry no learning signal",
    doc="Final-window share of zero-σ groups (all rollouts rewarded the same) at least "
    "`warn_at` (critical at `critical_at`). Those groups get zero advantage under GRPO: their "
    "samples are wasted compute. The message says which side: all-correct groups (too easy: "
    "the curriculum is stale) or all-wrong groups (too hard: the policy is left behind).",
    remedy="too easy: drop solved prompts, harder curriculum, DAPO dynamic sampling; too hard: "
    "easier prompts, SFT warm-up, partial-credit rewards, larger groups.",
    metrics=("signal.zero_std_frac", "signal.all_correct_frac", "signal.all_wrong_frac"),
    params={
        "warn_at": Param(0.5, "final-window zero-σ share for a warning"),
        "critical_at": Param(0.8, "final-window zero-σ share for a critical finding"),
    },
)
def dead_prompts(ctx: RuleContext) -> Iterator[Finding]:
    zero = ctx.series("signal.zero_std_frac")
    if zero is None or len(zero) == 0:
        return
    level = final_mean(zero)
    severity = level_severity(level, ctx.params)
    if severity is None:
        return
    easy, hard = ctx.series("signal.all_correct_frac"), ctx.series("signal.all_wrong_frac")
    easy_level = final_mean(easy) if easy is not None and len(easy) else None
    hard_level = final_mean(hard) if hard is not None and len(hard) else None
    if easy_level is not None and hard_level is not None:
        side = "too easy" if easy_level >= hard_level else "too hard"
        detail = f" ({pct(easy_level)} all correct, {pct(hard_level)} all wrong: {side})"
    else:
        side, detail = "unknown", ""
    yield ctx.finding(
        f"{pct(level)} of prompt groups have zero reward variance and give no gradient{detail}.",
        severity=severity,
        zero_std_frac=level,
        all_correct_frac=easy_level,
        all_wrong_frac=hard_level,
        side=side,
        steps=[int(zero.steps[-1])],
    )


@rule(
    "reward-concentration",
    layer="L3",
    title="A few prompts carry most of the gradient",
    doc="Among the prompt groups that do carry signal (Σ|advantage| > 0), the effective share "
    "(Σw)²/(P_live·Σw²), pooled over the groups of the final fifth of the run, is below "
    "`live_share_max`: the prompt-level "
    "reward distribution is long-tailed and the effective batch is far smaller than the nominal "
    "one. (Groups with no signal at all are dead-prompts' business.)",
    remedy="normalise rewards per prompt (GRPO's std normalisation) or clip reward scale; "
    "rebalance the prompt mix; check reward functions for prompt-dependent scales.",
    metrics=("signal.effective_prompt_frac",),
    params={
        "live_share_max": Param(0.4, "effective share among live groups below this"),
    },
)
def reward_concentration(ctx: RuleContext) -> Iterator[Finding]:
    frame = ctx.frame("signal.effective_prompt_frac")
    if frame is None or frame.height == 0:
        return
    steps = frame["step"].sort()
    first = int(steps[-window_size(len(steps), 0.2)])
    # Pooled over the window's groups: one step of a small batch has too few live groups for
    # the share to fall far (it cannot go below 1 / live groups).
    sums = (
        frame.filter(pl.col("step") >= first)
        .select(pl.col("w_sum", "w_sq", "live_prompts", "prompts").sum(), pl.len().alias("steps"))
        .row(0, named=True)
    )
    if not sums["w_sq"] or not sums["live_prompts"]:
        return
    share = sums["w_sum"] ** 2 / (sums["live_prompts"] * sums["w_sq"])
    nominal = sums["prompts"] / sums["steps"]
    effective = share * sums["live_prompts"] / sums["steps"]
    if share < ctx.params["live_share_max"]:
        yield ctx.finding(
            f"The gradient comes from ≈{effective:.1f} of {nominal:.0f} prompts per step "
            f"(effective share {pct(share)} of the prompts with signal).",
            live_effective_share=share,
            effective_prompts=effective,
            nominal_prompts=nominal,
            steps=[first, int(steps[-1])],
        )


@rule(
    "mode-collapse",
    layer="L3",
    title="pass@1 rises while pass@k does not",
    doc="Between the first and last fifth of the run pass@1 rose by at least `min_rise` "
    "(z >= `z`), while pass@k (k = group size) closed less than `k_ratio` of the share of its "
    "headroom that pass@1 closed — (last - first) / (1 - first) for each, so a pass@k that is "
    "simply near its ceiling does not count as flat — or fell; pass@k must start at most "
    "1 - `headroom`. Probability is concentrating on modes the policy already knew and no new "
    "ones are found: the early sign of mode collapse (Yue et al. 2025), long before reward "
    "turns down.",
    remedy="keep exploration alive: higher temperature, entropy bonus or clip-higher, larger "
    "groups; check pass@k at large k against the base model; diversify prompts.",
    metrics=("signal.pass_at_1", "signal.pass_at_k"),
    params={
        "min_rise": Param(0.03, "pass@1 rise (absolute) that counts"),
        "z": Param(3.0, "z-score of the pass@1 rise"),
        "k_ratio": Param(0.25, "pass@k closing less than this share of pass@1's headroom gain"),
        "headroom": Param(0.05, "pass@k must start at most 1 - headroom"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
)
def mode_collapse(ctx: RuleContext) -> Iterator[Finding]:
    p1, pk = ctx.series("signal.pass_at_1"), ctx.series("signal.pass_at_k")
    p = ctx.params
    if p1 is None or pk is None or min(len(p1), len(pk)) < p["min_steps"]:
        return
    one, k = compare_windows(p1), compare_windows(pk)
    rising = one.delta >= p["min_rise"] and one.z >= p["z"] and one.first < 1
    if not rising or k.first > 1 - p["headroom"]:
        return
    gain_one, gain_k = one.delta / (1 - one.first), k.delta / (1 - k.first)
    if gain_k < p["k_ratio"] * gain_one:
        yield ctx.finding(
            f"pass@1 rose {one.first:.3f} → {one.last:.3f} while pass@k went {k.first:.3f} → "
            f"{k.last:.3f}: the policy sharpens known answers instead of finding new ones.",
            pass_at_1=[one.first, one.last],
            pass_at_k=[k.first, k.last],
            headroom_closed={"pass@1": gain_one, "pass@k": gain_k},
            steps=[one.first_steps[0], one.last_steps[1]],
        )
