"""L1 training stability: loss, gradient norm, clip fraction, KL to the reference, PPO KL."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import polars as pl

from rlscope.context import MetricContext
from rlscope.exactsum import ordered_sum
from rlscope.metrics._common import custom, f64, ratio_variant, safe_div, step_column, step_sums
from rlscope.reader import INVALID_PREFIX
from rlscope.spec import Declarations, Metric, Variant
from rlscope.tokenscan import ADVANTAGE_TIERS, HISTOGRAMS, MAX_PREFIX

#: This layer's metrics, in order (collected by rlscope.catalog).
DECLARED = Declarations()

_d = f64("ref_logprob") - f64("logprob")
K3 = _d.exp() - _d - 1.0

DECLARED.metric(
    Metric(
        id="stability.loss",
        brief="policy loss as logged",
        layer="L1",
        title="Policy loss",
        doc="The trainer's logged loss per optimizer step. In policy-gradient RL the loss is not "
        "an objective that must fall: its level depends on the advantage normalisation, and it can "
        "keep falling while the policy degenerates. Read it for spikes and NaNs, not for progress.",
        healthy="no spikes or NaNs; the level itself carries little meaning",
        variants=(step_column("loss"),),
    )
)

DECLARED.metric(
    Metric(
        id="stability.grad_norm",
        brief="gradient norm as logged",
        layer="L1",
        title="Gradient norm",
        doc="The trainer's logged gradient norm (before clipping) per step. In sparse-reward runs "
        "a spike usually coincides with one rollout of extreme reward; rlscope's grad-spike "
        "finding names the step and its most extreme rollouts.",
        healthy="smooth, slowly varying; isolated multiplicative outliers are spikes",
        variants=(step_column("grad_norm"),),
    )
)


DECLARED.metric(
    Metric(
        id="stability.lr",
        brief="learning rate as logged",
        layer="L1",
        title="Learning rate",
        doc="The trainer's logged learning rate per step (format v1 `lr`; TRL `learning_rate`, "
        "verl `actor/lr`). An optimizer step moves the weights by the learning rate times the "
        "(Adam-normalised) gradient, so where the rate is 0 nothing is learned whatever the loss "
        "and gradients show: a warmup longer than the run, a schedule that reaches 0 early, or "
        "a rate of 0 in the config.",
        healthy="> 0 at every step after warmup; a schedule may decay towards 0 at the very end",
        variants=(step_column("lr"),),
    )
)


def _nonfinite(column: str) -> pl.Expr:
    """Values of `column` that were NaN or ±inf in the file (the reader reads them as null and
    flags them; `column` is named too so that the steps scan turns the flags on)."""
    return (pl.col(INVALID_PREFIX + column) & pl.col(column).is_null()).cast(pl.Int64).sum()


#: The critic's value loss under each name it is logged as: a non-finite one is counted too.
VALUE_LOSS_COLUMNS = ("value_loss", "critic/vf_loss", "critic_loss")


def _nonfinite_variant(columns: tuple[str, ...]) -> Variant:
    """NaN/inf counts of `columns`, and of the value loss where the run logged one."""

    def counted(ctx: MetricContext) -> tuple[str, ...]:
        return columns + tuple(c for c in VALUE_LOSS_COLUMNS if ctx.run.has("steps", c))

    def partials(ctx: MetricContext) -> dict[str, pl.Expr]:
        return {f"nonfinite_{c}": _nonfinite(c) for c in counted(ctx)}

    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        names = counted(ctx)
        return frame.select(
            "step",
            pl.sum_horizontal(pl.col(f"nonfinite_{c}").fill_null(0) for c in names)
            .cast(pl.Float64)
            .alias("value"),
            *(pl.col(f"nonfinite_{c}").cast(pl.Float64).alias(f"extra_{c}") for c in names),
        )

    return custom(
        "steps",
        columns,
        series,
        partials,
        source="steps: " + ", ".join(columns) + " (and a logged value loss) logged as NaN or ±inf",
    )


DECLARED.metric(
    Metric(
        id="stability.nonfinite",
        brief="logged loss, grad norm and value loss values that are NaN or ±inf, per step",
        layer="L1",
        title="Non-finite loss, gradient norm or value loss",
        doc="Per step, how many of the logged loss, gradient norm and (PPO with a critic) value "
        "loss are NaN or ±inf (verl and TRL write NaN, verl's orjson writer null, which its "
        "importer keeps as NaN). A non-finite gradient norm means the update was NaN (or skipped "
        "by a loss scaler): the divergence finding names the steps; a non-finite value loss is "
        "a critic that diverged (value-divergence). rlscope's other step metrics leave those "
        "values out.",
        healthy="0 at every step",
        better="down",
        variants=(
            _nonfinite_variant(("loss", "grad_norm")),
            _nonfinite_variant(("grad_norm",)),
            _nonfinite_variant(("loss",)),
        ),
    )
)


_ratio = (f64("logprob") - f64("old_logprob")).exp()
_adv = f64("advantage")


def clip_partials(ctx: MetricContext) -> dict[str, pl.Expr]:
    """TRL's rule: low-clipped r < 1-ε_low with A < 0, high-clipped r > 1+ε_high with A > 0."""
    low, high = ctx.run.meta.get("clip_ratio_low"), ctx.run.meta.get("clip_ratio_high")
    eps_low = float(low) if low is not None else 0.2
    eps_high = float(high) if high is not None else eps_low
    valid = _ratio.is_not_null() & _adv.is_not_null()
    return {
        "clip_low_n": ((_ratio < 1 - eps_low) & (_adv < 0)).cast(pl.Int64).sum(),
        "clip_high_n": ((_ratio > 1 + eps_high) & (_adv > 0)).cast(pl.Int64).sum(),
        "clip_ratio_n": valid.cast(pl.Int64).sum(),
    }


