"""PPO with a learned critic: explained variance from tokens (verl's formula), the value loss, the
value clip fraction and the KL coefficient as the trainers log them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import GENUINE, run_trainer

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
#: Read from verl's keys only.
VERL_CRITIC = {"stability.critic_grad_norm": "critic/grad_norm", "stability.critic_lr": "critic/lr"}
FIXTURES = GENUINE / "ppo-critic"


def _fixture(name: str) -> Path:
    return FIXTURES / f"{name}.jsonl"


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
    source = _fixture(name)
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
    for metric_id, key in VERL_CRITIC.items():
        result = report.metrics[metric_id]
        assert list(result.values) == pytest.approx([line["data"][key] for line in lines])
        assert result.part == "critic"
    assert report.run.meta["algorithm"] == "PPO"
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
        import_run("verl-metrics", _fixture(name), out)
        found[name] = _critic_finding(analyze(out))
    assert found["healthy"] is None
    frozen = found["frozen-critic"]
    assert frozen is not None and frozen.severity == "critical"
    assert abs(frozen.evidence["level"]) < 1e-3 and frozen.onset is not None
    assert frozen.onset <= 20
    assert frozen.evidence["critic_lr_zero"] is True  # verl logged critic/lr = 0
    assert "learning rate is 0" in frozen.message


def test_openrlhfs_critic_keys(write_run: Any) -> None:
    """OpenRLHF's ppo_critic.py `training_step` status, as steps columns of its own names."""
    rows = [
        {
            "step": s,
            "loss": 0.1,
            "critic_loss": 0.5 / s,
            "critic_grad_norm": 2.0 + s,
            "critic_lr": 1e-6 * s,
        }
        for s in range(1, 6)
    ]
    report = analyze(write_run({"steps": rows}))
    for metric_id, key in (
        ("stability.value_loss", "critic_loss"),
        ("stability.critic_grad_norm", "critic_grad_norm"),
        ("stability.critic_lr", "critic_lr"),
    ):
        result = report.metrics[metric_id]
        assert list(result.values) == pytest.approx([row[key] for row in rows])
        assert "OpenRLHF" in result.source


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


def test_a_blow_up_at_the_first_update_is_no_warm_up(write_run: Any) -> None:
    """Critic lr far too high (as a genuine verl-keyed PPO run with critic lr 0.3): value loss 52
    after the first update, then ~0.04 for 100 steps, explained variance within ±0.02 of 0. The
    first fifth's mean falls with the blow-up's decay, not its median: critical at every judged
    length (before 35 steps the blow-up's own scatter already makes the mean's fall unsure)."""
    rng = np.random.default_rng(3)
    ev = list(rng.uniform(-0.02, 0.02, 100))
    blown = [52.0, 9.0, 1.5, *(0.04 * (1 + rng.normal(0, 0.1, 97)))]
    found = _critic_finding(analyze(write_run({"steps": _critic_steps(ev, blown)})))
    assert found is not None and found.severity == "critical"
    for prefix in (20, 34, 35, 60):
        shorter = write_run({"steps": _critic_steps(ev[:prefix], blown[:prefix])})
        assert _critic_finding(analyze(shorter)) is not None


def test_a_critic_that_unlearns_warns(write_run: Any) -> None:
    rng = np.random.default_rng(2)
    ev = [0.6 - 0.5 * i / 29 + rng.normal(0, 0.02) for i in range(30)]
    finding = _critic_finding(analyze(write_run({"steps": _critic_steps(ev, None)})))
    assert finding is not None and finding.severity == "warn"
    assert finding.evidence["first"] > 0.5 and finding.evidence["last"] < 0.25


# --- a genuine PPO loop with a critic, in verl's format (slow): tests/trainers/torch_ppo_critic.py


def _ppo_run(tmp_path: Path, mode: str, steps: int | None = None) -> Computed:
    log = tmp_path / f"{mode}.jsonl"
    run_trainer("torch_ppo_critic.py", log, mode, *([str(steps)] if steps else []), timeout=600)
    out = tmp_path / mode
    import_run("verl-metrics", log, out)
    return compute(open_run(out))


