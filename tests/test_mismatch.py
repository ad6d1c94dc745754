"""The training–inference mismatch: the sampler's log-probs (tokens.rollout_logprob) against the
trainer's, computed from tokens and read where verl and TRL log it, and its finding."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import run_cli, run_trainer

from rlscope.analysis import analyze
from rlscope.catalog import default_catalog
from rlscope.importers import import_run
from rlscope.integrations.trl import RlscopeCallback

MISMATCH = (
    "stability.mismatch_kl",
    "stability.mismatch_log_ppl_gap",
    "stability.mismatch_abs_logp",
    "stability.mismatch_tail",
    "stability.mismatch_prob_diff",
)


def _tokens_run(
    write_run: Any,
    sigma: Any,
    *,
    steps: int = 30,
    length: int = 20,
    trainer: str = "old_logprob",
    seed: int = 0,
    rollouts_per_step: int = 8,
    shared: float = 0.0,
) -> tuple[Path, dict[str, np.ndarray]]:
    """A run whose sampler log-probs differ from the trainer's by N(0, sigma(step)) per token
    plus, with `shared`, one N(0, shared) draw per rollout for all its tokens:
    `rollouts_per_step` rollouts of `length` tokens a step. Returns it and its token arrays."""
    rng = np.random.default_rng(seed)
    rollouts: dict[str, list[Any]] = {k: [] for k in ("rollout_id", "step", "prompt_id")}
    rollouts |= {"reward": [], "response_len": []}
    columns: dict[str, list[Any]] = {k: [] for k in ("rollout_id", "step", "pos")}
    columns |= {trainer: [], "rollout_logprob": []}
    rid = 0
    for step in range(steps):
        for g in range(rollouts_per_step):
            rollouts["rollout_id"].append(rid)
            rollouts["step"].append(step)
            rollouts["prompt_id"].append(f"p{step}-{g // 2}")
            rollouts["reward"].append(float(rng.integers(0, 2)))
            rollouts["response_len"].append(length)
            lp = np.log(rng.uniform(0.05, 1.0, length)).astype(np.float32)
            noise = rng.normal(0.0, sigma(step) if callable(sigma) else sigma, length)
            noise += rng.normal(0.0, shared) if shared else 0.0
            columns["rollout_id"] += [rid] * length
            columns["step"] += [step] * length
            columns["pos"] += list(range(length))
            columns[trainer] += lp.tolist()
            columns["rollout_logprob"] += (lp - noise).astype(np.float32).tolist()
            rid += 1
    path = write_run({"rollouts": rollouts, "tokens": columns})
    arrays = {k: np.asarray(v) for k, v in columns.items()}
    return path, arrays


def _per_step(arrays: dict[str, np.ndarray], trainer: str) -> dict[str, list[float]]:
    """The five metrics per step, computed independently with numpy (float64)."""
    t = arrays[trainer].astype(np.float64)
    r = arrays["rollout_logprob"].astype(np.float64)
    out: dict[str, list[float]] = {m: [] for m in MISMATCH}
    for step in np.unique(arrays["step"]):
        at = arrays["step"] == step
        d = t[at] - r[at]
        out["stability.mismatch_kl"].append(float(np.mean(np.exp(d) - d - 1)))
        out["stability.mismatch_log_ppl_gap"].append(float(np.mean(-d)))
        out["stability.mismatch_abs_logp"].append(float(np.mean(np.abs(d))))
        out["stability.mismatch_tail"].append(float(np.mean(np.abs(d) > math.log(2))))
        out["stability.mismatch_prob_diff"].append(
            float(np.mean(np.abs(np.exp(t[at]) - np.exp(r[at]))))
        )
    return out


@pytest.mark.parametrize("trainer", ["old_logprob", "logprob"])
def test_mismatch_metrics_equal_an_independent_computation(write_run: Any, trainer: str) -> None:
    path, arrays = _tokens_run(write_run, 0.3, steps=6, trainer=trainer)
    report = analyze(path, metrics=MISMATCH)
    expected = _per_step(arrays, trainer)
    for metric_id in MISMATCH:
        result = report.metrics[metric_id]
        assert result.values == pytest.approx(expected[metric_id], rel=1e-9, abs=1e-12)
        assert trainer in result.source
    # k3 is a KL estimate: ~sigma²/2 for small centred log-ratio noise.
    assert report.metrics["stability.mismatch_kl"].value == pytest.approx(0.3**2 / 2, rel=0.2)


def test_the_steps_error_by_rollout_equals_an_independent_computation(write_run: Any) -> None:
    """The k3 step mean's standard error with each rollout one draw (the ratio estimator over
    the step's rollouts) and with each token one, against numpy, on one step (the final
    window's mean of a one-step run is that step's)."""
    path, arrays = _tokens_run(write_run, 0.3, steps=1, length=7, rollouts_per_step=12)
    d = arrays["old_logprob"].astype(np.float64) - arrays["rollout_logprob"].astype(np.float64)
    k3 = np.exp(d) - d - 1
    ids = arrays["rollout_id"]
    sums = np.array([k3[ids == r].sum() for r in np.unique(ids)])
    counts = np.array([(ids == r).sum() for r in np.unique(ids)], dtype=np.float64)
    mean = sums.sum() / counts.sum()
    r = sums.size
    by_rollout = math.sqrt(np.sum((sums - mean * counts) ** 2) * r / (r - 1)) / counts.sum()
    components = analyze(path, metrics=MISMATCH[:1]).metrics[MISMATCH[0]].extra["components"]
    assert components["rollout_se"] == pytest.approx(by_rollout, rel=1e-9)
    assert components["token_se"] == pytest.approx(k3.std(ddof=1) / math.sqrt(k3.size), rel=1e-9)
    assert components["rollouts"] == r and components["n"] == k3.size


def test_a_sequences_shared_offset_is_not_sure_from_its_tokens(write_run: Any) -> None:
    """Each rollout's 40 tokens all off by one draw of N(0, 0.125): k ≈ 0.0078 a token, 0.31 a
    sequence, below the warning's 0.35, and the tokens are as correlated as they can be. On 4
    rollouts a step, a level judged on its tokens' error (as if independent) would be sure
    of a warning on a quarter of the first steps (counted here, independently); the rollouts'
    scatter, Student-t widened for 3 degrees of freedom, is not. 64 rollouts of a real
    mismatch of that kind (N(0, 0.35): 2.4 a sequence) are critical from the first step."""
    token_sure, fired = 0, 0
    for seed in range(30):
        path, arrays = _tokens_run(
            write_run, 0.0, steps=1, length=40, rollouts_per_step=4, shared=0.125, seed=seed
        )
        d = arrays["old_logprob"].astype(np.float64) - arrays["rollout_logprob"]
        k3 = np.exp(d) - d - 1
        token_sure += 40 * (k3.mean() - 2 * k3.std(ddof=1) / math.sqrt(k3.size)) >= 0.3466
        fired += _finding(analyze(path)) is not None
    assert token_sure >= 6 and fired <= 1, (token_sure, fired)
    path, _ = _tokens_run(write_run, 0.0, steps=1, length=40, rollouts_per_step=64, shared=0.35)
    sure = _finding(analyze(path))
    assert sure is not None and sure.severity == "critical"


def test_a_moderate_level_warns_from_the_first_step(write_run: Any) -> None:
    """32 rollouts of 12 tokens at σ = 0.3 a token (k ≈ 0.045, 0.54 a sequence: 34% kept):
    the rollouts say the step's error is ~0.005 a token, so a warning at the first step; the
    bound that took a sequence's tokens as one draw (× √12) could not be sure of it."""
    path, _ = _tokens_run(write_run, 0.3, steps=1, length=12, rollouts_per_step=32)
    finding = _finding(analyze(path))
    assert finding is not None and finding.severity == "warn"


