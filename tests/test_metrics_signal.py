"""L3 learning-signal metrics against direct numpy / pure-Python computations."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from fractions import Fraction
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import GENUINE, final_window

from rlscope.analysis import analyze
from rlscope.engine import compute
from rlscope.reader import open_run

WriteRun = Callable[..., Path]
CheckSeries = Callable[..., None]
Expected = dict[int, float | None]

STEPS = list(range(1, 15))
SIZES = (1, 2, 3, 4, 4, 4, 6, 8)  # modal size 4; one group of one
ROLLOUT_METRICS = (
    "signal.reward",
    "signal.group_std",
    "signal.zero_std_frac",
    "signal.all_correct_frac",
    "signal.all_wrong_frac",
    "signal.pass_at_1",
    "signal.pass_at_k",
    "signal.pass_gap",
    "signal.effective_prompt_frac",
    "signal.medium_adv_share",
)


# ---------------------------------------------------------------- synthetic groups


def make_groups(seed: int) -> list[dict[str, Any]]:
    """Train prompt groups: per step the SIZES (one dropped at random steps, never the 8), each
    with an accuracy in {0, .25, .5, .75, 1}; half the groups have 0/1 rewards (zero-σ groups
    occur), half continuous ones (reward > 0 iff the latent success)."""
    rng = np.random.default_rng(seed)
    groups = []
    for step in STEPS:
        sizes = list(rng.permutation(SIZES))
        if rng.random() < 0.4:
            sizes.remove(int(rng.choice([1, 2, 3, 4, 6])))
        for g, n in enumerate(sizes):
            p = float(rng.choice([0, 0.25, 0.5, 0.75, 1.0]))
            latent = rng.random(n) < p
            if rng.random() < 0.5:
                reward = latent.astype(np.float64)
            else:
                reward = np.where(latent, rng.uniform(0.5, 1.5, n), -rng.uniform(0.0, 0.5, n))
            groups.append(
                {
                    "step": step,
                    "prompt_id": f"p{g}",
                    "reward": reward,
                    "flag": rng.random(n) < 0.6,  # an explicit `correct`, unrelated to the reward
                    "advantage": rng.normal(0.0, 1.0, n),
                }
            )
    return groups


def rollouts(groups: list[dict[str, Any]], *, correct: bool, advantage: bool) -> dict[str, Any]:
    cols: dict[str, list[Any]] = {
        "step": [],
        "prompt_id": [],
        "reward": [],
        "correct": [],
        "advantage": [],
    }
    for g in groups:
        n = g["reward"].size
        cols["step"] += [g["step"]] * n
        cols["prompt_id"] += [g["prompt_id"]] * n
        cols["reward"] += list(g["reward"])
        cols["correct"] += list(g["flag"])
        cols["advantage"] += list(g["advantage"])
    out: dict[str, Any] = {**cols, "rollout_id": list(range(len(cols["step"])))}
    out["response_len"] = [10] * len(cols["step"])
    out["split"] = ["train"] * len(cols["step"])
    if not correct:
        del out["correct"]
    if not advantage:
        del out["advantage"]
    return out


def eval_rows(groups: list[dict[str, Any]], *, correct: bool, advantage: bool) -> dict[str, Any]:
    """Per step, five held-out groups of six at the train prompt ids (they would make the modal
    group size 6), with wild values."""
    cols: dict[str, list[Any]] = {
        k: [] for k in ("step", "prompt_id", "reward", "correct", "advantage")
    }
    for step in STEPS:
        for g in range(5):
            cols["step"] += [step] * 6
            cols["prompt_id"] += [f"p{g}"] * 6
            cols["reward"] += [1e6, -1e6, 1e6, 1e6, 3.0, 1e6]
            cols["correct"] += [True, False, True, True, True, False]
            cols["advantage"] += [1e9, -1e9, 5.0, 0.0, 1.0, 2.0]
    n = len(cols["step"])
    out: dict[str, Any] = {
        **cols,
        "rollout_id": list(range(100_000, 100_000 + n)),
        "response_len": [10**6] * n,
        "split": ["eval_id"] * n,
    }
    if not correct:
        del out["correct"]
    if not advantage:
        del out["advantage"]
    return out


def successes(group: dict[str, Any], mode: str) -> np.ndarray:
    if mode == "column":
        return group["flag"]
    if mode == "threshold":
        return group["reward"] >= 0.8
    return group["reward"] > 0


def per_step(
    groups: list[dict[str, Any]], fn: Callable[[list[dict[str, Any]]], float | None]
) -> Expected:
    return {s: fn([g for g in groups if g["step"] == s]) for s in STEPS}


def mean_or_none(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def chen_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s numerically stable product form (independent of math.comb)."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod([1.0 - k / i for i in range(n - c + 1, n + 1)]))


def grpo_weight(reward: np.ndarray) -> float:
    if reward.size < 2 or np.std(reward, ddof=1) == 0:
        return 0.0
    return float(np.abs(reward - reward.mean()).sum() / (np.std(reward, ddof=1) + 1e-6))


def summary(expected: Expected) -> float:
    return final_window([v for _, v in sorted(expected.items()) if v is not None])


# ---------------------------------------------------------------- reward, σ_G, dead groups


@pytest.mark.parametrize("mode", ["reward>0", "column", "threshold"])
def test_group_metrics(write_run: WriteRun, check_series: CheckSeries, mode: str) -> None:
    groups = make_groups(1)
    has_correct = mode == "column"
    meta = {"correct_threshold": 0.8} if mode == "threshold" else {}
    path = write_run(
        {
            "rollouts": [
                rollouts(groups, correct=has_correct, advantage=True),
                eval_rows(groups, correct=has_correct, advantage=True),
            ]
        },
        **meta,
    )
    computed = compute(open_run(path))
    results = computed.results
    for g in groups:
        g["c"] = int(successes(g, mode).sum())
        g["n"] = g["reward"].size
    big = [g for g in groups if g["n"] >= 2]
    # pass@1's evidence per step (performance-regression): the groups and Σ (c/n)².
    evidence = computed.frames["signal.pass_at_1"].sort("step")
    expected_sq = per_step(groups, lambda gs: sum((g["c"] / g["n"]) ** 2 for g in gs))
    expected_groups = per_step(groups, lambda gs: float(len(gs)))
    for row in evidence.iter_rows(named=True):
        assert row["acc_sq"] == pytest.approx(expected_sq[row["step"]], rel=1e-12)
        assert row["groups"] == expected_groups[row["step"]]

    def over_big(fn: Callable[[dict[str, Any]], float]) -> Expected:
        return per_step(big, lambda gs: mean_or_none([fn(g) for g in gs]))

    check_series(
        results["signal.reward"],
        per_step(groups, lambda gs: float(np.concatenate([g["reward"] for g in gs]).mean())),
    )
    check_series(
        results["signal.group_std"], over_big(lambda g: float(np.std(g["reward"], ddof=1)))
    )
    check_series(
        results["signal.zero_std_frac"],
        over_big(lambda g: float(g["reward"].max() == g["reward"].min())),
    )
    check_series(results["signal.all_correct_frac"], over_big(lambda g: float(g["c"] == g["n"])))
    check_series(results["signal.all_wrong_frac"], over_big(lambda g: float(g["c"] == 0)))
    check_series(
        results["signal.pass_at_1"],
        per_step(groups, lambda gs: mean_or_none([g["c"] / g["n"] for g in gs])),
    )
    # The generator gives every kind of group somewhere.
    assert any(g["c"] == g["n"] for g in big) and any(g["c"] == 0 for g in big)
    assert any(g["reward"].max() == g["reward"].min() for g in big)


def test_reward_extremes(write_run: WriteRun) -> None:
    """signal.reward's `reward_extremes` (the rollouts grad-spike names): per step, up to 3 of the
    groups' highest and lowest rewards, furthest from the step's mean first; the first is the
    furthest of all the step's rollouts."""
    groups = make_groups(2)
    data = rollouts(groups, correct=False, advantage=False)
    path = write_run({"rollouts": [data, eval_rows(groups, correct=False, advantage=False)]})
    frame = compute(open_run(path)).frames["signal.reward"].sort("step")
    columns = (data["rollout_id"], data["prompt_id"], data["reward"])
    by_id = {i: (p, r) for i, p, r in zip(*columns, strict=True)}
    for step, listed in zip(frame["step"], frame["reward_extremes"].to_list(), strict=True):
        here = [g for g in groups if g["step"] == step]
        mean = float(np.concatenate([g["reward"] for g in here]).mean())
        ends = sorted(
            (abs(v - mean) for g in here for v in {g["reward"].max(), g["reward"].min()}),
            reverse=True,
        )
        got = [abs(item["reward"] - mean) for item in listed]
        assert got == pytest.approx(ends[:3])
        assert got[0] == pytest.approx(max(abs(g["reward"] - mean).max() for g in here))
        for item in listed:  # each names a real train rollout, with its prompt and reward
            assert by_id[item["rollout_id"]] == (item["prompt_id"], pytest.approx(item["reward"]))


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    ("meta", "k"), [({}, 4), ({"group_size": 6}, 6)], ids=["modal-size", "run.json-group_size"]
)
def test_pass_at_k(
    write_run: WriteRun, check_series: CheckSeries, meta: dict[str, int], k: int
) -> None:
    groups = make_groups(2)
    path = write_run(
        {
            "rollouts": [
                rollouts(groups, correct=False, advantage=False),
                eval_rows(groups, correct=False, advantage=False),
            ]
        },
        **meta,
    )
    results = compute(open_run(path)).results
    for g in groups:
        g["c"], g["n"] = int((g["reward"] > 0).sum()), g["reward"].size
    eligible = [g for g in groups if g["n"] >= k]
    ks = [1, 2, 4] + ([k] if k != 4 else [])

    def pass_at(j: int) -> Expected:
        return per_step(
            eligible, lambda gs: mean_or_none([chen_pass_at_k(g["n"], g["c"], j) for g in gs])
        )

    result = results["signal.pass_at_k"]
    check_series(result, pass_at(k))
    assert result.extra["k"] == k
    components = result.extra["components"]
    assert list(components) == [f"pass@{j}" for j in ks]
    for j in ks:
        assert components[f"pass@{j}"] == pytest.approx(summary(pass_at(j)), rel=1e-9)
    values = [components[f"pass@{j}"] for j in ks]
    assert values == sorted(values)  # monotone in k
    by_k = {j: pass_at(j) for j in ks}
    for s in STEPS:  # per step too, over the same groups
        assert all(by_k[a][s] <= by_k[b][s] + 1e-12 for a, b in pairwise(ks))
    assert any(by_k[k][s] > by_k[1][s] for s in STEPS)  # pass@k ≥ pass@1, not always equal
    gap = per_step(
        eligible,
        lambda gs: mean_or_none([chen_pass_at_k(g["n"], g["c"], k) - g["c"] / g["n"] for g in gs]),
    )
    check_series(results["signal.pass_gap"], gap)
    assert all(v is not None and v >= 0 for v in results["signal.pass_gap"].values)


