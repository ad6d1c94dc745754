"""L2 policy behaviour: token entropy and its drivers, response length vs correctness, tools."""

from __future__ import annotations

from typing import Any

import polars as pl

from rlscope import text
from rlscope.context import MetricContext
from rlscope.metrics._common import (
    custom,
    f64,
    per_rollout,
    ratio_variant,
    safe_div,
    step_column,
    step_sums,
    train,
)
from rlscope.spec import Declarations, Metric, Variant
from rlscope.tokenscan import (
    BIN_COUNT,
    ENTROPY_BIN_OFFSET,
    ENTROPY_BINS_PER_EFOLD,
    entropy_bin_midpoint,
)

#: This layer's metrics, in order (collected by rlscope.catalog).
DECLARED = Declarations()

ENTROPY_QUANTILE = 0.8

# Rollout group partials shared by several metrics (same name, same expression).
N = ("n", pl.len().cast(pl.Int64))
N_CORRECT = ("n_correct", pl.col("correct").cast(pl.Int64).sum())
LEN_SUM = ("len_sum", f64("response_len").sum())
LEN_SQ = ("len_sq", (f64("response_len") ** 2).sum())
LEN_CORRECT_SUM = ("len_correct_sum", (f64("response_len") * f64("correct")).sum())
CALLS_SUM = ("calls_sum", f64("n_tool_calls").sum())
CALLS_SQ = ("calls_sq", (f64("n_tool_calls") ** 2).sum())
ENT_N = ("ent_n", BIN_COUNT)

DECLARED.metric(
    Metric(
        id="behavior.entropy",
        brief="token-mean entropy (else logged, else mean −logprob)",
        logged_as=("entropy", "actor/entropy"),
        layer="L2",
        title="Token entropy",
        doc="Token-mean of the full-vocabulary entropy H = -Σ π log π (nats) per step. Without a "
        "token entropy column: the steps table's logged entropy, else the mean of -logprob of the "
        "sampled tokens (an unbiased Monte Carlo estimate of mean entropy). A monotone decline is "
        "normal; a steep early drop is collapse, and collapsed entropy caps attainable reward "
        "(R ≈ -a·e^H + b). Entropy is local: high entropy can be deliberation or guessing.",
        healthy="smooth decline; no loss of most of the initial entropy in the first steps",
        references="Cui et al. 2025 (arXiv 2505.22617); Wang et al. 2025 (arXiv 2506.01939)",
        trajectory=True,
        variants=(
            ratio_variant(
                "tokens",
                ("entropy",),
                ("ent_sum", f64("entropy").sum()),
                ENT_N,
                source="tokens.entropy",
            ),
            step_column("entropy"),
            ratio_variant(
                "tokens",
                ("logprob",),
                ("neg_logprob_sum", (-f64("logprob")).sum()),
                ("logprob_n", pl.col("logprob").count().cast(pl.Int64)),
                source="estimated as the token-mean of -logprob (no entropy column)",
            ),
        ),
    )
)