def _clip_from_ratio(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    sums = step_sums(frame, ["clip_low_n", "clip_high_n", "clip_ratio_n"])
    n = pl.col("clip_ratio_n")
    return sums.select(
        "step",
        safe_div(pl.col("clip_low_n") + pl.col("clip_high_n"), n).alias("value"),
        safe_div(pl.col("clip_low_n"), n).alias("extra_low"),
        safe_div(pl.col("clip_high_n"), n).alias("extra_high"),
    )


DECLARED.metric(
    Metric(
        id="stability.clip_frac",
        brief="token-mean of `clipped`, else TRL's low/high rule from the ratio, else logged",
        unit="share",
        logged_as=("clip_frac", "actor/pg_clipfrac", "clip_ratio/region_mean"),
        layer="L1",
        title="PPO clip fraction",
        doc="Share of tokens whose PPO ratio clip is active. From the tokens' `clipped` flag when "
        "logged; otherwise derived with TRL's rule from r = exp(logprob - old_logprob) and the "
        "token advantage (low: r < 1-ε_low and A < 0; high: r > 1+ε_high and A > 0; ε from "
        "run.json clip_ratio_low/high, default 0.2); otherwise the steps table's clip_frac (a "
        "logged value outside [0, 1] is corrupt and left out). Fully "
        "on-policy runs (one update per batch) have r = 1 and a clip fraction of 0 by "
        "construction. Read with entropy: low entropy with a high clip fraction is the classic "
        "instability (entropy-clip-conflict).",
        healthy="moderate and stable, typically 0.001-0.05 with ε = 0.2; > 0.1 is aggressive",
        references="TRL clip_ratio/{low,high,region}_mean; verl actor/pg_clipfrac",
        variants=(
            ratio_variant(
                "tokens",
                ("clipped",),
                ("clip_n", f64("clipped").sum()),
                ("clip_valid_n", pl.col("clipped").count()),
                source="tokens.clipped",
            ),
            custom(
                "tokens",
                ("logprob", "old_logprob", "advantage"),
                _clip_from_ratio,
                clip_partials,
                source="derived from the token ratio and advantage (TRL's rule)",
            ),
            step_column("clip_frac", share=True),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.kl",
        brief="token-mean k3 = e^d − d − 1, d = ref_logprob − logprob, else logged `kl`",
        logged_as=("kl", "actor/kl_loss"),
        layer="L1",
        title="KL to the reference policy (k3)",
        doc="Token-mean k3 estimator of KL(π‖π_ref): with d = ref_logprob - logprob, "
        "k3 = e^d - d - 1 (non-negative, low variance; TRL logs it as `kl`; verl's low_var_kl "
        "additionally clamps to [-10, 10], rlscope does not). Without token log-probs, the steps "
        "table's logged `kl`. The absolute value has no standard; the shape of the curve matters: "
        "flat near zero = not moving from the base model, accelerating = drifting away from it.",
        healthy="grows smoothly and sub-linearly from 0; neither flat at ~0 nor accelerating",
        references="Schulman, 'Approximating KL divergence' (k1/k2/k3)",
        variants=(
            ratio_variant(
                "tokens",
                ("logprob", "ref_logprob"),
                ("kl_sum", K3.sum()),
                ("kl_n", _d.count()),  # = K3.count(), without evaluating e^d to count
                source="tokens: token-mean k3",
            ),
            step_column("kl"),
        ),
    )
)

_ppo = f64("old_logprob") - f64("logprob")
DECLARED.metric(
    Metric(
        id="stability.ppo_kl",
        brief="token-mean old_logprob − logprob",
        logged_as=("ppo_kl", "actor/ppo_kl"),
        layer="L1",
        title="PPO KL (drift within one update)",
        doc="Token-mean of old_logprob - logprob (verl's actor/ppo_kl): how far the updated "
        "policy has moved from the behaviour policy that generated the batch. Zero for fully "
        "on-policy single-update runs; large values mean the update overshoots the trust region.",
        healthy="small (|ppo_kl| << 0.01 per token is typical) and stable",
        references="verl actor/ppo_kl",
        variants=(
            ratio_variant(
                "tokens",
                ("logprob", "old_logprob"),
                ("ppo_kl_sum", _ppo.sum()),
                ("ppo_kl_n", _ppo.count()),
                source="tokens: token-mean old_logprob - logprob",
            ),
        ),
    )
)


# --- the training–inference mismatch: the sampler's log-probs against the trainer's ------------

#: Where the trainer's log-prob of the sampled token is read, first found first: the behaviour
#: policy as the trainer recomputes it before the update (verl old_log_prob, TRL
#: old_per_token_logps), else the current policy (the same one in a single on-policy update).
_TRAINER_LOGPROBS = (("old_logprob", "old"), ("logprob", "cur"))
#: |log ratio| beyond which a token counts in the tail: the ratio outside [1/2, 2], the bound
#: truncated and masked importance sampling use by default (verl rollout_is_threshold = 2).
TAIL_LOG_RATIO = 0.6931471805599453  # ln 2


def _token_mean_and_se(
    total: str, count: str, squares: str, frame: pl.LazyFrame, ctx: MetricContext
) -> pl.LazyFrame:
    """Per step, the token mean and its standard error over the step's tokens (extra_token_se,
    as if tokens were independent; extra_n the tokens)."""
    return step_sums(frame, [total, count, squares]).select(
        "step", *_mean_and_token_se(total, count, squares)
    )


def _mean_and_token_se(total: str, count: str, squares: str) -> list[pl.Expr]:
    """value, extra_n and extra_token_se from a step's summed columns."""
    n = pl.col(count).cast(pl.Float64)
    mean = pl.col(total) / n
    spread = pl.max_horizontal((pl.col(squares) / n - mean**2) * n / (n - 1), pl.lit(0.0))
    return [
        safe_div(pl.col(total), n).alias("value"),
        n.alias("extra_n"),
        pl.when(n > 1).then((spread / n).sqrt()).alias("extra_token_se"),
    ]


def _rollout_mean_and_se(
    total: str, count: str, squares: str, frame: pl.LazyFrame, ctx: MetricContext
) -> pl.LazyFrame:
    """`_token_mean_and_se` from sums per (step, rollout) (the token scan's ids level), and
    the step mean's standard error with each rollout's tokens as one draw (extra_rollout_se:
    the ratio estimator's over the step's R rollouts, √(Σ_r (S_r − mean·n_r)² · R/(R−1)) / Σ n_r).
    A sequence's tokens share a prompt and a policy state, so they are correlated and the
    token-level error understates the step's; this one needs no assumption on by how much."""
    rollouts = frame.filter(pl.col(count) > 0).select(
        "step", *(pl.col(c).cast(pl.Float64) for c in (total, count, squares))
    )
    steps = rollouts.group_by("step").agg(
        *(ordered_sum(pl.col(c)).alias(c) for c in (total, count, squares)),
        pl.len().cast(pl.Float64).alias("__rollouts"),
    )
    centred = pl.col(total) - pl.col("__mean") * pl.col(count)
    residuals = (
        rollouts.join(
            steps.select("step", (pl.col(total) / pl.col(count)).alias("__mean")), on="step"
        )
        .group_by("step")
        .agg(ordered_sum(centred**2).alias("__residual"))
    )
    r = pl.col("__rollouts")
    return (
        steps.join(residuals, on="step")
        .select(
            "step",
            *_mean_and_token_se(total, count, squares),
            r.alias("extra_rollouts"),
            pl.when(r > 1)
            .then((pl.col("__residual") * r / (r - 1)).sqrt() / pl.col(count))
            .alias("extra_rollout_se"),
        )
        .sort("step")
    )


def _mismatch_variants(
    name: str,
    per_token: Callable[[pl.Expr, pl.Expr], pl.Expr],
    source: str,
    logged: tuple[tuple[str, str], ...] = (),
    *,
    by_rollout: bool = False,
) -> tuple[Variant, ...]:
    """Token-mean of `per_token(trainer, sampler)` log-probs: the trainer's old_logprob (else
    logprob) and rollout_logprob; then the trainers' logged columns, (column, whose). With
    `by_rollout`, summed per (step, rollout) for the step's error by rollout too."""
    variants = []
    for column, tag in _TRAINER_LOGPROBS:
        value = per_token(f64(column), f64("rollout_logprob"))
        names = [f"mm_{name}_{tag}_{k}" for k in ("sum", "n", "sq")]
        series = _rollout_mean_and_se if by_rollout else _token_mean_and_se
        variants.append(
            Variant(
                "tokens",
                (column, "rollout_logprob"),
                partial(series, names[0], names[1], names[2]),
                dict(zip(names, (value.sum(), value.count(), (value**2).sum()), strict=True)),
                source=f"tokens: token-mean {source}, d = {column} - rollout_logprob",
                level="ids" if by_rollout else "",
            )
        )
    for column, whose in logged:
        variants.append(step_column(column, source=f"steps.{column} as logged ({whose})"))
    return tuple(variants)


def _k3(trainer: pl.Expr, sampler: pl.Expr) -> pl.Expr:
    d = trainer - sampler
    return d.exp() - d - 1.0


_MISMATCH_WHY = (
    "The sampling engine (vLLM, SGLang: bf16 or fp8 kernels, other reductions) and the trainer "
    "(FSDP, Megatron) compute different probabilities for the same weights and token, so the "
    "rollouts come from a policy the trainer does not optimise: the update is off-policy "
    "without saying so. The gap grows with the policy's sharpness and has been seen to rise "
    "for hundreds of steps before a collapse (Liu, Li et al. 2025, 'When Speed Kills "
    "Stability'; Yao et al. 2025, truncated importance sampling). "
)

DECLARED.metric(
    Metric(
        id="stability.mismatch_kl",
        brief="training–inference mismatch: token-mean k3 KL(sampler ‖ trainer) from "
        "rollout_logprob, else verl's rollout_corr/k3_kl",
        logged_as=("rollout_corr/k3_kl",),
        layer="L1",
        title="Training–inference mismatch (KL, k3)",
        doc=_MISMATCH_WHY + "Per step, the token-mean k3 = e^d − d − 1 with d = the trainer's "
        "log-prob (old_logprob, else logprob) − the sampler's (rollout_logprob): an estimate of "
        "KL(π_sampler ‖ π_trainer) per token from the sampled tokens (verl "
        "rollout_corr_helper.py `compute_offpolicy_metrics` `k3_kl`, the same formula). It is "
        "not the KL to the reference (stability.kl): that one measures how far training moved "
        "the policy from its start; this one how far two implementations of the *same* policy "
        "disagree, and it should stay near 0 whatever training does. Per token, it does not "
        "depend on the vocabulary; a sequence of T tokens carries T times it "
        "(train-inference-mismatch judges that).",
        healthy="~1e-4 per token or less and flat; rising over the run is the warning sign",
        references="Liu, Li et al. 2025 (When Speed Kills Stability); Yao et al. 2025 (TIS); "
        "verl rollout_corr/k3_kl",
        better="down",
        variants=_mismatch_variants(
            "k3",
            _k3,
            "k3 = e^d - d - 1",
            (("rollout_corr/k3_kl", "verl, rollout_corr_helper.py compute_offpolicy_metrics"),),
            by_rollout=True,
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.mismatch_log_ppl_gap",
        brief="token-mean rollout_logprob − trainer log-prob = log(PPL_trainer / PPL_sampler) "
        "(k1), else verl's rollout_corr/kl",
        logged_as=("rollout_corr/kl",),
        layer="L1",
        title="Training–inference mismatch (log-perplexity gap, k1)",
        doc="Per step, the token-mean of rollout_logprob − the trainer's log-prob (old_logprob, "
        "else logprob): the log of the trainer's perplexity over the sampler's on the sampled "
        "tokens, and the k1 estimator of KL(π_sampler ‖ π_trainer) (verl "
        "rollout_corr_helper.py `compute_offpolicy_metrics` `kl`, the same formula; its "
        "`log_ppl_diff` averages per sequence first and is kept as logged). Positive: the "
        "sampler is more confident than the trainer. Unlike k3 it has a sign and a larger "
        "variance; see stability.mismatch_kl for why the gap matters.",
        healthy="near 0, flat",
        references="verl rollout_corr/kl, rollout_corr/log_ppl_diff",
        variants=_mismatch_variants(
            "k1",
            lambda trainer, sampler: sampler - trainer,
            "-d",
            (("rollout_corr/kl", "verl, rollout_corr_helper.py compute_offpolicy_metrics"),),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.mismatch_abs_logp",
        brief="token-mean |trainer log-prob − rollout_logprob|, else TRL's "
        "sampling/sampling_logp_difference/mean",
        logged_as=("sampling/sampling_logp_difference/mean",),
        layer="L1",
        title="Training–inference mismatch (mean |Δ log p|)",
        doc="Per step, the token-mean absolute difference between the trainer's log-prob "
        "(old_logprob, else logprob) and the sampler's (rollout_logprob): what TRL logs as "
        "`sampling/sampling_logp_difference/mean` when it samples with vLLM and corrects by "
        "importance sampling (grpo_trainer.py `_generate_and_score_completions`, "
        "`vllm_importance_sampling_correction`). For small, centred differences it relates to "
        "the KL as k ≈ (π/4)·mean|d|² (a normal d: E|d| = σ√(2/π), k3 ≈ σ²/2), which is how "
        "train-inference-mismatch judges a run that logged only this.",
        healthy="small (a few hundredths of a nat or less) and flat",
        references="TRL sampling/sampling_logp_difference/mean",
        better="down",
        variants=_mismatch_variants(
            "abs",
            lambda trainer, sampler: (trainer - sampler).abs(),
            "|d|",
            (("sampling/sampling_logp_difference/mean", "TRL, grpo_trainer.py"),),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.mismatch_tail",
        brief="share of tokens whose sampler/trainer probability ratio is outside [1/2, 2]",
        unit="share",
        layer="L1",
        title="Training–inference mismatch (tail share)",
        doc="Per step, the share of tokens with |trainer log-prob − rollout_logprob| > ln 2: "
        "the tokens truncated importance sampling would clip and masked importance sampling "
        "would drop at the usual bound of 2 (verl `rollout_is_threshold` default). The "
        "mismatch concentrates on low-probability tokens, which a mean hides: a growing tail "
        "is where the gradient's bias comes from (Liu, Li et al. 2025).",
        healthy="well below 1%",
        references="Liu, Li et al. 2025; Yao et al. 2025 (TIS)",
        better="down",
        variants=_mismatch_variants(
            "tail",
            lambda trainer, sampler: ((trainer - sampler).abs() > TAIL_LOG_RATIO).cast(pl.Float64),
            "[|d| > ln 2]",
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.mismatch_prob_diff",
        brief="token-mean |p_trainer − p_sampler| of the sampled token, else verl's "
        "training/rollout_probs_diff_mean",
        logged_as=("training/rollout_probs_diff_mean",),
        layer="L1",
        title="Training–inference mismatch (mean |Δ p|)",
        doc="Per step, the token-mean absolute difference of the sampled token's probability "
        "under the trainer (e^old_logprob, else e^logprob) and the sampler (e^rollout_logprob): "
        "verl's debug metric `training/rollout_probs_diff_mean` (verl/utils/debug/metrics.py "
        "`calculate_debug_metrics`, probabilities despite its helper's name).",
        healthy="below ~0.01",
        references="verl training/rollout_probs_diff_mean",
        better="down",
        variants=_mismatch_variants(
            "pdiff",
            lambda trainer, sampler: (trainer.exp() - sampler.exp()).abs(),
            "|e^trainer - e^rollout_logprob|",
            (("training/rollout_probs_diff_mean", "verl, utils/debug/metrics.py"),),
        ),
    )
)


# --- PPO with a critic: the value function and the KL controller, from tokens or as logged -----

_RET, _DIFF = f64("return"), f64("return") - f64("value")
#: verl metric_utils.py `compute_data_metrics`: 1 - Var(R - V) / (Var(R) + 1e-5).
EV_EPS = 1e-5


def _unbiased_var(total: str, squares: str, n: str) -> pl.Expr:
    """Var from per-step sums (Float64), with n - 1 (torch.var's default, as verl)."""
    count = pl.col(n)
    return (pl.col(squares) - pl.col(total) ** 2 / count) / (count - 1)


def _explained_variance(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    names = ["ev_n", "ev_r", "ev_r2", "ev_d", "ev_d2"]
    sums = step_sums(frame, names)
    value = 1.0 - _unbiased_var("ev_d", "ev_d2", "ev_n") / (
        _unbiased_var("ev_r", "ev_r2", "ev_n") + EV_EPS
    )
    return sums.select("step", pl.when(pl.col("ev_n") >= 2).then(value).alias("value"))


DECLARED.metric(
    Metric(
        id="stability.explained_variance",
        part="critic",
        brief="critic: 1 − Var(return − value)/Var(return) over response tokens, else as logged",
        logged_as=("explained_variance", "critic/vf_explained_var"),
        layer="L1",
        title="Critic explained variance",
        doc="PPO with a learned critic: per step, how much of the variance of the returns the "
        "value function explains, over response tokens: 1 − Var(return − value) / (Var(return) "
        "+ 1e-5), variances with n − 1 (verl metric_utils.py `compute_data_metrics` "
        "`critic/vf_explained_var`, the same formula), from tokens `value` and `return`; else "
        "the steps table's `explained_variance` or verl's logged `critic/vf_explained_var`. "
        "1 = the critic predicts every return, 0 = no better than a constant, < 0 = worse than "
        "a constant. GAE's advantages are returns minus values: at or below 0 they are the "
        "returns' noise, and the policy learns from noise.",
        healthy="rising above 0 after the first steps (often 0.3–0.9 once the critic has learnt)",
        references="verl critic/vf_explained_var; Schulman et al. 2016 (GAE)",
        variants=(
            custom(
                "tokens",
                ("value", "return"),
                _explained_variance,
                {
                    "ev_n": _DIFF.count(),
                    "ev_r": pl.when(_DIFF.is_not_null()).then(_RET).sum(),
                    "ev_r2": pl.when(_DIFF.is_not_null()).then(_RET**2).sum(),
                    "ev_d": _DIFF.sum(),
                    "ev_d2": (_DIFF**2).sum(),
                },
                source="tokens: 1 - Var(return - value) / (Var(return) + 1e-5)",
            ),
            step_column("explained_variance"),
            step_column(
                "critic/vf_explained_var",
                source="steps.critic/vf_explained_var as logged (verl, metric_utils.py)",
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.value_loss",
        part="critic",
        brief="critic value loss as logged",
        layer="L1",
        title="Critic value loss",
        doc="PPO with a learned critic: the value loss per step as the trainer logged it (format "
        "v1 `value_loss`; verl `critic/vf_loss`, dp_critic.py `update_critic`, the clipped "
        "squared error summed over its micro-batches; OpenRLHF `critic_loss`, ppo_critic.py). "
        "Its scale is the returns' squared scale, so its level means little across runs; its "
        "course does: falling then flat while the critic learns, rising by orders of magnitude "
        "or non-finite when it diverges.",
        healthy="falls in the first steps, then flat or slowly falling; never non-finite",
        references="verl critic/vf_loss; OpenRLHF critic_loss",
        variants=(
            step_column("value_loss"),
            step_column("critic/vf_loss", source="steps.critic/vf_loss as logged (verl)"),
            step_column("critic_loss", source="steps.critic_loss as logged (OpenRLHF)"),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.value_clip_frac",
        part="critic",
        brief="share of value predictions clipped, as logged",
        unit="share",
        layer="L1",
        title="Critic value clip fraction",
        doc="PPO with a clipped value loss: the share of value predictions outside "
        "old value ± cliprange_value whose clipped loss was used (format v1 `value_clip_frac`; "
        "verl `critic/vf_clipfrac`, core_algos.py `compute_value_loss`). High means the critic "
        "wants to move further each update than the clip allows.",
        healthy="small (a few percent); near 0 with a critic that barely moves",
        references="verl critic/vf_clipfrac",
        variants=(
            step_column("value_clip_frac", share=True),
            step_column(
                "critic/vf_clipfrac", source="steps.critic/vf_clipfrac as logged (verl)", share=True
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.critic_grad_norm",
        part="critic",
        brief="critic gradient norm as logged",
        layer="L1",
        title="Critic gradient norm",
        doc="The critic's gradient norm per step before clipping, as logged (verl "
        "`critic/grad_norm`, dp_critic.py `_optimizer_step`; OpenRLHF `critic_grad_norm`, "
        "ppo_critic.py `training_step`). Read beside the policy's (stability.grad_norm): a "
        "critic whose gradient explodes while the policy's is calm is a value-divergence in "
        "the making.",
        healthy="smooth; no spikes of orders of magnitude",
        references="verl critic/grad_norm; OpenRLHF critic_grad_norm",
        variants=(
            step_column("critic/grad_norm", source="steps.critic/grad_norm as logged (verl)"),
            step_column("critic_grad_norm", source="steps.critic_grad_norm as logged (OpenRLHF)"),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.critic_lr",
        part="critic",
        brief="critic learning rate as logged",
        layer="L1",
        title="Critic learning rate",
        doc="The critic's learning rate per step, as logged (verl `critic/lr`, dp_critic.py; "
        "OpenRLHF `critic_lr`, ppo_critic.py `training_step`). A critic learning rate of 0 "
        "(a warm-up longer than the run, a frozen value head) is a critic that never learns: "
        "critic-not-learning says so when it sees one.",
        healthy="> 0 after warm-up",
        references="verl critic/lr; OpenRLHF critic_lr",
        variants=(
            step_column("critic/lr", source="steps.critic/lr as logged (verl)"),
            step_column("critic_lr", source="steps.critic_lr as logged (OpenRLHF)"),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="stability.kl_coef",
        brief="KL penalty coefficient β in use, as logged",
        layer="L1",
        title="KL coefficient (β)",
        doc="The coefficient of the KL penalty per step (format v1 `kl_coef`; verl "
        "`actor/reward_kl_penalty_coeff`, ray_trainer.py `apply_kl_penalty`: the "
        "AdaptiveKLController's value when kl_ctrl.type = adaptive, else the fixed β). An "
        "adaptive controller raises β while the KL is above its target and lowers it below; "
        "a β that keeps growing means the controller cannot pull the KL back.",
        healthy="constant (fixed controller) or wandering around its initial value (adaptive)",
        references="Ziegler et al. 2019 (adaptive KL); verl actor/reward_kl_penalty_coeff",
        variants=(
            step_column("kl_coef"),
            step_column(
                "actor/reward_kl_penalty_coeff",
                source="steps.actor/reward_kl_penalty_coeff as logged (verl)",
            ),
        ),
    )
)


# --- Advantage extremes and the gradient's level ------------------------------------------------

#: verl's whitened advantages are logged as their batch maximum and minimum only.
_VERL_ADVANTAGE = ("critic/advantages/max", "critic/advantages/min")
#: The advantage_tiers level's partials: per (step, tier) its tokens, Σ a² and largest |a|.
_TIERS = HISTOGRAMS["advantage_tiers"]
ADV_TIER_N, ADV_TIER_Q, ADV_MAX = "adv_tier_n", "adv_tier_q", MAX_PREFIX + "adv_tier_abs"
#: A token whose |advantage| is below this share of the step's scale (its RMS advantage; the
#: floor is the highest tier under it) is float noise of a zero-σ group, not a signal.
ADV_NOISE_SHARE = 1e-2


def _advantage_extreme(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    tier = pl.col(_TIERS.key)
    # above floor i: the tiers past i (a token's tier is how many floors it is above)
    per_step = frame.group_by("step").agg(
        *(
            pl.col(ADV_TIER_N).filter(tier > i).sum().alias(f"adv_n{i}")
            for i in range(len(ADVANTAGE_TIERS))
        ),
        *(
            ordered_sum(pl.col(ADV_TIER_Q).filter(tier > i)).alias(f"adv_q{i}")
            for i in range(len(ADVANTAGE_TIERS))
        ),
        pl.col(ADV_MAX).max(),
    )
    scale = (pl.col("adv_q0") / pl.col("adv_n0")).sqrt()
    floor = pl.lit(0)
    for i, at in enumerate(ADVANTAGE_TIERS[1:], start=1):
        floor = pl.when(scale * ADV_NOISE_SHARE >= at).then(i).otherwise(floor)

    def at_floor(kind: str) -> pl.Expr:
        picked = pl.lit(None, dtype=pl.Float64)
        for i in range(len(ADVANTAGE_TIERS)):
            picked = pl.when(pl.col("floor") == i).then(pl.col(f"adv_{kind}{i}")).otherwise(picked)
        return picked.cast(pl.Float64)

    rms = (pl.col("q") / pl.col("n")).sqrt()
    return (
        per_step.with_columns(floor.alias("floor"))
        .with_columns(at_floor("n").alias("n"), at_floor("q").alias("q"))
        .select(
            "step",
            pl.when((pl.col("n") >= 2) & (pl.col("q") > 0))
            .then(pl.col(ADV_MAX) / rms)
            .alias("value"),
            pl.col("n").alias("extra_n"),
            pl.col(ADV_MAX).alias("extra_max_abs"),
            rms.alias("extra_rms"),
            pl.col("floor")
            .replace_strict(dict(enumerate(ADVANTAGE_TIERS)), return_dtype=pl.Float64)
            .alias("extra_noise_floor"),
        )
    )


def _verl_advantage_extreme(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    top, bottom = (pl.col(f"steps_{c}") for c in _VERL_ADVANTAGE)
    return frame.select(
        "step",
        pl.max_horizontal(top.abs(), bottom.abs()).alias("value"),
        pl.max_horizontal(top.abs(), bottom.abs()).alias("extra_max_abs"),
    )


DECLARED.metric(
    Metric(
        id="stability.advantage_extreme",
        brief="max |advantage| / RMS of the advantages above float noise, per step (tokens; "
        "verl's whitened max/min)",
        layer="L1",
        title="Largest advantage in standard deviations",
        doc="Per step, the largest |advantage| of a token divided by the root mean square of the "
        "advantages of the tokens that carry one: how many standard deviations (advantages are "
        "centred: their RMS is their spread) the most extreme token sits from 0. A token whose "
        "|advantage| is below 1% of the step's scale (its RMS over every non-zero token; the "
        "floor is the highest of 0, 1e-12, 1e-9, 1e-6, 1e-3 under it) carries no signal and is "
        "left out: a GRPO group with no spread whose reward is not exactly representable (0.1, "
        "a format bonus) gets (r − μ)/(σ + ε) of float noise, not 0 — 1e-17 to 1e-9 in float64, "
        "up to 6e-4 in TRL's float32 with ε = 1e-4 (measured with torch: rewards of 0.7 in "
        "groups of 8) — and such tokens, all of one value, would make any spread meaningless. "
        "An RMS has no cancellation (a variance from Σa² − (Σa)²/n of near-equal values is "
        "rounding). Components: n (the tokens counted), max_abs, rms and noise_floor. Without "
        "tokens, verl's logged `critic/advantages/max` "
        "and `/min` (trainer/ppo/metric_utils.py `compute_data_metrics`): verl whitens GAE and "
        "REINFORCE++ advantages over the batch (core_algos.py, `masked_whiten`), so their "
        "standard deviation is 1 and the larger of |max|, |min| is the ratio; GRPO's group-"
        "normalised ones have a batch spread of at most 1, so it is then a lower bound. n is "
        "not logged. Of n standard-normal values the largest |z| is about √(2 ln 2n) (4.9 at "
        "10^5); far beyond it, a few tokens carry the batch's gradient.",
        healthy="a few units; below ~√(2 ln 2n) for n tokens a step",
        references="verl critic/advantages/max, min; extreme-value theory (Gumbel)",
        variants=(
            Variant(
                "tokens",
                ("advantage",),
                _advantage_extreme,
                {
                    ADV_TIER_N: _TIERS.partial("count"),
                    ADV_TIER_Q: _TIERS.partial("squares"),
                    ADV_MAX: _TIERS.partial("max_abs"),
                },
                source="tokens: max |advantage| / RMS of the advantages above float noise",
                level="advantage_tiers",
            ),
            custom(
                "steps",
                _VERL_ADVANTAGE,
                _verl_advantage_extreme,
                {f"steps_{c}": f64(c).mean() for c in _VERL_ADVANTAGE},
                source="steps.critic/advantages/max, /min as logged (verl; whitened: std 1)",
            ),
        ),
    )
)

#: The first steps whose median is a gradient norm's early level.
EARLY_STEPS = 5


def _grad_norm_rel(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    logged = frame.select("step", pl.col("steps_grad_norm").alias("norm")).sort("step")
    early = logged.filter(pl.col("norm") > 0).head(EARLY_STEPS).select(pl.col("norm").median())
    return logged.join(early.select(pl.col("norm").alias("early")), how="cross").select(
        "step",
        pl.when(pl.col("early") > 0).then(pl.col("norm") / pl.col("early")).alias("value"),
        pl.col("early").alias("extra_early"),
    )


DECLARED.metric(
    Metric(
        id="stability.grad_norm_rel",
        brief=f"gradient norm over its early level (median of its first {EARLY_STEPS} steps)",
        layer="L1",
        title="Gradient norm against its early level",
        doc="The logged gradient norm of each step divided by its early level, the median of "
        f"its first {EARLY_STEPS} positive values (a median: one spike at the start does not "
        "set the scale). A gradient norm's level depends on the model, the loss aggregation and "
        "the batch, its course much less: a run whose ratio falls by orders of magnitude while "
        "its rewards still differ is no longer moving its weights (gradient-vanishing).",
        healthy="within an order of magnitude of 1; slowly falling is normal",
        variants=(
            custom(
                "steps",
                ("grad_norm",),
                _grad_norm_rel,
                {"steps_grad_norm": f64("grad_norm").mean()},
            ),
        ),
    )
)