def test_pass_at_k_verl_example(write_run: WriteRun) -> None:
    # One correct of four at k = 4 is 1.0 (verl's bootstrap best@4 gives about 0.68).
    data = {
        "rollout_id": [0, 1, 2, 3],
        "step": [1] * 4,
        "prompt_id": ["q"] * 4,
        "reward": [1.0, 0.0, 0.0, 0.0],
        "response_len": [5] * 4,
    }
    results = compute(open_run(write_run({"rollouts": data}, group_size=4))).results
    assert results["signal.pass_at_k"].values == (1.0,)
    assert results["signal.pass_at_k"].extra["components"] == pytest.approx(
        {"pass@1": 0.25, "pass@2": 0.5, "pass@4": 1.0}
    )
    assert results["signal.pass_at_1"].values == (0.25,)
    assert results["signal.pass_gap"].values == (0.75,)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(8, 0, 4), (8, 1, 4), (8, 3, 8), (5, 2, 2), (7, 7, 3), (6, 1, 1), (9, 5, 4)]
)
def test_pass_at_k_estimator_single_group(write_run: WriteRun, n: int, c: int, k: int) -> None:
    data = {
        "rollout_id": list(range(n)),
        "step": [1] * n,
        "prompt_id": ["q"] * n,
        "reward": [1.0] * c + [0.0] * (n - c),
        "response_len": [5] * n,
    }
    results = compute(open_run(write_run({"rollouts": data}, group_size=k))).results
    assert results["signal.pass_at_k"].values[0] == pytest.approx(
        chen_pass_at_k(n, c, k), rel=1e-12, abs=1e-15
    )
    assert 1 - math.comb(n - c, k) / math.comb(n, k) == pytest.approx(chen_pass_at_k(n, c, k))


