"""L5 generalisation: in-distribution vs out-of-distribution evaluations over training."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from rlscope.context import MetricContext
from rlscope.metrics._common import custom, example_partial, examples, f64, safe_div
from rlscope.metrics.behavior import N_CORRECT, N
from rlscope.spec import Declarations, Metric

#: This layer's metrics, in order (collected by rlscope.catalog).
DECLARED = Declarations()

_PARTIALS = dict([N, N_CORRECT])
ID_SPLIT, OOD_SPLIT = "eval_id", "eval_ood"


def _split(name: str) -> pl.Expr:
    """`eval_id` pools `eval_id` and `eval_id_*` (several ID sets), likewise `eval_ood`."""
    return (pl.col("split") == name) | pl.col("split").str.starts_with(f"{name}_")


def eval_accuracy(frame: pl.LazyFrame, split: str) -> pl.LazyFrame:
    """Per eval step: accuracy over the split's rollouts and their count."""
    sums = frame.filter(_split(split)).group_by("step").agg(pl.col("n", "n_correct").sum())
    return sums.select(
        "step",
        safe_div(f64("n_correct"), f64("n")).alias("value"),
        pl.col("n").alias("rollouts"),
    )


def _accuracy(split: str):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        return eval_accuracy(frame, split)

    return series


#: Per eval step, an incorrect OOD rollout from each OOD group that has one (ood-gap names them).
FAILED_OOD_EXAMPLES = "failed_examples"


