"""L5 generalisation and L6 reasoning metrics against direct Python/numpy computations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlscope.engine import compute
from rlscope.reader import open_run

WriteRun = Callable[..., Path]
CheckSeries = Callable[..., None]


def norm(x: str | None) -> str | None:
    return None if x is None else " ".join(x.lower().split())


def voted_rollouts(seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(6):
        for g in range(int(rng.integers(2, 6))):
            n = int(rng.integers(1, 7))
            gold = "7"
            for _ in range(n):
                answer = rng.choice(["7", " 7 ", "8", "9", None, "8"])
                rows.append(
                    {
                        "rollout_id": int(rng.integers(0, 10**9)),  # order is not id order
                        "step": step,
                        "prompt_id": f"p{g}",
                        "answer": answer,
                        "correct": norm(answer) == gold,
                        "reward": float(norm(answer) == gold),
                        "response_len": 4,
                    }
                )
    ids = rng.permutation(len(rows) * 3)[: len(rows)]
    for row, rid in zip(rows, ids, strict=True):
        row["rollout_id"] = int(rid)
    return rows


def reference_majority(group: list[dict]) -> tuple[float, float, float]:
    """(mean accuracy, maj@N with uniform tie-breaking, maj@N first-seen wins)."""
    accuracy = float(np.mean([r["correct"] for r in group]))
    votes = [r for r in group if norm(r["answer"])]
    if not votes:
        return accuracy, 0.0, 0.0
    counts = Counter(norm(r["answer"]) for r in votes)
    top = max(counts.values())
    tied = [a for a, c in counts.items() if c == top]

    def answer_accuracy(a: str) -> float:
        return float(np.mean([r["correct"] for r in votes if norm(r["answer"]) == a]))

    uniform = float(np.mean([answer_accuracy(a) for a in tied]))
    first_seen = {a: min(r["rollout_id"] for r in votes if norm(r["answer"]) == a) for a in tied}
    first = answer_accuracy(min(tied, key=lambda a: first_seen[a]))
    return accuracy, uniform, first


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_self_consistency(write_run: WriteRun, check_series: CheckSeries, seed: int) -> None:
    rows = voted_rollouts(seed)
    path = write_run({"rollouts": {k: [r[k] for r in rows] for k in rows[0]}})
    results = compute(open_run(path)).results
    gap, first, maj, acc = {}, {}, {}, {}
    for step in sorted({r["step"] for r in rows}):
        groups: dict[str, list] = {}
        for r in rows:
            if r["step"] == step:
                groups.setdefault(r["prompt_id"], []).append(r)
        stats = [reference_majority(g) for g in groups.values() if len(g) >= 2]
        if not stats:
            gap[step] = first[step] = maj[step] = acc[step] = None
            continue
        gap[step] = float(np.mean([u - a for a, u, _ in stats]))
        baseline = [1.0 if a > 0.5 else 0.5 if a == 0.5 else 0.0 for a, _, _ in stats]
        maj[step], acc[step] = float(np.mean(baseline)), float(np.mean([a for a, _, _ in stats]))
        first[step] = float(np.mean([f for _, _, f in stats]))
    check_series(results["reasoning.self_consistency_gap"], gap)
    check_series(results["reasoning.maj_at_n_first"], first)
    frame = compute(open_run(path)).frames["reasoning.self_consistency_gap"].sort("step")
    for row in frame.iter_rows(named=True):
        assert row["extra_majority_baseline"] == pytest.approx(maj[row["step"]])
        assert row["extra_mean_accuracy"] == pytest.approx(acc[row["step"]])


def test_eval_metrics(write_run: WriteRun, check_series: CheckSeries) -> None:
    rng = np.random.default_rng(4)
    rows = []
    for step in range(0, 50, 10):
        for split in ("train", "eval_id", "eval_id_hard", "eval_ood"):
            for _ in range(int(rng.integers(3, 9))):
                rows.append(
                    {
                        "rollout_id": len(rows),
                        "step": step,
                        "prompt_id": f"{split}-{rng.integers(0, 3)}",
                        "split": split,
                        "reward": float(rng.random() < 0.6),
                        "response_len": 4,
                    }
                )
    path = write_run({"rollouts": {k: [r[k] for r in rows] for k in rows[0]}})
    results = compute(open_run(path)).results

    def accuracy(step: int, splits: tuple[str, ...]) -> float:
        chosen = [r["reward"] > 0 for r in rows if r["step"] == step and r["split"] in splits]
        return float(np.mean(chosen))

    steps = range(0, 50, 10)
    in_dist = {s: accuracy(s, ("eval_id", "eval_id_hard")) for s in steps}
    out_dist = {s: accuracy(s, ("eval_ood",)) for s in steps}
    check_series(results["generalization.eval_id"], in_dist)
    check_series(results["generalization.eval_ood"], out_dist)
    gap = {s: in_dist[s] - out_dist[s] for s in steps}
    check_series(results["generalization.ood_gap"], gap)
    # The incorrect OOD rollouts ood-gap names: per eval step, each OOD group's smallest.
    frame = compute(open_run(path)).frames["generalization.ood_gap"].sort("step")
    for s, listed in zip(frame["step"], frame["failed_examples"].to_list(), strict=True):
        wrong: dict[str, int] = {}
        for r in rows:
            if r["step"] == s and r["split"] == "eval_ood" and r["reward"] <= 0:
                wrong[r["prompt_id"]] = min(
                    wrong.get(r["prompt_id"], r["rollout_id"]), r["rollout_id"]
                )
        assert listed == sorted(wrong.values())
    trend = results["generalization.ood_gap"].extra["trend"]
    slope = np.polyfit(list(steps), [gap[s] for s in steps], 1)[0] * 100
    assert trend["slope_per_100_steps"] == pytest.approx(slope)
    assert trend["first"] == pytest.approx(gap[0]) and trend["last"] == pytest.approx(gap[40])


def test_no_eval_split_is_skipped_with_reason(write_run: WriteRun) -> None:
    path = write_run(
        {
            "rollouts": {
                "rollout_id": [0],
                "step": [0],
                "prompt_id": ["p"],
                "reward": [1.0],
                "response_len": [1],
            }
        }
    )
    skipped = {s.metric: s.reason for s in compute(open_run(path)).skipped}
    assert "eval_id" in skipped["generalization.eval_id"]
    assert "eval_ood" in skipped["generalization.ood_gap"]


def probe_run(write_run: WriteRun, seed: int) -> tuple[Path, list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    rollouts, probes = [], []
    for step in range(5):
        for i in range(4):
            rid = step * 10 + i
            answer = None if i == 3 and step == 2 else str(rng.integers(0, 3))
            rollouts.append(
                {
                    "rollout_id": rid,
                    "step": step,
                    "prompt_id": "p",
                    "reward": 1.0,
                    "response_len": 5,
                    "answer": answer,
                }
            )
            fractions = sorted(
                rng.choice([0.0, 0.2, 0.5, 0.8, 1.0], rng.integers(1, 4), replace=False)
            )
            for f in fractions:
                probes.append(
                    {
                        "rollout_id": rid,
                        "intervention": "truncate",
                        "fraction": float(f),
                        "answer": str(rng.integers(0, 3)) if rng.random() < 0.8 else None,
                        "hint": None,
                        "response": None,
                    }
                )
            for kind in ("mistake", "paraphrase", "filler"):
                probes.append(
                    {
                        "rollout_id": rid,
                        "intervention": kind,
                        "fraction": 0.5 if kind == "mistake" else None,
                        "answer": str(rng.integers(0, 3)),
                        "hint": None,
                        "response": None,
                    }
                )
            hint = str(rng.integers(0, 3))
            moved = rng.random() < 0.5
            probes.append(
                {
                    "rollout_id": rid,
                    "intervention": "bias",
                    "fraction": None,
                    "answer": hint if moved else str(rng.integers(0, 3)),
                    "hint": hint,
                    "response": rng.choice(
                        ["Because the user suggested it.", "Computing directly.", None]
                    ),
                }
            )
    path = write_run(
        {
            "rollouts": {k: [r[k] for r in rollouts] for k in rollouts[0]},
            "probes": {k: [p[k] for p in probes] for k in probes[0]},
        }
    )
    return path, rollouts, probes


@pytest.mark.parametrize("seed", [0, 1])
def test_probe_metrics(write_run: WriteRun, check_series: CheckSeries, seed: int) -> None:
    path, rollouts, probes = probe_run(write_run, seed)
    results = compute(open_run(path)).results
    original = {r["rollout_id"]: r["answer"] for r in rollouts}
    step_of = {r["rollout_id"]: r["step"] for r in rollouts}

    def unchanged(p: dict) -> bool:
        return norm(p["answer"]) == norm(original[p["rollout_id"]])

    known = [p for p in probes if original[p["rollout_id"]] is not None]
    for kind in ("truncate", "mistake", "paraphrase", "filler"):
        expected = {}
        for step in range(5):
            chosen = [
                unchanged(p)
                for p in known
                if p["intervention"] == kind and step_of[p["rollout_id"]] == step
            ]
            expected[step] = float(np.mean(chosen)) if chosen else None
        check_series(results[f"reasoning.answer_unchanged.{kind}"], expected)

    aoc: dict[int, list[float]] = {}
    for rid in original:
        if original[rid] is None:
            continue
        points: dict[float, list[float]] = {}
        for p in known:
            if p["rollout_id"] == rid and p["intervention"] == "truncate":
                points.setdefault(p["fraction"], []).append(float(unchanged(p)))
        if not points:
            continue
        if max(points) < 1.0:
            points[1.0] = [1.0]
        xs = sorted(points)
        ys = [np.mean(points[x]) for x in xs]
        if xs[-1] - xs[0] <= 0:
            continue
        area = np.trapezoid(ys, xs) if hasattr(np, "trapezoid") else np.trapz(ys, xs)
        aoc.setdefault(step_of[rid], []).append(1 - area / (xs[-1] - xs[0]))
    check_series(
        results["reasoning.early_answer_aoc"], {s: float(np.mean(v)) for s, v in aoc.items()}
    )

    follow, mention = {}, {}
    for step in range(5):
        biased = [
            p for p in known if p["intervention"] == "bias" and step_of[p["rollout_id"]] == step
        ]
        eligible = [p for p in biased if norm(p["hint"]) != norm(original[p["rollout_id"]])]
        follow[step] = (
            float(np.mean([norm(p["answer"]) == norm(p["hint"]) for p in eligible]))
            if eligible
            else None
        )
        texts = [  # the mention rate is over every biased probe, with or without an original
            p["response"]
            for p in probes
            if p["intervention"] == "bias"
            and step_of[p["rollout_id"]] == step
            and p["response"] is not None
        ]
        mention[step] = float(np.mean(["suggested" in t for t in texts])) if texts else None
    check_series(results["reasoning.bias_following"], follow)
    frame = compute(open_run(path)).frames["reasoning.bias_following"].sort("step")
    got = dict(zip(frame["step"].to_list(), frame["extra_mention_rate"].to_list(), strict=True))
    assert got == pytest.approx({s: v for s, v in mention.items() if s in got})


def test_step_accuracy(write_run: WriteRun, check_series: CheckSeries) -> None:
    rng = np.random.default_rng(5)
    n = 60
    step = np.repeat(np.arange(6), 10)
    checked = rng.integers(0, 5, n)
    verified = np.minimum(checked, rng.integers(0, 5, n))
    correct = rng.random(n) < 0.6
    path = write_run(
        {
            "rollouts": {
                "rollout_id": np.arange(n),
                "step": step,
                "prompt_id": "p",
                "reward": correct.astype(float),
                "correct": correct,
                "response_len": 4,
                "steps_checked": checked.astype(np.int32),
                "steps_verified": verified.astype(np.int32),
            }
        }
    )
    computed = compute(open_run(path))
    expected = {s: verified[step == s].sum() / checked[step == s].sum() for s in range(6)}
    check_series(computed.results["reasoning.step_accuracy"], expected)
    frame = computed.frames["reasoning.step_accuracy"].sort("step")
    for s, value in zip(frame["step"], frame["extra_correct_with_step_errors"], strict=True):
        mask = (step == s) & correct & (checked > 0)
        assert value == pytest.approx((verified[mask] < checked[mask]).mean())
    # The example step-errors names: one prompt group a step, so its smallest such rollout.
    for s, listed in zip(frame["step"], frame["step_error_examples"].to_list(), strict=True):
        failed = np.flatnonzero((step == s) & correct & (checked > 0) & (verified < checked))
        assert listed == ([int(failed.min())] if failed.size else [])