def test_pass_at_k_skipped_when_no_group_reaches_k(write_run: WriteRun) -> None:
    groups = make_groups(3)
    path = write_run({"rollouts": rollouts(groups, correct=False, advantage=False)}, group_size=16)
    computed = compute(open_run(path))
    reasons = {s.metric: s.reason for s in computed.skipped}
    for metric in ("signal.pass_at_k", "signal.pass_gap"):
        assert metric not in computed.results
        assert "k" in reasons[metric] and "group_size" in reasons[metric]
    assert "signal.pass_at_1" in computed.results


def test_modal_group_size_and_counts_come_from_the_group_sizes(write_run: WriteRun) -> None:
    """k = the modal train group size, the larger of a tie; eval groups (more, and larger) do
    not count; the header's rollouts, train groups and eval rollouts are the rows' own counts,
    in the step range; a rollout without a reward is in none of them."""
    rows: dict[str, list[Any]] = {k: [] for k in ("rollout_id", "step", "split", "prompt_id")}
    rows["reward"] = []
    sizes = {1: [4, 6, 3], 2: [6, 4], 3: [4, 6, 5]}  # train: 4 x3, 6 x3, 3, 5
    for step, groups in sizes.items():
        for g, n in enumerate(groups):
            for _ in range(n):
                rows["step"].append(step), rows["split"].append("train")
                rows["prompt_id"].append(f"p{g}"), rows["reward"].append(1.0 if g else 0.0)
        for g in range(4):  # four eval groups of 10 per step
            for _ in range(10):
                rows["step"].append(step), rows["split"].append("eval")
                rows["prompt_id"].append(f"e{g}"), rows["reward"].append(0.5)
    rows["rollout_id"] = list(range(len(rows["step"])))
    rows["response_len"] = [5] * len(rows["step"])
    rows["reward"][0] = None  # left out: a group of 3 at step 1
    half = len(rows["step"]) // 2
    path = write_run(
        {
            "rollouts": [
                {k: v[:half] for k, v in rows.items()},
                {k: v[half:] for k, v in rows.items()},
            ]
        }
    )
    report = analyze(path, use_cache=False)
    assert report.metrics["signal.pass_at_k"].extra["k"] == 6
    assert report.run.n_rollouts == (13 - 1) + 10 + 15 + 3 * 40
    assert report.run.n_groups == 8
    assert report.run.n_eval_rollouts == 120
    ranged = analyze(path, use_cache=False, steps=(2, 3))
    assert ranged.metrics["signal.pass_at_k"].extra["k"] == 6  # 4, 6, 4, 6, 5: a tie
    assert (ranged.run.n_rollouts, ranged.run.n_groups, ranged.run.n_eval_rollouts) == (
        10 + 15 + 2 * 40,
        5,
        80,
    )
    only = analyze(path, use_cache=False, steps=(1, 1))
    assert only.metrics["signal.pass_at_k"].extra["k"] == 3  # 3 (4, one left out), 6, 3
    # ...but with run.json's group_size that is k.
    fixed = analyze(write_run({"rollouts": rows}, group_size=4), use_cache=False)
    assert fixed.metrics["signal.pass_at_k"].extra["k"] == 4


