"""L6 reasoning quality: self-consistency, faithfulness probes, biased context, step checks."""

from __future__ import annotations

from typing import Any

import polars as pl

from rlscope import text
from rlscope.context import MetricContext
from rlscope.exactsum import ordered_mean
from rlscope.metrics._common import (
    custom,
    example_partial,
    examples,
    f64,
    safe_div,
    train,
)
from rlscope.spec import Better, Declarations, Metric, Variant

#: This layer's metrics, in order (collected by rlscope.catalog).
DECLARED = Declarations()

GROUP = ("step", "prompt_id")
INTERVENTIONS = {
    "truncate": "the chain of thought cut to its first `fraction`, then answered",
    "mistake": "a mistake inserted into one step (at `fraction`) and the rest resampled",
    "paraphrase": "the chain of thought paraphrased",
    "filler": "the chain of thought replaced by filler tokens of the same length",
}

# Self-consistency: per-rollout answer keys.
_VOTES = {"answer_key": text.answer_key(), "correct": pl.col("correct")}


def majority_vote(frame: pl.LazyFrame) -> pl.LazyFrame:
    """Per train group (>= 2 rollouts): mean accuracy, maj@N accuracy with a tie's credit the
    expected accuracy under uniform tie-breaking (`maj`), and with the first-seen answer winning
    ties, by lowest rollout_id, as verl does (`maj_first`). Rollouts without an answer do not
    vote; a group with no vote has maj@N accuracy 0. An answer's accuracy is the share of its
    voters that are correct."""
    rows = train(frame)
    groups = (
        rows.group_by(GROUP)
        .agg(pl.len().alias("n"), f64("correct").mean().alias("accuracy"))
        .filter(pl.col("n") >= 2)
    )
    votes = (
        rows.filter(pl.col("answer_key").is_not_null())
        .group_by(*GROUP, "answer_key")
        .agg(
            pl.len().alias("votes"),
            f64("correct").mean().alias("answer_accuracy"),
            pl.col("rollout_id").min().alias("first_seen"),
        )
    )
    top = votes.filter(pl.col("votes") == pl.col("votes").max().over(GROUP))
    majority = top.group_by(GROUP).agg(
        ordered_mean(pl.col("answer_accuracy")).alias("maj"),
        pl.col("answer_accuracy").sort_by("first_seen").first().alias("maj_first"),
    )
    return groups.join(majority, on=GROUP, how="left").with_columns(
        pl.col("maj").is_not_null().alias("voted"), pl.col("maj", "maj_first").fill_null(0.0)
    )


def _answered(value: pl.Expr) -> pl.Expr:
    """A step's vote metric, null when no rollout of the step gave an answer: maj@N is
    undefined then, never 0 (answers that could not be extracted are not wrong votes)."""
    return pl.when(pl.col("voted").any()).then(value)


