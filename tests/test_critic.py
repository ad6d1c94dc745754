"""PPO with a learned critic: explained variance from tokens (verl's formula), the value loss, the
value clip fraction and the KL coefficient as the trainers log them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import run_trainer

from rlscope.analysis import analyze
from rlscope.config import Config
from rlscope.engine import Computed, compute
from rlscope.evaluation import evaluate, evaluate_prefix
from rlscope.importers import import_run
from rlscope.reader import open_run
from rlscope.rules.base import MIN_TREND_STEPS

CRITIC = (
    "stability.explained_variance",
    "stability.value_loss",
    "stability.value_clip_frac",
    "stability.kl_coef",
)
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "ppo-critic"


def _verl_explained_variance(returns: np.ndarray, values: np.ndarray) -> float:
    """verl metric_utils.py `compute_data_metrics`: 1 - Var(R - V) / (Var(R) + 1e-5), with
    torch.var's default (n - 1)."""
    return float(1.0 - np.var(returns - values, ddof=1) / (np.var(returns, ddof=1) + 1e-5))


def test_explained_variance_from_tokens_is_verls(write_run: Any) -> None:
    """Tokens over two files per step (the partial sums merge); a critic that explains part
    of the returns, one that explains none (constant), one worse than a constant."""
    rng = np.random.default_rng(0)
    batches, expected = [], []
    rid = 0
    for step, (slope, noise) in enumerate([(0.8, 0.3), (0.0, 0.0), (-1.0, 0.5)]):
        per_step_r, per_step_v = [], []
        for _ in range(2):  # two files for the step
            n = 50
            ret = rng.normal(0.5, 1.0, n)
            val = slope * ret + rng.normal(0, noise, n) if slope else np.full(n, 0.3)
            per_step_r.append(ret)
            per_step_v.append(val)
            batches.append(
                {
                    "rollout_id": [rid + i // 10 for i in range(n)],
                    "step": [step] * n,
                    "pos": [i % 10 for i in range(n)],
                    "value": val.astype(np.float32),
                    "return": ret.astype(np.float32),
                }
            )
            rid += n // 10
        r = np.concatenate(per_step_r).astype(np.float32).astype(np.float64)
        v = np.concatenate(per_step_v).astype(np.float32).astype(np.float64)
        expected.append(_verl_explained_variance(r, v))
    ids = sorted({i for b in batches for i in b["rollout_id"]})
    rollouts = {
        "rollout_id": ids,
        "step": [next(b["step"][0] for b in batches if i in b["rollout_id"]) for i in ids],
        "prompt_id": [f"p{i}" for i in ids],
        "reward": [1.0] * len(ids),
        "response_len": [10] * len(ids),
    }
    path = write_run({"rollouts": rollouts, "tokens": batches})
    result = analyze(path, metrics=["stability.explained_variance"]).metrics[
        "stability.explained_variance"
    ]
    assert list(result.values) == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert result.values[1] == pytest.approx(0.0, abs=1e-4)  # a constant explains nothing
    assert result.values[2] < 0  # anti-correlated: worse than a constant
    assert result.source.startswith("tokens")


def test_critic_metrics_as_written_with_format_names(write_run: Any) -> None:
    steps = [
        {
            "step": s,
            "loss": 0.1,
            "value_loss": 1.0 / s,
            "value_clip_frac": 0.01 * s,
            "explained_variance": 0.1 * s,
            "kl_coef": 0.02 * 1.1**s,
        }
        for s in range(1, 6)
    ]
    report = analyze(write_run({"steps": steps}))
    for metric_id, column in zip(
        CRITIC, ("explained_variance", "value_loss", "value_clip_frac", "kl_coef"), strict=True
    ):
        result = report.metrics[metric_id]
        assert list(result.values) == pytest.approx([row[column] for row in steps])
        assert result.source == f"steps.{column} as logged"


@pytest.mark.parametrize("name", ["healthy", "frozen-critic"])
def test_critic_metrics_read_from_verls_own_keys(tmp_path: Path, name: str) -> None:
    """The genuine PPO runs in verl's file-logger format: every value as verl logged it."""
    source = FIXTURES / f"{name}.jsonl"
    lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    out = tmp_path / name
    import_run("verl-metrics", source, out)
    report = analyze(out)
    for metric_id, key in zip(
        CRITIC,
        (
            "critic/vf_explained_var",
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "actor/reward_kl_penalty_coeff",
        ),
        strict=True,
    ):
        result = report.metrics[metric_id]
        assert list(result.values) == pytest.approx([line["data"][key] for line in lines])
        assert "(verl" in result.source
    ev = report.metrics["stability.explained_variance"]
    if name == "frozen-critic":  # the head outputs 0: it explains nothing, at every step
        assert max(abs(v) for v in ev.values if v is not None) < 1e-3
    else:  # the critic learns
        assert ev.value is not None and ev.value > 0.2


# --- critic-not-learning ----------------------------------------------------------------------


def _critic_finding(report: Any) -> Any:
    return next((f for f in report.findings if f.id == "critic-not-learning"), None)


def test_the_frozen_critic_is_named_and_the_healthy_one_is_not(tmp_path: Path) -> None:
    """Genuine PPO runs (verl's format): a critic that never learns (explained variance 0 at
    every step, value loss flat) against one that learns from step ~15 (tests/test_onsets.py:
    silent at every prefix of the healthy one)."""
    found = {}
    for name in ("healthy", "frozen-critic"):
        out = tmp_path / name
        import_run("verl-metrics", FIXTURES / f"{name}.jsonl", out)
        found[name] = _critic_finding(analyze(out))
    assert found["healthy"] is None
    frozen = found["frozen-critic"]
    assert frozen is not None and frozen.severity == "critical"
    assert abs(frozen.evidence["level"]) < 1e-3 and frozen.onset is not None
    assert frozen.onset <= 20


def _critic_steps(ev: list[float], value_loss: list[float] | None) -> list[dict[str, float]]:
    rows = []
    for i, e in enumerate(ev):
        row = {"step": i + 1, "loss": 0.0, "explained_variance": e}
        if value_loss is not None:
            row["value_loss"] = value_loss[i]
        rows.append(row)
    return rows


def test_a_critic_still_warming_up_is_not_judged(write_run: Any) -> None:
    rng = np.random.default_rng(1)
    ev = list(rng.normal(0.0, 0.005, 20))
    falling = [0.2 * 0.9**i + rng.normal(0, 0.002) for i in range(20)]
    flat = list(0.15 + rng.normal(0, 0.005, 20))
    assert _critic_finding(analyze(write_run({"steps": _critic_steps(ev, falling)}))) is None
    frozen = _critic_finding(analyze(write_run({"steps": _critic_steps(ev, flat)})))
    assert frozen is not None and frozen.severity == "critical"
    # Without a value loss, a flat explained variance of 0 is enough.
    alone = _critic_finding(analyze(write_run({"steps": _critic_steps(ev, None)})))
    assert alone is not None and alone.evidence["value_loss"] is None


def test_a_critic_that_unlearns_warns(write_run: Any) -> None:
    rng = np.random.default_rng(2)
    ev = [0.6 - 0.5 * i / 29 + rng.normal(0, 0.02) for i in range(30)]
    finding = _critic_finding(analyze(write_run({"steps": _critic_steps(ev, None)})))
    assert finding is not None and finding.severity == "warn"
    assert finding.evidence["first"] > 0.5 and finding.evidence["last"] < 0.25


# --- a genuine PPO loop with a critic, in verl's format (slow): tests/trainers/torch_ppo_critic.py


def _ppo_run(tmp_path: Path, mode: str) -> Computed:
    log = tmp_path / f"{mode}.jsonl"
    run_trainer("torch_ppo_critic.py", log, mode, timeout=600)
    out = tmp_path / mode
    import_run("verl-metrics", log, out)
    return compute(open_run(out))


def _critical_at_prefixes(computed: Computed) -> dict[int, list[str]]:
    steps = sorted(computed.results["stability.explained_variance"].steps)
    found = {}
    for step in steps[MIN_TREND_STEPS - 1 :]:
        ids = [
            f.id
            for f in evaluate_prefix(computed, step, Config()).findings
            if f.severity == "critical"
        ]
        if ids:
            found[step] = ids
    return found


@pytest.mark.slow
def test_a_healthy_ppo_run_is_never_critical(tmp_path: Path) -> None:
    """Its critic warms up for ~20 steps (value loss falling, explained variance 0) and its KL
    rises late (0 → 0.26 nats/token): no critical verdict at any prefix, so stop_on="critical"
    would let it train."""
    computed = _ppo_run(tmp_path, "healthy")
    assert _critical_at_prefixes(computed) == {}


@pytest.mark.slow
def test_a_critic_whose_learning_rate_jumps_diverges(tmp_path: Path) -> None:
    """The critic's learning rate jumps from 3e-3 to 3 at step 30: value-divergence from the
    first prefix that can see it, and the critic that learns nothing filed under it."""
    computed = _ppo_run(tmp_path, "critic-lr-jump")
    critical = _critical_at_prefixes(computed)
    first = min(s for s, ids in critical.items() if "value-divergence" in ids)
    assert 30 < first <= 36
    assert all(ids == [] or "value-divergence" not in ids for s, ids in critical.items() if s < 30)
    report_findings = evaluate(computed, Config()).findings
    divergence = next(f for f in report_findings if f.id == "value-divergence")
    assert divergence.evidence["last"] > 5 * divergence.evidence["first"]
    follower = next(f for f in report_findings if f.id == "critic-not-learning")
    assert follower.caused_by == ("value-divergence",)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["frozen-critic", "critic-diverges"])