def _at_prefixes(
    computed: Computed, severities: tuple[str, ...] = ("critical",)
) -> dict[int, list[str]]:
    """The findings of `severities` at every prefix of the run that can be judged."""
    steps = sorted(computed.results["stability.explained_variance"].steps)
    found = {}
    for step in steps[MIN_TREND_STEPS - 1 :]:
        ids = [
            f.id
            for f in evaluate_prefix(computed, step, Config()).findings
            if f.severity in severities
        ]
        if ids:
            found[step] = ids
    return found


#: What the PPO loop's healthy run must never raise, at any prefix and severity.
CRITIC_RULES = (
    "critic-not-learning",
    "value-divergence",
    "kl-coef-runaway",
    "advantage-explosion",
    "gradient-vanishing",
)


@pytest.mark.slow
def test_a_healthy_ppo_run_is_never_critical(tmp_path: Path) -> None:
    """Its critic warms up for ~20 steps (value loss falling, explained variance 0) and its KL
    rises late (0 → 0.26 nats/token): no critical verdict at any prefix, so stop_on="critical"
    would let it train."""
    computed = _ppo_run(tmp_path, "healthy")
    assert _at_prefixes(computed) == {}
    anything = _at_prefixes(computed, ("info", "warn", "critical"))
    assert not {i for ids in anything.values() for i in ids} & set(CRITIC_RULES)


@pytest.mark.slow
def test_a_kl_target_below_any_reachable_kl_runs_the_coefficient_away(tmp_path: Path) -> None:
    """verl's adaptive controller with a target of 1e-6: β climbs ×1.064 a step; warned from
    ×4 (step 47), critical from ×10 (step 61); nothing else about the critic."""
    computed = _ppo_run(tmp_path, "kl-runaway", steps=70)
    found = _at_prefixes(computed, ("warn", "critical"))
    first = min(s for s, ids in found.items() if "kl-coef-runaway" in ids)
    critical = min(s for s, ids in _at_prefixes(computed).items() if "kl-coef-runaway" in ids)
    assert 44 <= first <= 50 and 58 <= critical <= 64
    assert all("kl-coef-runaway" in ids for s, ids in found.items() if s >= first)
    assert not {i for ids in found.values() for i in ids} & (
        set(CRITIC_RULES) - {"kl-coef-runaway"}
    )


@pytest.mark.slow
def test_a_critic_whose_learning_rate_jumps_diverges(tmp_path: Path) -> None:
    """The critic's learning rate jumps from 3e-3 to 3 at step 30: value-divergence from the
    first prefix that can see it, and the critic that learns nothing filed under it."""
    computed = _ppo_run(tmp_path, "critic-lr-jump")
    critical = _at_prefixes(computed)
    first = min(s for s, ids in critical.items() if "value-divergence" in ids)
    assert 30 < first <= 36
    assert all(ids == [] or "value-divergence" not in ids for s, ids in critical.items() if s < 30)
    report_findings = evaluate(computed, Config()).findings
    divergence = next(f for f in report_findings if f.id == "value-divergence")
    assert divergence.evidence["last"] > 5 * divergence.evidence["first"]
    follower = next(f for f in report_findings if f.id == "critic-not-learning")
    # the critic's learning rate jumped first (update-change, at its step): it explains both
    change = next(f for f in report_findings if f.id == "update-change")
    assert change.began == 30 and "critic learning rate jumped ×1e+03" in change.message
    assert divergence.caused_by == ("update-change",)
    assert follower.caused_by == ("update-change", "value-divergence")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["frozen-critic", "critic-diverges"])
def test_a_critic_that_learns_nothing_is_critical(tmp_path: Path, mode: str) -> None:
    computed = _ppo_run(tmp_path, mode)
    critical = _at_prefixes(computed)
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