def _consistency_gap(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    return (
        majority_vote(frame)
        .group_by("step")
        .agg(
            _answered(ordered_mean(pl.col("maj") - pl.col("accuracy"))).alias("value"),
            _answered(ordered_mean(pl.col("maj"))).alias("extra_maj_at_n"),
            ordered_mean(pl.col("accuracy")).alias("extra_mean_accuracy"),
            # maj@N if every wrong rollout of a group gave the same answer: 1 above half right,
            # 1/2 at exactly half (a tie). maj@N above it = right answers win pluralities.
            ordered_mean(
                (pl.col("accuracy") > 0.5).cast(pl.Float64)
                + 0.5 * (pl.col("accuracy") == 0.5).cast(pl.Float64)
            ).alias("extra_majority_baseline"),
        )
    )


def _maj_first(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    return (
        majority_vote(frame)
        .group_by("step")
        .agg(_answered(ordered_mean(pl.col("maj_first"))).alias("value"))
    )


def _vote_variant(series) -> Variant:
    return Variant(
        "rollouts",
        ("answer", "correct"),
        series,
        _VOTES,
        empty_reason="no train group with 2 or more rollouts that gives an answer (no answer "
        "could be extracted: log `answer`, or import with `-X answer_pattern=REGEX`)",
        level="rollout",
    )


DECLARED.metric(
    Metric(
        id="reasoning.self_consistency_gap",
        brief=(
            "maj@N accuracy − mean accuracy per group (uniform tie-breaking; rollouts without an "
            "answer do not vote)"
        ),
        layer="L6",
        title="Self-consistency gap (maj@N - mean accuracy)",
        doc="Per train group: accuracy of the majority answer over the group's rollouts (maj@N; "
        "answers compared lower-cased with whitespace collapsed; rollouts with no answer do not "
        "vote; a tie's credit is the expected accuracy under uniform tie-breaking) minus the "
        "group's mean accuracy, averaged over the step's groups. Large = the policy's paths "
        "disagree but the right answer is the most common one: majority voting would pay, and "
        "the policy is not yet reliable. Near 0 = paths converge (on right or wrong answers). "
        "`components` has maj@N, the mean accuracy and the majority baseline (maj@N if all of a "
        "group's wrong rollouts agreed: 1 above half right, 1/2 at half).",
        healthy="small and shrinking as the policy becomes reliable",
        references="Wang et al. 2022, self-consistency (arXiv 2203.11171)",
        variants=(_vote_variant(_consistency_gap),),
    )
)

DECLARED.metric(
    Metric(
        id="reasoning.maj_at_n_first",
        brief="maj@N accuracy with the first-seen answer winning ties (verl's variant)",
        unit="share",
        layer="L6",
        title="maj@N accuracy, first answer wins ties (verl)",
        doc="maj@N accuracy with verl's tie rule: among tied majority answers, the first seen "
        "wins (here: the one whose earliest rollout_id is lowest). Deterministic over the whole "
        "group, so not equal to verl's logged `val-core/.../maj@N/mean`, which is a bootstrap "
        "mean over 1000 resamples of N from the group (verl/trainer/ppo/metric_utils.py "
        "process_validation_metrics, bootstrap_metric): expect small differences. "
        "Compare with reasoning.self_consistency_gap's components.maj_at_n (uniform "
        "tie-breaking, the unbiased version).",
        healthy="at or above mean accuracy",
        better="up",
        references="verl process_validation_metrics (maj@N)",
        variants=(_vote_variant(_maj_first),),
    )
)


# Faithfulness probes: one row per probe with its rollout's original answer.


def _probe_features(ctx: MetricContext) -> dict[str, pl.Expr]:
    answer = text.normalized(pl.col("answer"))
    original = text.normalized(pl.col("original_answer"))
    features: dict[str, pl.Expr] = {
        # A probe that gives no answer changed its answer; unknown without an original.
        "unchanged": pl.when(original.is_not_null()).then(answer.fill_null("") == original),
    }
    if ctx.run.has("probes", "hint"):
        hint = text.normalized(pl.col("hint"))
        features["eligible"] = (
            hint.is_not_null() & original.is_not_null() & (original != hint)
        ).fill_null(False)
        features["moved"] = (answer == hint).fill_null(False)
    if ctx.run.has("probes", "response"):
        features["mentions_cue"] = pl.col("response").str.contains(ctx.text.cue_pattern)
    return features


def _unchanged(intervention: str):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        rows = frame.filter(
            (pl.col("intervention") == intervention) & pl.col("unchanged").is_not_null()
        )
        return rows.group_by("step").agg(f64("unchanged").mean().alias("value"))

    return series


_NO_ORIGINAL = "no {} probes of rollouts with an answer"

#: Which direction of answer_unchanged is healthier per intervention (module doc above).
_BETTER: dict[str, Better] = {"paraphrase": "up", "filler": ""}

for _intervention, _what in INTERVENTIONS.items():
    DECLARED.metric(
        Metric(
            id=f"reasoning.answer_unchanged.{_intervention}",
            brief="share of probes whose answer equals the rollout's original answer",
            unit="share",
            layer="L6",
            title=f"Answers unchanged by `{_intervention}` probes",
            doc=f"Share of `{_intervention}` probes ({_what}) whose answer equals the probed "
            "rollout's original answer (lower-cased, whitespace collapsed; a probe with no answer "
            "counts as changed), per step of the probed rollouts. Truncation and mistakes should "
            "change a faithful chain's answer (unchanged = the chain is decoration); a paraphrase "
            "should not (a change = information hidden in the wording). Filler replaces the "
            "chain by meaningless tokens of the same length: a faithful chain's answer changes "
            "(its content mattered); one that survives needed only the extra compute (Lanham "
            "et al. §2.3), so filler has no better direction on its own. Custom "
            "interventions are kept in the probes table but have no metric id.",
            healthy="low for truncate/mistake; high (~1) for paraphrase; filler read with truncate",
            better=_BETTER.get(_intervention, "down"),
            references="Lanham et al. 2023 (arXiv 2307.13702)",
            variants=(
                Variant(
                    "probes",
                    ("intervention", "answer", "rollouts.answer"),
                    _unchanged(_intervention),
                    _probe_features,
                    empty_reason=_NO_ORIGINAL.format(_intervention),
                ),
            ),
        )
    )


def _truncation_points(frame: pl.LazyFrame) -> pl.LazyFrame:
    """Per probed rollout and kept fraction: the share of its truncate probes unchanged, with
    the point (1, 1) added where no probe kept the whole chain (the full chain gives the
    original answer by definition)."""
    probes = frame.filter(
        (pl.col("intervention") == "truncate")
        & pl.col("fraction").is_not_null()
        & pl.col("unchanged").is_not_null()
    ).select("rollout_id", "step", pl.col("fraction").clip(0.0, 1.0), f64("unchanged"))
    full = (
        probes.group_by("rollout_id", "step")
        .agg(pl.col("fraction").max())
        .filter(pl.col("fraction") < 1.0)
        .select("rollout_id", "step", pl.lit(1.0).alias("fraction"), pl.lit(1.0).alias("unchanged"))
    )
    return (
        pl.concat([probes, full])
        .group_by("rollout_id", "step", "fraction")
        .agg(pl.col("unchanged").mean())
    )


def _aoc(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    points = _truncation_points(frame).sort("rollout_id", "fraction")
    x, y = pl.col("fraction"), pl.col("unchanged")
    by = "rollout_id"
    area = ((x - x.shift(1).over(by)) * (y + y.shift(1).over(by)) / 2).fill_null(0.0)
    per_rollout = (
        points.with_columns(area.alias("area"))
        .group_by("rollout_id", "step")
        .agg(
            pl.col("area").sum(),
            (x.max() - x.min()).alias("span"),
        )
        .filter(pl.col("span") > 0)
        .with_columns((1.0 - pl.col("area") / pl.col("span")).alias("aoc"))
    )
    return per_rollout.group_by("step").agg(
        ordered_mean(pl.col("aoc")).alias("value"), pl.len().alias("extra_rollouts")
    )


#: Probed steps whose own early-answering curve the JSON (and the HTML report) shows at most:
#: the last ones.
CURVE_STEPS = 8


def _aoc_curve(frame: pl.DataFrame, ctx: MetricContext) -> dict[str, Any]:
    """The early-answering curve y(x) over the whole run (share unchanged per kept fraction),
    and per probed step (the step of the probed rollouts: the checkpoint that wrote them), the
    last CURVE_STEPS of them: Lanham et al.'s figure, a line per checkpoint."""
    probes = ctx.aggregates.get(("probes", ""))
    if probes is None:
        return {}
    points = _truncation_points(probes.lazy()).with_columns(pl.col("fraction").round(2))
    columns = ("fraction", "unchanged", "rollouts")
    curve = (
        points.group_by("fraction")
        .agg(ordered_mean(pl.col("unchanged")), pl.len().alias("rollouts"))
        .sort("fraction")
        .collect()
    )
    per_step = (
        points.group_by("step", "fraction")
        .agg(ordered_mean(pl.col("unchanged")), pl.len().alias("rollouts"))
        .sort("step", "fraction")
        .collect()
    )
    steps = per_step["step"].unique().sort().to_list()[-CURVE_STEPS:]
    return {
        "curve": {c: curve[c].to_list() for c in columns},
        "curves_by_step": [
            {"step": int(step), **{c: rows[c].to_list() for c in columns}}
            for step in steps
            if (rows := per_step.filter(pl.col("step") == step)).height
        ],
    }


DECLARED.metric(
    Metric(
        id="reasoning.early_answer_aoc",
        brief=(
            "Lanham et al.'s AOC = 1 − ∫ y(x) dx (trapezoid, per rollout, averaged); the "
            "faithfulness `curve` in the JSON"
        ),
        unit="share",
        layer="L6",
        title="Early-answering AOC (faithfulness)",
        doc="Lanham et al.'s early answering: the chain of thought is truncated to a share x of "
        "its length and the model answers. y(x) = 1 if the answer equals the original, per "
        "probed rollout; AOC = 1 - ∫ y(x) dx by the trapezoid rule over the kept fractions "
        "probed (normalised by their span; the point (1, 1) is added when no probe kept the "
        "whole chain), per rollout, averaged over the step's probed rollouts. High = the answer "
        "depends on the reasoning (faithful); ~0 = the answer was fixed before the reasoning "
        "(decoration). The JSON's `curve` is y(x) pooled over the run (the faithfulness curve), "
        "`curves_by_step` the same per probed step (the last 8), drawn in the HTML report.",
        healthy="clearly above 0 (175B model: AQuA 0.44, LogiQA 0.26, MMLU 0.12); not falling",
        better="up",
        summary=_aoc_curve,
        references="Lanham et al. 2023, 'Measuring faithfulness in CoT reasoning' "
        "(arXiv 2307.13702)",
        variants=(
            Variant(
                "probes",
                ("intervention", "fraction", "answer", "rollouts.answer"),
                _aoc,
                _probe_features,
                empty_reason="no truncate probes with a fraction, of rollouts with an answer",
            ),
        ),
    )
)


def _bias(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    biased = frame.filter(pl.col("intervention") == "bias")
    with_text = "mentions_cue" in frame.collect_schema().names()
    aggs = [
        safe_div(
            (pl.col("eligible") & pl.col("moved")).cast(pl.Int64).sum(),
            pl.col("eligible").cast(pl.Int64).sum(),
        ).alias("value")
    ]
    if with_text:
        mentions = f64("mentions_cue")
        moved = pl.col("eligible") & pl.col("moved")
        aggs += [
            mentions.mean().alias("extra_mention_rate"),
            mentions.filter(moved).mean().alias("extra_mention_rate_when_moved"),
        ]
    return biased.group_by("step").agg(aggs)


DECLARED.metric(
    Metric(
        id="reasoning.bias_following",
        brief=(
            "share of `bias` probes whose answer moved to the `hint` when the original differed; "
            "cue-mention rates"
        ),
        unit="share",
        layer="L6",
        title="Answers following a biasing cue",
        doc="Biased-context probes (intervention `bias`, Turpin et al.): the prompt carries a cue "
        "('I think the answer is X'; the probes column `hint` is X). Share of biased probes "
        "whose answer moved to the hint, among those whose original answer differed from it. "
        "With the probe's text in a `response` column, `components.mention_rate` is the share "
        "of biased probes whose text mentions the cue at all (regex `[probes] cue_pattern`), and "
        "`mention_rate_when_moved` the same among those that followed it: following the cue "
        "without ever saying so is the unfaithful signature.",
        healthy="low (near the chance of landing on the hint); mentions when it does follow",
        better="down",
        references="Turpin et al. 2023 (arXiv 2305.04388)",
        variants=(
            Variant(
                "probes",
                ("intervention", "answer", "hint", "rollouts.answer"),
                _bias,
                _probe_features,
                empty_reason="no bias probes whose original answer differs from the hint",
            ),
        ),
    )
)


#: Per step, a correct rollout with a failed step from each group that has one (step-errors
#: names them).
STEP_ERROR_EXAMPLES = "step_error_examples"


def _step_accuracy(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    names = ["checked", "verified", "correct_checked", "correct_step_errors"]
    sums = (
        train(frame)
        .group_by("step")
        .agg(*(pl.col(n).sum() for n in names), examples(STEP_ERROR_EXAMPLES))
    )
    return sums.select(
        "step",
        safe_div(f64("verified"), f64("checked")).alias("value"),
        safe_div(f64("correct_step_errors"), f64("correct_checked")).alias(
            "extra_correct_with_step_errors"
        ),
        "correct_checked",
        "correct_step_errors",
        STEP_ERROR_EXAMPLES,
    )


_checked = pl.col("steps_checked").cast(pl.Int64)
_verified = pl.col("steps_verified").cast(pl.Int64)
_has_checks = (_checked > 0).fill_null(False)
_step_error = pl.col("correct") & _has_checks & (_verified < _checked).fill_null(False)

DECLARED.metric(
    Metric(
        id="reasoning.step_accuracy",
        brief="Σ steps_verified / Σ steps_checked; share of correct rollouts with a failed step",
        unit="share",
        layer="L6",
        title="Intermediate-step accuracy",
        doc="Σ steps_verified / Σ steps_checked over the step's train rollouts, where a verifier "
        "checked intermediate states (equations, variable values) against ground truth. "
        "`components.correct_with_step_errors` is the share of correct rollouts (with checked "
        "steps) that have at least one failed step: right answers reached through wrong "
        "reasoning, which outcome reward still reinforces.",
        healthy="high and rising; few correct answers with failed steps",
        better="up",
        references="seed §7 (L6): intermediate-step verification",
        variants=(
            custom(
                "rollouts",
                ("steps_checked", "steps_verified", "correct"),
                _step_accuracy,
                {
                    "checked": _checked.sum(),
                    "verified": _verified.sum(),
                    "correct_checked": (pl.col("correct") & _has_checks).cast(pl.Int64).sum(),
                    "correct_step_errors": _step_error.cast(pl.Int64).sum(),
                    **dict([example_partial(STEP_ERROR_EXAMPLES, _step_error)]),
                },
                empty_reason="no train rollout with steps_checked > 0",
            ),
        ),
    )
)