# ---------------------------------------------------------------- effective batch, tiers


@pytest.mark.parametrize("source", ["advantage", "grpo"])
def test_effective_prompt_frac(write_run: WriteRun, check_series: CheckSeries, source: str) -> None:
    groups = make_groups(4)
    use_adv = source == "advantage"
    path = write_run(
        {
            "rollouts": [
                rollouts(groups, correct=False, advantage=use_adv),
                eval_rows(groups, correct=False, advantage=use_adv),
            ]
        }
    )
    result = compute(open_run(path)).results["signal.effective_prompt_frac"]
    for g in groups:
        g["w"] = float(np.abs(g["advantage"]).sum()) if use_adv else grpo_weight(g["reward"])

    def kish(gs: list[dict[str, Any]]) -> float | None:
        w = np.array([g["w"] for g in gs])
        return float(w.sum() ** 2 / (len(w) * (w**2).sum())) if (w**2).sum() > 0 else None

    expected = per_step(groups, kish)
    check_series(result, expected)
    assert result.source == (
        "rollouts.advantage" if use_adv else "GRPO-normalised reward (no advantage column)"
    )
    if not use_adv:  # zero-σ and single-rollout groups weigh nothing but count in P
        assert any(g["w"] == 0 for g in groups)
        assert all(v is not None and v < 1 for v in expected.values())


