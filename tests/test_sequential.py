"""The earliest sure verdicts: the sequential test of a fall, jumps of a setting outside its
schedule, sustained shifts of what the update does, each both ways on hand-made series."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import polars as pl
import pytest
from test_rules_verdicts import ids, judge

from rlscope.metrics.signal import ACC_SQ
from rlscope.rules.base import (
    RESPONSES,
    Series,
    fall_threshold,
    fold,
    level_shifts,
    sequential_fall,
    setting_jumps,
)

SHIFTS = (0.05, 0.15, 0.3)
KL = RESPONSES["stability.kl"]


def groups_frame(accuracies: Sequence[np.ndarray], first_step: int = 1) -> pl.DataFrame:
    """pass@1's frame (per step: the groups' mean accuracy, their number, Σ accuracy²) from
    each step's group accuracies."""
    return pl.DataFrame(
        {
            "step": list(range(first_step, first_step + len(accuracies))),
            "value": [float(a.mean()) for a in accuracies],
            "groups": [len(a) for a in accuracies],
            ACC_SQ: [float((a**2).sum()) for a in accuracies],
        }
    )


def run(
    rng: np.random.Generator,
    levels: Sequence[float],
    groups: int = 8,
    size: int = 8,
    spread: float = 8.0,
) -> list[np.ndarray]:
    """A GRPO run's group accuracies: per step `groups` prompts whose difficulty is drawn
    around the step's level (Beta with `spread` pseudo-counts: prompts differ), `size`
    rollouts each."""
    steps = []
    for level in levels:
        p = rng.beta(level * spread, (1 - level) * spread, groups)
        steps.append(rng.binomial(size, p) / size)
    return steps


def test_the_threshold_spends_at_most_alpha_over_any_run() -> None:
    """Half of alpha over every start, half over the steps after each change: the budget over
    10,000 steps with 3 changes and 3 tests stays under alpha."""
    alpha, primed = 0.01, [5, 40, 41]
    spent = sum(3 * math.exp(-fall_threshold(j, j, primed, alpha, 3)) for j in range(1, 10_001))
    assert spent <= alpha
    assert fall_threshold(30, 30, [25], alpha, 3) < fall_threshold(30, 30, [], alpha, 3)
    assert fall_threshold(30, 30, [10], alpha, 3) == fall_threshold(30, 30, [], alpha, 3)


@pytest.mark.parametrize("shape", ["flat", "rising", "plateau"])
def test_healthy_runs_raise_a_false_alarm_less_often_than_the_bound(shape: str) -> None:
    """Over 300 healthy runs of 80 steps (prompts of varied difficulty: groups disagree, as
    in a real batch) judged at alpha = 0.05, the share of runs with a fall at their end is
    within the bound (the binomial allowance of 300 runs included)."""
    rng = np.random.default_rng(7)
    levels = {
        "flat": np.full(80, 0.6),
        "rising": np.linspace(0.3, 0.8, 80),
        "plateau": np.minimum(np.linspace(0.4, 1.2, 80), 0.85),
    }[shape]
    alarms = sum(
        sequential_fall(groups_frame(run(rng, levels)), "groups", ACC_SQ, 0.05, SHIFTS) is not None
        for _ in range(300)
    )
    assert alarms <= 0.05 * 300 + 3 * math.sqrt(0.05 * 0.95 * 300)


def test_a_collapse_is_sure_within_steps_and_begins_where_it_began() -> None:
    rng = np.random.default_rng(1)
    levels = [0.8] * 30 + [0.1] * 20
    fall = sequential_fall(groups_frame(run(rng, levels)), "groups", ACC_SQ, 0.01, SHIFTS)
    assert fall is not None
    assert fall.began == 31 and fall.sure <= 33
    assert fall.before == pytest.approx(0.8, abs=0.1) and fall.after < 0.25
    assert fall.reference == (21, 30)


def test_the_first_step_is_a_reference() -> None:
    """A policy broken by its first update (a learning rate far too high) is sure at step 2:
    step 1's 8 groups are the reference."""
    first = np.array([0.75, 0.875, 0.625, 1.0, 0.75, 0.5, 0.875, 0.875])
    fall = sequential_fall(
        groups_frame([first, np.zeros(8), np.zeros(8)]), "groups", ACC_SQ, 0.01, SHIFTS
    )
    assert fall is not None and (fall.began, fall.sure) == (2, 2)
    assert fall.before == pytest.approx(first.mean())