def test_without_rollout_logprob_the_mismatch_is_not_a_zero(write_run: Any) -> None:
    path = write_run(
        {
            "rollouts": {
                "rollout_id": [0, 1],
                "step": [0, 0],
                "prompt_id": ["p", "p"],
                "reward": [1.0, 0.0],
                "response_len": [2, 2],
            },
            "tokens": {
                "rollout_id": [0, 0, 1, 1],
                "step": [0] * 4,
                "pos": [0, 1, 0, 1],
                "old_logprob": [-0.1, -0.2, -0.3, -0.4],
            },
        }
    )
    report = analyze(path)
    assert not set(MISMATCH) & set(report.metrics)
    skipped = {s.metric: s.reason for s in report.skipped}
    assert "rollout_logprob" in skipped["stability.mismatch_kl"]
    assert "train-inference-mismatch" in skipped


# --- the finding -----------------------------------------------------------------------------


def _finding(report: Any) -> Any:
    return next((f for f in report.findings if f.id == "train-inference-mismatch"), None)


def test_a_matched_sampler_raises_nothing(write_run: Any) -> None:
    """bf16-like noise (σ = 0.01 nats: k ≈ 5e-5 per token, 1e-3 a 20-token sequence)."""
    path, _ = _tokens_run(write_run, 0.01)
    assert _finding(analyze(path)) is None


