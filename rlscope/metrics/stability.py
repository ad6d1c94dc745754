"""L1 training stability: loss, gradient norm, clip fraction, KL to the reference, PPO KL."""

from __future__ import annotations

import polars as pl

from rlscope.context import MetricContext
from rlscope.metrics._common import custom, f64, ratio_variant, safe_div, step_column, step_sums
from rlscope.reader import INVALID_PREFIX
from rlscope.spec import Declarations, Metric, Variant

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


def _nonfinite_variant(columns: tuple[str, ...]) -> Variant:
    names = [f"nonfinite_{c}" for c in columns]

    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        return frame.select(
            "step",
            pl.sum_horizontal(pl.col(n).fill_null(0) for n in names)
            .cast(pl.Float64)
            .alias("value"),
            *(
                pl.col(n).cast(pl.Float64).alias(f"extra_{c}")
                for n, c in zip(names, columns, strict=True)
            ),
        )

    return custom(
        "steps",
        columns,
        series,
        {n: _nonfinite(c) for n, c in zip(names, columns, strict=True)},
        source="steps: " + ", ".join(columns) + " logged as NaN or ±inf",
    )


DECLARED.metric(
    Metric(
        id="stability.nonfinite",
        brief="logged loss and grad norm values that are NaN or ±inf, per step",
        layer="L1",
        title="Non-finite loss or gradient norm",
        doc="Per step, how many of the logged loss and gradient norm are NaN or ±inf (verl and "
        "TRL write NaN, verl's orjson writer null, which its importer keeps as NaN). A non-finite "
        "gradient norm means the update was NaN (or skipped by a loss scaler): the divergence "
        "finding names the steps. rlscope's other step metrics leave those values out.",
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