def test_a_non_finite_value_loss_is_the_critics_divergence(write_run: Any) -> None:
    """A NaN value loss is value-divergence (the critic's), not divergence (the policy's)."""
    rows = [{"step": s, "loss": 0.1, "grad_norm": 1.0, "critic/vf_loss": 0.2} for s in range(1, 13)]
    rows[7]["critic/vf_loss"] = float("nan")
    report = analyze(write_run({"steps": rows}))
    found = _divergence(report)
    assert found is not None and found.severity == "critical"
    assert found.evidence["nonfinite_steps"] == [8]
    assert "critic/vf_loss" in found.message
    assert not any(f.id == "divergence" for f in report.findings)
    assert report.metrics["stability.nonfinite"].values[7] == 1


# --- kl-coef-runaway ---------------------------------------------------------------------------


def _beta_steps(betas: list[float], kl: float = 0.05) -> list[dict[str, float]]:
    return [{"step": i + 1, "loss": 0.0, "kl": kl, "kl_coef": b} for i, b in enumerate(betas)]


def _runaway(report: Any) -> Any:
    return next((f for f in report.findings if f.id == "kl-coef-runaway"), None)


def test_an_adaptive_beta_that_keeps_climbing_runs_away(write_run: Any) -> None:
    """verl's controller at its largest factor (×1.064 a step): silent below ×4 its start, a
    warning from ×4, critical from ×10; a fixed β, a controller that settles below its start,
    and one that pulled β back are never judged."""
    climb = [0.02 * 1.064**i for i in range(45)]  # ×16 by the end
    judged = {}
    for name, betas in {
        "fixed": [0.02] * 45,
        "settles": [0.02 * 0.936 ** min(i, 20) * (1 + 0.01 * (-1) ** i) for i in range(45)],
        "pulled back": climb[:30] + [climb[29] * 0.97**k for k in range(1, 16)],
        "x3": climb[:19],
        "x5": climb[:27],
        "x16": climb,
    }.items():
        judged[name] = _runaway(analyze(write_run({"steps": _beta_steps(betas)})))
    assert judged["fixed"] is None and judged["settles"] is None
    assert judged["pulled back"] is None and judged["x3"] is None
    assert judged["x5"] is not None and judged["x5"].severity == "warn"
    assert judged["x5"].evidence["per_step"] == pytest.approx(1.064, rel=1e-6)
    assert judged["x16"].severity == "critical" and judged["x16"].evidence["growth"] > 10
    assert judged["x16"].onset == 24  # ×4 = 1.064^22.4: the first prefix past it
    assert judged["x16"].last_good == 23


def test_a_beta_pinned_at_a_clamp_and_a_dip_in_the_climb(write_run: Any) -> None:
    climb = [0.02 * 1.1**i for i in range(20)]
    pinned = climb + [climb[-1]] * 8  # ×6.1, then held
    dip = [*climb, climb[-1] * 0.99, climb[-1] * 1.05, climb[-1] * 1.1]  # a dip below target
    found = _runaway(analyze(write_run({"steps": _beta_steps(pinned)})))
    assert found is not None and found.evidence["pinned"] is True
    assert "clamp" in found.message
    found = _runaway(analyze(write_run({"steps": _beta_steps(dip)})))
    assert found is not None and found.evidence["pinned"] is False


# --- advantage extremes ------------------------------------------------------------------------


