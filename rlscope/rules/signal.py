"""L3 findings: dead prompts, concentrated reward, accuracy out of range, mode collapse."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import polars as pl

from rlscope.rules.base import (
    MIN_TREND_STEPS,
    ONE_SIDED_95,
    RuleContext,
    compare_windows,
    final_mean,
    level_severity,
    pct,
    share_se,
)
from rlscope.spec import Declarations, Finding, Param
from rlscope.windows import TREND_FRACTION, window_size

#: This layer's findings, in order (collected by rlscope.catalog).
DECLARED = Declarations()


@DECLARED.rule(
    "dead-prompts",
    brief=(
        "≥ 50% zero-σ groups two standard errors deep (critical when the level is ≥ 80%); too "
        "hard keeps the severity, too easy is `info`, and a warning from 80% on"
    ),
    layer="L3",
    title="Most prompt groups carry no learning signal",
    doc="Final-window share of zero-σ groups (all rollouts rewarded the same) at least "
    "`warn_at` (critical at `critical_at`), judged on the share minus two standard errors (the "
    "larger of the binomial error over the window's groups and the step-to-step scatter), so a "
    "final window of a few dozen groups does not fire on noise. Those groups get zero advantage "
    "under GRPO: their samples are wasted compute (seed §4: σ_G = 0 all correct = too easy, all "
    "wrong = too hard), and with groups of one size the effective batch is the nominal one "
    "times (1 − the share). Which side decides the severity: all-wrong groups (too hard: the "
    "policy is left behind, no signal to learn from) keep it. All-correct groups (too easy) are "
    "`info` below `critical_at` — a policy that has solved most of its prompts is the goal of "
    "training, and a moderate share only costs efficiency — and a warning from `critical_at` "
    "on: then nearly every rollout is generated for no gradient (at 90%, a tenth of the batch "
    "still teaches), and the run must change now (stop, or harden the data). Measured on the "
    "scorecard's 14 healthy TRL runs (12 twins over seeds, group sizes, reward scales, losses "
    "and schedules, and 2 genuine runs): their final windows end at 33–70% zero-σ groups with "
    "50–70% all correct while their accuracy still rises or holds at 0.87–0.96, so a warning "
    "from 60% could fire on 3 of them (62–70%); the one run past 80% (a learning rate ×10 at "
    "step 25: 81% zero-σ, 75% all correct by step 34, then a diversity collapse) is a fault "
    "run. Zero variance is "
    "measured on the reward, all correct / all wrong on correctness: where the reward has terms "
    "beyond correctness (format, length), a solved group can still have reward variance, so "
    "the two shares need not add up; the message gives both.",
    remedy="too easy: stop (the prompts are solved), or drop solved prompts / a harder "
    "curriculum, DAPO dynamic sampling (filter zero-σ groups before the update); too hard: "
    "easier prompts, SFT warm-up, partial-credit rewards, larger groups.",
    metrics=("signal.zero_std_frac", "signal.all_correct_frac", "signal.all_wrong_frac"),
    params={
        "warn_at": Param(0.5, "final-window zero-σ share for a warning"),
        "critical_at": Param(
            0.8, "final-window zero-σ share for a critical finding (too easy: a warning)"
        ),
    },
)
def dead_prompts(ctx: RuleContext) -> Iterator[Finding]:
    zero = ctx.series("signal.zero_std_frac")
    frame = ctx.frame("signal.zero_std_frac")
    if zero is None or len(zero) == 0 or frame is None:
        return
    level, se, first = _final_share(frame, len(zero))
    severity = level_severity(level, ctx.params, se)
    if severity is None:
        return
    easy, hard = ctx.series("signal.all_correct_frac"), ctx.series("signal.all_wrong_frac")
    easy_level = final_mean(easy) if easy is not None and len(easy) else None
    hard_level = final_mean(hard) if hard is not None and len(hard) else None
    if easy_level is not None and hard_level is not None:
        side = "too easy" if easy_level >= hard_level else "too hard"
        detail = (
            f" ({side}: by correctness, {pct(easy_level)} of the groups are all correct and "
            f"{pct(hard_level)} all wrong"
        )
        if easy_level + hard_level > level + 2 * se:
            detail += "; some solved or failed groups still differ in reward: other terms vary"
        detail += ")"
    else:
        side, detail = "unknown", ""
    if side == "too easy":
        severity = "warn" if severity == "critical" else "info"
        detail += (
            f": the policy has solved its prompts, and ≈{pct(level)} of the rollouts are "
            "generated for no gradient — stop, or harden the data (drop solved prompts, "
            "filter zero-σ groups as DAPO does)"
            if severity == "warn"
            else "; the policy has solved most of its prompts"
        )
    yield ctx.finding(
        f"{pct(level)} of prompt groups have zero reward variance and give no gradient{detail}.",
        severity=severity,
        zero_std_frac=level,
        standard_error=se,
        all_correct_frac=easy_level,
        all_wrong_frac=hard_level,
        side=side,
        steps=[first, int(zero.steps[-1])],
    )


ADVANTAGE_SHARES = "signal.advantage_share.*"


@DECLARED.rule(
    "auxiliary-reward-dominates",
    brief=(
        "the task term carries < 25% of the advantage mass over the final window (two standard "
        "errors deep), and < 50% even where it varies"
    ),
    layer="L3",
    title="The policy is trained mostly on an auxiliary reward term",
    doc="The advantage is exactly Σ_k w_k·(r_k − r̄_k)/s_G, so each reward term carries a "
    "share of what the update is made of (signal.advantage_share.<term>, under the run's own "
    "normalisation). The finding fires when the task term — the reward function run.json's "
    "`correct_source` names — carries less than `task_share_max` of it, pooled over the final "
    "window's groups and two standard errors deep (the step-to-step scatter), and less than "
    "`live_share_max` even in the groups where it varies. Then most of every update pushes on "
    "another term (a format or length bonus), whatever the total reward curve says: with two "
    "terms, below 25% the other weighs three times the task. The second condition separates "
    "a task signal drowned by another term (the remedy here) from one that is absent because "
    "the groups are all wrong or all right (dead-prompts' business): there the task term "
    "carries most of the mass of the few groups where it varies. Shares are ratios of sums, "
    "so they hold at any reward scale and group size; the window's standard error from its "
    "scatter, so at any batch size.",
    remedy="normalise rewards per group (TRL scale_rewards='group', GRPO's default), lower the "
    "auxiliary term's weight, or gate it on correctness (format bonus only when right).",
    metrics=(ADVANTAGE_SHARES,),
    params={
        "task_share_max": Param(0.25, "the task term's final-window share below this"),
        "live_share_max": Param(0.5, "and below this in the groups where the task term varies"),
        "min_steps": Param(3, "fewest steps to judge"),
    },
)
def auxiliary_reward_dominates(ctx: RuleContext) -> Iterator[Finding]:
    shares = {
        metric_id.removeprefix("signal.advantage_share."): frame
        for metric_id in sorted(ctx.results)
        if metric_id.startswith("signal.advantage_share.")
        and (frame := ctx.frame(metric_id)) is not None
    }
    task = _task_term(ctx.meta, list(shares))
    if task is None:
        return
    frame = shares[task].filter(pl.col("value").is_not_null()).sort("step")
    if frame.height < ctx.params["min_steps"]:
        return
    window = frame.tail(window_size(frame.height))
    sums = window.select(pl.col("mass", "total_mass", "live_mass", "live_total").sum()).row(0)
    mass, total, live_mass, live_total = (float(v or 0.0) for v in sums)
    if total <= 0:
        return
    share = mass / total
    live = live_mass / live_total if live_total > 0 else 0.0
    values = window["value"].cast(pl.Float64).to_numpy()
    se = float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else 0.0
    if share + 2 * se >= ctx.params["task_share_max"] or live >= ctx.params["live_share_max"]:
        return
    others = {
        term: _pooled_share(frame_of, int(window["step"][0]))
        for term, frame_of in shares.items()
        if term != task
    }
    top = max(others, key=lambda t: others[t])
    yield ctx.finding(
        f"The task term `{task}` carries {pct(share)} of the advantage mass over the final "
        f"window ({pct(live)} even in the groups where it varies); `{top}` carries "
        f"{pct(others[top])}: the policy is trained mostly on `{top}`.",
        task_term=task,
        task_share=share,
        task_live_share=live,
        standard_error=se,
        shares={term: value for term, value in sorted(others.items())} | {task: share},
        steps=[int(window["step"][0]), int(window["step"][-1])],
    )


def _task_term(meta: Mapping[str, Any], terms: list[str]) -> str | None:
    """The reward term run.json's `correct_source` names (`accuracy_reward > 0`), if one."""
    source = meta.get("correct_source")
    if not isinstance(source, str):
        return None
    named = [t for t in terms if re.search(rf"(?<![\w/]){re.escape(t)}(?!\w)", source)]
    return named[0] if len(named) == 1 else None


