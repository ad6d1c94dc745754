"""L4 exploration metrics against direct computations: Counter clusters, Python Levenshtein,
exact Jaccard of word 3-gram sets (the MinHash estimate within its stated error)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from itertools import combinations
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from rlscope.engine import compute
from rlscope.metrics import exploration
from rlscope.metrics.exploration import edit_distances
from rlscope.reader import open_run
from rlscope.text import MINHASH_K
from rlscope.trajectory import decline_shape

WriteRun = Callable[..., Path]
CheckSeries = Callable[..., None]


def levenshtein(a: list, b: list) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[:], i
        for j, y in enumerate(b, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (x != y))
    return row[-1]


def grams(text: str) -> set:
    words = " ".join(text.lower().split()).split(" ")
    if len(words) < 3:
        return {tuple(words)}
    return {tuple(words[i : i + 3]) for i in range(len(words) - 2)}


def jaccard(a: str, b: str) -> float:
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def rollouts(step_groups: dict[int, list[list]], column: str) -> dict[str, list]:
    rows: dict[str, list] = {k: [] for k in ("rollout_id", "step", "prompt_id", "reward")}
    rows[column] = []
    rows["response_len"] = []
    for step, groups in step_groups.items():
        for g, members in enumerate(groups):
            for member in members:
                rows["rollout_id"].append(len(rows["rollout_id"]))
                rows["step"].append(step)
                rows["prompt_id"].append(f"p{g}")
                rows["reward"].append(1.0)
                rows[column].append(member)
                rows["response_len"].append(5)
    return rows


def test_edit_distance_matches_python() -> None:
    rng = np.random.default_rng(0)
    a = [rng.integers(0, 4, rng.integers(0, 9)) for _ in range(300)]
    b = [rng.integers(0, 4, rng.integers(0, 9)) for _ in range(300)]
    expected = [levenshtein(list(x), list(y)) for x, y in zip(a, b, strict=True)]
    assert edit_distances(a, b).tolist() == expected


def test_action_metrics(write_run: WriteRun, check_series: CheckSeries) -> None:
    rng = np.random.default_rng(1)
    actions = ["go north", "look", "take key", "open door"]
    data = {
        step: [
            [list(rng.choice(actions, rng.integers(0, 5))) for _ in range(rng.integers(1, 6))]
            for _ in range(4)
        ]
        for step in range(5)
    }
    data[5] = [[["look"], ["look"], ["look"]], [["go north"]]]  # one collapsed group
    path = write_run({"rollouts": rollouts(data, "actions")})
    results = compute(open_run(path)).results

    def per_step(fn: Callable[[list], float]) -> dict[int, float | None]:
        out = {}
        for step, groups in data.items():
            values = [fn(g) for g in groups if len(g) >= 2]
            out[step] = sum(values) / len(values) if values else None
        return out

    def unique(g: list) -> float:
        return len({tuple(x) for x in g}) / len(g)

    def largest(g: list) -> float:
        return max(Counter(tuple(x) for x in g).values()) / len(g)

    def diversity(g: list) -> float:
        pairs = list(combinations(g, 2))
        return sum(levenshtein(x, y) / max(len(x), len(y), 1) for x, y in pairs) / len(pairs)

    check_series(results["exploration.unique_frac"], per_step(unique))
    check_series(results["exploration.cluster_sizes"], per_step(largest))
    check_series(results["exploration.pairwise_diversity"], per_step(diversity))
    sizes = Counter(
        n
        for groups in data.values()
        for g in groups
        if len(g) >= 2
        for n in Counter(tuple(x) for x in g).values()
    )
    hist = results["exploration.cluster_sizes"].extra["cluster_sizes"]["run"]
    assert hist == {str(k): sizes[k] for k in sorted(sizes)}


def random_text(rng: np.random.Generator, base: list[str], keep: float) -> str:
    """A variant of `base`: each word kept with probability `keep`, else replaced."""
    words = [w if rng.random() < keep else f"x{rng.integers(0, 10**6)}" for w in base]
    return " ".join(words)


def test_text_diversity_estimates_jaccard(write_run: WriteRun) -> None:
    """Group means of 1 - MinHash Jaccard vs the exact Jaccard of 3-gram sets: per step (~40
    groups, ~10 pairs each) within 4 standard errors of the estimator's stated bound."""
    rng = np.random.default_rng(2)
    data = {}
    for step, keep in enumerate([0.0, 0.5, 0.8, 0.95, 1.0]):
        groups = []
        for _ in range(40):
            base = [f"w{rng.integers(0, 50)}" for _ in range(int(rng.integers(8, 40)))]
            groups.append([random_text(rng, base, keep) for _ in range(int(rng.integers(2, 7)))])
        data[step] = groups
    path = write_run({"rollouts": rollouts(data, "response")})
    result = compute(open_run(path)).results["exploration.pairwise_diversity"]
    got = dict(zip(result.steps, result.values, strict=True))
    for step, groups in data.items():
        exact = np.mean(
            [np.mean([1 - jaccard(a, b) for a, b in combinations(g, 2)]) for g in groups]
        )
        pairs = sum(len(g) * (len(g) - 1) / 2 for g in groups)
        # per-pair error sd <= 1/(2 sqrt(K)); pairs of one group share rollouts, so bound the
        # mean's error by the number of groups, not pairs
        bound = 4 * 0.5 / math.sqrt(MINHASH_K) / math.sqrt(len(groups))
        assert abs(got[step] - exact) <= bound, (step, got[step], exact, pairs)
    assert got[4] == 0.0  # identical texts agree at every signature position