def test_a_dip_that_recovered_is_no_fall() -> None:
    rng = np.random.default_rng(2)
    levels = [0.8] * 30 + [0.2] * 4 + [0.8] * 20
    frame = groups_frame(run(rng, levels))
    assert sequential_fall(frame.head(34), "groups", ACC_SQ, 0.01, SHIFTS) is not None
    assert sequential_fall(frame, "groups", ACC_SQ, 0.01, SHIFTS) is None


def test_a_change_of_a_setting_makes_the_fall_after_it_sure_sooner() -> None:
    rng = np.random.default_rng(3)
    levels = [0.85] * 25 + [0.55] * 10
    frame = groups_frame(run(rng, levels))
    plain = sequential_fall(frame, "groups", ACC_SQ, 0.01, SHIFTS)
    primed = sequential_fall(frame, "groups", ACC_SQ, 0.01, SHIFTS, primed=[25])
    assert plain is not None and primed is not None
    assert primed.sure <= plain.sure and primed.threshold < plain.threshold


def test_the_reference_is_the_pooled_level_of_the_10_steps_before() -> None:
    """An independent computation: the reference mean pools the groups of steps 1-10 of a
    fall at step 11, and the level after pools the fallen steps' groups."""
    accuracies = [np.array([0.5, 1.0, 0.75, 0.75])] * 10 + [np.array([0.0, 0.25, 0.0])] * 4
    fall = sequential_fall(groups_frame(accuracies), "groups", ACC_SQ, 0.01, SHIFTS)
    assert fall is not None and fall.began == 11
    assert fall.before == pytest.approx(0.75) and fall.after == pytest.approx(1 / 12)


# --- a setting's jump outside its schedule ----------------------------------------------------


def series(values: Sequence[float]) -> Series:
    return Series(np.arange(1, len(values) + 1), np.asarray(values, dtype=np.float64))


def test_scheduled_learning_rates_are_no_jump() -> None:
    peak = 5e-4
    warmup = [peak * i / 10 for i in range(10)]  # HF's linear warm-up logs 0 at its first step
    cosine = [peak * 0.5 * (1 + math.cos(math.pi * i / 40)) for i in range(40)]
    schedules = {
        "warm-up then cosine": warmup + cosine,
        "exponential warm-up": [peak * 2.0 ** (i - 10) for i in range(11)] + [peak] * 20,
        "step decay": [peak] * 20 + [peak / 10] * 20 + [peak / 100] * 10,
        "warm restarts": (cosine[:20] * 3),
        "constant": [peak] * 50,
        "linear decay to 0": [peak * (1 - i / 49) for i in range(50)],
    }
    for name, values in schedules.items():
        assert setting_jumps(series(values), "stability.lr") == [], name


def test_a_learning_rate_x10_outside_its_schedule_is_a_jump_at_its_step() -> None:
    values = [5e-4] * 24 + [5e-3] * 20
    (jump,) = setting_jumps(series(values), "stability.lr")
    assert (jump.step, jump.before, jump.after) == (25, 5e-4, 5e-3)
    assert jump.factor == pytest.approx(10)
    # during a warm-up too: the step is ten times the warm-up's
    warm = [5e-5 * i for i in range(10)]
    (jump,) = setting_jumps(series([*warm, 5e-3, 5e-3]), "stability.lr")
    assert jump.step == 11


def test_fold_is_a_change_s_size_whichever_way_it_went() -> None:
    assert fold(0.5, 1.5) == fold(1.5, 0.5) == pytest.approx(3.0)
    assert fold(-2.0, 1.0) == 2.0
    assert fold(0.0, 0.0) == 1.0 and fold(0.0, 1e-9) == math.inf


# --- a sustained shift of a response ------------------------------------------------------------


