"""L1 stability metrics against direct numpy computations on small synthetic runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import final_window

from rlscope.engine import compute
from rlscope.reader import open_run

WriteRun = Callable[..., Path]
CheckSeries = Callable[..., None]

STEPS = list(range(1, 16))
F32_COLUMNS = ("logprob", "old_logprob", "ref_logprob", "entropy", "advantage")


def rollouts_for(steps: list[int]) -> dict[str, Any]:
    """One train rollout per step (the tokens below belong to it)."""
    return {
        "rollout_id": steps,
        "step": steps,
        "prompt_id": ["p"] * len(steps),
        "reward": [1.0] * len(steps),
        "response_len": [10] * len(steps),
    }


def make_tokens(
    seed: int, *, steps: list[int] = STEPS, drop: tuple[str, ...] = (), bad: bool = True
) -> dict[str, np.ndarray]:
    """Random float32 token columns, a different number of tokens per step; with `bad`, ~3% of
    each float column is NaN or ±inf (at independent positions)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(40, 160, size=len(steps))
    step = np.repeat(np.array(steps, dtype=np.int64), sizes)
    n = step.size
    logprob = -rng.gamma(0.7, 1.0, n)
    cols: dict[str, np.ndarray] = {
        "rollout_id": step.copy(),
        "step": step,
        "pos": np.concatenate([np.arange(k) for k in sizes]).astype(np.int32),
        "logprob": logprob,
        "old_logprob": logprob + rng.normal(0.0, 0.3, n),
        "ref_logprob": logprob + rng.normal(0.0, 0.5, n),
        "entropy": rng.gamma(0.6, 1.5, n),
        "advantage": rng.normal(0.0, 1.0, n),
        "clipped": rng.random(n) < 0.15,
    }
    for name in F32_COLUMNS:
        cols[name] = cols[name].astype(np.float32)
        if bad:
            idx = rng.choice(n, size=n // 33, replace=False)
            cols[name][idx] = rng.choice([np.nan, np.inf, -np.inf], size=idx.size)
    return {k: v for k, v in cols.items() if k not in drop}


def per_step(tokens: dict[str, np.ndarray], fn: Any) -> dict[int, float | None]:
    """{step: fn(mask)} for every step of the tokens."""
    return {int(s): fn(tokens["step"] == s) for s in np.unique(tokens["step"])}


def f64(tokens: dict[str, np.ndarray], name: str) -> np.ndarray:
    return tokens[name].astype(np.float64)


def token_mean(values: np.ndarray, valid: np.ndarray, mask: np.ndarray) -> float | None:
    m = mask & valid
    return float(values[m].sum() / m.sum()) if m.any() else None


# ---------------------------------------------------------------- loss, grad_norm


def test_loss_and_grad_norm_are_step_means(write_run: WriteRun, check_series: CheckSeries) -> None:
    rng = np.random.default_rng(1)
    rows: list[dict[str, Any]] = []
    expected: dict[str, dict[int, list[float]]] = {"loss": {}, "grad_norm": {}}
    for step in rng.permutation(np.arange(1, 24)):  # logged out of order
        for _ in range(int(rng.integers(1, 4))):  # duplicate rows for some steps
            row = {"step": int(step)}
            for name in expected:
                value = float(rng.normal(0.1, 1.0)) if name == "loss" else float(rng.gamma(2.0))
                if rng.random() < 0.1:
                    value = float(rng.choice([np.nan, np.inf]))
                row[name] = value
                if math.isfinite(value):
                    expected[name].setdefault(int(step), []).append(value)
            rows.append(row)
    # A step where grad_norm is NaN in every row: undefined there, not zero.
    rows.append({"step": 30, "loss": 0.5, "grad_norm": float("nan")})
    expected["loss"][30] = [0.5]
    path = write_run({"rollouts": rollouts_for([1]), "steps": rows})
    results = compute(open_run(path)).results
    for name, by_step in expected.items():
        result = results[f"stability.{name}"]
        check_series(result, {s: float(np.mean(v)) for s, v in by_step.items()})
        assert result.source == f"steps.{name} as logged"


def test_summary_is_the_final_window_of_defined_steps(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    # 25 defined steps -> the summary is the mean of the last 3; undefined steps don't count.
    rows = [{"step": s, "loss": float(s)} for s in range(1, 26)]
    rows += [{"step": s, "loss": float("nan")} for s in range(26, 30)]
    path = write_run({"rollouts": rollouts_for([1]), "steps": rows})
    result = compute(open_run(path)).results["stability.loss"]
    assert result.value == pytest.approx((23 + 24 + 25) / 3, rel=1e-12)
    check_series(result, {s: float(s) for s in range(1, 26)})
    # Fewer than 30 steps: the last 3 (the window the findings judge), all of them below 3.
    path = write_run({"rollouts": rollouts_for([1]), "steps": rows[:4]})
    assert compute(open_run(path)).results["stability.loss"].value == 3.0
    path = write_run({"rollouts": rollouts_for([1]), "steps": rows[:2]})
    assert compute(open_run(path)).results["stability.loss"].value == 1.5
    assert final_window([1.0, 2.0, 3.0, 4.0]) == 3.0


def test_lr_is_the_logged_step_mean(write_run: WriteRun, check_series: CheckSeries) -> None:
    rows = [{"step": s, "lr": 1e-6 * (1 - s / 10)} for s in range(1, 11)]
    rows += [{"step": 4, "lr": 0.0}, {"step": 12, "lr": float("nan")}]  # a duplicate; undefined
    path = write_run({"rollouts": rollouts_for([1]), "steps": rows})
    result = compute(open_run(path)).results["stability.lr"]
    expected = {s: 1e-6 * (1 - s / 10) for s in range(1, 11)} | {4: 0.6e-6 / 2}
    check_series(result, expected)
    assert result.value == pytest.approx(np.mean([0.2e-6, 0.1e-6, 0.0]), abs=1e-18)
    assert result.source == "steps.lr as logged"


def test_loss_skipped_without_steps_table(write_run: WriteRun) -> None:
    computed = compute(open_run(write_run({"rollouts": rollouts_for([1])})))
    skipped = {s.metric: s.reason for s in computed.skipped}
    assert "stability.loss" not in computed.results
    assert "steps" in skipped["stability.loss"]
    assert "stability.grad_norm" in skipped


# ---------------------------------------------------------------- KL (k3) and PPO KL


def expected_k3(tokens: dict[str, np.ndarray]) -> dict[int, float | None]:
    with np.errstate(invalid="ignore"):
        d = f64(tokens, "ref_logprob") - f64(tokens, "logprob")
    valid = np.isfinite(d)
    d = np.where(valid, d, 0.0)
    k3 = np.exp(d) - d - 1.0
    return per_step(tokens, lambda m: token_mean(k3, valid, m))


@pytest.mark.parametrize("with_entropy", [True, False], ids=["binned", "per-step"])
def test_kl_is_token_mean_k3(
    write_run: WriteRun, check_series: CheckSeries, with_entropy: bool
) -> None:
    tokens = make_tokens(2, drop=() if with_entropy else ("entropy",))
    steps = [{"step": s, "kl": 99.0} for s in STEPS]  # tokens win over the logged value
    path = write_run({"rollouts": rollouts_for(STEPS), "tokens": tokens, "steps": steps})
    result = compute(open_run(path)).results["stability.kl"]
    expected = expected_k3(tokens)
    check_series(result, expected)
    assert result.source == "tokens: token-mean k3"
    assert all(v is not None and v >= 0 for v in result.values)


def test_kl_falls_back_to_logged_kl(write_run: WriteRun, check_series: CheckSeries) -> None:
    tokens = make_tokens(4, drop=("ref_logprob",))
    rows = [{"step": s, "kl": 0.01 * s} for s in STEPS] + [{"step": 3, "kl": 0.5}]
    path = write_run({"rollouts": rollouts_for(STEPS), "tokens": tokens, "steps": rows})
    result = compute(open_run(path)).results["stability.kl"]
    expected = {s: 0.01 * s for s in STEPS} | {3: (0.03 + 0.5) / 2}
    check_series(result, expected)
    assert result.source == "steps.kl as logged"


def test_kl_skipped_without_inputs_names_the_columns(write_run: WriteRun) -> None:
    tokens = make_tokens(5, drop=("ref_logprob",))
    rows = [{"step": s, "loss": 1.0} for s in STEPS]
    computed = compute(
        open_run(write_run({"rollouts": rollouts_for(STEPS), "tokens": tokens, "steps": rows}))
    )
    assert "stability.kl" not in computed.results
    reason = {s.metric: s.reason for s in computed.skipped}["stability.kl"]
    assert "tokens.ref_logprob" in reason and "steps.kl" in reason


def test_ppo_kl_is_token_mean_of_old_minus_new(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    tokens = make_tokens(6)
    path = write_run({"rollouts": rollouts_for(STEPS), "tokens": tokens})
    result = compute(open_run(path)).results["stability.ppo_kl"]
    with np.errstate(invalid="ignore"):
        diff = f64(tokens, "old_logprob") - f64(tokens, "logprob")
    valid = np.isfinite(diff)
    check_series(result, per_step(tokens, lambda m: token_mean(np.where(valid, diff, 0), valid, m)))


def test_ppo_kl_skipped_without_old_logprob(write_run: WriteRun) -> None:
    tokens = make_tokens(7, drop=("old_logprob",))
    computed = compute(open_run(write_run({"rollouts": rollouts_for(STEPS), "tokens": tokens})))
    assert "stability.ppo_kl" not in computed.results
    assert "old_logprob" in {s.metric: s.reason for s in computed.skipped}["stability.ppo_kl"]


# ---------------------------------------------------------------- clip fraction


def test_clip_frac_from_clipped_column(write_run: WriteRun, check_series: CheckSeries) -> None:
    tokens: dict[str, Any] = make_tokens(8)
    clipped = [bool(c) for c in tokens["clipped"]]
    for i in range(0, len(clipped), 17):
        clipped[i] = None  # nulls are not counted in either numerator or denominator
    tokens["clipped"] = clipped
    path = write_run(
        {
            "rollouts": rollouts_for(STEPS),
            "tokens": tokens,
            "steps": [{"step": s, "clip_frac": 0.9} for s in STEPS],
        }
    )
    result = compute(open_run(path)).results["stability.clip_frac"]
    flag = np.array([bool(c) for c in clipped])
    valid = np.array([c is not None for c in clipped])
    check_series(result, per_step(tokens, lambda m: token_mean(flag.astype(float), valid, m)))
    assert result.source == "tokens.clipped"


def expected_clip(
    tokens: dict[str, np.ndarray], eps_low: float, eps_high: float
) -> tuple[dict[int, float | None], dict[int, float | None], dict[int, float | None]]:
    lp, old, adv = f64(tokens, "logprob"), f64(tokens, "old_logprob"), f64(tokens, "advantage")
    valid = np.isfinite(lp) & np.isfinite(old) & np.isfinite(adv)
    with np.errstate(invalid="ignore", over="ignore"):
        r = np.exp(lp - old)
        low = valid & (r < 1 - eps_low) & (adv < 0)
        high = valid & (r > 1 + eps_high) & (adv > 0)
    return (
        per_step(tokens, lambda m: token_mean((low | high).astype(float), valid, m)),
        per_step(tokens, lambda m: token_mean(low.astype(float), valid, m)),
        per_step(tokens, lambda m: token_mean(high.astype(float), valid, m)),
    )


@pytest.mark.parametrize(
    ("meta", "eps_low", "eps_high"),
    [
        ({}, 0.2, 0.2),
        ({"clip_ratio_low": 0.1}, 0.1, 0.1),
        ({"clip_ratio_low": 0.15, "clip_ratio_high": 0.28}, 0.15, 0.28),
    ],
    ids=["defaults", "high-defaults-to-low", "asymmetric"],
)
def test_clip_frac_derived_from_ratio_and_advantage(
    write_run: WriteRun,
    check_series: CheckSeries,
    meta: dict[str, float],
    eps_low: float,
    eps_high: float,
) -> None:
    tokens = make_tokens(9, drop=("clipped",))
    path = write_run(
        {
            "rollouts": rollouts_for(STEPS),
            "tokens": tokens,
            "steps": [{"step": s, "clip_frac": 0.9} for s in STEPS],
        },
        **meta,
    )
    result = compute(open_run(path)).results["stability.clip_frac"]
    total, low, high = expected_clip(tokens, eps_low, eps_high)
    check_series(result, total)
    assert "derived" in result.source
    components = result.extra["components"]
    for name, series in (("low", low), ("high", high)):
        values = [series[s] for s in sorted(series) if series[s] is not None]
        assert components[name] == pytest.approx(final_window(values), rel=1e-9, abs=1e-12)
    assert components["low"] > 0 and components["high"] > 0


def test_clip_frac_falls_back_to_logged(write_run: WriteRun, check_series: CheckSeries) -> None:
    tokens = make_tokens(10, drop=("clipped", "old_logprob"))
    rows = [{"step": s, "clip_frac": 0.002 * s} for s in STEPS]
    path = write_run({"rollouts": rollouts_for(STEPS), "tokens": tokens, "steps": rows})
    result = compute(open_run(path)).results["stability.clip_frac"]
    check_series(result, {s: 0.002 * s for s in STEPS})
    assert result.source == "steps.clip_frac as logged"


def test_clip_frac_skipped_without_any_input(write_run: WriteRun) -> None:
    tokens = make_tokens(11, drop=("clipped", "advantage"))
    computed = compute(open_run(write_run({"rollouts": rollouts_for(STEPS), "tokens": tokens})))
    assert "stability.clip_frac" not in computed.results
    reason = {s.metric: s.reason for s in computed.skipped}["stability.clip_frac"]
    assert "tokens.clipped" in reason and "tokens.advantage" in reason


def test_clip_ratio_low_zero_is_honoured(write_run: WriteRun, check_series: CheckSeries) -> None:
    tokens = make_tokens(12, drop=("clipped",))
    path = write_run(
        {"rollouts": rollouts_for(STEPS), "tokens": tokens},
        clip_ratio_low=0.0,
        clip_ratio_high=0.28,
    )
    computed = compute(open_run(path))
    total, _, _ = expected_clip(tokens, 0.0, 0.28)
    check_series(computed.results["stability.clip_frac"], total)


def test_token_metrics_when_entropy_only_in_later_files(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    # Tokens are aggregated per (step, entropy bin): rows without entropy fall in a null bin
    # and must still count for the other token metrics.
    early = make_tokens(13, steps=STEPS[:8], drop=("entropy",))
    late = make_tokens(14, steps=STEPS[5:])
    path = write_run({"rollouts": rollouts_for(STEPS), "tokens": [early, late]})
    results = compute(open_run(path)).results
    both = {k: np.concatenate([early[k], late[k]]) for k in early}
    check_series(results["stability.kl"], expected_k3(both))
    with np.errstate(invalid="ignore"):
        diff = f64(both, "old_logprob") - f64(both, "logprob")
    valid = np.isfinite(diff)
    check_series(
        results["stability.ppo_kl"],
        per_step(both, lambda m: token_mean(np.where(valid, diff, 0), valid, m)),
    )
    entropy = f64(late, "entropy")
    ok = np.isfinite(entropy)
    check_series(
        results["behavior.entropy"],
        per_step(late, lambda m: token_mean(np.where(ok, entropy, 0), ok, m)),
    )


def test_a_logged_share_outside_0_1_is_left_out(write_run: Any) -> None:
    """A corrupt logged clip fraction (-7.9, found by the fuzz test) is no share: left out,
    the other steps' values kept."""
    steps = [
        {"step": s, "loss": 0.1, "clip_frac": v}
        for s, v in enumerate([-7.894893278397399, 0.05, 1.5, 0.04])
    ]
    run = write_run({"steps": steps})
    result = compute(open_run(run), ["stability.clip_frac"]).results["stability.clip_frac"]
    assert result.values == (None, 0.05, None, 0.04)
