"""L2 findings: entropy collapse, spurious length growth, overthinking, truncation, tools."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import polars as pl

from rlscope.rules.base import (
    LEVEL_NOTE,
    MIN_EVIDENCE_POINTS,
    MIN_TREND_STEPS,
    RuleContext,
    Series,
    compare_windows,
    example_ids,
    final_level,
    final_mean,
    final_steps,
    pct,
    pooled_corr,
    rolling_median,
)
from rlscope.spec import Declarations, Finding, Param, Severity
from rlscope.windows import MIN_STEPS, window_size

#: This layer's findings, in order (collected by rlscope.catalog).
DECLARED = Declarations()


@DECLARED.rule(
    "entropy-collapse",
    brief=(
        "≥ 50% of entropy lost and either ≥ 75% of the loss within 20% of the steps (a cliff, "
        "early or late: the message says which) or ≥ 85% lost whatever the shape"
    ),
    layer="L2",
    title="Token entropy collapsed",
    doc="Token entropy lost at least `min_drop` of its initial level (first vs final window, "
    "3-step rolling median) and either the loss came as a cliff — at least `cliff_share` of it "
    "within `cliff_fraction` of the steps, anywhere in the run — or the policy is left nearly "
    "deterministic (at least `floor_drop` of the initial entropy gone, whatever the shape). "
    "Mechanism (Cui et al. 2025, arXiv 2505.22617): under policy gradient, entropy falls by the "
    "covariance of log-probability and advantage; once it is gone the policy stops exploring "
    "and attainable reward is capped (R ≈ -a·e^H + b). A smooth, moderate decline is normal "
    "(seed §6: monotone decline is the norm); a cliff or a floor is collapse. The seed's "
    "contrast of a sharp drop in the first ~50 steps with a smooth decline is a detail of the "
    "message: a cliff starting within `early_fraction` of the run is early, and almost always "
    "precedes saturated performance; a late cliff is "
    "collapse too. Thresholds are shares of the run's own initial level and of its length, so "
    "they hold at any run length, vocabulary and batch size.",
    remedy="lower the learning rate; use clip-higher (DAPO), Clip-Cov/KL-Cov or an entropy "
    "bonus; check for a too-low sampling temperature; raise the KL coefficient.",
    metrics=("behavior.entropy",),
    params={
        "min_drop": Param(0.5, "entropy lost over the run, as a share of its initial value"),
        "cliff_fraction": Param(0.2, "the width of a cliff, as a share of the run's steps"),
        "cliff_share": Param(0.75, "share of the total loss within one such window"),
        "floor_drop": Param(0.85, "entropy lost, whatever the shape, that is collapse"),
        "early_fraction": Param(0.2, "a cliff starting within this share of the run is early"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
    severity="critical",
)
def entropy_collapse(ctx: RuleContext) -> Iterator[Finding]:
    entropy = ctx.series("behavior.entropy")
    p = ctx.params
    if entropy is None or len(entropy) < p["min_steps"]:
        return
    smooth = rolling_median(entropy.values, 3)
    n = len(smooth)
    start = float(smooth[: window_size(n, 0.02, 1)].mean())
    end = final_mean(entropy)
    if start <= 0 or not math.isfinite(start):
        return
    drop = start - end
    if drop / start < p["min_drop"]:
        return
    width = max(1, math.ceil(p["cliff_fraction"] * (n - 1)))
    falls = smooth[:-width] - smooth[width:]
    at = int(np.argmax(falls))
    cliff = float(falls[at]) / drop
    if cliff < p["cliff_share"] and drop / start < p["floor_drop"]:
        return
    begin, stop = int(entropy.steps[at]), int(entropy.steps[at + width])
    if cliff >= p["cliff_share"]:
        early = at <= p["early_fraction"] * (n - 1)
        shape = f"{pct(min(cliff, 1.0))} of it in a cliff over steps {begin}–{stop}" + (
            " (early: collapse this early almost always precedes saturated performance)"
            if early
            else " (late in the run)"
        )
    else:
        shape = "a decline that leaves the policy nearly deterministic"
    yield ctx.finding(
        f"Entropy fell from {start:.3g} to {end:.3g} nats ({pct(drop / start)} lost), {shape}.",
        entropy_start=start,
        entropy_end=end,
        cliff_share=cliff,
        steps=[begin, stop],
    )


@DECLARED.rule(
    "spurious-length-growth",
    brief=(
        "length +20% while within-prompt |r| < 0.05 and pass@1 flat (upper one-sided 90% bound of"
        ' its rise < 0.05, so a small batch\'s unproven rise is not "flat")'
    ),
    layer="L2",
    title="Responses grow longer without getting more correct",
    doc="Mean response length grew by at least `growth_min` (last vs first fifth of the run, "
    "significant at z > 2), while within prompts length and correctness are unrelated (pooled "
    "within-group correlation |r| < `corr_max`) and pass@1 did not rise: the upper end of "
    "the one-sided 90% interval of its rise is below `acc_rise_max` (judged on the interval, "
    "so a real rise that a small batch cannot show as significant is not read as flat). "
    "The seed's 'spurious length growth': a length bias of the objective (Dr. GRPO: GRPO's 1/|o| "
    "normalisation favours long wrong answers) rather than longer reasoning that helps.",
    remedy="use token-level or constant length normalisation (Dr. GRPO, DAPO's token-level "
    "loss); add an overlong penalty; inspect long responses for repetition.",
    metrics=("behavior.response_len", "behavior.len_correct_corr", "signal.pass_at_1"),
    requires=("behavior.response_len", "behavior.len_correct_corr", "signal.pass_at_1"),
    params={
        "growth_min": Param(0.2, "relative growth of the mean length"),
        "corr_max": Param(0.05, "|within-prompt correlation| below this counts as none"),
        "acc_rise_max": Param(0.05, "pass@1 rising less than this counts as flat"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
)
def spurious_length_growth(ctx: RuleContext) -> Iterator[Finding]:
    length, acc = ctx.series("behavior.response_len"), ctx.series("signal.pass_at_1")
    corr_frame = ctx.frame("behavior.len_correct_corr")
    p = ctx.params
    if length is None or acc is None or corr_frame is None or len(length) < p["min_steps"]:
        return
    grow, acc_trend = compare_windows(length), compare_windows(acc)
    pooled = pooled_corr(corr_frame)
    if pooled is None or grow.first <= 0:
        return
    r, _ = pooled
    growth = grow.last / grow.first - 1
    # Flat means sure it is flat: the one-sided 90% upper bound of the rise is small (a rise
    # that is merely not significant in a small batch is not flat).
    accuracy_flat = acc_trend.not_rising(p["acc_rise_max"], z=1.28)
    if growth >= p["growth_min"] and grow.z > 2 and abs(r) < p["corr_max"] and accuracy_flat:
        yield ctx.finding(
            f"Mean length grew {pct(growth)} ({grow.first:.0f} → {grow.last:.0f} tokens) while "
            f"pass@1 moved {acc_trend.delta:+.3f} and length is unrelated to correctness within "
            f"prompts (r = {r:+.3f}).",
            length_first=grow.first,
            length_last=grow.last,
            within_prompt_corr=r,
            pass_at_1_delta=acc_trend.delta,
            steps=[grow.first_steps[0], grow.last_steps[1]],
        )


@DECLARED.rule(
    "overthinking",
    brief=(
        "length +10% (z > 2) while within-prompt r ≤ −0.1, significantly, over the second half "
        "(wrong answers being longer without growth is not overthinking)"
    ),
    layer="L2",
    title="Responses grow longer, and longer responses are less often correct",
    doc="Mean response length grew by at least `growth_min` between the first and last fifth of "
    "the run (z > 2 against the step-to-step scatter), and over the second half of the run the "
    "pooled within-prompt correlation of length and correctness is at most `corr_max` and "
    "significantly negative (r·sqrt(dof) <= -`z`): for the same prompt, longer attempts fail "
    "more, and the policy is moving toward them. The seed's table reads the relation of length "
    "and correctness *as length grows* (R1/o1: RL lengthens responses): 'longer → less "
    "correct' is overthinking or hallucinating past the answer. A negative correlation alone is "
    "not that: in almost every model wrong attempts are longer (rambling, truncated, looping), "
    "also in healthy runs whose responses get shorter; so without growth it stays silent. "
    "Within-prompt (pooled within-group) correlation removes prompt difficulty; both tests use "
    "the run's own noise, so they hold at any batch and group size.",
    remedy="add a length penalty or overlong shaping; check for repetition loops and for "
    "answers buried in or after long reasoning; lower max_response_len.",
    metrics=("behavior.len_correct_corr", "behavior.response_len"),
    requires=("behavior.len_correct_corr", "behavior.response_len"),
    params={
        "corr_max": Param(-0.1, "pooled within-prompt correlation at or below this"),
        "z": Param(3.0, "and at least this many standard errors below 0"),
        "growth_min": Param(0.1, "relative growth of the mean length"),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge the growth"),
    },
)
def overthinking(ctx: RuleContext) -> Iterator[Finding]:
    frame = ctx.frame("behavior.len_correct_corr")
    length = ctx.series("behavior.response_len")
    p = ctx.params
    if frame is None or frame.height == 0 or length is None or len(length) < p["min_steps"]:
        return
    grow = compare_windows(length)
    if grow.first <= 0 or grow.last / grow.first - 1 < p["growth_min"] or grow.z <= 2:
        return
    steps = frame["step"].sort()
    half = int(steps[len(steps) // 2])
    pooled = pooled_corr(frame, first_step=half)
    if pooled is None:
        return
    r, dof = pooled
    if r <= p["corr_max"] and r * math.sqrt(max(dof, 1.0)) <= -p["z"]:
        yield ctx.finding(
            f"Responses grew {pct(grow.last / grow.first - 1)} ({grow.first:.0f} → "
            f"{grow.last:.0f}) and within prompts longer responses are less often correct "
            f"(r = {r:+.3f} over steps {half}–{int(steps[-1])}).",
            within_prompt_corr=r,
            dof=dof,
            length_first=grow.first,
            length_last=grow.last,
            steps=[half, int(steps[-1])],
        )


def _level_rule(
    ctx: RuleContext,
    metric_id: str,
    what: str,
    *,
    complement: bool = False,
    examples: Callable[[pl.DataFrame], list[int]] | None = None,
    excused: float = 0.0,
    learnt: bool = False,
    binary: bool = False,
) -> Iterator[Finding]:
    """A final-window level against `warn_at`/`critical_at` (of 1 - value with `complement`),
    less the share `excused` that another finding explains; `examples` picks rollout ids from
    the per-rollout rows of the final window. With `learnt`, a warning level that is falling
    significantly since the run's start (the policy is being taught out of it) is `info`."""
    found = final_level(ctx, metric_id, complement=complement, excused=excused, binary=binary)
    if found is None:
        return
    series = found.series
    severity: Severity = found.severity
    falling = ""
    if learnt and severity == "warn" and len(series) >= MIN_EVIDENCE_POINTS:
        shares = Series(series.steps, 1 - series.values if complement else series.values)
        trend = compare_windows(shares, first=MIN_STEPS)
        if trend.falling(2.0):
            severity = "info"
            falling = (
                f"; down from {pct(trend.first)} over steps {trend.first_steps[0]}–"
                f"{trend.first_steps[1]} (z = {trend.z:.1f}): the policy is learning it, to watch"
            )
    evidence = {}
    rows = ctx.rollout_rows()
    if examples is not None and rows is not None:
        first = final_steps(series)
        recent = rows.filter((pl.col("split") == "train") & (pl.col("step") >= first))
        evidence["rollout_ids"] = examples(recent)
    yield ctx.finding(
        f"{pct(found.level)} of {what} over the last steps"
        + falling
        + (
            f"; e.g. rollouts {', '.join(map(str, evidence['rollout_ids']))}"
            if evidence.get("rollout_ids")
            else ""
        )
        + ".",
        severity=severity,
        final_value=found.value,
        steps=[int(series.steps[-1])],
        **evidence,
    )