def _gap(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    in_dist = eval_accuracy(frame, ID_SPLIT).rename({"value": "id", "rollouts": "n_id"})
    out_dist = eval_accuracy(frame, OOD_SPLIT).rename({"value": "ood", "rollouts": "n_ood"})
    failed = frame.filter(_split(OOD_SPLIT)).group_by("step").agg(examples(FAILED_OOD_EXAMPLES))
    both = in_dist.join(out_dist, on="step", how="inner").join(failed, on="step", how="left")
    return both.select(
        "step",
        (pl.col("id") - pl.col("ood")).alias("value"),
        pl.col("id").alias("extra_id"),
        pl.col("ood").alias("extra_ood"),
        "n_id",
        "n_ood",
        FAILED_OOD_EXAMPLES,
    )


def gap_trend(steps: np.ndarray, gaps: np.ndarray) -> dict[str, Any]:
    """Least-squares slope of the gap per 100 steps and its change from the first to the last
    fifth of the eval steps (at least one eval each)."""
    if len(gaps) < 2 or np.ptp(steps) == 0:
        return {"slope_per_100_steps": None, "first": None, "last": None}
    slope = float(np.polyfit(steps.astype(np.float64), gaps, 1)[0]) * 100
    w = max(1, int(np.ceil(0.2 * len(gaps))))
    return {
        "slope_per_100_steps": slope,
        "first": float(gaps[:w].mean()),
        "last": float(gaps[-w:].mean()),
    }


def _gap_summary(frame: pl.DataFrame, ctx: MetricContext) -> dict[str, Any]:
    rows = frame.filter(pl.col("value").is_not_null()).sort("step")
    return {"trend": gap_trend(rows["step"].to_numpy(), rows["value"].to_numpy())}


_EMPTY = "no rollouts with split {} (or {}_*)"


def _logged(split: str) -> tuple[str, str]:
    """The steps columns of a split's logged eval (the TRL importer's, from its eval sets):
    accuracy, and the completions it was measured on (null: unknown)."""
    return f"{split}_accuracy", f"{split}_completions"


def _logged_partials(*splits: str):
    def partials(ctx: MetricContext) -> dict[str, pl.Expr]:
        out = {}
        for split in splits:
            accuracy, completions = _logged(split)
            out[f"steps_{accuracy}"] = f64(accuracy).mean()
            sized = ctx.run.has("steps", completions)
            out[f"steps_{completions}"] = (
                f64(completions).mean() if sized else pl.lit(None, pl.Float64)
            )
        return out

    return partials


def _logged_accuracy(split: str):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        accuracy, completions = _logged(split)
        return frame.select(
            "step",
            pl.col(f"steps_{accuracy}").alias("value"),
            pl.col(f"steps_{completions}").alias("rollouts"),
        ).filter(pl.col("value").is_not_null())

    return series


def _logged_gap(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    (id_acc, id_n), (ood_acc, ood_n) = _logged(ID_SPLIT), _logged(OOD_SPLIT)
    return frame.select(
        "step",
        (pl.col(f"steps_{id_acc}") - pl.col(f"steps_{ood_acc}")).alias("value"),
        pl.col(f"steps_{id_acc}").alias("extra_id"),
        pl.col(f"steps_{ood_acc}").alias("extra_ood"),
        pl.col(f"steps_{id_n}").alias("n_id"),
        pl.col(f"steps_{ood_n}").alias("n_ood"),
    ).filter(pl.col("value").is_not_null())


_LOGGED_SOURCE = (
    "steps.{} as logged (the trainer's eval of its {} sets: TRL's eval_<set>_* entries; "
    "completions from the set's size times num_generations_eval)"
)


def _declare(metric_id: str, split: str, title: str, doc: str, brief: str, task: str) -> None:
    DECLARED.metric(
        Metric(
            id=metric_id,
            brief=brief,
            unit="share",
            layer="L5",
            title=title,
            doc=doc,
            healthy="rising with training",
            better="up",
            task=task,
            references="seed §6 (L5); HGPO (arXiv 2602.22817)",
            variants=(
                custom(
                    "rollouts",
                    ("split", "correct"),
                    _accuracy(split),
                    _PARTIALS,
                    empty_reason=_EMPTY.format(split, split),
                ),
                custom(
                    "steps",
                    (_logged(split)[0],),
                    _logged_accuracy(split),
                    _logged_partials(split),
                    source=_LOGGED_SOURCE.format(_logged(split)[0], split),
                ),
            ),
        )
    )


_declare(
    "generalization.eval_id",
    ID_SPLIT,
    "In-distribution eval accuracy",
    "Accuracy (share correct) of the `eval_id` rollouts (pooled with any `eval_id_*` split) at "
    "each eval step: held-out prompts from the training distribution.",
    brief="accuracy of `eval_id` (and `eval_id_*`) rollouts per eval step",
    task="eval ID accuracy",
)
_declare(
    "generalization.eval_ood",
    OOD_SPLIT,
    "Out-of-distribution eval accuracy",
    "Accuracy (share correct) of the `eval_ood` rollouts (pooled with any `eval_ood_*` split) "
    "at each eval step: prompts from another distribution (other tasks, harder levels, unseen "
    "environments).",
    brief="accuracy of `eval_ood` (and `eval_ood_*`) rollouts per eval step",
    task="eval OOD accuracy",
)


DECLARED.metric(
    Metric(
        id="generalization.ood_gap",
        brief="ID − OOD accuracy; `trend` (slope per 100 steps, first vs last fifth)",
        layer="L5",
        title="ID - OOD accuracy gap",
        doc="generalization.eval_id - generalization.eval_ood at the steps with both. A gap that "
        "widens over training means the policy is learning the training distribution's patterns "
        "(or memorising answers) rather than skills that transfer. The JSON's `trend` has the "
        "least-squares slope per 100 steps and the first vs last fifth of the eval steps; "
        "`components` the final ID and OOD accuracies.",
        healthy="small and not widening",
        summary=_gap_summary,
        references="HGPO (arXiv 2602.22817): GiGPO 90.2 ID / 84.8 OOD on ALFWorld",
        variants=(
            custom(
                "rollouts",
                ("split", "correct"),
                _gap,
                {**_PARTIALS, **dict([example_partial(FAILED_OOD_EXAMPLES, ~pl.col("correct"))])},
                empty_reason="needs eval_id and eval_ood rollouts at the same steps",
            ),
            custom(
                "steps",
                (_logged(ID_SPLIT)[0], _logged(OOD_SPLIT)[0]),
                _logged_gap,
                _logged_partials(ID_SPLIT, OOD_SPLIT),
                source=_LOGGED_SOURCE.format("eval_id/eval_ood_accuracy", "ID and OOD"),
                empty_reason="needs eval_id and eval_ood accuracies logged at the same steps",
            ),
        ),
    )
)
