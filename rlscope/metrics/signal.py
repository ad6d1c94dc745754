"""L3 learning signal: reward, σ_G and dead groups, pass@k, effective batch, difficulty tiers."""

from __future__ import annotations

import polars as pl

from rlscope.binary import bernoulli_ratio, outside_unit_range
from rlscope.context import MetricContext
from rlscope.exactsum import ordered_mean
from rlscope.metrics._common import (
    custom,
    f64,
    pass_at_k,
    ratio_variant,
    safe_div,
    step_column,
    train,
)
from rlscope.metrics.behavior import N_CORRECT, N
from rlscope.reader import Run
from rlscope.spec import Declarations, Metric

#: This layer's metrics, in order (collected by rlscope.catalog).
DECLARED = Declarations()

R_SUM = ("r_sum", f64("reward").sum())
R_STD = ("r_std", f64("reward").std(ddof=1))
R_MIN = ("r_min", f64("reward").min())
R_MAX = ("r_max", f64("reward").max())
W_ADV = ("w_adv", f64("advantage").abs().sum())
# GRPO's advantage when none is logged: (r - mean) / (std + 1e-6), std with ddof=1 as in
# TRL and verl; a zero-σ group has advantage 0.
_r = f64("reward")
W_GRPO = ("w_grpo", ((_r - _r.mean()).abs().sum() / (_r.std(ddof=1) + 1e-6)).fill_null(0.0))

#: Difficulty tiers by the group's accuracy p = correct / n (document-facing constants).
HARD_BELOW = 1 / 3
EASY_ABOVE = 2 / 3

#: Per step, the train rollouts of extreme reward ({rollout_id, prompt_id, reward}, furthest from
#: the step's mean first, at most 3): each group's highest and lowest are the candidates, so
#: the furthest one is exact. grad-spike names them (a spike usually comes from one rollout).
REWARD_EXTREMES = "reward_extremes"
EXTREMES_KEPT = 3
_EXTREME_IDS = {
    "r_max_id": pl.col("rollout_id")
    .sort_by(f64("reward"), descending=True, nulls_last=True)
    .first(),
    "r_min_id": pl.col("rollout_id").sort_by(f64("reward"), nulls_last=True).first(),
}


