"""Findings on runs rlscope was not built on (issue 14).

`tests/shapes.py` is a GRPO run generator independent of `rlscope.synth` (its own latent model:
prompt difficulty, skill, entropy driving both token statistics and within-group text sharing,
TRL's clip rule, k3 KL). Healthy shapes vary what a real run looks like (low entropy, DAPO
dynamic sampling, {-1, 1} rewards, step numbering, sparse eval, only a rollouts table, agent
runs with coarse actions, long plateaus, on-policy updates, small batches): none may raise a
finding at warn or above. Failure shapes each carry the mechanism of one issue-14 failure class:
the finding named for it must fire.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from shapes import FAILURE_SHAPES, HEALTHY_SHAPES, write_shape

from rlscope.analysis import analyze
from rlscope.config import Config
from rlscope.report import Report

#: Run sizes (steps × prompts per step × group size); `small-batch` is always 4 × 4 per step.
SIZES = {
    "small": dict(steps=40, prompts=8, group=8),
    "large": dict(steps=120, prompts=16, group=8),
}
#: Failure shapes are judged at a size where "flat" can be told from "not yet significant".
FAILURE_SIZE = dict(steps=80, prompts=16, group=8)

ALARM = ("warn", "critical")


def _analyze(path: Path) -> Report:
    return analyze(path, config=Config(), use_cache=False)


def _alarms(report: Report) -> list[str]:
    return [f"{f.id} ({f.severity}): {f.message}" for f in report.findings if f.severity in ALARM]


def _healthy(tmp_path: Path, shape: str, size: str, seed: int) -> None:
    path = write_shape(tmp_path / f"{shape}-{size}-{seed}", shape, seed=seed, **SIZES[size])
    assert _alarms(_analyze(path)) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", HEALTHY_SHAPES)
def test_healthy_shape_raises_no_alarm(tmp_path: Path, shape: str, seed: int) -> None:
    _healthy(tmp_path, shape, "small", seed)


@pytest.mark.parametrize("shape", ["base", "low-entropy", "long-plateau"])
def test_healthy_shape_with_long_texts_raises_no_alarm(tmp_path: Path, shape: str) -> None:
    """The same latent runs, written as multi-sentence reasoning (60-90 words a response)."""
    path = write_shape(tmp_path / shape, shape, seed=0, text="long", **SIZES["small"])
    assert _alarms(_analyze(path)) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", HEALTHY_SHAPES)
def test_healthy_shape_raises_no_alarm_large(tmp_path: Path, shape: str, seed: int) -> None:
    _healthy(tmp_path, shape, "large", seed)


#: failure shape -> the finding its mechanism must raise
EXPECTED = {
    "late-entropy-cliff": "entropy-collapse",
    "low-entropy-high-clip": "entropy-clip-conflict",
    "clip-too-high": "clip-too-high",
    "clip-too-low-offpolicy": "clip-too-low",
    "reward-up-task-down": "reward-hacking",
    "text-collapse-constant-actions": "diversity-collapse",
    "ood-stalls": "ood-gap",
    "divergence": "divergence",
}
#: Rules that do not (yet) catch their shape on today's code: xfail, not strict.
PENDING: set[str] = set()


def test_every_failure_shape_has_an_expected_finding() -> None:
    assert set(EXPECTED) == set(FAILURE_SHAPES)


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(
            s, marks=pytest.mark.xfail(strict=False, reason="rule pending") if s in PENDING else ()
        )
        for s in FAILURE_SHAPES
    ],
)
def test_failure_shape_raises_its_finding(tmp_path: Path, shape: str) -> None:
    path = write_shape(tmp_path / shape, shape, seed=3, **FAILURE_SIZE)
    report = _analyze(path)
    fired = {f.id: f for f in report.findings}
    expected = EXPECTED[shape]
    assert expected in fired, f"{expected} did not fire on {shape}; got {_alarms(report)}"
    assert fired[expected].severity in ALARM


def test_on_policy_run_is_not_clip_too_low(tmp_path: Path) -> None:
    """One update per batch (TRL num_iterations=1): clip fraction 0 by construction, even when
    learning is slow (a long plateau)."""
    path = write_shape(tmp_path / "on-policy", "on-policy", seed=3, **FAILURE_SIZE)
    plateau = write_shape(
        tmp_path / "on-policy-plateau",
        "long-plateau",
        seed=3,
        on_policy=True,
        clip=lambda t: 0.0,
        **FAILURE_SIZE,
    )
    for run in (path, plateau):
        report = _analyze(run)
        assert report.metrics["stability.clip_frac"].value == 0.0
        assert "clip-too-low" not in {f.id for f in report.findings}


def test_agent_texts_differ_though_coarse_actions_repeat(tmp_path: Path) -> None:
    """The generator's own promise behind the agent shape (issue 14, class 1): coarse action
    lists repeat within groups while every rollout's text differs."""
    import polars as pl

    path = write_shape(tmp_path / "agent", "agent-coarse-actions", seed=0, **SIZES["small"])
    rows = pl.read_parquet(path / "rollouts" / "*.parquet").filter(pl.col("split") == "train")
    per_group = rows.group_by("step", "prompt_id").agg(
        pl.col("actions").list.join(",").n_unique().alias("actions"),
        pl.col("response").n_unique().alias("texts"),
        pl.len().alias("n"),
    )
    assert (per_group["actions"] < per_group["n"]).mean() > 0.9
    assert (per_group["texts"] == per_group["n"]).mean() > 0.9