def _entropy_quantile(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    # numpy's linear quantile: the value at rank h = q·(n-1), interpolated between the values of
    # ranks floor(h) and ceil(h); each value is known to its bin, so we use the bin midpoint.
    binned = frame.filter(pl.col("entropy_bin").is_not_null() & (pl.col("ent_n") > 0))
    ordered = binned.sort("step", "entropy_bin").with_columns(
        pl.col("ent_n").cum_sum().over("step").alias("cum"),
        (ENTROPY_QUANTILE * (pl.col("ent_n").sum().over("step") - 1)).alias("rank"),
    )
    midpoint = entropy_bin_midpoint(pl.col("entropy_bin").first())

    def value_at(rank: pl.Expr, name: str) -> pl.LazyFrame:
        return (
            ordered.filter(pl.col("cum") > rank)
            .group_by("step")
            .agg(midpoint.alias(name), pl.col("rank").first())
        )

    low = value_at(pl.col("rank").floor(), "low")
    high = value_at(pl.col("rank").ceil(), "high").drop("rank")
    weight = pl.col("rank") - pl.col("rank").floor()
    return low.join(high, on="step").select(
        "step", (pl.col("low") + weight * (pl.col("high") - pl.col("low"))).alias("value")
    )


DECLARED.metric(
    Metric(
        id="behavior.entropy_p80",
        brief=(
            "80th percentile of token entropy (log-binned histogram: within 0.5% of (value + 0.05"
            " nats))"
        ),
        layer="L2",
        title="80th percentile of token entropy",
        doc="Per-step 80th percentile of token entropy: the threshold above which the 'forking' "
        "minority of high-entropy tokens lies (these carry most of the useful gradient). Computed "
        "from a per-step histogram with log-spaced bins, so memory does not grow with the number "
        "of tokens: within half a bin of numpy's linear quantile, i.e. within "
        f"{50 / ENTROPY_BINS_PER_EFOLD:g}% of (value + {ENTROPY_BIN_OFFSET:g} nats).",
        healthy="stays clearly above 0 (0.672 nats on Qwen3-8B CoT); falling to ~0 means even "
        "forking tokens have become deterministic",
        references="Wang et al. 2025, 'Beyond the 80/20 rule' (arXiv 2506.01939)",
        variants=(
            Variant("tokens", ("entropy",), _entropy_quantile, dict([ENT_N]), level="entropy_bins"),
        ),
    )
)

_both = pl.col("logprob").is_not_null() & pl.col("advantage").is_not_null()
_x = pl.when(_both).then(f64("logprob"))
_y = pl.when(_both).then(f64("advantage"))


def _cov(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    sums = frame.group_by("step").agg(pl.col("cov_n", "cov_x", "cov_y", "cov_xy").sum())
    n = pl.col("cov_n")
    mean_x, mean_y = pl.col("cov_x") / n, pl.col("cov_y") / n
    return sums.select(
        "step", pl.when(n > 1).then(pl.col("cov_xy") / n - mean_x * mean_y).alias("value")
    )


DECLARED.metric(
    Metric(
        id="behavior.entropy_adv_cov",
        brief="Cov(logprob, advantage) over the step's tokens",
        layer="L2",
        title="Cov(logprob, advantage) over tokens",
        doc="Per-step covariance between a token's log-probability and its advantage over the "
        "step's tokens (population covariance, accumulated in float64). Under policy gradient the "
        "entropy change is driven by this covariance: positive = confident tokens are being "
        "reinforced and entropy falls (Clip-Cov / KL-Cov target the tokens with the largest "
        "covariance).",
        healthy="small and near 0; persistently positive predicts entropy decline",
        references="Cui et al. 2025, 'The entropy mechanism of RL for reasoning LMs' "
        "(arXiv 2505.22617)",
        variants=(
            custom(
                "tokens",
                ("logprob", "advantage"),
                _cov,
                {
                    "cov_n": _both.cast(pl.Int64).sum(),
                    "cov_x": _x.sum(),
                    "cov_y": _y.sum(),
                    "cov_xy": (_x * _y).sum(),
                },
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="behavior.response_len",
        brief="mean response length",
        logged_as=("response_length/mean", "completions/mean_length", "response_len"),
        layer="L2",
        title="Mean response length",
        doc="Mean generated tokens per train rollout. Rising length is the R1/o1 signature, but "
        "on its own it says nothing: read it with the correct/incorrect split and the "
        "within-prompt length-correctness correlation.",
        healthy="any level; growth should come with accuracy (see behavior.len_correct_corr)",
        variants=(
            ratio_variant("rollouts", ("response_len",), LEN_SUM, N),
            # Runs with step metrics only: the trainer's own figure (tokens), as logged.
            step_column("response_len", source="steps.response_len as logged (tokens)"),
            step_column(
                "response_length/mean", source="steps.response_length/mean as logged (verl)"
            ),
            step_column(
                "completions/mean_length",
                source="steps.completions/mean_length as logged (TRL, tokens)",
            ),
            # The TRL importer's name for it (kept apart from rlscope's word counts).
            step_column(
                "completions/mean_length_logged",
                source="steps.completions/mean_length as logged (TRL, tokens)",
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="behavior.response_len_correct",
        brief="mean length of correct responses",
        layer="L2",
        title="Mean length of correct responses",
        doc="Mean response length over correct train rollouts. Dr. GRPO shows GRPO's 1/|o| "
        "normalisation rewards longer incorrect responses: track correct and incorrect lengths "
        "separately.",
        healthy="correct responses not systematically shorter than incorrect ones",
        references="Liu et al. 2025, Dr. GRPO (arXiv 2503.20783)",
        variants=(
            ratio_variant("rollouts", ("response_len", "correct"), LEN_CORRECT_SUM, N_CORRECT),
        ),
    )
)


def _len_incorrect(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    sums = (
        train(frame)
        .group_by("step")
        .agg(pl.col("len_sum", "len_correct_sum", "n", "n_correct").sum())
    )
    return sums.select(
        "step",
        safe_div(
            pl.col("len_sum") - pl.col("len_correct_sum"), pl.col("n") - pl.col("n_correct")
        ).alias("value"),
    )


DECLARED.metric(
    Metric(
        id="behavior.response_len_incorrect",
        brief="mean length of incorrect responses",
        layer="L2",
        title="Mean length of incorrect responses",
        doc="Mean response length over incorrect train rollouts. Incorrect responses growing "
        "longer than correct ones is Dr. GRPO's length bias, or overthinking.",
        healthy="not growing faster than behavior.response_len_correct",
        references="Liu et al. 2025, Dr. GRPO (arXiv 2503.20783)",
        variants=(
            custom(
                "rollouts",
                ("response_len", "correct"),
                _len_incorrect,
                dict([LEN_SUM, LEN_CORRECT_SUM, N, N_CORRECT]),
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="behavior.truncation_rate",
        brief="share at the length cap",
        band=(0.0, 0.05),
        unit="share",
        logged_as=("response_length/clip_ratio", "completions/clipped_ratio", "truncation_rate"),
        layer="L2",
        title="Truncation rate",
        doc="Share of train rollouts that hit the generation length cap (`truncated`, or "
        "response_len >= run.json max_response_len); without rollouts, the trainer's logged "
        "share (a value outside [0, 1] is corrupt and left out). Truncated responses usually get "
        "no reward for a reason unrelated to the task, which biases the learning signal.",
        healthy="below a few percent",
        references="verl response_length/clip_ratio; TRL completions/clipped_ratio",
        better="down",
        variants=(
            ratio_variant(
                "rollouts",
                ("truncated",),
                ("trunc_n", pl.col("truncated").cast(pl.Int64).sum()),
                N,
            ),
            # The trainer's own share, as logged (without rollouts, or without a cap to test).
            step_column("truncation_rate", source="steps.truncation_rate as logged", share=True),
            step_column(
                "response_length/clip_ratio",
                source="steps.response_length/clip_ratio as logged (verl)",
                share=True,
            ),
            step_column(
                "completions/clipped_ratio",
                source="steps.completions/clipped_ratio as logged (TRL)",
                share=True,
            ),
        ),
    )
)


def within_group_sums(
    frame: pl.LazyFrame, x_sum: str, x_sq: str, y_sum: str, y_sq: str | None, xy_sum: str
) -> pl.LazyFrame:
    """Per step: Σ over train groups (n >= 2) of the centred sums Sxx, Syy, Sxy.

    Centring each rollout by its group mean removes prompt difficulty from the relation.
    """
    n = pl.col("n").cast(pl.Float64)
    ysq = pl.col(y_sq) if y_sq else pl.col(y_sum)  # a 0/1 variable is its own square
    centred = (
        train(frame)
        .filter(pl.col("n") >= 2)
        .select(
            "step",
            (pl.col(x_sq) - pl.col(x_sum) ** 2 / n).alias("sxx"),
            (ysq - pl.col(y_sum) ** 2 / n).alias("syy"),
            (pl.col(xy_sum) - pl.col(x_sum) * pl.col(y_sum) / n).alias("sxy"),
            (n - 1).alias("dof"),
        )
    )
    return centred.group_by("step").agg(pl.col("sxx", "syy", "sxy", "dof").sum())


def _len_corr(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    sums = within_group_sums(frame, "len_sum", "len_sq", "n_correct", None, "len_correct_sum")
    denom = (pl.col("sxx") * pl.col("syy")).sqrt()
    return sums.with_columns(safe_div(pl.col("sxy"), denom).alias("value"))


DECLARED.metric(
    Metric(
        id="behavior.len_correct_corr",
        brief="length ↔ correctness correlation *within* prompt groups",
        band=(-0.1, None),
        layer="L2",
        title="Within-prompt length-correctness correlation",
        doc="Pearson correlation of response length and correctness after centring both by "
        "their prompt group's mean (pooled over the step's groups), so that prompt difficulty "
        "does not confound it: across prompts, hard prompts have long wrong answers. Positive = "
        "longer reasoning helps; ~0 while length grows = spurious length growth; negative = "
        "overthinking. Null at a step where no group has both correct and incorrect rollouts.",
        healthy="> 0 (longer → more correct within a prompt)",
        references="seed §3; Liu et al. 2025, Dr. GRPO (arXiv 2503.20783)",
        variants=(
            custom(
                "rollouts",
                ("response_len", "correct"),
                _len_corr,
                dict([N, N_CORRECT, LEN_SUM, LEN_SQ, LEN_CORRECT_SUM]),
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="behavior.tool_calls",
        brief="mean tool calls",
        layer="L2",
        title="Mean tool calls per rollout",
        doc="Mean n_tool_calls over train rollouts (or the length of `tool_calls`). A proxy of "
        "agency quality in search/tool agents: ~1 = calls when needed; near the cap = mechanical "
        "repeated calling; high variance within a prompt = unstable policy.",
        healthy="task-dependent; GiGPO reports ~0.9 single-hop, ~1.6 multi-hop; not at the cap",
        references="Feng et al. 2025, GiGPO; Wang et al. 2025, OTC (arXiv 2504.14870)",
        variants=(ratio_variant("rollouts", ("n_tool_calls",), CALLS_SUM, N),),
    )
)


def _cap_partials(ctx: MetricContext) -> dict[str, pl.Expr]:
    cap = int(ctx.run.meta["max_tool_calls"])
    return {"at_cap_n": (pl.col("n_tool_calls") >= cap).cast(pl.Int64).sum(), N[0]: N[1]}


def _cap_frac(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    sums = train(frame).group_by("step").agg(pl.col("at_cap_n", "n").sum())
    return sums.select("step", safe_div(pl.col("at_cap_n"), pl.col("n")).alias("value"))


DECLARED.metric(
    Metric(
        id="behavior.tool_cap_frac",
        brief="share at `max_tool_calls`",
        band=(0.0, 0.2),
        unit="share",
        layer="L2",
        title="Share of rollouts at the tool-call cap",
        doc="Share of train rollouts whose n_tool_calls reached run.json max_tool_calls. A "
        "rising share means the policy calls tools mechanically until stopped: invisible in "
        "reward, costly in latency and compute.",
        healthy="a small minority (< 0.1)",
        variants=(
            custom(
                "rollouts",
                ("n_tool_calls",),
                _cap_frac,
                _cap_partials,
                needs_meta=("max_tool_calls",),
            ),
        ),
    )
)


def _calls_std(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    sums = within_group_sums(frame, "calls_sum", "calls_sq", "calls_sum", "calls_sq", "calls_sq")
    means = train(frame).group_by("step").agg(pl.col("calls_sum", "n").sum())
    return sums.join(means, on="step").select(
        "step",
        safe_div(pl.col("sxx"), pl.col("dof")).sqrt().alias("value"),
        safe_div(pl.col("calls_sum"), pl.col("n")).alias("mean_calls"),
        "sxx",
        "dof",
    )


DECLARED.metric(
    Metric(
        id="behavior.tool_calls_std",
        brief="pooled within-prompt std of tool calls",
        layer="L2",
        title="Within-prompt std of tool calls",
        doc="Pooled within-group standard deviation of n_tool_calls: how differently the policy "
        "behaves on the same prompt, sqrt(Σ_groups Σ (calls - group mean)² / Σ_groups (n - 1)). "
        "Large relative to the mean number of calls = an unstable tool policy (seed §3).",
        healthy="small relative to behavior.tool_calls (coefficient of variation well below 1)",
        variants=(
            custom("rollouts", ("n_tool_calls",), _calls_std, dict([N, CALLS_SUM, CALLS_SQ])),
        ),
    )
)


# Rollout text and tools: per-rollout features (level "rollout"), parsed with the config's tags.


_CALLS = "_calls"


def _text_prelude(ctx: MetricContext) -> dict[str, pl.Expr]:
    tags = ctx.text.tags
    prelude = {**text.reasoning_prelude(tags), _CALLS: text.call_arguments(tags)}
    for segment in text.SEGMENTS:
        prelude[f"_seg_{segment}"] = text.segments(tags, segment)
    return prelude


def _text_features(ctx: MetricContext) -> dict[str, pl.Expr]:
    tags = ctx.text.tags
    features = {
        "has_response": pl.col("response").is_not_null(),
        "tagged": text.tagged(tags),
        "format_ok": text.format_ok(tags),
        "repetition": text.repetition(pl.col(text.REASONING_GRAMS)),
        "tag_calls_n": pl.col(_CALLS).list.len().cast(pl.Int64),
        "tag_calls_redundant": text.redundant_calls(pl.col(_CALLS)),
    }
    for segment in text.SEGMENTS:
        found = pl.col(f"_seg_{segment}")
        features[f"words_{segment}"] = text.segment_words(tags, segment, found=found)
        features[f"present_{segment}"] = found.list.len() > 0
    return features


def _text_variant(num: str, den: str | None = None, **options: Any) -> Variant:
    """A per-rollout metric over the response's text features."""
    return per_rollout(("response",), _text_features, num, den, prelude=_text_prelude, **options)


_LIST_CALLS = {
    "calls_n": pl.col("tool_calls").list.len().cast(pl.Int64),
    "calls_redundant": text.redundant_calls(
        pl.col("tool_calls").list.eval(pl.element().str.replace_all(r"\s+", " ").str.strip_chars())
    ),
}


def _segment_tokens(segment: str) -> Variant:
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        rows = frame.filter(pl.col("segment") == segment)
        return rows.select("step", safe_div(f64("seg_tokens"), f64("seg_rollouts")).alias("value"))

    partials = {
        "seg_tokens": pl.len().cast(pl.Int64),
        "seg_rollouts": pl.col("rollout_id").n_unique(),
    }
    return Variant(
        "tokens",
        ("segment",),
        series,
        partials,
        source="tokens.segment: tokens per rollout that has the segment",
        empty_reason=f"no token labelled `{segment}` in the tokens table's segment column",
        level="segments",
    )


def _segment_entropy(segment: str) -> Variant:
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        rows = frame.filter(pl.col("segment") == segment)
        return rows.select("step", safe_div(pl.col("ent_sum"), f64("ent_n")).alias("value"))

    return Variant(
        "tokens",
        ("segment", "entropy"),
        series,
        dict([("ent_sum", f64("entropy").sum()), ENT_N]),
        empty_reason=f"no token labelled `{segment}` (with an entropy) in the tokens table",
        level="segments",
    )


_SEGMENT_DOCS = {
    "think": "the reasoning before acting or answering",
    "answer": "the final answer",
    "tool_call": "tool calls (a call's JSON, or a Search-R1 query)",
    "tool_response": "what the tools returned (injected by the environment, not generated)",
}

for _segment, _what in _SEGMENT_DOCS.items():
    DECLARED.metric(
        Metric(
            id=f"behavior.segment_len.{_segment}",
            brief=(
                "tokens per rollout in the segment (tokens' `segment`), else words inside its "
                "tags; `components.present`"
            ),
            layer="L2",
            title=f"Length of the {_segment} segment",
            doc=f"Mean length of {_what} per train rollout that has such a segment: tokens "
            "labelled with this `segment` in the tokens table, else whitespace words inside the "
            f"response's {_segment} tags (all of a rollout's {_segment} segments added up; tag "
            "names per segment are set under [tags] in config). `components.present` is the "
            "share of rollouts with the segment. Read with behavior.response_len: a think segment "
            "that grows while the answer and accuracy do not is spurious length growth "
            "localised. From tokens, rollouts are counted per batch of a token file (files are "
            "reduced separately and merged): exact when each rollout's tokens lie in one batch, "
            "as RunWriter and the importers write them; a rollout cut by a file or batch "
            "boundary counts once per piece, so the length is low by at most a share B/R (B "
            "boundaries inside the step, R rollouts with the segment; with 1M-row files of 1k-"
            "token responses, 0.1% per boundary).",
            healthy="task-dependent; growth should come with accuracy, and no segment vanishing",
            variants=(
                _segment_tokens(_segment),
                _text_variant(
                    f"words_{_segment}",
                    source=f"rollouts.response: words inside the {_segment} tags",
                    components={"present": (f"present_{_segment}", "has_response")},
                    empty_reason=f"no response has a {_segment} segment (tags: see [tags])",
                ),
            ),
        )
    )

for _segment in text.SEGMENTS:
    DECLARED.metric(
        Metric(
            id=f"behavior.entropy.{_segment}",
            brief="token-mean entropy of the segment's tokens",
            layer="L2",
            title=f"Token entropy in the {_segment} segment",
            doc=f"Token-mean entropy (nats) of the tokens labelled `{_segment}` in the tokens "
            "table's `segment` column. Exploration lives in the reasoning: a think segment whose "
            "entropy collapses while the answer's stays put means the policy stopped exploring "
            "how it reasons, not what it answers.",
            healthy="think entropy declining smoothly, above the answer's",
            references="Wang et al. 2025 (arXiv 2506.01939)",
            variants=(_segment_entropy(_segment),),
        )
    )

DECLARED.metric(
    Metric(
        id="behavior.format_ok",
        brief=(
            "share with balanced tags in the allowed order, a non-blank answer, tool calls that "
            "parse as JSON with `name` and `arguments`"
        ),
        unit="share",
        layer="L2",
        title="Format compliance",
        doc="Share of train rollouts whose response has balanced tags in the allowed order (an "
        "optional think, then any number of tool call → optional tool response → optional think, "
        "then exactly one answer), a non-blank answer, and every JSON tool call parsing with "
        "`name` and `arguments`. Tag names per segment are set under [tags] in config (default: "
        "Qwen/Hermes think/answer/tool_call/tool_response and Search-R1 search/information). "
        "Null at steps where no response uses any tag (an untagged run is not judged); "
        "`components.tagged` is the share of responses using tags. Format breaks get no reward "
        "for reasons unrelated to the task and waste the batch.",
        healthy="> 0.95 and not falling",
        better="up",
        variants=(
            _text_variant(
                "format_ok",
                "has_response",
                defined_if="tagged",
                components={"tagged": ("tagged", "has_response")},
                source="rollouts.response parsed with the [tags] tag set",
                empty_reason="no response uses any tag of the [tags] tag set",
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="behavior.repetition",
        brief="mean 1 − distinct/total word 3-grams of the think segment (else the whole response)",
        unit="share",
        layer="L2",
        title="Repetition in the reasoning",
        doc="Mean over train rollouts of 1 - distinct/total word 3-grams (lower-cased, whitespace "
        "split) in the think segments, or in the whole response when it has no think tag "
        "(open-r1's repetition measure); rollouts of fewer than 3 words are left out. Loops "
        "('wait, let me re-check... wait, let me re-check...') raise it long before they hit "
        "the length cap.",
        healthy="< 0.1 (natural text repeats few 3-grams)",
        better="down",
        references="open-r1 repetition penalty (n = 3)",
        variants=(
            _text_variant(
                "repetition",
                source="rollouts.response: word 3-grams of the think segments",
                empty_reason="no response with at least 3 words",
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="behavior.redundant_tool_calls",
        brief="share of tool calls repeating an earlier call's arguments in the rollout",
        unit="share",
        layer="L2",
        title="Redundant tool calls",
        doc="Share of tool calls that repeat an earlier call's arguments in the same rollout "
        "(exact string after whitespace normalisation): Σ (calls - distinct calls) / Σ calls "
        "over the step's train rollouts. From `tool_calls` (serialized arguments), else from the "
        "response's tool-call tags. Invisible in reward, but it multiplies cost and latency.",
        healthy="< 0.05",
        better="down",
        references="Wang et al. 2025, OTC (arXiv 2504.14870)",
        variants=(
            per_rollout(
                ("tool_calls",),
                _LIST_CALLS,
                "calls_redundant",
                "calls_n",
                source="rollouts.tool_calls",
                empty_reason="no tool calls",
            ),
            _text_variant(
                "tag_calls_redundant",
                "tag_calls_n",
                source="rollouts.response: tool-call tags",
                empty_reason="no tool-call tags in any response",
            ),
        ),
    )
)


def _productivity(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    sums = step_sums(frame, ["n_correct", "calls_sum"], groups=True)
    return sums.select("step", safe_div(f64("n_correct"), pl.col("calls_sum")).alias("value"))


DECLARED.metric(
    Metric(
        id="behavior.tool_productivity",
        brief="correct answers per tool call",
        layer="L2",
        title="Correct answers per tool call",
        doc="Σ correct / Σ tool calls over the step's train rollouts (OTC's tool productivity). "
        "Falling while accuracy holds = more calls for the same answers; null at steps without "
        "calls.",
        healthy="stable or rising",
        references="Wang et al. 2025, OTC (arXiv 2504.14870)",
        variants=(
            custom(
                "rollouts",
                ("n_tool_calls", "correct"),
                _productivity,
                dict([N_CORRECT, CALLS_SUM]),
                empty_reason="no tool calls",
            ),
        ),
    )
)
