"""L2 behaviour metrics against direct numpy computations on small synthetic runs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlscope.engine import compute
from rlscope.reader import open_run
from rlscope.tokenscan import ENTROPY_BIN_OFFSET, ENTROPY_BINS_PER_EFOLD

WriteRun = Callable[..., Path]
CheckSeries = Callable[..., None]
Expected = dict[int, float | None]

STEPS = list(range(1, 13))
SIZES = (1, 2, 3, 4, 4, 4, 6)  # rollouts per prompt group, incl. a group of one
MAX_LEN, MAX_CALLS = 48, 4


def half_bin(entropy: float) -> float:
    """The documented error bound of the entropy histogram: half a bin at this entropy."""
    return (entropy + ENTROPY_BIN_OFFSET) * math.expm1(1 / ENTROPY_BINS_PER_EFOLD) / 2 + 1e-12


# ---------------------------------------------------------------- synthetic rollouts


def make_rollouts(seed: int, *, uniform_steps: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """Train rollouts: every step has groups of SIZES (one group dropped at random steps) with a
    per-group accuracy in {0, .25, .5, .75, 1}; at `uniform_steps` every group is all-correct."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "step",
            "prompt_id",
            "latent",
            "reward",
            "correct",
            "response_len",
            "truncated",
            "n_tool_calls",
            "advantage",
        )
    }
    for step in STEPS:
        sizes = list(rng.permutation(SIZES))
        if rng.random() < 0.3:
            sizes.pop(int(rng.integers(1, len(sizes))))
        for g, n in enumerate(sizes):
            p = 1.0 if step in uniform_steps else float(rng.choice([0, 0.25, 0.5, 0.75, 1.0]))
            latent = rng.random(n) < p
            binary = rng.random() < 0.5
            win = np.ones(n) if binary else rng.uniform(0.5, 1.5, n)
            lose = np.zeros(n) if binary else -rng.uniform(0.0, 0.5, n)
            cols["step"] += [step] * n
            cols["prompt_id"] += [f"p{g}"] * n
            cols["latent"] += list(latent)
            cols["reward"] += list(np.where(latent, win, lose))
            cols["correct"] += list(rng.random(n) < 0.5)  # independent of the reward
            cols["response_len"] += list(rng.integers(1, 65, n))
            cols["truncated"] += list(rng.random(n) < 0.2)
            cols["n_tool_calls"] += list(rng.integers(0, 7, n))
            cols["advantage"] += list(rng.normal(0.0, 1.0, n))
    out = {k: np.array(v) for k, v in cols.items()}
    out["rollout_id"] = np.arange(out["step"].size, dtype=np.int64)
    out["response_len"] = out["response_len"].astype(np.int32)
    out["n_tool_calls"] = out["n_tool_calls"].astype(np.int32)
    return out


def eval_rows(train: dict[str, np.ndarray]) -> dict[str, Any]:
    """Held-out rollouts at the same steps and prompt ids, with values that would wreck every
    metric if they were counted."""
    n = train["step"].size
    return {
        "rollout_id": np.arange(n, 2 * n, dtype=np.int64) + 10_000,
        "step": train["step"],
        "prompt_id": train["prompt_id"],
        "split": ["eval_id"] * n,
        "reward": np.full(n, 1e6),
        "correct": np.arange(n) % 2 == 0,
        "response_len": np.full(n, 1_000_000, dtype=np.int32),
        "truncated": np.ones(n, dtype=bool),
        "n_tool_calls": (np.arange(n) % 3 * 1000).astype(np.int32),
        "advantage": np.full(n, 1e9),
    }