@DECLARED.rule(
    "truncation",
    brief="≥ 5% truncated (critical ≥ 20%)",
    layer="L2",
    title="Many responses hit the length cap",
    doc="Final-window truncation rate at least `warn_at` (critical at `critical_at`). Truncated "
    "responses are usually scored wrong for a reason unrelated to the task, so the reward "
    "penalises length, not mistakes, and the run learns to stop early or never finishes "
    "(verl response_length/clip_ratio, TRL completions/clipped_ratio). A cap is in tokens: "
    "word counts are never compared with it." + LEVEL_NOTE,
    remedy="raise max_response_len; use overlong filtering or soft overlong punishment (DAPO); "
    "check for repetition loops in truncated responses.",
    metrics=("behavior.truncation_rate",),
    params={
        "warn_at": Param(0.05, "final-window truncation rate for a warning"),
        "critical_at": Param(0.2, "final-window truncation rate for a critical finding"),
    },
)
def truncation(ctx: RuleContext) -> Iterator[Finding]:
    yield from _level_rule(ctx, "behavior.truncation_rate", "rollouts hit the length cap")


@DECLARED.rule(
    "tool-cap-saturation",
    brief="≥ 20% at the tool-call cap (critical ≥ 50%)",
    layer="L2",
    title="Rollouts run into the tool-call cap",
    doc="Final-window share of rollouts at run.json max_tool_calls at least `warn_at` "
    "(critical at `critical_at`): the policy calls tools mechanically until stopped. Reward may "
    "look fine while cost and latency multiply (seed §3: calls near the cap = mechanical "
    "repeated calling)." + LEVEL_NOTE,
    remedy="penalise tool calls beyond need (OTC-style tool-efficiency reward); inspect "
    "redundant calls; check the tool's responses are actually used.",
    metrics=("behavior.tool_cap_frac",),
    params={
        "warn_at": Param(0.2, "final-window share at the cap for a warning"),
        "critical_at": Param(0.5, "final-window share at the cap for a critical finding"),
    },
)
def tool_cap_saturation(ctx: RuleContext) -> Iterator[Finding]:
    yield from _level_rule(ctx, "behavior.tool_cap_frac", "rollouts reach the tool-call cap")