@pytest.mark.parametrize("source", ["advantage", "grpo"])
def test_medium_adv_share(write_run: WriteRun, check_series: CheckSeries, source: str) -> None:
    groups = make_groups(5)
    use_adv = source == "advantage"
    path = write_run(
        {
            "rollouts": [
                rollouts(groups, correct=True, advantage=use_adv),
                eval_rows(groups, correct=True, advantage=use_adv),
            ]
        }
    )
    result = compute(open_run(path)).results["signal.medium_adv_share"]
    tiers: dict[str, Expected] = {"medium": {}, "easy": {}, "hard": {}}
    for s in STEPS:
        mass = dict.fromkeys(tiers, 0.0)
        for g in (g for g in groups if g["step"] == s):
            w = float(np.abs(g["advantage"]).sum()) if use_adv else grpo_weight(g["reward"])
            p = Fraction(int(g["flag"].sum()), g["flag"].size)
            tier = "hard" if p < Fraction(1, 3) else "easy" if p > Fraction(2, 3) else "medium"
            mass[tier] += w
        total = sum(mass.values())
        for tier in tiers:
            tiers[tier][s] = mass[tier] / total if total > 0 else None
    check_series(result, tiers["medium"])
    for tier in ("easy", "hard"):
        assert result.extra["components"][tier] == pytest.approx(summary(tiers[tier]), rel=1e-9)


def test_medium_tier_boundaries_are_inclusive(write_run: WriteRun) -> None:
    # Accuracies 1/3 and 2/3 are medium; 1/4 hard; 3/4 easy. Advantage 1 per rollout.
    spec = {"a": (1, 3), "b": (2, 3), "c": (1, 4), "d": (3, 4), "e": (2, 6)}
    cols: dict[str, list[Any]] = {"step": [], "prompt_id": [], "reward": [], "advantage": []}
    for pid, (c, n) in spec.items():
        cols["step"] += [1] * n
        cols["prompt_id"] += [pid] * n
        cols["reward"] += [1.0] * c + [0.0] * (n - c)
        cols["advantage"] += [1.0] * n
    n_rows = len(cols["step"])
    data = {**cols, "rollout_id": list(range(n_rows)), "response_len": [3] * n_rows}
    result = compute(open_run(write_run({"rollouts": data}))).results["signal.medium_adv_share"]
    assert result.values[0] == pytest.approx(12 / 20)
    assert result.extra["components"] == pytest.approx({"easy": 4 / 20, "hard": 4 / 20})


# ---------------------------------------------------------------- split, missing values


def test_eval_rollouts_change_nothing(write_run: WriteRun) -> None:
    groups = make_groups(6)
    alone = write_run({"rollouts": rollouts(groups, correct=True, advantage=True)})
    mixed = write_run(
        {
            "rollouts": [
                rollouts(groups, correct=True, advantage=True),
                eval_rows(groups, correct=True, advantage=True),
            ]
        }
    )
    a, b = compute(open_run(alone)).results, compute(open_run(mixed)).results
    for metric in ROLLOUT_METRICS:
        assert a[metric].steps == b[metric].steps
        assert a[metric].values == pytest.approx(b[metric].values, rel=1e-12), metric
        assert a[metric].value == pytest.approx(b[metric].value, rel=1e-12), metric
        components = a[metric].extra.get("components", {})
        assert components == pytest.approx(b[metric].extra.get("components", {}), rel=1e-12)
    assert compute(open_run(mixed)).context.pass_k == 4


def test_only_eval_rollouts_means_skipped_not_zero(write_run: WriteRun) -> None:
    groups = make_groups(7)
    computed = compute(
        open_run(write_run({"rollouts": eval_rows(groups, correct=True, advantage=True)}))
    )
    reasons = {s.metric: s.reason for s in computed.skipped}
    for metric in ROLLOUT_METRICS:
        assert metric not in computed.results
        assert reasons[metric]