def test_a_large_steady_mismatch_is_critical(write_run: Any) -> None:
    """σ = 0.5: k3 ≈ 0.13 nats/token, ×20 tokens ≈ 2.6 nats a sequence: e^(−5) ≈ 1% kept."""
    path, _ = _tokens_run(write_run, 0.5)
    finding = _finding(analyze(path))
    assert finding is not None and finding.severity == "critical"
    assert finding.evidence["sequence_kl"] == pytest.approx(
        finding.evidence["per_token"] * 20, rel=1e-9
    )
    assert finding.evidence["ess"] < 0.05 and not finding.evidence["rising"]


def test_a_moderate_level_warns(write_run: Any) -> None:
    """σ = 0.25: k ≈ 0.031 per token, 0.63 a sequence: e^(−1.3) ≈ 28% kept (< 50%)."""
    path, _ = _tokens_run(write_run, 0.25)
    finding = _finding(analyze(path))
    assert finding is not None and finding.severity == "warn"
    assert 0.05 < finding.evidence["ess"] < 0.5


def test_a_rising_mismatch_warns_before_its_level_matters(write_run: Any) -> None:
    """σ from 0.02 to 0.12 over 30 steps: k from 2e-4 to 7e-3, a sequence 0.14 nats at the
    end (90% kept: no level finding), but rising ×30: the papers' precursor of a collapse."""
    path, _ = _tokens_run(write_run, lambda step: 0.02 + 0.1 * step / 29)
    finding = _finding(analyze(path))
    assert finding is not None and finding.severity == "warn"
    assert finding.evidence["rising"] and finding.evidence["ess"] > 0.5
    assert "rose" in finding.message


def test_a_sure_level_is_judged_from_the_first_steps(write_run: Any) -> None:
    """With the tokens, a step's own error is known: a mismatch of ~0.13 nats/token over 64
    rollouts of 50 tokens a step is critical from the first step on (its error bound, as if
    each sequence were one draw: 1.3 nats a sequence against a level of 6), a 0 one never; 8
    rollouts of 3 tokens at 4.5e-4 a token are nothing. The rise waits for its steps."""
    for steps in (1, 2, 8):
        path, _ = _tokens_run(write_run, 0.5, steps=steps, length=50, rollouts_per_step=64)
        finding = _finding(analyze(path))
        assert finding is not None and finding.severity == "critical", steps
        assert not finding.evidence["rising"]
        path, _ = _tokens_run(write_run, 0.0, steps=steps, length=50, rollouts_per_step=64)
        assert _finding(analyze(path)) is None
    noisy, _ = _tokens_run(write_run, 0.03, steps=2, length=3)
    assert _finding(analyze(noisy)) is None


def test_the_mismatch_rise_waits_for_its_steps_and_is_not_the_kl_to_the_reference() -> None:
    rule = default_catalog().rules["train-inference-mismatch"]
    assert rule.params["min_trend_steps"].default >= 3
    shown = run_cli("explain", "train-inference-mismatch").stdout
    assert "not the KL to the reference" in " ".join(shown.split())
    assert "stability.kl" in shown