@DECLARED.rule(
    "tool-call-instability",
    brief="within-prompt std of calls > 0.8× the mean",
    layer="L2",
    title="Tool use varies wildly for the same prompt",
    doc="Over the final fifth of the run, the pooled within-prompt standard deviation of tool "
    "calls is more than `cv_max` times the mean number of calls (and the mean is at least "
    "`min_calls`): for one prompt the policy sometimes calls no tool and sometimes many. The "
    "seed's 'high variance = unstable policy' (§3). Pooled within-prompt, so prompt "
    "difficulty does not inflate it, and over the final fifth's groups, so a small batch "
    "still pools hundreds of rollouts; a ratio to the mean, so it holds at any call budget.",
    remedy="lower the learning rate; shape the reward for consistent tool use; check that tool "
    "failures are handled the same way across rollouts.",
    metrics=("behavior.tool_calls_std", "behavior.tool_calls"),
    params={
        "cv_max": Param(0.8, "within-prompt std / mean calls above this is unstable"),
        "min_calls": Param(0.5, "only judged when rollouts make at least this many calls"),
    },
)
def tool_call_instability(ctx: RuleContext) -> Iterator[Finding]:
    frame = ctx.frame("behavior.tool_calls_std")
    if frame is None or frame.height == 0:
        return
    steps = frame["step"].sort()
    first = int(steps[min(len(steps) - 1, int(0.8 * len(steps)))])
    window = frame.filter(pl.col("step") >= first)
    sxx, dof = (float(window[c].sum() or 0.0) for c in ("sxx", "dof"))
    mean_calls = float(np.nanmean(window["mean_calls"].cast(pl.Float64).to_numpy()))
    if dof <= 0 or not math.isfinite(mean_calls) or mean_calls < ctx.params["min_calls"]:
        return
    cv = math.sqrt(sxx / dof) / mean_calls
    if cv > ctx.params["cv_max"]:
        yield ctx.finding(
            f"For the same prompt, tool calls vary by ±{math.sqrt(sxx / dof):.2f} around a mean "
            f"of {mean_calls:.2f} (CV {cv:.2f}) over steps {first}–{int(steps[-1])}.",
            within_prompt_std=math.sqrt(sxx / dof),
            mean_calls=mean_calls,
            cv=cv,
            steps=[first, int(steps[-1])],
        )