def test_text_unique_frac_normalises(write_run: WriteRun, check_series: CheckSeries) -> None:
    data = {0: [["The  answer is 4", "the answer is 4\n", "THE ANSWER IS 5"], ["a", "b"]]}
    path = write_run({"rollouts": rollouts(data, "response")})
    results = compute(open_run(path)).results
    check_series(results["exploration.unique_frac"], {0: (2 / 3 + 1) / 2})
    check_series(results["exploration.cluster_sizes"], {0: (2 / 3 + 1 / 2) / 2})


@pytest.mark.parametrize(
    "values, shape",
    [
        ([1.0] * 3 + [0.2] * 37, "cliff"),
        (list(np.linspace(1.0, 0.2, 40)), "smooth"),
        (list(1.0 + 0.01 * np.sin(np.arange(40))), "flat"),
        (list(np.linspace(0.5, 1.0, 40)), "rising"),
    ],
)
def test_decline_shape(values: list[float], shape: str) -> None:
    out = decline_shape(list(range(len(values))), values)
    assert out["shape"] == shape
    if shape == "cliff":
        assert out["steepest_steps"][0] <= 3 <= out["steepest_steps"][1]


@pytest.mark.parametrize("variant", ["minhash", "actions"])
def test_pairwise_diversity_does_not_depend_on_the_rows_order(variant: str) -> None:
    """The step's mean over its groups is the same to the last bit whatever the order the
    groups come in (Polars' group-by gives no order: the mean is taken over sorted values)."""
    rng = np.random.default_rng(7)
    rows = 3 * 150 * 4  # 3 steps x 150 groups x 4 rollouts
    frame = pl.DataFrame(
        {
            "step": np.repeat(np.arange(3), 600),
            "prompt_id": [f"p{i // 4}" for i in range(rows)],
            "split": ["train"] * rows,
        }
    )
    if variant == "minhash":
        signature = {f"minhash_{j}": rng.integers(0, 3, rows) for j in range(MINHASH_K)}
        frame = frame.with_columns(**signature)
        series = exploration._minhash_diversity
    else:
        actions = [rng.integers(0, 4, rng.integers(1, 6)).tolist() for _ in range(rows)]
        frame = frame.with_columns(pl.Series("action_seq", actions, pl.List(pl.UInt64)))
        series = exploration._edit_diversity
    results = [
        series(frame.sample(fraction=1.0, shuffle=True, seed=seed).lazy(), None)  # type: ignore[arg-type]
        .collect()
        .sort("step")
        for seed in range(6)
    ]
    for other in results[1:]:
        assert other["value"].to_list() == results[0]["value"].to_list()


def test_collapsed_groups_and_their_correct_modes(write_run: WriteRun) -> None:
    """exploration.cluster_sizes' per-step components, counted with Python: groups whose
    largest identical cluster is at least half of them, and of those, the ones whose largest
    cluster is correct (a tie of sizes: a correct one wins)."""
    rng = np.random.default_rng(4)
    answers = ["a b", "a c", "d e"]
    rows: dict[str, list] = {k: [] for k in ("rollout_id", "step", "prompt_id", "reward")}
    rows |= {"response_len": [], "response": [], "correct": []}
    groups: dict[int, list[list[tuple[str, bool]]]] = {}
    for step in range(6):
        for g in range(5):
            size = int(rng.integers(2, 7))
            group = [(str(rng.choice(answers)), bool(rng.random() < 0.5)) for _ in range(size)]
            for text, right in group:
                rows["rollout_id"].append(len(rows["rollout_id"]))
                rows["step"].append(step)
                rows["prompt_id"].append(f"p{g}")
                rows["reward"].append(float(right))
                rows["response_len"].append(2)
                rows["response"].append(text)
                rows["correct"].append(right)
            groups.setdefault(step, []).append(group)
    frame = compute(open_run(write_run({"rollouts": rows}))).frames["exploration.cluster_sizes"]
    got = {r["step"]: r for r in frame.iter_rows(named=True)}
    for step, step_groups in groups.items():
        collapsed = correct = 0
        for group in step_groups:
            clusters: dict[str, list[bool]] = {}
            for text, right in group:
                clusters.setdefault(text, []).append(right)
            top = max(len(c) for c in clusters.values())
            if top < 0.5 * len(group):
                continue
            collapsed += 1
            shares = [sum(c) / len(c) for c in clusters.values() if len(c) == top]
            correct += max(shares) > 0.5
        assert got[step]["extra_collapsed"] == collapsed, step
        assert got[step]["extra_collapsed_correct"] == correct, step
