"""L4 findings: within-group diversity collapsing toward one mode."""

from __future__ import annotations

from collections.abc import Iterator

import polars as pl

from rlscope.rules.base import MIN_TREND_STEPS, RuleContext, compare_windows, final_mean, pct
from rlscope.spec import Declarations, Finding, Param, Severity
from rlscope.windows import window_size

#: This layer's findings, in order (collected by rlscope.catalog).
DECLARED = Declarations()


def _collapsed_group(ctx: RuleContext, last_step: int) -> list[int]:
    """Rollout ids of the largest identical-trajectory cluster at the last step."""
    rows = ctx.rollout_rows()
    if rows is None:
        return []
    key = next((k for k in ("trajectory_key", "action_key") if k in rows.columns), None)
    if key is None:
        return []
    recent = rows.filter(
        (pl.col("split") == "train") & (pl.col("step") == last_step) & pl.col(key).is_not_null()
    )
    if recent.height == 0:
        return []
    clusters = (
        recent.group_by("prompt_id", key)
        .agg(pl.col("rollout_id").sort())
        .with_columns(pl.col("rollout_id").list.len().alias("size"))
        .sort("size", "prompt_id", descending=[True, False])
    )
    return [int(i) for i in clusters["rollout_id"][0][:8]]


def _converged_share(ctx: RuleContext) -> float | None:
    """Over the final window, of the train groups collapsed onto one trajectory (its largest
    identical cluster at least half the group: exploration.cluster_sizes' components), the
    share whose largest cluster is a correct answer. None without such groups or without
    correctness."""
    frame = ctx.frame("exploration.cluster_sizes")
    if frame is None or "extra_collapsed" not in frame.columns:
        return None
    window = frame.sort("step").tail(window_size(frame.height))
    collapsed = float(window["extra_collapsed"].fill_null(0).sum())
    if collapsed == 0:
        return None
    return float(window["extra_collapsed_correct"].fill_null(0).sum()) / collapsed


@DECLARED.rule(
    "diversity-collapse",
    brief=(
        "within-group diversity of whole trajectories (text with actions and arguments, never "
        "coarse action names alone) down ≥ 50% from a first-fifth level ≥ 0.1 to the last fifth, "
        "significantly (critical when the largest identical cluster is ≥ half a group, unless "
        "that cluster is a correct answer in nearly all of them); names an identical cluster"
    ),
    layer="L4",
    title="Rollouts of a prompt collapse toward one mode",
    doc="Within-group diversity (exploration.pairwise_diversity, else exploration.unique_frac) "
    "fell by at least `min_drop` of its level in the first fifth of the run to the last fifth, "
    "significantly (z <= -`z` against the step-to-step scatter), from a level that existed: "
    "the first fifth's diversity must be at least `min_initial` (rollouts that were alike from "
    "the start did not collapse). Diversity is judged on whole trajectories — the text with "
    "its actions and tool-call arguments, never coarse action names alone — so rollouts whose "
    "texts differ are never called identical (seed §4: diversity in trajectory space). The "
    "z-score uses the run's own step-to-step noise, so it holds at any group size and batch; "
    "the drop is a share of the run's own level, so at any text length. Critical when the final "
    "share of a group in its largest identical cluster (exploration.cluster_sizes) is at least "
    "`critical_mode_share` — unless in at least `converged_share` of the final window's "
    "collapsed groups (a largest cluster of at least half the group) "
    "the largest cluster is a correct answer: the policy converged on the answer of prompts it "
    "has learnt, which is the goal on a task with one answer (a 2-token answer has nothing "
    "else to vary), and such a collapse is `info`. A collapse onto wrong answers keeps the "
    "group from learning and stays critical; measured on genuine TRL runs, the largest cluster "
    "is correct in 100% of the collapsed groups of a healthy run and in 4% after a learning-"
    "rate collapse. A group of near-copies gives GRPO no contrast to learn from and the "
    "policy stops finding new solutions; healthy runs alternate exploitation and exploration "
    "rather than collapsing monotonically. The evidence names the largest identical cluster of "
    "the last step.",
    remedy="raise sampling temperature or entropy regularisation (clip-higher, Clip-Cov); lower "
    "the learning rate; add diversity-promoting rewards or rollout dedup; check for entropy "
    "collapse (L2).",
    metrics=(
        "exploration.pairwise_diversity",
        "exploration.unique_frac",
        "exploration.cluster_sizes",
    ),
    params={
        "min_drop": Param(0.5, "share of the initial diversity lost"),
        "min_initial": Param(0.1, "first-fifth diversity below this is no level to lose"),
        "z": Param(2.0, "significance of the fall (z-score)"),
        "critical_mode_share": Param(0.5, "final largest-cluster share for a critical finding"),
        "converged_share": Param(
            0.9, "share of the collapsed groups whose mode is correct for an info finding"
        ),
        "min_steps": Param(MIN_TREND_STEPS, "fewest steps to judge"),
    },
)
def diversity_collapse(ctx: RuleContext) -> Iterator[Finding]:
    p = ctx.params
    metric_id = next(
        (
            m
            for m in ("exploration.pairwise_diversity", "exploration.unique_frac")
            if ctx.series(m) is not None
        ),
        None,
    )
    if metric_id is None:
        return
    series = ctx.series(metric_id)
    assert series is not None
    if len(series) < p["min_steps"]:
        return
    w = compare_windows(series)
    if w.first < p["min_initial"] or w.last > (1 - p["min_drop"]) * w.first or w.z > -p["z"]:
        return
    modes = ctx.series("exploration.cluster_sizes")
    mode_share = final_mean(modes) if modes is not None and len(modes) else None
    severity: Severity | None = None
    converged = None
    if mode_share is not None and mode_share >= p["critical_mode_share"]:
        converged = _converged_share(ctx)
        on_answer = converged is not None and converged >= p["converged_share"]
        severity = "info" if on_answer else "critical"
    ids = _collapsed_group(ctx, int(series.steps[-1]))
    decline = ctx.results[metric_id].extra.get("decline", {}).get("shape")
    yield ctx.finding(
        f"{metric_id} fell from {w.first:.3g} to {w.last:.3g} ({pct(1 - w.last / w.first)} lost"
        + (f", a {decline} decline" if decline in ("cliff", "smooth") else "")
        + ")"
        + (
            f"; a group's largest identical cluster is {pct(mode_share)} of it"
            if mode_share
            else ""
        )
        + (f"; e.g. identical rollouts {', '.join(map(str, ids))}" if len(ids) > 1 else "")
        + (
            f"; in {pct(converged)} of the collapsed groups it is a correct answer: "
            "converged on the answer"
            if severity == "info" and converged is not None
            else ""
        )
        + ".",
        severity=severity,
        first=w.first,
        last=w.last,
        z=w.z,
        mode_share=mode_share,
        converged_share=converged,
        decline=decline,
        steps=[w.first_steps[0], w.last_steps[1]],
        rollout_ids=ids,
    )