def _mean_reward(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    groups = train(frame)
    sums = groups.group_by("step").agg(pl.col("r_sum", "n").sum())
    mean = sums.select("step", safe_div(pl.col("r_sum"), pl.col("n")).alias("value"))
    candidates = pl.concat(
        [
            groups.select("step", "prompt_id", rollout_id=f"r_{end}_id", reward=f"r_{end}")
            for end in ("max", "min")
        ]
    ).unique(["step", "rollout_id"])
    extreme = pl.struct("rollout_id", "prompt_id", "reward")
    distance = (pl.col("reward") - pl.col("value")).abs()
    extremes = (
        candidates.drop_nulls("reward")
        .join(mean, on="step")
        .group_by("step")
        .agg(
            extreme.sort_by(distance, pl.col("rollout_id"), descending=[True, False])
            .head(EXTREMES_KEPT)
            .alias(REWARD_EXTREMES)
        )
    )
    return mean.join(extremes, on="step", how="left")


DECLARED.metric(
    Metric(
        id="signal.reward",
        brief="mean reward",
        logged_as=("reward", "critic/score/mean"),
        layer="L3",
        title="Mean reward",
        doc="Mean sequence reward over the step's train rollouts. Necessary, not sufficient: it "
        "keeps rising while the policy mode-collapses (compare signal.pass_at_k). Its scale is "
        "the run's own reward functions and weights: `compare` judges two runs on it only where "
        "run.json `reward_components` and `reward_weights` are the same.",
        healthy="rising, then plateauing",
        better="up",
        task="reward",
        scale_from=("reward_components", "reward_weights"),
        variants=(
            custom(
                "rollouts",
                ("reward",),
                _mean_reward,
                dict([R_SUM, N, R_MAX, R_MIN], **_EXTREME_IDS),
            ),
            # Runs with step metrics only: the trainer's mean reward, as logged.
            step_column("reward", source="steps.reward as logged (mean sequence reward)"),
            step_column("critic/score/mean", source="steps.critic/score/mean as logged (verl)"),
        ),
    )
)


#: Rollouts columns named like this (`reward_len`, TRL-style `format_reward`) are reward terms
#: even when run.json lists none.
REWARD_COLUMN_PREFIX, REWARD_COLUMN_SUFFIX = "reward_", "_reward"
_REWARD_DOC = (
    "Mean of one reward function's per-rollout value over the step's train rollouts (one "
    "metric per function: run.json `reward_components` names the rollouts columns, as the TRL "
    "importer writes from trainer_state.json's rewards/<name>/mean keys; any numeric "
    "`reward_*` or `*_reward` column counts too). The total reward can rise through one term "
    "(a format bonus) while the task term falls: the reward-hacking finding reads these to "
    "name the term driving the rise."
)


def reward_components(run: Run) -> list[str]:
    """The rollouts columns holding individual reward terms: run.json `reward_components`
    (those present) and numeric `reward_*` columns, in that order."""
    if "rollouts" not in run.tables:
        return []
    schema = run.tables["rollouts"].schema
    numeric = [c for c, t in schema.items() if t.is_numeric() and c != "reward"]
    listed = [c for c in run.meta.get("reward_components") or () if c in numeric]
    prefixed = [
        c for c in numeric if c.startswith(REWARD_COLUMN_PREFIX) or c.endswith(REWARD_COLUMN_SUFFIX)
    ]
    return list(dict.fromkeys(listed + prefixed))


def _reward_term(name: str) -> Metric:
    # The TRL callback keeps reward functions as `rewards/<name>` columns: the id says <name>.
    return Metric(
        id=f"signal.reward.{name.removeprefix('rewards/')}",
        layer="L3",
        title=f"Mean reward term `{name}`",
        doc=_REWARD_DOC,
        healthy="the task term rising with the total",
        variants=(
            ratio_variant(
                "rollouts",
                (name,),
                (f"rc_sum:{name}", f64(name).sum()),
                (f"rc_n:{name}", f64(name).is_not_null().cast(pl.Int64).sum()),
                source=f"rollouts.{name} (a reward term)",
            ),
        ),
    )


DECLARED.family(
    Metric(
        id="signal.reward.*",
        brief=(
            "mean of one reward term per reward function (run.json `reward_components`, any "
            "`reward_*` / `*_reward` column)"
        ),
        layer="L3",
        title="Mean reward per reward function",
        doc=_REWARD_DOC,
        healthy="the task term rising with the total",
        variants=(),
    ),
    lambda run: [_reward_term(name) for name in reward_components(run)],
)


#: Groups' reward deviation Σ|r − r̄| (with Σ|advantage|: the scale the trainer divided by).
R_DEV = ("r_dev", (f64("reward") - f64("reward").mean()).abs().sum())
#: TRL's epsilon in the group std scaling (grpo_trainer.py: std + 1e-4).
GROUP_STD_EPS = 1e-4


def _term_dev(name: str, weight: float) -> tuple[str, pl.Expr]:
    """A reward term's part of the group's advantage mass before scaling: Σ|w·(r_k − r̄_k)|."""
    term = f64(name)
    return (f"tdev:{name}", (weight * (term - term.mean())).abs().sum().fill_null(0.0))


def _weights(run: Run) -> dict[str, float]:
    given = run.meta.get("reward_weights")
    weights = given if isinstance(given, dict) else {}
    return {
        name: float(w) if isinstance((w := weights.get(name, 1.0)), int | float) else 1.0
        for name in reward_components(run)
    }


def _share_partials(logged: bool):
    def partials(ctx: MetricContext) -> dict[str, pl.Expr]:
        terms = dict(_term_dev(name, w) for name, w in _weights(ctx.run).items())
        scale = [W_ADV, R_DEV] if logged else [R_STD]
        return {**terms, **dict(scale)}

    return partials


def _advantage_share(name: str, logged: bool):
    """Per step, term `name`'s share of Σ_k Σ_groups |w_k·(r_k − r̄_k)| / s_G, s_G the group's
    scale (from the logged advantages, Σ|r − r̄| / Σ|A|; else run.json scale_rewards: the
    group's std + 1e-4 for `group`, 1 for `none` and `batch` — one scale for a whole step
    cancels in a share); `live_value`: the same over the groups where the term varies."""

    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        terms = list(_weights(ctx.run))
        if logged:
            inverse = safe_div(pl.col("w_adv"), pl.col("r_dev"))
        elif ctx.run.meta.get("scale_rewards", "group") == "group":
            inverse = (1.0 / (pl.col("r_std") + GROUP_STD_EPS)).fill_null(0.0)
        else:
            inverse = pl.lit(1.0)
        groups = train(frame).filter(pl.col("n") >= 2)
        mass = [(pl.col(f"tdev:{t}") * inverse).fill_null(0.0) for t in terms]
        total = pl.sum_horizontal(mass)
        own = mass[terms.index(name)]
        live = pl.col(f"tdev:{name}") > 0
        per_step = groups.group_by("step").agg(
            own.sum().alias("mass"),
            total.sum().alias("total_mass"),
            own.filter(live).sum().alias("live_mass"),
            total.filter(live).sum().alias("live_total"),
        )
        return per_step.with_columns(
            safe_div(pl.col("mass"), pl.col("total_mass")).alias("value"),
            safe_div(pl.col("live_mass"), pl.col("live_total")).alias("live_value"),
        )

    return series


_SHARE_DOC = (
    "The share of the policy's advantage mass that one reward term carries. A GRPO advantage "
    "is the group-centred reward over the group's scale s_G, and the reward is Σ w_k·r_k, so "
    "the advantage is exactly Σ_k w_k·(r_k − r̄_k) / s_G: each term's part of it. The share is "
    "term k's Σ|part| over all terms' Σ|part|, pooled over the step's groups (size ≥ 2): what "
    "the update is made of, under the trainer's own normalisation. s_G comes from the logged "
    "advantages where the rollouts have them (Σ|r − r̄| / Σ|A| per group), else from run.json "
    "`scale_rewards` (TRL's; `group`, the default: the group's std + 1e-4; `none` (Dr. GRPO) "
    "and `batch`: one scale a step, which cancels). Weights from run.json `reward_weights` "
    "(the TRL importer and callback write them; absent: 1). `live_value` is the share over the "
    "groups where the term varies. The total reward can rise through one term while the "
    "policy is trained almost only on it: these shares show which."
)


def _advantage_share_member(name: str, terms: list[str]) -> Metric:
    short = name.removeprefix("rewards/")
    return Metric(
        id=f"signal.advantage_share.{short}",
        layer="L3",
        title=f"Advantage share of `{short}`",
        doc=_SHARE_DOC,
        healthy="the task term carrying a fair share (≥ 1/(number of terms))",
        unit="share",
        variants=(
            custom(
                "rollouts",
                ("reward", "advantage", *terms),
                _advantage_share(name, logged=True),
                _share_partials(logged=True),
                source="rollouts.advantage (the trainer's scale per group)",
            ),
            custom(
                "rollouts",
                ("reward", *terms),
                _advantage_share(name, logged=False),
                _share_partials(logged=False),
                source="run.json scale_rewards (the advantage reconstructed from the reward)",
            ),
        ),
    )


DECLARED.family(
    Metric(
        id="signal.advantage_share.*",
        brief="share of the advantage mass each reward term carries (run's normalisation)",
        layer="L3",
        title="Advantage share per reward term",
        doc=_SHARE_DOC,
        healthy="the task term carrying a fair share (≥ 1/(number of terms))",
        unit="share",
        variants=(),
    ),
    lambda run: (
        [_advantage_share_member(n, terms) for n in terms]
        if len(terms := reward_components(run)) >= 2
        else []
    ),
)


def _group_mean(value: pl.Expr, *, min_size: int = 2):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        groups = train(frame).filter(pl.col("n") >= min_size)
        return groups.group_by("step").agg(value.mean().alias("value"), pl.len().alias("groups"))

    return series


_zero_std = (pl.col("r_max") == pl.col("r_min")).cast(pl.Float64)
DECLARED.metric(
    Metric(
        id="signal.group_std",
        brief="mean σ_G (ddof 1)",
        layer="L3",
        title="Mean within-group reward std (σ_G)",
        doc="Mean over the step's prompt groups of the reward standard deviation within the group "
        "(ddof = 1, GRPO's normaliser). σ_G = 0 means the group gives GRPO no gradient at all. "
        "Groups of one rollout have no σ_G and are left out.",
        healthy="clearly above 0; for 0/1 rewards at most ~0.53 (N = 8, half correct)",
        references="Shao et al. 2024, GRPO (DeepSeekMath)",
        variants=(custom("rollouts", ("reward",), _group_mean(pl.col("r_std")), dict([N, R_STD])),),
    )
)

DECLARED.metric(
    Metric(
        id="signal.zero_std_frac",
        brief="share of groups with all rewards equal",
        band=(0.0, 0.5),
        unit="share",
        logged_as=("frac_reward_zero_std",),
        layer="L3",
        title="Share of zero-σ groups",
        doc="Share of the step's prompt groups (size >= 2) whose rewards are all equal: zero "
        "advantage, no gradient, wasted samples. DAPO's dynamic sampling drops them; TRL logs it "
        "as frac_reward_zero_std. Split into too easy / too hard by signal.all_correct_frac and "
        "signal.all_wrong_frac.",
        healthy="below ~0.5; higher means the prompt set no longer fits the policy",
        references="Yu et al. 2025, DAPO (arXiv 2503.14476); TRL frac_reward_zero_std",
        variants=(
            custom("rollouts", ("reward",), _group_mean(_zero_std), dict([N, R_MIN, R_MAX])),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="signal.all_correct_frac",
        brief="share of all-correct groups",
        unit="share",
        layer="L3",
        title="Share of all-correct groups",
        doc="Share of prompt groups (size >= 2) where every rollout is correct: too easy for the "
        "current policy.",
        healthy="a minority; a growing share means the curriculum is stale",
        variants=(
            custom(
                "rollouts",
                ("correct",),
                _group_mean((pl.col("n_correct") == pl.col("n")).cast(pl.Float64)),
                dict([N, N_CORRECT]),
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="signal.all_wrong_frac",
        brief="share of all-wrong groups",
        unit="share",
        layer="L3",
        title="Share of all-wrong groups",
        doc="Share of prompt groups (size >= 2) where no rollout is correct: too hard for the "
        "current policy.",
        healthy="a minority; a large share means the policy is left behind",
        variants=(
            custom(
                "rollouts",
                ("correct",),
                _group_mean((pl.col("n_correct") == 0).cast(pl.Float64)),
                dict([N, N_CORRECT]),
            ),
        ),
    )
)


_NO_K = "no train group has at least k rollouts (k = run.json group_size or the modal size)"


def ks_for(group_size: int) -> list[int]:
    """k = 1, 2, 4, ... up to the group size, and the group size itself."""
    ks, k = [], 1
    while k < group_size:
        ks.append(k)
        k *= 2
    return [*ks, group_size]


def _with_pass_at(frame: pl.LazyFrame, ks: list[int]) -> pl.LazyFrame:
    """Each train group of size >= max(ks) with its pass@k for every k in ks."""
    k_max = max(ks)
    groups = train(frame).filter(pl.col("n") >= k_max)
    # The exact values depend only on (n, c): compute them for the few pairs that occur.
    pairs = groups.select("n", "n_correct").unique().collect()
    rows = [
        {"n": n, "n_correct": c, **{f"pass@{k}": pass_at_k(n, c, k) for k in ks}}
        for n, c in pairs.iter_rows()
    ]
    schema = {"n": pl.Int64, "n_correct": pl.Int64, **{f"pass@{k}": pl.Float64 for k in ks}}
    lookup = pl.DataFrame(rows, schema=schema, orient="row").lazy()
    return groups.join(lookup, on=["n", "n_correct"], how="left")


def _pass_k(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    ks = ks_for(ctx.pass_k or 1)
    k = ks[-1]
    per_group = _with_pass_at(frame, ks)
    return per_group.group_by("step").agg(
        ordered_mean(pl.col(f"pass@{k}")).alias("value"),
        *[ordered_mean(pl.col(f"pass@{j}")).alias(f"extra_pass@{j}") for j in ks],
        pl.len().alias("groups"),
    )


#: pass@1's per-step Σ (group accuracy)²: with `groups`, the sampling error of a window.
ACC_SQ = "acc_sq"
#: A logged accuracy's prompts (its responses over run.json's group size): the units a fall is
#: judged on when the prompt groups themselves are not known (rules.stability).
PROMPTS = "extra_prompts"


def _pass_1(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    groups = train(frame).filter(pl.col("n") >= 1)
    acc = pl.col("n_correct").cast(pl.Float64) / pl.col("n")
    return groups.group_by("step").agg(
        acc.mean().alias("value"), pl.len().alias("groups"), (acc**2).sum().alias(ACC_SQ)
    )


def _logged_pass_1(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    """The logged accuracy p with its sampling units, as _pass_1 gives them from rollouts: the
    responses counted, n = r / (r − 1) for r = std² / (p(1 − p)) (torch's unbiased std of 0/1
    values), carried forward to steps where p is 0 or 1 (no spread to count from; TRL's batch
    does not change size), and Σ (0/1)² = p·n. With the group size G known (run.json), also
    the step's prompts, n / G (PROMPTS): a prompt's G responses are not independent, and
    without the groups a fall is judged on the prompts as 0/1 draws, the most a prompt's mean
    can vary (rules.stability `_sequential_fall`)."""
    p, std = pl.col("logged_correct_rate"), pl.col("logged_correct_rate_std")
    ratio = bernoulli_ratio(p, std)
    broken = outside_unit_range(p, std)
    counted = pl.when(~broken & (ratio > 1)).then((ratio / (ratio - 1)).round(0))
    # A broken step (accuracy-out-of-range) has no accuracy, so no Σ accuracy² either.
    value = pl.when(~broken).then(p.clip(0.0, 1.0))
    prompts = (
        [(pl.col("groups") / ctx.pass_k).round(0).clip(lower_bound=1).alias(PROMPTS)]
        if ctx.pass_k
        else []
    )
    return (
        frame.sort("step")
        .with_columns(counted.forward_fill().alias("groups"))
        .select(
            "step",
            value.alias("value"),
            "groups",
            (value * pl.col("groups")).alias(ACC_SQ),
            *prompts,
        )
    )


def _pass_gap(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    k = ctx.pass_k or 1
    per_group = _with_pass_at(frame, [1, k])
    return per_group.group_by("step").agg(
        ordered_mean(pl.col(f"pass@{k}") - pl.col("pass@1")).alias("value")
    )


DECLARED.metric(
    Metric(
        id="signal.pass_at_1",
        brief="mean group accuracy",
        unit="share",
        layer="L3",
        title="pass@1",
        doc="Mean over the step's prompt groups of the group accuracy c/n (each prompt weighs "
        "the same, as in pass@k). Without rollouts, the steps' `correct_rate` as the trainer "
        "logged it (TRL's rewards/<accuracy>/mean of a 0/1 accuracy reward, read by the "
        "TensorBoard, W&B and MLflow importers): the share of the step's completions that are "
        "correct, equal to the mean group accuracy when groups are of one size. Its sampling "
        "units are its responses (counted from the logged std), and for the sequential test of "
        "a fall (performance-regression) its prompts (the responses over run.json's group "
        "size: component `prompts`), each as uncertain as a 0/1 draw: without the groups a "
        "prompt's responses are taken to agree as much as they can, so a steps-only log never "
        "names a fall surer than its rollouts would. A step whose logged mean and std no rewards "
        "in [0, 1] can give (accuracy-out-of-range) is left out.",
        healthy="rising",
        better="up",
        task="pass@1",
        variants=(
            custom("rollouts", ("correct",), _pass_1, dict([N, N_CORRECT])),
            custom(
                "steps",
                ("correct_rate", "correct_rate_std"),
                _logged_pass_1,
                {f"logged_{c}": f64(c).mean() for c in ("correct_rate", "correct_rate_std")},
                source="steps.correct_rate as logged (the trainer's per-step accuracy), its "
                "responses counted from correct_rate_std",
            ),
            step_column(
                "correct_rate",
                share=True,
                source="steps.correct_rate as logged (the trainer's per-step accuracy)",
            ),
        ),
    )
)


def _accuracy_out_of_range(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
    p, std = pl.col("logged_correct_rate"), pl.col("logged_correct_rate_std")
    return frame.select(
        "step",
        outside_unit_range(p, std).cast(pl.Float64).alias("value"),
        p.alias("logged_mean"),
        std.alias("logged_std"),
    )


DECLARED.metric(
    Metric(
        id="signal.accuracy_out_of_range",
        brief="1 at a step whose logged 0/1 accuracy reward left [0, 1]",
        layer="L3",
        title="Accuracy reward outside [0, 1]",
        doc="Per step, 1 when the 0/1 accuracy reward's logged mean and (unbiased) standard "
        "deviation are ones no rewards in [0, 1] can give over a batch of 4 or more: the mean "
        "outside [0, 1], a spread at a mean of 0 or 1, or std² above p(1 − p)·4/3 "
        "(Bhatia–Davis: values in [0, 1] with mean p vary by at most p(1 − p); torch's "
        "unbiased std adds n / (n − 1) ≤ 4/3). Read where an importer took the reward as the "
        "run's accuracy because it was 0/1 at its other steps (steps.correct_rate and "
        "correct_rate_std: TRL's rewards/<accuracy>/mean and /std through TensorBoard, W&B or "
        "MLflow). Exact, not statistical: no sampling error makes a 0/1 reward's mean and std "
        "cross the bound.",
        healthy="0 at every step",
        better="down",
        variants=(
            custom(
                "steps",
                ("correct_rate", "correct_rate_std"),
                _accuracy_out_of_range,
                {f"logged_{c}": f64(c).mean() for c in ("correct_rate", "correct_rate_std")},
                source="steps.correct_rate and correct_rate_std as logged",
            ),
        ),
    )
)

DECLARED.metric(
    Metric(
        id="signal.pass_at_k",
        brief="unbiased pass@k (Chen et al.), k = group size; pass@1, 2, 4, …, N in the JSON",
        unit="share",
        layer="L3",
        title="pass@k (k = group size)",
        doc="Chen et al.'s unbiased estimator pass@k = 1 - C(n-c, k)/C(n, k), computed exactly "
        "per group of n rollouts with c correct and averaged over the step's groups of size >= k; "
        "k = run.json group_size or the modal group size. The JSON adds pass@1, 2, 4, ..., k as "
        "`components`. Unlike verl's bootstrap best@k it is unbiased (1 correct of 4 gives 1.0 at "
        "k = 4, not ≈0.68). RL typically raises pass@1 while pass@k at large k stays flat: "
        "reward rising with pass@k flat is the mode-collapse signature.",
        healthy="rising with pass@1, or at least not falling",
        better="up",
        references="Chen et al. 2021 (Codex); Yue et al. 2025 (arXiv 2504.13837); verl PR 7240",
        task="pass@k",
        variants=(
            custom("rollouts", ("correct",), _pass_k, dict([N, N_CORRECT]), empty_reason=_NO_K),
        ),
        summary=lambda frame, ctx: {"k": ctx.pass_k},
    )
)

DECLARED.metric(
    Metric(
        id="signal.pass_gap",
        brief="pass@k − pass@1",
        layer="L3",
        title="pass@k - pass@1",
        doc="Mean over groups of size >= k of pass@k - pass@1. Large = the policy knows how but "
        "is unstable (majority vote or more sampling would help); small with high pass@1 = "
        "reliably solves; small with low pass@1 = reliably fails.",
        healthy="shrinking because pass@1 rises, not because pass@k falls",
        references="seed §4; Chen et al. 2021",
        variants=(
            custom("rollouts", ("correct",), _pass_gap, dict([N, N_CORRECT]), empty_reason=_NO_K),
        ),
    )
)


def _weights_series(weight: str):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        w = pl.col(weight)
        per_step = (
            train(frame)
            .group_by("step")
            .agg(
                w.sum().alias("w_sum"),
                (w**2).sum().alias("w_sq"),
                pl.len().alias("prompts"),
                (w > 0).sum().alias("live_prompts"),
            )
        )
        return per_step.with_columns(
            safe_div(pl.col("w_sum") ** 2, pl.col("prompts") * pl.col("w_sq")).alias("value")
        )

    return series


_EFFECTIVE_DOC = (
    "(Σw)² / (P·Σw²) over the step's P prompt groups, w = the group's Σ|advantage| (the "
    "advantage column, or GRPO's normalised reward when absent): the effective number of "
    "prompts carrying the gradient, as a share of the nominal P. 1 = every prompt contributes "
    "equally; a long-tailed prompt reward distribution drives it far below 1. Zero-σ groups "
    "count in P with w = 0."
)
DECLARED.metric(
    Metric(
        id="signal.effective_prompt_frac",
        brief="(Σw)²/(P·Σw²), w = group Σ|advantage|",
        band=(0.5, 1.0),
        unit="share",
        layer="L3",
        title="Effective prompt share",
        doc=_EFFECTIVE_DOC,
        healthy="> 0.5",
        references="Kish's effective sample size; seed §4",
        variants=(
            custom(
                "rollouts",
                ("advantage",),
                _weights_series("w_adv"),
                dict([W_ADV]),
                source="rollouts.advantage",
            ),
            custom(
                "rollouts",
                ("reward",),
                _weights_series("w_grpo"),
                dict([W_GRPO]),
                source="GRPO-normalised reward (no advantage column)",
            ),
        ),
    )
)


def _tiers(weight: str):
    def series(frame: pl.LazyFrame, ctx: MetricContext) -> pl.LazyFrame:
        w = pl.col(weight)
        p = pl.col("n_correct").cast(pl.Float64) / pl.col("n")
        hard, easy = p < HARD_BELOW, p > EASY_ABOVE
        per_step = (
            train(frame)
            .group_by("step")
            .agg(
                w.sum().alias("w_sum"),
                w.filter(~hard & ~easy).sum().alias("w_medium"),
                w.filter(easy).sum().alias("w_easy"),
                w.filter(hard).sum().alias("w_hard"),
            )
        )
        total = pl.col("w_sum")
        return per_step.select(
            "step",
            safe_div(pl.col("w_medium"), total).alias("value"),
            safe_div(pl.col("w_easy"), total).alias("extra_easy"),
            safe_div(pl.col("w_hard"), total).alias("extra_hard"),
        )

    return series


_TIERS_DOC = (
    "Share of the step's |advantage| mass that comes from medium-difficulty prompt groups. "
    f"Tiers by group accuracy p = correct/n: hard p < {HARD_BELOW:.3g}, medium "
    f"{HARD_BELOW:.3g} <= p <= {EASY_ABOVE:.3g}, easy p > {EASY_ABOVE:.3g} (all-correct and "
    "all-wrong groups fall in easy and hard, with no mass under GRPO). The JSON gives the easy "
    "and hard shares as components. Healthy training draws most of its gradient from medium "
    "prompts; mass moving to easy prompts = stale curriculum, to hard = the policy is left "
    "behind."
)
DECLARED.metric(
    Metric(
        id="signal.medium_adv_share",
        brief="|advantage| mass from medium-difficulty groups (tiers: p < 1/3, 1/3–2/3, > 2/3)",
        unit="share",
        layer="L3",
        title="Advantage mass from medium prompts",
        doc=_TIERS_DOC,
        healthy="the largest of the three tiers (> 0.4)",
        references="seed §4 (gradient flow by difficulty)",
        variants=(
            custom(
                "rollouts",
                ("advantage", "correct"),
                _tiers("w_adv"),
                dict([N, N_CORRECT, W_ADV]),
                source="rollouts.advantage",
            ),
            custom(
                "rollouts",
                ("reward", "correct"),
                _tiers("w_grpo"),
                dict([N, N_CORRECT, W_GRPO]),
                source="GRPO-normalised reward (no advantage column)",
            ),
        ),
    )
)