def _advantage_run(write_run: Any, per_step: list[list[np.ndarray]], **meta: Any) -> Any:
    """Tokens whose advantages are `per_step[step][file]` (a file per array), 10 per rollout."""
    batches, rid, ids, id_steps = [], 0, [], []
    for step, files in enumerate(per_step):
        for values in files:
            n = values.size
            batches.append(
                {
                    "rollout_id": [rid + i // 10 for i in range(n)],
                    "step": [step] * n,
                    "pos": [i % 10 for i in range(n)],
                    "advantage": values.astype(np.float32),
                }
            )
            new = sorted({rid + i // 10 for i in range(n)})
            ids += new
            id_steps += [step] * len(new)
            rid = new[-1] + 1
    rollouts = {
        "rollout_id": ids,
        "step": id_steps,
        "prompt_id": [f"p{i}" for i in ids],
        "reward": [1.0] * len(ids),
        "response_len": [10] * len(ids),
    }
    return write_run({"rollouts": rollouts, "tokens": batches}, **meta)


def test_the_largest_advantage_in_standard_deviations_is_numpys(write_run: Any) -> None:
    """The max merges over files (the outlier in the second file of its step); tokens with an
    advantage of exactly 0 are left out of the spread; the same from a warm cache."""
    rng = np.random.default_rng(5)
    calm = [rng.normal(0, 1, 400), rng.normal(0, 1, 400)]
    outlier = rng.normal(0, 1, 400)
    outlier[123] = 60.0
    spiked = [rng.normal(0, 1, 400), np.concatenate([outlier, np.zeros(200)])]
    path = _advantage_run(write_run, [calm, spiked])
    expected, counted = [], []
    for files in (calm, spiked):
        a = np.concatenate(files).astype(np.float32).astype(np.float64)
        carrying = a[np.abs(a) > 1e-3]  # the noise floor of a step whose RMS is ~1
        expected.append(np.abs(a).max() / np.sqrt(np.mean(carrying**2)))
        counted.append(carrying.size)
    for _ in range(2):  # cold, then from the cache
        report = analyze(path)
        result = report.metrics["stability.advantage_extreme"]
        assert list(result.values) == pytest.approx(expected, rel=1e-9)
        assert result.source.startswith("tokens")
        found = next(f for f in report.findings if f.id == "advantage-explosion")
        assert found.evidence["extreme_steps"] == [1]
        n = counted[1]  # the spiked step's advantages above noise (the 200 zeros left out)
        assert 795 < n <= 800 and found.evidence["bound"] == pytest.approx(
            2 * np.sqrt(2 * np.log(2 * n))
        )


def test_gaussian_advantages_and_grpo_groups_are_not_explosions(write_run: Any) -> None:
    """Normal advantages at 10^2 to 10^5 tokens a step stay under the bound; a GRPO group of 64
    with one success (advantage (G − 1)/√G = 7.9) is the estimator's design, not an outlier."""
    rng = np.random.default_rng(6)
    steps = [[rng.normal(0, 1, n)] for n in (100, 1_000, 10_000, 100_000)]
    report = analyze(_advantage_run(write_run, steps))
    assert not any(f.id == "advantage-explosion" for f in report.findings)
    g = 64
    one_success = np.full(g, -1 / np.sqrt(g))
    one_success[0] = (g - 1) / np.sqrt(g)
    group = np.repeat(one_success, 10)
    mixed = [[np.concatenate([group, rng.normal(0, 1, 2000)])]]
    report = analyze(_advantage_run(write_run, mixed, group_size=g))
    assert not any(f.id == "advantage-explosion" for f in report.findings)


def test_float_noise_of_zero_sigma_groups_is_not_an_advantage(write_run: Any) -> None:
    """Groups with one reward for all get (r − μ)/(σ + ε) of rounding, not 0 (torch float32 with
    ε = 1e-4: 7.5e-5 for rewards of 0.1 in groups of 8; float64: 1e-17): a step of such groups
    alone, or one of them among real groups, is no explosion, and the spread is the real
    groups' (measured here with numpy, the noise left out)."""
    rng = np.random.default_rng(7)
    real = rng.normal(0, 1, 3000)
    noise32 = np.full(5000, 7.450580596923828e-05)
    noise64 = np.full(5000, 1.3877787807814457e-17)
    steps = [[noise32], [noise64], [np.concatenate([real, noise32, noise64])], [real]]
    report = analyze(_advantage_run(write_run, steps))
    assert not any(f.id == "advantage-explosion" for f in report.findings)
    result = report.metrics["stability.advantage_extreme"]
    a = real.astype(np.float32).astype(np.float64)
    a = a[np.abs(a) > 1e-3]  # the floor at a scale of ~1: 1e-3
    expected = np.abs(a).max() / np.sqrt(np.mean(a**2))
    ratio = dict(zip(result.steps, result.values, strict=True))
    assert ratio[2] == pytest.approx(expected, rel=1e-9) and ratio[3] == ratio[2]
    assert ratio[0] == pytest.approx(1.0) and ratio[1] == pytest.approx(1.0)


def test_verls_whitened_advantage_extremes_as_logged(write_run: Any) -> None:
    rows = [
        {"step": s, "loss": 0.0, "critic/advantages/max": 3.0, "critic/advantages/min": -4.0}
        for s in range(1, 6)
    ]
    rows[3]["critic/advantages/max"] = 40.0
    report = analyze(write_run({"steps": rows}))
    result = report.metrics["stability.advantage_extreme"]
    assert list(result.values) == [4.0, 4.0, 4.0, 40.0, 4.0]
    found = next(f for f in report.findings if f.id == "advantage-explosion")
    assert found.evidence["extreme_steps"] == [4]
    assert found.evidence["bound"] == pytest.approx(2 * np.sqrt(2 * np.log(2e8)))


# --- gradient-vanishing ------------------------------------------------------------------------


def _vanishing(report: Any) -> Any:
    return next((f for f in report.findings if f.id == "gradient-vanishing"), None)


def test_grad_norm_against_its_early_level(write_run: Any) -> None:
    norms = [5.0, 1.0, 1.2, 0.8, 1.1, 0.5, 0.25]  # a spike first: the median sets the level
    rows = [{"step": i, "loss": 0.0, "grad_norm": g} for i, g in enumerate(norms)]
    result = analyze(write_run({"steps": rows})).metrics["stability.grad_norm_rel"]
    assert list(result.values) == pytest.approx([g / 1.1 for g in norms])


def _grad_run(write_run: Any, norms: np.ndarray, correct: list[np.ndarray]) -> Any:
    """Steps with `norms`, rollouts in groups of 4 whose correctness per step is `correct`."""
    steps = [{"step": i, "loss": 0.0, "grad_norm": float(g)} for i, g in enumerate(norms)]
    rollouts: dict[str, list[Any]] = {k: [] for k in ("rollout_id", "step", "prompt_id")}
    rollouts |= {"reward": [], "correct": [], "response_len": []}
    for step, outcome in enumerate(correct):
        for i, ok in enumerate(outcome):
            rollouts["rollout_id"].append(len(rollouts["rollout_id"]))
            rollouts["step"].append(step)
            rollouts["prompt_id"].append(f"s{step}p{i // 4}")
            rollouts["reward"].append(float(ok))
            rollouts["correct"].append(bool(ok))
            rollouts["response_len"].append(20)
    return write_run({"steps": steps, "rollouts": rollouts}, group_size=4)


def test_a_gradient_that_vanishes_while_the_rewards_still_differ(write_run: Any) -> None:
    rng = np.random.default_rng(7)
    n = 40
    vanishing = 1.0 * 10 ** (-3 * np.arange(n) / n) * np.exp(rng.normal(0, 0.1, n))
    drifting = 1.0 * 10 ** (-0.5 * np.arange(n) / n) * np.exp(rng.normal(0, 0.1, n))
    mixed = [rng.random(32) < 0.5 for _ in range(n)]  # σ_G > 0, flat
    solved = [np.ones(32, bool) for _ in range(n)]  # every group all correct: σ_G = 0
    rising = [rng.random(32) < 0.2 + 0.6 * s / n for s in range(n)]
    found = _vanishing(analyze(_grad_run(write_run, vanishing, mixed)))
    assert found is not None and found.evidence["last"] < 0.01 * found.evidence["first"]
    assert found.evidence["group_std"] > 0.3
    assert _vanishing(analyze(_grad_run(write_run, drifting, mixed))) is None
    assert _vanishing(analyze(_grad_run(write_run, vanishing, solved))) is None
    assert _vanishing(analyze(_grad_run(write_run, vanishing, rising))) is None