def table(train: dict[str, np.ndarray], drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The rollouts batch to log, with an explicit split `train` (a null split drops the rows:
    test_metrics_signal.py::test_null_split_counts_as_train)."""
    cols = {k: v for k, v in train.items() if k != "latent" and k not in drop}
    return {**cols, "split": ["train"] * train["step"].size}


def groups_by_step(train: dict[str, np.ndarray], correct: np.ndarray) -> dict[int, list[dict]]:
    """{step: [group, ...]}, each group a dict of that group's column arrays."""
    out: dict[int, list[dict]] = {}
    keys = list(zip(train["step"].tolist(), train["prompt_id"].tolist(), strict=True))
    for key in dict.fromkeys(keys):
        mask = np.array([k == key for k in keys])
        group = {name: values[mask] for name, values in train.items()}
        group["correct"] = correct[mask]
        out.setdefault(key[0], []).append(group)
    return out


def step_mean(
    train: dict[str, np.ndarray], values: np.ndarray, where: np.ndarray | None = None
) -> Expected:
    out: Expected = {}
    for s in STEPS:
        m = train["step"] == s
        if where is not None:
            m &= where
        out[s] = float(values[m].astype(np.float64).mean()) if m.any() else None
    return out


def pooled_std(groups: list[dict], name: str) -> float | None:
    big = [g[name].astype(np.float64) for g in groups if g[name].size >= 2]
    dof = sum(x.size - 1 for x in big)
    if dof == 0:
        return None
    return math.sqrt(sum(float(((x - x.mean()) ** 2).sum()) for x in big) / dof)


def within_corr(groups: list[dict]) -> float | None:
    sxy = sxx = syy = 0.0
    for g in groups:
        if g["response_len"].size < 2:
            continue
        x = g["response_len"].astype(np.float64)
        y = g["correct"].astype(np.float64)
        x, y = x - x.mean(), y - y.mean()
        sxy, sxx, syy = sxy + float(x @ y), sxx + float(x @ x), syy + float(y @ y)
    return sxy / math.sqrt(sxx * syy) if sxx * syy > 0 else None


# ---------------------------------------------------------------- length and correctness


@pytest.mark.parametrize("mode", ["column", "reward>0", "threshold"])
def test_length_metrics(write_run: WriteRun, check_series: CheckSeries, mode: str) -> None:
    train = make_rollouts(1, uniform_steps=(STEPS[-1],))
    meta: dict[str, Any] = {}
    if mode == "column":
        correct, drop = train["correct"], ()
    elif mode == "reward>0":
        correct, drop = train["reward"] > 0, ("correct",)
    else:
        meta["correct_threshold"] = 0.8
        correct, drop = train["reward"] >= 0.8, ("correct",)
    ev = eval_rows(train)
    if drop:
        ev.pop("correct")
    path = write_run({"rollouts": [table(train, drop), ev]}, **meta)
    results = compute(open_run(path)).results
    length = train["response_len"]
    check_series(results["behavior.response_len"], step_mean(train, length))
    check_series(results["behavior.response_len_correct"], step_mean(train, length, correct))
    check_series(results["behavior.response_len_incorrect"], step_mean(train, length, ~correct))
    by_step = groups_by_step(train, correct)
    corr = {s: within_corr(g) for s, g in by_step.items()}
    if mode == "reward>0":  # every group all-correct at the last step: undefined there
        assert corr[STEPS[-1]] is None
    check_series(results["behavior.len_correct_corr"], corr)
    if mode != "column":
        assert any("correct" in note for note in results["behavior.response_len_correct"].notes)


def test_len_correct_corr_not_confounded_by_prompt_difficulty(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    # Hard prompts: long and mostly wrong; easy prompts: short and mostly right. Within every
    # prompt, the correct responses are the longer ones (+15 tokens).
    rng = np.random.default_rng(2)
    rows: dict[str, list[Any]] = {"step": [], "prompt_id": [], "response_len": [], "correct": []}
    for step in (1, 2, 3):
        for j, (base, c) in enumerate([(40, 7), (150, 5), (350, 2), (700, 1)]):
            correct = rng.permutation(np.arange(8) < c)  # both outcomes in every group
            length = base + rng.integers(0, 10, 8) + 15 * correct
            rows["step"] += [step] * 8
            rows["prompt_id"] += [f"p{j}"] * 8
            rows["response_len"] += list(length)
            rows["correct"] += list(correct)
    n = len(rows["step"])
    data = {**rows, "rollout_id": list(range(n)), "reward": [float(c) for c in rows["correct"]]}
    length, correct = np.array(rows["response_len"], float), np.array(rows["correct"], float)
    assert np.corrcoef(length, correct)[0, 1] < -0.5  # confounded pooled correlation
    result = compute(open_run(write_run({"rollouts": data}))).results["behavior.len_correct_corr"]
    assert all(v is not None and v > 0.3 for v in result.values)
    assert result.value is not None and result.value > 0.3
    arrays = {k: np.array(v) for k, v in rows.items()}
    by_step = groups_by_step(arrays, arrays["correct"])
    check_series(result, {s: within_corr(g) for s, g in by_step.items()})


def test_truncation_rate_from_column_or_cap(write_run: WriteRun, check_series: CheckSeries) -> None:
    train = make_rollouts(3)
    ev = eval_rows(train)
    # The column wins over the cap when both exist.
    path = write_run({"rollouts": [table(train), ev]}, max_response_len=MAX_LEN)
    result = compute(open_run(path)).results["behavior.truncation_rate"]
    check_series(result, step_mean(train, train["truncated"]))
    assert result.notes == ()
    # No column: response_len >= run.json max_response_len.
    ev.pop("truncated")
    path = write_run({"rollouts": [table(train, ("truncated",)), ev]}, max_response_len=MAX_LEN)
    result = compute(open_run(path)).results["behavior.truncation_rate"]
    check_series(result, step_mean(train, train["response_len"] >= MAX_LEN))
    assert any("max_response_len" in note for note in result.notes)


def test_truncation_rate_skipped_without_column_or_cap(write_run: WriteRun) -> None:
    train = make_rollouts(4)
    computed = compute(open_run(write_run({"rollouts": table(train, ("truncated",))})))
    assert "behavior.truncation_rate" not in computed.results
    assert "truncated" in {s.metric: s.reason for s in computed.skipped}["behavior.truncation_rate"]


# ---------------------------------------------------------------- tool calls


def check_tools(
    results: dict, train: dict[str, np.ndarray], calls: np.ndarray, check_series: CheckSeries
) -> None:
    check_series(results["behavior.tool_calls"], step_mean(train, calls))
    check_series(results["behavior.tool_cap_frac"], step_mean(train, calls >= MAX_CALLS))
    with_calls = {**train, "calls": calls}
    by_step = groups_by_step(with_calls, train["correct"])
    check_series(
        results["behavior.tool_calls_std"], {s: pooled_std(g, "calls") for s, g in by_step.items()}
    )


def test_tool_metrics_from_n_tool_calls(write_run: WriteRun, check_series: CheckSeries) -> None:
    train = make_rollouts(5)
    path = write_run({"rollouts": [table(train), eval_rows(train)]}, max_tool_calls=MAX_CALLS)
    results = compute(open_run(path)).results
    check_tools(results, train, train["n_tool_calls"], check_series)


def test_tool_metrics_from_tool_calls_lists(write_run: WriteRun, check_series: CheckSeries) -> None:
    train = make_rollouts(6)
    calls = [
        [f'{{"query": "q{i}-{k}"}}' for k in range(int(c))]
        for i, c in enumerate(train["n_tool_calls"])
    ]
    data = {**table(train, ("n_tool_calls",)), "tool_calls": calls}
    ev = eval_rows(train)
    ev["tool_calls"] = [["x"] * int(c) for c in ev.pop("n_tool_calls")]
    path = write_run({"rollouts": [data, ev]}, max_tool_calls=MAX_CALLS)
    results = compute(open_run(path)).results
    check_tools(results, train, train["n_tool_calls"], check_series)
    assert any("tool_calls" in n for n in results["behavior.tool_calls"].notes)


def test_tool_calls_std_undefined_with_only_groups_of_one(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    data = {
        "rollout_id": [0, 1, 2, 3],
        "step": [1, 1, 2, 2],
        "prompt_id": ["a", "b", "a", "a"],
        "reward": [1.0, 0.0, 1.0, 0.0],
        "response_len": [5, 6, 7, 8],
        "n_tool_calls": [1, 3, 2, 5],
    }
    results = compute(open_run(write_run({"rollouts": data}))).results
    # Step 1 has two groups of one: no within-group spread to measure.
    check_series(results["behavior.tool_calls_std"], {2: math.sqrt(4.5)})
    check_series(results["behavior.tool_calls"], {1: 2.0, 2: 3.5})


def test_tool_metrics_skipped_without_inputs(write_run: WriteRun) -> None:
    train = make_rollouts(7)
    computed = compute(open_run(write_run({"rollouts": table(train)})))
    reasons = {s.metric: s.reason for s in computed.skipped}
    assert "behavior.tool_cap_frac" not in computed.results
    assert "run.json max_tool_calls" in reasons["behavior.tool_cap_frac"]
    computed = compute(open_run(write_run({"rollouts": table(train, ("n_tool_calls",))})))
    reasons = {s.metric: s.reason for s in computed.skipped}
    for metric in ("behavior.tool_calls", "behavior.tool_calls_std", "behavior.tool_cap_frac"):
        assert metric not in computed.results
        assert "n_tool_calls" in reasons[metric]


# ---------------------------------------------------------------- token entropy


def make_tokens(
    seed: int, per_step: tuple[int, int] = (50, 200), steps: list[int] = STEPS, bad: bool = True
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(*per_step, size=len(steps))
    step = np.repeat(np.array(steps, dtype=np.int64), sizes)
    n = step.size
    entropy = rng.gamma(0.6, 1.0 + step / 10, n)
    logprob = -entropy * rng.exponential(1.0, n)
    cols = {
        "rollout_id": np.zeros(n, dtype=np.int64),
        "step": step,
        "pos": np.arange(n, dtype=np.int32),
        "entropy": entropy.astype(np.float32),
        "logprob": logprob.astype(np.float32),
        # correlated with logprob, so the covariance is clearly non-zero
        "advantage": (0.8 * logprob + rng.normal(0.0, 1.0, n)).astype(np.float32),
    }
    if bad:
        for name in ("entropy", "logprob", "advantage"):
            idx = rng.choice(n, size=n // 25, replace=False)
            cols[name][idx] = rng.choice([np.nan, np.inf, -np.inf], size=idx.size)
    return cols


ONE_ROLLOUT = {
    "rollout_id": [0],
    "step": [1],
    "prompt_id": ["p"],
    "reward": [1.0],
    "response_len": [1],
}


def token_step_mean(tokens: dict[str, np.ndarray], values: np.ndarray) -> Expected:
    out: Expected = {}
    for s in np.unique(tokens["step"]):
        v = values[(tokens["step"] == s) & np.isfinite(values)]
        out[int(s)] = float(v.mean()) if v.size else None
    return out


def test_entropy_token_mean(write_run: WriteRun, check_series: CheckSeries) -> None:
    tokens = make_tokens(10)
    steps = [{"step": s, "entropy": 50.0} for s in STEPS]
    path = write_run({"rollouts": ONE_ROLLOUT, "tokens": tokens, "steps": steps})
    result = compute(open_run(path)).results["behavior.entropy"]
    check_series(result, token_step_mean(tokens, tokens["entropy"].astype(np.float64)))
    assert result.source == "tokens.entropy"


def test_entropy_falls_back_to_steps_then_neg_logprob(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    tokens = make_tokens(11)
    del tokens["entropy"]
    rows = [{"step": s, "entropy": 0.1 * s} for s in STEPS] + [{"step": 2, "entropy": 1.0}]
    path = write_run({"rollouts": ONE_ROLLOUT, "tokens": tokens, "steps": rows})
    result = compute(open_run(path)).results["behavior.entropy"]
    check_series(result, {s: 0.1 * s for s in STEPS} | {2: 0.6})
    assert result.source == "steps.entropy as logged"

    path = write_run({"rollouts": ONE_ROLLOUT, "tokens": tokens})
    result = compute(open_run(path)).results["behavior.entropy"]
    check_series(result, token_step_mean(tokens, -tokens["logprob"].astype(np.float64)))
    assert "-logprob" in result.source


def test_entropy_skipped_without_any_input(write_run: WriteRun) -> None:
    computed = compute(open_run(write_run({"rollouts": ONE_ROLLOUT})))
    reasons = {s.metric: s.reason for s in computed.skipped}
    for metric in ("behavior.entropy", "behavior.entropy_p80", "behavior.entropy_adv_cov"):
        assert metric not in computed.results
        assert "tokens" in reasons[metric]


def test_entropy_p80_matches_numpy_quantile(write_run: WriteRun) -> None:
    tokens = make_tokens(12, per_step=(2000, 5000), steps=list(range(1, 7)))
    path = write_run({"rollouts": ONE_ROLLOUT, "tokens": tokens})
    result = compute(open_run(path)).results["behavior.entropy_p80"]
    expected = {}
    for s in range(1, 7):
        e = tokens["entropy"][tokens["step"] == s].astype(np.float64)
        expected[s] = float(np.quantile(e[np.isfinite(e)], 0.8))
    assert result.steps == tuple(range(1, 7))
    for step, value in zip(result.steps, result.values, strict=True):
        assert value == pytest.approx(expected[step], abs=half_bin(expected[step])), step
    final = [expected[s] for s in (4, 5, 6)]
    assert result.value == pytest.approx(np.mean(final), abs=max(map(half_bin, final)))


def test_entropy_p80_rank_convention(write_run: WriteRun) -> None:
    # numpy's linear quantile of 11 values 0.1 apart is the 9th smallest (rank 0.8 * 10 = 8);
    # one token: that token, to the bin.
    values = np.arange(11) * 0.1 + 0.05
    tokens = {
        "rollout_id": [0] * 12,
        "step": [1] + [2] * 11,
        "pos": list(range(12)),
        "entropy": np.array([0.7, *values], dtype=np.float32),
    }
    result = compute(open_run(write_run({"rollouts": ONE_ROLLOUT, "tokens": tokens})))
    p80 = result.results["behavior.entropy_p80"]
    assert p80.steps == (1, 2)
    assert p80.values[0] == pytest.approx(0.7, abs=half_bin(0.7))
    exact = float(np.quantile(values, 0.8))
    assert p80.values[1] == pytest.approx(exact, abs=half_bin(exact))


def test_entropy_adv_cov_is_population_covariance(
    write_run: WriteRun, check_series: CheckSeries
) -> None:
    tokens = make_tokens(13)
    path = write_run({"rollouts": ONE_ROLLOUT, "tokens": tokens})
    result = compute(open_run(path)).results["behavior.entropy_adv_cov"]
    x, y = tokens["logprob"].astype(np.float64), tokens["advantage"].astype(np.float64)
    expected: Expected = {}
    for s in STEPS:
        m = (tokens["step"] == s) & np.isfinite(x) & np.isfinite(y)
        expected[s] = float(np.cov(x[m], y[m], ddof=0)[0, 1])
    assert all(v is not None and v > 0 for v in expected.values())
    check_series(result, expected, rel=1e-8)


def test_entropy_adv_cov_skipped_without_advantage(write_run: WriteRun) -> None:
    tokens = make_tokens(14)
    del tokens["advantage"]
    computed = compute(open_run(write_run({"rollouts": ONE_ROLLOUT, "tokens": tokens})))
    assert "behavior.entropy_adv_cov" not in computed.results
    reason = {s.metric: s.reason for s in computed.skipped}["behavior.entropy_adv_cov"]
    assert "tokens.advantage" in reason