@DECLARED.rule(
    "format-violations",
    brief="≥ 10% of rollouts break the format in the final window (critical ≥ 30%); names examples",
    layer="L2",
    title="Responses break the output format",
    doc="Final-window share of train rollouts failing behavior.format_ok (unbalanced or "
    "misordered tags, a missing or blank answer, a tool call that is not JSON with `name` and "
    "`arguments`) at least `warn_at` (critical at `critical_at`). Only judged when responses use "
    "tags. A broken format gets no reward for reasons unrelated to the task; a share that rises "
    "during training is often reward hacking around the parser or a collapse into loops "
    "(seed §3, segment quality). A response cut at the length cap cannot close its tags or "
    "give its answer: that is truncation's finding, so the share judged here is the "
    "violations beyond the final-window truncation rate (behavior.truncation_rate, recomputed "
    "or as the trainer logged it) when it is known. Answers may be tagged (`<answer>`) or an "
    "untagged final line after the last tag (`Answer: X` as DAPO / R1, `#### N` as GSM8K). "
    "A share that is falling significantly from the run's first 3 steps (z ≥ 2) is `info`: "
    "the policy is being taught the format (a genuine TRL run starts at 15% and is at 2% by "
    "step 30)." + LEVEL_NOTE,
    remedy="open the listed rollouts (`rlscope show RUN ID`); add or raise a format reward; "
    "check the chat template and stop tokens; check [tags] matches the model's tags.",
    metrics=("behavior.format_ok", "behavior.truncation_rate"),
    params={
        "warn_at": Param(0.1, "final-window share of violations for a warning"),
        "critical_at": Param(0.3, "final-window share of violations for a critical finding"),
    },
)
def format_violations(ctx: RuleContext) -> Iterator[Finding]:
    truncation = ctx.series("behavior.truncation_rate")
    yield from _level_rule(
        ctx,
        "behavior.format_ok",
        "rollouts break the format",
        complement=True,
        excused=final_mean(truncation) if truncation is not None and len(truncation) else 0.0,
        examples=lambda rows: example_ids(
            rows, pl.col("tagged").is_not_null() & ~pl.col("format_ok")
        ),
        learnt=True,
        binary=True,
    )