# --- read where the trainers log it ------------------------------------------------------------


def _offpolicy_metrics(old: np.ndarray, rollout: np.ndarray) -> dict[str, float]:
    """verl's `compute_offpolicy_metrics` (trainer/ppo/rollout_corr_helper.py), ported to numpy
    for rows of equal length (no mask): the keys and formulas verl logs under rollout_corr/."""
    log_ratio = old - rollout
    seq_train, seq_roll = old.mean(axis=1), rollout.mean(axis=1)
    log_ppl_diff = seq_roll - seq_train
    return {
        "training_ppl": float(np.exp(-seq_train).mean()),
        "training_log_ppl": float((-seq_train).mean()),
        "kl": float((rollout - old).mean()),
        "k3_kl": float((np.exp(log_ratio) - log_ratio - 1).mean()),
        "rollout_ppl": float(np.exp(-seq_roll).mean()),
        "rollout_log_ppl": float((-seq_roll).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(np.abs(log_ppl_diff).mean()),
        "ppl_ratio": float(np.exp(log_ppl_diff).mean()),
        "chi2_token": float((np.exp(np.clip(log_ratio, -20, 20)) ** 2).mean() - 1.0),
    }


def _debug_metrics(old: np.ndarray, rollout: np.ndarray) -> dict[str, float]:
    """verl's `calculate_debug_metrics` (verl/utils/debug/metrics.py), ported to numpy."""
    diff = np.abs(np.exp(old) - np.exp(rollout)).ravel()
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std(ddof=1)),
        "training/rollout_actor_probs_pearson_corr": float(
            np.corrcoef(np.exp(old).ravel(), np.exp(rollout).ravel())[0, 1]
        ),
    }


def _verl_metrics_log(tmp_path: Path, sigma: float, steps: int = 30) -> tuple[Path, list[dict]]:
    """A verl file-logger log (`{"step": N, "data": {...}}` lines, verl/utils/tracking.py) with
    the rollout-correction and debug metrics verl computes from its batch's log-probs."""
    rng = np.random.default_rng(3)
    lines, logged = [], []
    for step in range(1, steps + 1):
        old = np.log(rng.uniform(0.05, 1.0, (16, 40)))
        rollout = old - rng.normal(0.0, sigma, old.shape)
        data: dict[str, Any] = {
            "actor/pg_loss": float(rng.normal(0, 0.01)),
            "actor/grad_norm": float(rng.uniform(0.2, 0.4)),
            "response_length/mean": 40.0,
            "critic/score/mean": float(rng.uniform(0.4, 0.6)),
        }
        data |= {f"rollout_corr/{k}": v for k, v in _offpolicy_metrics(old, rollout).items()}
        data |= _debug_metrics(old, rollout)
        lines.append(json.dumps({"step": step, "data": data}))
        logged.append(data)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, logged


def test_verl_logged_mismatch_is_read_as_logged(tmp_path: Path) -> None:
    source, logged = _verl_metrics_log(tmp_path, 0.01)
    out = tmp_path / "imported"
    import_run("verl-metrics", source, out)
    report = analyze(out)
    for metric_id, key in (
        ("stability.mismatch_kl", "rollout_corr/k3_kl"),
        ("stability.mismatch_log_ppl_gap", "rollout_corr/kl"),
        ("stability.mismatch_prob_diff", "training/rollout_probs_diff_mean"),
    ):
        result = report.metrics[metric_id]
        assert list(result.values) == pytest.approx([d[key] for d in logged])
        assert f"steps.{key} as logged (verl" in result.source
    assert _finding(report) is None  # a matched sampler: k ≈ 5e-5 x 40 tokens


def test_verl_logged_large_mismatch_fires(tmp_path: Path) -> None:
    source, _ = _verl_metrics_log(tmp_path, 0.4)
    out = tmp_path / "imported"
    import_run("verl-metrics", source, out)
    finding = _finding(analyze(out))
    assert finding is not None and finding.severity == "critical"
    assert finding.evidence["tokens"] == pytest.approx(40.0)