def test_null_split_counts_as_train(write_run: WriteRun, check_series: CheckSeries) -> None:
    first = {
        "rollout_id": [0, 1],
        "step": [1, 1],
        "prompt_id": ["p", "p"],
        "reward": [1.0, 0.0],
        "response_len": [3, 4],
    }
    second = {
        "rollout_id": [2, 3, 4],
        "step": [2, 2, 2],
        "prompt_id": ["p", "p", "p"],
        "split": ["train", "train", "eval_id"],
        "reward": [1.0, 1.0, 9.0],
        "response_len": [3, 4, 5],
    }
    results = compute(open_run(write_run({"rollouts": [first, second]}))).results
    check_series(results["signal.reward"], {1: 0.5, 2: 1.0})


def test_nan_reward_is_ignored_in_mean_reward(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    data = {
        "rollout_id": [0, 1, 2, 3],
        "step": [1, 1, 1, 1],
        "prompt_id": ["p", "p", "q", "q"],
        "reward": [1.0, float("nan"), 0.5, float("inf")],
        "response_len": [3, 4, 5, 6],
    }
    results = compute(open_run(write_run({"rollouts": data}))).results
    check_series(results["signal.reward"], {1: 0.75})


def test_null_correct_is_derived_from_reward(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    first = {
        "rollout_id": [0, 1, 2, 3],
        "step": [1] * 4,
        "prompt_id": ["p"] * 4,
        "reward": [1.0, 1.0, 1.0, 0.0],
        "response_len": [3] * 4,
    }
    second = {
        **first,
        "rollout_id": [4, 5, 6, 7],
        "step": [2] * 4,
        "correct": [True, False, False, False],
    }
    results = compute(open_run(write_run({"rollouts": [first, second]}))).results
    check_series(results["signal.pass_at_1"], {1: 0.75, 2: 0.25})


def _term_rows(seed: int, steps: int = 4, groups: int = 5, size: int = 4) -> dict[str, Any]:
    """Rollouts with two reward terms: `acc_reward` (0/1) and `fmt_reward` (0 or 0.5)."""
    rng = np.random.default_rng(seed)
    n = steps * groups * size
    acc = rng.binomial(1, 0.5, n).astype(float)
    fmt = 0.5 * rng.binomial(1, 0.7, n)
    return {
        "rollout_id": list(range(n)),
        "step": [i // (groups * size) for i in range(n)],
        "prompt_id": [f"p{i // size}" for i in range(n)],
        "acc_reward": acc,
        "fmt_reward": fmt,
        "response_len": [5] * n,
    }


def _direct_shares(rows: dict[str, Any], weights: dict[str, float], scale: str) -> dict:
    """Per step, each term's Σ_groups Σ|w(r_k − r̄_k)| / s_G over all terms', by hand."""
    out: dict[int, dict[str, float]] = {}
    steps = np.asarray(rows["step"])
    prompts = np.asarray(rows["prompt_id"])
    reward = sum(w * np.asarray(rows[t]) for t, w in weights.items())
    for step in sorted(set(steps.tolist())):
        mass = dict.fromkeys(weights, 0.0)
        for prompt in sorted(set(prompts[steps == step].tolist())):
            at = (steps == step) & (prompts == prompt)
            r = reward[at]
            s = (r.std(ddof=1) + 1e-4) if scale == "group" else 1.0
            for term, w in weights.items():
                values = w * np.asarray(rows[term])[at]
                mass[term] += float(np.abs(values - values.mean()).sum()) / s
        total = sum(mass.values())
        out[step] = {t: m / total for t, m in mass.items()}
    return out


@pytest.mark.parametrize("variant", ["logged", "group", "none"])
def test_advantage_share_against_a_direct_computation(
    write_run: WriteRun, check_series: CheckSeries, variant: str
) -> None:
    """signal.advantage_share.<term>: from the logged advantages (TRL's group scaling), or
    reconstructed from run.json scale_rewards (`group`, `none`): the hand computation."""
    weights = {"acc_reward": 1.0, "fmt_reward": 4.0}
    rows = _term_rows(3)
    reward = sum(w * np.asarray(rows[t]) for t, w in weights.items())
    rows["reward"] = reward
    scale = "none" if variant == "none" else "group"
    if variant == "logged":
        frame = pl.DataFrame({"p": rows["prompt_id"], "r": reward})
        centred = frame.select(
            (pl.col("r") - pl.col("r").mean().over("p"))
            / (pl.col("r").std(ddof=1).over("p") + 1e-4)
        )
        rows["advantage"] = centred.to_series().to_numpy()
    meta = {"reward_components": list(weights), "reward_weights": weights, "group_size": 4}
    if variant != "logged":
        meta["scale_rewards"] = scale
    computed = compute(open_run(write_run({"rollouts": rows}, **meta)))
    expected = _direct_shares(rows, weights, scale)
    for term in weights:
        result = computed.results[f"signal.advantage_share.{term}"]
        check_series(result, {s: shares[term] for s, shares in expected.items()})
        source = "rollouts.advantage" if variant == "logged" else "run.json scale_rewards"
        assert result.source.startswith(source)
    # One term alone: no share to speak of.
    alone = {k: v for k, v in rows.items() if k != "fmt_reward"}
    one = compute(open_run(write_run({"rollouts": alone}, reward_components=["acc_reward"])))
    assert not [m for m in one.results if m.startswith("signal.advantage_share.")]


def test_a_heavy_auxiliary_term_without_group_scaling_is_found(write_run: WriteRun) -> None:
    """Dr. GRPO (scale_rewards none) with a format term weighted 16x: accuracy varies in most
    groups, yet the format term carries most of every update: auxiliary-reward-dominates."""
    from rlscope.analysis import analyze

    weights = {"acc_reward": 1.0, "fmt_reward": 16.0}
    rows = _term_rows(4, steps=20, groups=16)
    rows["reward"] = sum(w * np.asarray(rows[t]) for t, w in weights.items())
    meta = {
        "reward_components": list(weights),
        "reward_weights": weights,
        "scale_rewards": "none",
        "correct_source": "acc_reward > 0",
    }
    report = analyze(write_run({"rollouts": rows}, **meta), use_cache=False)
    (found,) = [f for f in report.findings if f.id == "auxiliary-reward-dominates"]
    assert found.evidence["task_term"] == "acc_reward" and found.evidence["task_share"] < 0.25
    # With the weights equal, nothing.
    fair = analyze(
        write_run(
            {"rollouts": {**rows, "reward": rows["acc_reward"] + rows["fmt_reward"]}},
            **{**meta, "reward_weights": {"acc_reward": 1.0, "fmt_reward": 1.0}},
        ),
        use_cache=False,
    )
    assert "auxiliary-reward-dominates" not in {f.id for f in fair.findings}


WEIGHTED = GENUINE / "trl-real/format-weighted-groupnorm"


def test_advantage_share_reconstructed_equals_trls_own_advantages(tmp_path: Path) -> None:
    """On a genuine TRL run (format weighted 32x accuracy, group std scaling): the shares from
    TRL's logged advantages and those reconstructed from the rewards with run.json's
    scale_rewards agree at every step (to TRL's float32), and the accuracy term's share
    rises ~0.4 -> ~0.8 as the run's README says accuracy keeps learning."""
    import shutil

    from rlscope.analysis import analyze
    from rlscope.importers import import_run

    run = tmp_path / "run"
    import_run("trl", WEIGHTED, run, correct_column="accuracy_reward")
    assert json.loads((run / "run.json").read_text())["scale_rewards"] == "group"
    bare = tmp_path / "without-advantages"
    shutil.copytree(run, bare)
    for path in (bare / "rollouts").rglob("*.parquet"):
        pl.read_parquet(path).drop("advantage").write_parquet(path)
    metric = "signal.advantage_share.accuracy_reward"
    logged = analyze(run, use_cache=False).metrics[metric]
    rebuilt = analyze(bare, use_cache=False).metrics[metric]
    assert logged.source.startswith("rollouts.advantage")
    assert rebuilt.source.startswith("run.json scale_rewards")
    assert logged.steps == rebuilt.steps
    assert np.allclose(logged.values, rebuilt.values, atol=1e-6)
    tenth = len(logged.values) // 10
    assert np.mean(logged.values[:tenth]) < 0.5 < 0.75 < np.mean(logged.values[-tenth:])