@DECLARED.rule(
    "repetition",
    brief=(
        "final-window mean 3-gram repetition ≥ 0.2 (critical ≥ 0.4); names the most repetitive "
        "rollouts"
    ),
    layer="L2",
    title="Reasoning repeats itself",
    doc="Final-window mean of behavior.repetition (1 - distinct/total word 3-grams in the think "
    "segment) at least `warn_at` (critical at `critical_at`). Natural reasoning repeats few "
    "3-grams (< 0.1); loops of the same sentences waste the length budget and usually end "
    "truncated or wrong (open-r1's repetition penalty measures the same 3-gram share)."
    + LEVEL_NOTE,
    remedy="open the listed rollouts; add a repetition penalty (open-r1) or overlong shaping; "
    "check sampling temperature and entropy (a collapsed policy loops).",
    metrics=("behavior.repetition",),
    params={
        "warn_at": Param(0.2, "final-window mean repetition for a warning"),
        "critical_at": Param(0.4, "final-window mean repetition for a critical finding"),
    },
)
def repetition(ctx: RuleContext) -> Iterator[Finding]:
    yield from _level_rule(
        ctx,
        "behavior.repetition",
        "the reasoning's word 3-grams are repeats",
        examples=lambda rows: example_ids(
            rows, pl.col("repetition").is_not_null(), order=pl.col("repetition")
        ),
    )


def _redundant_examples(rows: pl.DataFrame) -> list[int]:
    column = "calls_redundant" if "calls_redundant" in rows.columns else "tag_calls_redundant"
    return example_ids(rows, pl.col(column) > 0, order=pl.col(column))


@DECLARED.rule(
    "redundant-tool-calls",
    brief=(
        "≥ 10% of tool calls repeat an earlier call of the rollout (critical ≥ 30%); names examples"
    ),
    layer="L2",
    title="Tool calls repeat themselves",
    doc="Final-window share of tool calls that repeat an earlier call's arguments in the same "
    "rollout (behavior.redundant_tool_calls) at least `warn_at` (critical at `critical_at`). "
    "Repeated calls return what the policy already has: invisible in reward, they multiply "
    "latency and cost, and often mean the policy does not read the tool's response (seed §3: "
    "a hidden failure mode of agent RL)." + LEVEL_NOTE,
    remedy="open the listed rollouts; penalise repeated calls or reward tool efficiency (OTC); "
    "check that tool responses reach the context.",
    metrics=("behavior.redundant_tool_calls",),
    params={
        "warn_at": Param(0.1, "final-window share of redundant calls for a warning"),
        "critical_at": Param(0.3, "final-window share of redundant calls for a critical finding"),
    },
)
def redundant_tool_calls(ctx: RuleContext) -> Iterator[Finding]:
    yield from _level_rule(
        ctx,
        "behavior.redundant_tool_calls",
        "tool calls repeat an earlier call of the same rollout",
        examples=_redundant_examples,
    )