def _pooled_share(frame: pl.DataFrame, first_step: int) -> float:
    sums = frame.filter(pl.col("step") >= first_step).select(pl.col("mass", "total_mass").sum())
    mass, total = (float(v or 0.0) for v in sums.row(0))
    return mass / total if total > 0 else 0.0


def _final_share(frame: pl.DataFrame, n_steps: int) -> tuple[float, float, int]:
    """A per-step group share pooled over the final window (weighted by the step's groups),
    its standard error, and the window's first step."""
    frame = frame.filter(pl.col("value").is_not_null()).sort("step")
    window = frame.tail(window_size(n_steps))
    groups = window["groups"].cast(pl.Float64).to_numpy()
    values = window["value"].cast(pl.Float64).to_numpy()
    level = float((values * groups).sum() / groups.sum())
    return level, share_se(level, float(groups.sum()), values), int(window["step"][0])


@DECLARED.rule(
    "reward-concentration",
    brief="effective share among prompts with signal < 0.4 (pooled over the final fifth)",
    layer="L3",
    title="A few prompts carry most of the gradient",
    doc="Among the prompt groups that do carry signal (Σ|advantage| > 0), the effective share "
    "(Σw)²/(P_live·Σw²), pooled over the groups of the final fifth of the run, is below "
    "`live_share_max`: the prompt-level "
    "reward distribution is long-tailed and the effective batch is far smaller than the nominal "
    "one (seed §5: a long tail where a few prompts get all positive reward). (Groups with no "
    "signal at all are dead-prompts' business.) Pooled over the final fifth because one step "
    "of a small batch cannot get below 1 / live groups: pooling makes the share comparable "
    "at any batch size; it is a ratio of sums, so scale-free in the reward.",
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
    first = int(steps[-window_size(len(steps), TREND_FRACTION)])
    # Pooled over the window's groups: one step of a small batch has too few live groups for
    # the share to fall far (it cannot go below 1 / live groups).
    sums = (
        frame.filter(pl.col("step") >= first)
        .select(pl.col("w_sum", "w_sq", "live_prompts", "prompts").sum(), pl.len().alias("steps"))
        .row(0, named=True)
    )
    if not sums["w_sq"] or not sums["live_prompts"]:
        return
    if not (math.isfinite(sums["w_sum"]) and math.isfinite(sums["w_sq"])):
        return  # absurd advantages (|A| near 1e308 overflow the square): no share to judge
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


@DECLARED.rule(
    "accuracy-out-of-range",
    brief="warn: the 0/1 accuracy reward's logged mean and std left [0, 1] at a step; names "
    "the steps",
    layer="L3",
    title="The accuracy reward returned values outside [0, 1]",
    doc="At some steps the accuracy reward, 0/1 at the run's other steps, logged a mean and "
    "standard deviation that no rewards in [0, 1] can give (signal.accuracy_out_of_range: "
    "Bhatia–Davis). Some completions were scored outside [0, 1]: a verifier that returns a "
    "raw or rescaled score on some prompts, a reward changed mid-run. Those prompts' "
    "advantages grow with the scale (without GRPO's std normalisation, e.g. Dr. GRPO, by the "
    "full factor) and carry the update, and the steps' pass@1 is left out because their mean "
    "is not an accuracy. From the steps alone (TensorBoard, W&B, MLflow); with rollouts the "
    "same fault shows as reward-concentration. There is no threshold to calibrate: the "
    "bound is exact, sampling error cannot cross it, so one step is enough at any run "
    "length or batch (of 4 or more completions, which the 0/1 reading already requires).",
    remedy="run the reward function on the prompts of the listed steps and check its range; "
    "clip or fix the verifier; scale rewards per group (GRPO's std normalisation) while it "
    "is fixed.",
    metrics=("signal.accuracy_out_of_range",),
    requires=("signal.accuracy_out_of_range",),
    marks="points",
)
def accuracy_out_of_range(ctx: RuleContext) -> Iterator[Finding]:
    frame = ctx.frame("signal.accuracy_out_of_range")
    if frame is None or frame.height == 0:
        return
    bad = frame.filter(pl.col("value") > 0).sort("step")
    if bad.height == 0:
        return
    steps = [int(v) for v in bad["step"]]
    first = bad.row(0, named=True)
    shown = ", ".join(map(str, steps[:10])) + (", …" if len(steps) > 10 else "")
    yield ctx.finding(
        f"At {len(steps)} of {frame.height} steps the 0/1 accuracy reward's logged mean and "
        f"std cannot come from rewards in [0, 1] (step {first['step']}: mean "
        f"{first['logged_mean']:.3g}, std {first['logged_std']:.3g}): steps {shown}. A "
        "reward outside [0, 1] was given there; those steps are left out of pass@1.",
        steps=steps,
        out_of_range_steps=steps,
    )


@DECLARED.rule(
    "mode-collapse",
    brief="pass@1 up significantly while pass@k closes < 25% as much of its headroom (or falls)",
    layer="L3",
    title="pass@1 rises while pass@k does not",
    doc="Between the first and last fifth of the run pass@1 rose by at least `min_rise` "
    "(z >= `z`), while pass@k (k = group size) closed less than `k_ratio` of the share of its "
    "headroom that pass@1 closed — (last - first) / (1 - first) for each, so a pass@k that is "
    "simply near its ceiling does not count as flat — or fell; pass@k must start at most "
    "1 - `headroom`. Probability is concentrating on modes the policy already knew and no new "
    "ones are found: the seed's 'reward still rises but pass@k does not' (§6), the early sign "
    "of mode collapse (Yue et al. 2025, arXiv 2504.13837), long before reward turns down. "
    "When the reward rises but pass@1 does not, the reward is not buying correctness at all: "
    "that is reward-hacking's case, not this one. The z-scores use the step-to-step scatter "
    "of each window, so they hold at any batch and group size.",
    remedy="keep exploration alive: higher temperature, entropy bonus or clip-higher, larger "
    "groups; check pass@k at large k against the base model; diversify prompts.",
    metrics=("signal.pass_at_1", "signal.pass_at_k"),
    requires=("signal.pass_at_1", "signal.pass_at_k"),
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
    rising = one.delta >= p["min_rise"] and one.rising(p["z"]) and one.first < 1
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


REWARD_TERMS = "signal.reward.*"


@DECLARED.rule(
    "reward-hacking",
    brief=(
        "reward up (z ≥ 2) while pass@1 does not rise (upper one-sided 95% bound < 0.02) or "
        "falls; critical when pass@1 or pass@k fall significantly; names the reward term driving "
        "the rise"
    ),
    layer="L3",
    title="Reward rises while the task does not",
    doc="Between the first and last fifth of the run the mean reward rose significantly (z >= "
    "`z`) while pass@1 (correctness), with room to rise (it starts below 1 - `headroom`), did "
    "not: the upper end of the one-sided 95% interval of its rise (delta + 1.645 se) is below "
    "`flat_tol`, or it fell. The seed's opening sentence: reward keeps rising while the policy "
    "degenerates; reward that does not buy correctness comes from a term the task does not need "
    "(a format or length bonus, a judge's bias) or a verifier the policy has learned to game. "
    "Critical when pass@1 or pass@k fell significantly (z <= -`fall_z`: the policy is getting "
    "worse at the task). The message names the reward term that rose most and the ones that fell "
    "(signal.reward.<name>: TRL's reward functions, verl's reward extras, `reward_*` columns). "
    "Flat is judged on the interval, not on a failed significance test: in a small batch a real "
    "rise can be not significant, and that is not 'flat'. Standard errors come from each window's "
    "step-to-step scatter, so the test holds at any batch or group size and run length (at least "
    "`min_steps` steps).",
    remedy="inspect the highest-reward rollouts of the last steps; lower the weight of the term "
    "that drives the rise or make it conditional on correctness; check the verifier for "
    "exploits; track pass@k against the base model.",
    metrics=("signal.reward", "signal.pass_at_1", "signal.pass_at_k", REWARD_TERMS),
    requires=("signal.reward", "signal.pass_at_1"),
    params={
        "z": Param(2.0, "z-score of the reward rise"),
        "flat_tol": Param(0.02, "pass@1 rising by less than this (upper 95% bound) is flat"),
        "headroom": Param(0.05, "pass@1 must start at most 1 - headroom"),
        "fall_z": Param(2.0, "a fall of pass@1 or pass@k with z below -this is significant"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
)
def reward_hacking(ctx: RuleContext) -> Iterator[Finding]:
    reward, p1 = ctx.series("signal.reward"), ctx.series("signal.pass_at_1")
    p = ctx.params
    if reward is None or p1 is None or min(len(reward), len(p1)) < p["min_steps"]:
        return
    r, one = compare_windows(reward), compare_windows(p1)
    if not r.rising(p["z"]) or one.first > 1 - p["headroom"]:
        return
    if not one.not_rising(p["flat_tol"], z=ONE_SIDED_95):
        return
    pk = ctx.series("signal.pass_at_k")
    k = compare_windows(pk) if pk is not None and len(pk) >= p["min_steps"] else None
    falling = one.falling(p["fall_z"]) or (k is not None and k.falling(p["fall_z"]))
    terms = {
        metric_id.removeprefix("signal.reward."): compare_windows(series)
        for metric_id in sorted(ctx.results)
        if metric_id.startswith("signal.reward.")
        and (series := ctx.series(metric_id)) is not None
        and len(series) >= p["min_steps"]
    }
    driver = max(terms, key=lambda t: terms[t].delta, default=None)
    fell = [t for t, w in terms.items() if w.falling(p["fall_z"])]
    parts = [f"reward rose {r.first:.3g} → {r.last:.3g}"]
    if driver is not None and terms[driver].delta > 0:
        parts.append(f"driven by `{driver}` ({terms[driver].first:.3g} → {terms[driver].last:.3g})")
    task = f"pass@1 went {one.first:.3f} → {one.last:.3f}"
    if k is not None:
        task += f" and pass@k {k.first:.3f} → {k.last:.3f}"
    message = ", ".join(parts) + f", while {task}"
    if fell:
        message += "; falling: " + ", ".join(
            f"`{t}` {terms[t].first:.3g} → {terms[t].last:.3g}" for t in fell
        )
    yield ctx.finding(
        message[0].upper() + message[1:] + ": the reward is not buying correctness.",
        severity="critical" if falling else None,
        reward=[r.first, r.last],
        pass_at_1=[one.first, one.last],
        pass_at_k=[k.first, k.last] if k is not None else None,
        driver=driver,
        terms={t: [w.first, w.last] for t, w in terms.items()},
        metrics=[
            "signal.reward",
            "signal.pass_at_1",
            *(["signal.pass_at_k"] if k is not None else []),
            *(f"signal.reward.{t}" for t in terms),
        ],
        steps=[r.first_steps[0], r.last_steps[1]],
    )