def test_a_critic_that_learns_nothing_is_critical(tmp_path: Path, mode: str) -> None:
    computed = _ppo_run(tmp_path, mode)
    critical = _critical_at_prefixes(computed)
    last = max(critical)
    assert critical[last] == ["critic-not-learning"]
    assert len(critical) >= 40  # from its first steps on, at nearly every prefix


# --- value-divergence ------------------------------------------------------------------------


def _divergence(report: Any) -> Any:
    return next((f for f in report.findings if f.id == "value-divergence"), None)


def test_a_value_loss_up_an_order_of_magnitude_diverges(write_run: Any) -> None:
    rng = np.random.default_rng(4)
    calm = [0.2 * (1 + rng.normal(0, 0.1)) for _ in range(30)]
    exploding = calm[:20] + [0.2 * 3.0**k * (1 + rng.normal(0, 0.1)) for k in range(1, 11)]
    noisy = [0.2 * float(np.exp(rng.normal(0, 0.8))) for _ in range(30)]  # spiky, no trend
    judged = {}
    for name, losses in (("calm", calm), ("exploding", exploding), ("noisy", noisy)):
        rows = [{"step": i + 1, "loss": 0.0, "value_loss": v} for i, v in enumerate(losses)]
        judged[name] = _divergence(analyze(write_run({"steps": rows})))
    assert judged["calm"] is None and judged["noisy"] is None
    found = judged["exploding"]
    assert found is not None and found.severity == "critical"
    assert found.evidence["last"] / found.evidence["first"] > 10