def test_a_kl_growing_from_zero_is_no_shift_but_a_jump_from_a_settled_level_is() -> None:
    rng = np.random.default_rng(4)
    growing = np.concatenate([np.geomspace(1e-4, 0.3, 15), 0.3 * rng.lognormal(0, 0.4, 30)])
    assert level_shifts(series(growing), "stability.kl", KL, 5.0) == []
    settled = np.concatenate([0.07 * rng.lognormal(0, 0.4, 24), 3.0 * rng.lognormal(0, 0.3, 10)])
    (shift,) = level_shifts(series(settled), "stability.kl", KL, 5.0)
    assert shift.step == 25 and shift.factor > 10


def test_a_falling_kl_or_a_small_one_is_no_shift() -> None:
    rng = np.random.default_rng(9)
    falling = np.concatenate([3.0 * rng.lognormal(0, 0.2, 20), 0.07 * rng.lognormal(0, 0.2, 10)])
    assert level_shifts(series(falling), "stability.kl", KL, 5.0) == []
    small = np.concatenate([0.001 * rng.lognormal(0, 0.2, 20), 0.03 * rng.lognormal(0, 0.2, 10)])
    assert level_shifts(series(small), "stability.kl", KL, 5.0) == []
    entropy = np.concatenate([0.6 * rng.lognormal(0, 0.02, 20), 0.1 * rng.lognormal(0, 0.02, 10)])
    (shift,) = level_shifts(series(entropy), "behavior.entropy", RESPONSES["behavior.entropy"], 5.0)
    assert shift.step == 21 and shift.factor < 0.5


def test_a_spike_is_no_shift() -> None:
    rng = np.random.default_rng(5)
    kl = 0.07 * rng.lognormal(0, 0.3, 40)
    kl[20] = 5.0
    assert level_shifts(series(kl), "stability.kl", KL, 5.0) == []


# --- the finding --------------------------------------------------------------------------------


def test_update_change_names_the_jump_and_what_moved_with_it() -> None:
    rng = np.random.default_rng(6)
    lr = [5e-4] * 24 + [2e-2] * 16
    kl = np.concatenate([0.07 * rng.lognormal(0, 0.3, 24), 3.0 * rng.lognormal(0, 0.2, 16)])
    (found,) = judge("update-change", {"stability.lr": lr, "stability.kl": kl})
    assert found.id == "update-change" and found.severity == "warn"
    assert found.evidence["began"] == 25
    assert "learning rate jumped ×40 at step 25" in found.message
    assert "KL to the reference" in found.message
    assert judge("update-change", {"stability.lr": [5e-4] * 40, "stability.kl": kl[:24]}) == []


def test_update_change_explains_the_collapse_after_it() -> None:
    rule = judge.__globals__["RULES"]["update-change"]
    assert {"performance-regression", "kl-high", "value-divergence"} <= set(rule.explains)


def test_performance_regression_is_sure_right_after_a_jump() -> None:
    """pass@1 0.9 → 0.5 right after the learning rate jumped: the sequential test, its budget
    primed by the jump, is sure within 3 steps."""
    rng = np.random.default_rng(8)
    accuracies = run(rng, [0.9] * 25 + [0.5] * 5, spread=20)
    frame = groups_frame(accuracies)
    lr = [5e-4] * 25 + [5e-3] * 5
    found = judge(
        "performance-regression",
        {"signal.pass_at_1": frame["value"].to_list(), "stability.lr": lr},
        {"signal.pass_at_1": frame},
    )
    assert ids(found) == ["performance-regression"]
    assert found[0].evidence["began"] >= 26 and found[0].evidence["sure"] <= 28
    assert "learning rate" in found[0].message


# --- level rules from the first step their bound is sure --------------------------------------


def test_level_rules_judge_from_the_first_step_their_bound_is_sure() -> None:
    """A logged learning rate of 0 is sure at its second step (a linear warm-up logs 0 at its
    first only); a clip fraction or a truncation rate measured over a step's whole batch at its
    first."""
    (zero,) = judge("lr-zero", {"stability.lr": [0.0, 0.0]})
    assert zero.severity == "critical"
    assert judge("lr-zero", {"stability.lr": [0.0]}) == []
    assert judge("lr-zero", {"stability.lr": [0.0, 5e-5]}) == []
    (clip,) = judge("clip-too-high", {"stability.clip_frac": [0.2]})
    assert clip.severity == "warn"
    (cut,) = judge("truncation", {"behavior.truncation_rate": [0.3]})
    assert cut.severity == "critical"