def test_trl_logged_sampling_statistics_are_read(tmp_path: Path) -> None:
    """TRL logs mean |Δ log p| and the (truncated) importance ratios when it corrects vLLM's
    samples (grpo_trainer.py, `vllm_importance_sampling_correction`): `sampling/*` keys of
    its log_history."""
    source = tmp_path / "trl"
    source.mkdir()
    history = []
    for step in range(1, 31):
        mean_abs = 0.02 + 0.004 * step  # rising: 0.024 -> 0.14
        history.append(
            {
                "step": step,
                "loss": 0.01,
                "grad_norm": 0.3,
                "learning_rate": 1e-6,
                "reward": 0.5,
                "completions/mean_length": 200.0,
                "sampling/sampling_logp_difference/mean": mean_abs,
                "sampling/sampling_logp_difference/max": 10 * mean_abs,
                "sampling/importance_sampling_ratio/min": 0.5,
                "sampling/importance_sampling_ratio/mean": 1.0,
                "sampling/importance_sampling_ratio/max": 2.0,
            }
        )
    (source / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    out = tmp_path / "imported"
    import_run("trl", source, out)
    report = analyze(out)
    result = report.metrics["stability.mismatch_abs_logp"]
    assert list(result.values) == pytest.approx(
        [h["sampling/sampling_logp_difference/mean"] for h in history]
    )
    assert "(TRL" in result.source
    finding = _finding(report)
    assert finding is not None and finding.evidence["rising"]
    assert finding.evidence["estimator"].startswith("≈")


# --- a genuine sampler and trainer (slow): tests/trainers/torch_mismatch.py -------------------


def _genuine(tmp_path: Path, mode: str) -> Path:
    run = tmp_path / mode
    run_trainer("torch_mismatch.py", run, mode, timeout=600)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fp32", "bf16", "perturbed"])
def test_a_genuine_mismatch_is_judged_by_its_size(tmp_path: Path, mode: str) -> None:
    """Sampled by one copy of a real torch policy, trained by another: an fp32 or bf16 sampler
    raises nothing (the genuine small mismatch of bf16 kernels), a sampler whose weights are
    not the trainer's is critical; the metrics equal numpy on the written tokens."""
    run = _genuine(tmp_path, mode)
    report = analyze(run)
    tokens = pl.read_parquet(run / "tokens" / "*.parquet").sort("step", "rollout_id", "pos")
    arrays = {c: tokens[c].to_numpy() for c in ("step", "old_logprob", "rollout_logprob")}
    expected = _per_step(arrays, "old_logprob")
    for metric_id in MISMATCH:
        assert list(report.metrics[metric_id].values) == pytest.approx(
            expected[metric_id], rel=1e-6, abs=1e-12
        )
    finding = _finding(report)
    if mode == "perturbed":
        assert finding is not None and finding.severity == "critical"
        assert finding.evidence["sequence_kl"] > 1.5
    else:
        assert finding is None
        assert report.metrics["stability.mismatch_kl"].value < 1e-4
    if mode == "bf16":  # a real, small gap: not the fp32 copy's numerical zero
        assert report.metrics["stability.mismatch_abs_logp"].value > 1e-4


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # no trainer bound: steps only
def test_the_trl_callback_keeps_trls_sampling_statistics(tmp_path: Path) -> None:
    """TRL's GRPOTrainer logs its vLLM mismatch statistics through on_log; the callback keeps
    them as steps columns under TRL's names, where the metric reads them."""
    callback = RlscopeCallback(tmp_path / "run", algorithm="GRPO")
    args = SimpleNamespace()
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    callback.on_train_begin(args, state, SimpleNamespace())
    for step in range(1, 4):
        state.global_step = step
        callback.on_log(
            args,
            state,
            SimpleNamespace(),
            logs={"loss": 0.1, "sampling/sampling_logp_difference/mean": 0.01 * step},
        )
    callback.on_train_end(args, state, SimpleNamespace())
    steps = pl.read_parquet(tmp_path / "run" / "steps" / "*.parquet").sort("step")
    assert steps["sampling/sampling_logp_difference/mean"].to_list() == pytest.approx(
        [0.01, 0.02, 0.03]
    )
