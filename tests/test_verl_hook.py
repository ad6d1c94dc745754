"""RlscopeVerlHook: a verl batch's rollouts and tokens on numpy stand-ins for DataProto (fast), and
on verl 0.9.1's own DataProto, RayPPOTrainer and core_algos in the trainer venv (slow)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
import pytest
from conftest import run_cli, run_trainer

import rlscope.integrations.verl as verl_hook
from rlscope.analysis import analyze
from rlscope.integrations.verl import (
    WRAPPED,
    RlscopeVerlHook,
    batch_tables,
    verl_support,
    version_support,
)

B, T, G = 8, 5, 4


def _batch(rng: np.random.Generator, step: int) -> SimpleNamespace:
    """What RayPPOTrainer.fit hands `_update_actor`: DataProto's `batch` (a TensorDict: here a
    dict of arrays) and `non_tensor_batch`."""
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    scores = np.zeros((B, T), np.float32)
    reward = rng.integers(0, 2, size=B).astype(np.float32)
    scores[np.arange(B), lengths - 1] = reward
    grouped = reward.reshape(-1, G)
    advantage = (
        (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1) + 1e-6)[:, None]
    ).ravel()
    old = -rng.random((B, T)).astype(np.float32) * mask
    tensors = {
        "responses": rng.integers(0, 50, size=(B, T)),
        "response_mask": mask,
        "token_level_scores": scores,
        "old_log_probs": old,
        "ref_log_prob": old - 0.1,
        "advantages": (advantage[:, None] * mask).astype(np.float32),
    }
    uid = np.array([f"{step}-{i // G}" for i in range(B)], dtype=object)
    return SimpleNamespace(batch=tensors, non_tensor_batch={"uid": uid})


def test_batch_tables_maps_each_masked_token() -> None:
    batch = _batch(np.random.default_rng(0), 3)
    entropy = np.full((B, T), 0.7, np.float32)
    rollouts, tokens = batch_tables(batch.batch, batch.non_tensor_batch, 3, 100, entropy)
    mask = batch.batch["response_mask"]
    assert rollouts["rollout_id"].tolist() == list(range(100, 100 + B))
    assert rollouts["response_len"].tolist() == mask.sum(1).tolist()
    assert rollouts["reward"].tolist() == batch.batch["token_level_scores"].sum(1).tolist()
    assert rollouts["prompt_id"][:G] == ["3-0"] * G
    assert len(tokens["pos"]) == mask.sum() and (tokens["step"] == 3).all()
    first = tokens["rollout_id"] == 100
    assert tokens["pos"][first].tolist() == list(range(int(mask[0].sum())))
    assert tokens["logprob"][first] == pytest.approx(
        batch.batch["old_log_probs"][0, : mask[0].sum()]
    )
    assert "old_logprob" not in tokens  # the update's ratios are the workers'
    assert set(tokens) >= {"ref_logprob", "advantage", "entropy"}


class StandIn:
    """RayPPOTrainer's three wrapped methods, as fit() calls them, on numpy batches."""

    def __init__(self, rng: np.random.Generator, expected: dict[int, float]) -> None:
        self.rng, self.expected, self.global_steps = rng, expected, 0
        self.updates: list[str] = []

    def _compute_old_log_prob(self, batch: Any) -> tuple[Any, float]:
        entropy = (0.5 + self.rng.random((B, T))).astype(np.float32)
        mask = batch.batch["response_mask"]
        self.expected[self.global_steps] = float((entropy * mask).sum() / mask.sum())
        return SimpleNamespace(batch={"entropys": entropy}), 0.0

    def _update_critic(self, batch: Any) -> Any:
        self.updates.append("critic")
        return batch

    def _update_actor(self, batch: Any) -> Any:
        self.updates.append("actor")
        return batch


@pytest.fixture
def accept_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """bind refuses anything but verl's RayPPOTrainer: here numpy stand-ins stand in for it."""
    monkeypatch.setattr(verl_hook, "verl_support", lambda _: None)


def test_the_hook_writes_what_fit_hands_the_actor(tmp_path: Path, accept_stand_ins: None) -> None:
    """fit()'s order: `_compute_old_log_prob` (entropies kept, then popped by fit), then
    `_update_actor(batch)` at `global_steps`: rollouts and tokens per step, the token entropy
    what verl aggregates as actor/entropy (token-mean)."""
    rng = np.random.default_rng(1)
    expected: dict[int, float] = {}
    trainer = StandIn(rng, expected)
    hook = RlscopeVerlHook(tmp_path / "run", algorithm="GRPO", group_size=G).bind(trainer)
    for step in range(1, 5):
        trainer.global_steps = step
        batch = _batch(rng, step)
        trainer._compute_old_log_prob(batch)
        trainer._update_actor(batch)
    hook.close()
    rollouts = pl.read_parquet(tmp_path / "run" / "rollouts" / "*.parquet")
    assert rollouts["rollout_id"].n_unique() == 4 * B
    report = analyze(tmp_path / "run", metrics=("behavior.entropy", "stability.kl"))
    entropy = report.metrics["behavior.entropy"]
    assert entropy.source == "tokens.entropy"
    assert list(entropy.values) == pytest.approx([expected[s] for s in entropy.steps], abs=1e-6)
    kl = report.metrics["stability.kl"]
    assert list(kl.values) == pytest.approx([np.exp(-0.1) + 0.1 - 1] * 4, rel=1e-4)


def test_verl_s_own_lengths_scores_and_masks(tmp_path: Path) -> None:
    """A multi-turn row (tool tokens: attention 1, response_mask 0) and a row rollout
    correction rejected after the old log-probs: response_len is verl's response_length (the
    response part of attention_mask), reward verl's critic/score (every score), tokens the
    mask the entropies were aggregated over, the rollout advantage over the trained mask."""
    width = 6
    attention = np.ones((2, 3 + width), np.int64)  # 3 prompt tokens
    attention[1, 3 + 4 :] = 0  # row 1: 4 response tokens
    response_mask = np.array([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]])  # row 0: 2 tool tokens
    trained = response_mask.copy()
    trained[1] = 0  # rejected by rollout correction
    scores = np.zeros((2, width), np.float32)
    scores[0, 5], scores[1, 3] = 1.0, 0.5
    advantages = np.array([[0.5] * width, [0.0] * width], np.float32) * trained
    old = -np.arange(12, dtype=np.float32).reshape(2, width) / 10
    tensors = {
        "attention_mask": attention,
        "responses": np.arange(12).reshape(2, width),
        "response_mask": trained,
        "token_level_scores": scores,
        "advantages": advantages,
        "returns": advantages,  # GRPO's: dropped (no values)
        "old_log_probs": old,
        "rollout_log_probs": old.copy(),  # bypass mode's substitution: dropped
    }
    rollouts, tokens = batch_tables(tensors, {}, 1, 0, token_mask=response_mask)
    assert rollouts["response_len"].tolist() == [6, 4]
    assert rollouts["reward"].tolist() == [1.0, 0.5]
    assert rollouts["advantage"][0] == 0.5 and np.isnan(rollouts["advantage"][1])
    assert tokens["rollout_id"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert tokens["pos"].tolist() == [0, 1, 4, 5, 0, 1, 2, 3]
    assert "return" not in tokens and "rollout_logprob" not in tokens
    tensors["values"] = np.zeros((2, width), np.float32)
    tensors["rollout_log_probs"] = old - 0.01
    _, tokens = batch_tables(tensors, {}, 1, 0)
    assert tokens["return"].tolist() == [0.5] * 4 and len(tokens["rollout_logprob"]) == 4


def test_supported_versions_and_trainers() -> None:
    assert version_support("0.9.1") is None and version_support("0.9.0rc1") is None
    for outside in ("0.8.5", "0.10.0", "1.0"):
        assert f"verl {outside} is outside the supported 0.9 <= verl < 0.10" == (
            version_support(outside)
        )
    assert "is not verl's RayPPOTrainer" in str(verl_support(StandIn(np.random.default_rng(), {})))


def test_bind_refuses_a_trainer_it_does_not_know(tmp_path: Path) -> None:
    trainer = StandIn(np.random.default_rng(0), {})
    hook = RlscopeVerlHook(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match="not verl's RayPPOTrainer.*nothing is wrapped"):
        hook.bind(trainer)
    assert "_update_actor" not in vars(trainer) and hook.trainer is None
    hook.close()
    assert not (tmp_path / "run" / "rollouts").exists()


def test_critic_warmup_steps_are_written_once(tmp_path: Path, accept_stand_ins: None) -> None:
    """With a critic, fit() hands the batch to `_update_critic`, then (after the warm-up) the
    same batch to `_update_actor`: each step written once, warm-up steps too."""
    rng = np.random.default_rng(2)
    trainer = StandIn(rng, {})
    hook = RlscopeVerlHook(tmp_path / "run").bind(trainer)
    for step in (1, 2, 3):
        trainer.global_steps = step
        batch = _batch(rng, step)
        trainer._compute_old_log_prob(batch)
        trainer._update_critic(batch)
        if step > 1:  # critic_warmup = 1
            trainer._update_actor(batch)
    hook.close()
    assert trainer.updates == ["critic", "critic", "actor", "critic", "actor"]
    rollouts = pl.read_parquet(tmp_path / "run" / "rollouts" / "*.parquet")
    assert rollouts.group_by("step").len().sort("step")["len"].to_list() == [B, B, B]
    tokens = pl.read_parquet(tmp_path / "run" / "tokens" / "*.parquet")
    assert tokens["entropy"].null_count() == 0


def test_rows_changed_after_the_old_log_probs_drop_the_entropy(
    tmp_path: Path, accept_stand_ins: None
) -> None:
    rng = np.random.default_rng(3)
    trainer = StandIn(rng, {})
    hook = RlscopeVerlHook(tmp_path / "run").bind(trainer)
    trainer.global_steps = 1
    batch = _batch(rng, 1)
    trainer._compute_old_log_prob(batch)
    order = np.arange(B)[::-1]  # pf_ppo resamples rows in compute_advantage
    resampled = SimpleNamespace(
        batch={k: v[order] for k, v in batch.batch.items()},
        non_tensor_batch={k: v[order] for k, v in batch.non_tensor_batch.items()},
    )
    with pytest.warns(RuntimeWarning, match="rows changed"):
        trainer._update_actor(resampled)
    hook.close()
    tokens = pl.read_parquet(tmp_path / "run" / "tokens" / "*.parquet")
    assert "entropy" not in tokens.columns and len(tokens) == batch.batch["response_mask"].sum()


def test_a_batch_it_cannot_read_warns_and_training_goes_on(tmp_path: Path) -> None:
    hook = RlscopeVerlHook(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match="cannot read the batch"):
        hook.log_batch(SimpleNamespace(batch={}, non_tensor_batch={}), 1)
    hook.close()


# --- verl 0.9.1's own RayPPOTrainer, DataProto and core_algos, in the trainer venv (slow) -------

#: rlscope metric -> what tests/trainers/verl_hook_steps.py computes of the same tensors with
#: verl's own functions: `agg_loss` token-mean of the entropies (fit's actor/entropy), of
#: `kl_penalty(old_log_probs, ref_log_prob, "low_var_kl")`, rollout correction's k3_kl, and
#: `compute_data_metrics`' response length, score and explained variance.
VERL_METRICS = {
    "behavior.entropy": "actor/entropy",
    "stability.kl": "k3",
    "stability.mismatch_kl": "rollout_corr/k3_kl",
    "behavior.response_len": "response_length/mean",
    "signal.reward": "critic/score/mean",
    "stability.advantage_extreme": "advantage_extreme",
    "stability.explained_variance": "critic/vf_explained_var",
}
#: Per mode, the metrics verl's batch carries (the others must not come from tokens).
VERL_MODES = {
    "grpo": set(VERL_METRICS) - {"stability.explained_variance"},
    "grpo-rs": set(VERL_METRICS) - {"stability.explained_variance"},
    "grpo-bypass": set(VERL_METRICS)
    - {"behavior.entropy", "stability.mismatch_kl", "stability.explained_variance"},
    "ppo": set(VERL_METRICS) - {"stability.mismatch_kl"},
}
STEPS = 4


def _verl(tmp_path: Path, mode: str) -> dict[str, Any]:
    done = run_trainer("verl_hook_steps.py", tmp_path, mode, str(STEPS), timeout=600)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_the_real_trainer_has_the_wrapped_signatures_and_bind_refuses_the_rest(
    tmp_path: Path,
) -> None:
    """inspect.signature of verl 0.9.1's RayPPOTrainer methods is what WRAPPED says; bind
    accepts the real class and refuses, wrapping nothing and writing nothing, a plain object,
    a RayPPOTrainer subclass whose `_update_actor` takes more, and the installed verl once
    SUPPORTED_VERL excludes it."""
    result = _verl(tmp_path, "bind")
    assert result["version"] == "0.9.1"
    assert result["signatures"] == {name: list(params) for name, params in WRAPPED.items()}
    assert result["accepted"] is None
    nothing = "untouched=True wrote=False RlscopeVerlHook: "
    assert result["not_ray_trainer"].startswith(nothing + "Plain is not verl's RayPPOTrainer")
    assert result["changed_signature"].startswith(
        nothing + "_update_actor(batch, metrics) is not _update_actor(batch)"
    )
    assert result["outside_range"].startswith(
        nothing + "verl 0.9.1 is outside the supported 0.10 <= verl < 0.11"
    )
    assert all(
        r.endswith("nothing is wrapped and nothing will be written")
        for k, r in result.items()
        if k in ("not_ray_trainer", "changed_signature", "outside_range")
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(VERL_MODES))
def test_token_metrics_equal_verls_own_on_its_dataproto(tmp_path: Path, mode: str) -> None:
    """fit()'s steps on verl's real DataProto and RayPPOTrainer methods (worker groups and
    rollout on CPU: see tests/trainers/verl_hook_steps.py), the hook bound: `rlscope analyze`
    on what it wrote gives, at every step, what verl's own functions compute of the same
    tensors, to 1e-6. grpo-rs: rollout correction rejected tokens after the entropies were
    aggregated (the entropy is still fit's actor/entropy); ppo: step 1 is the critic's warm-up
    (written at `_update_critic`); grpo-bypass: no entropies and no mismatch to measure."""
    result = _verl(tmp_path, mode)
    assert result["same_outputs"]  # the wrapped _compute_old_log_prob returns verl's own
    assert result["wrapped"] == sorted(WRAPPED)
    assert (result["rejected_tokens"] > 0) == (mode == "grpo-rs")
    expected = {int(step): values for step, values in result["expected"].items()}
    assert sorted(expected) == list(range(1, STEPS + 1))
    out = run_cli(
        "analyze", str(tmp_path / "run"), "--format", "json", "--fail-on", "never",
        "--metrics", ",".join(VERL_METRICS),
    )  # fmt: skip
    metrics = json.loads(out.stdout)["metrics"]
    worst: dict[str, float] = {}
    for metric, key in VERL_METRICS.items():
        if metric not in VERL_MODES[mode]:
            assert metric not in metrics or not metrics[metric]["source"].startswith(
                ("tokens", "tokens.entropy")
            ), (metric, metrics[metric]["source"])
            continue
        series = metrics[metric]["series"]
        got = dict(zip(series["step"], series["value"], strict=True))
        want = {step: values[key] for step, values in expected.items()}
        assert sorted(got) == sorted(want), metric
        for step, value in want.items():
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (metric, step)
            worst[metric] = max(worst.get(metric, 0.0), abs(got[step] - value))
    print(f"{mode}: max |rlscope - verl|", {k: f"{v:.1e}" for k, v in worst.items()})
    rollouts = pl.read_parquet(tmp_path / "run" / "rollouts" / "*.parquet")
    assert rollouts.group_by("step").len()["len"].to_list() == [16] * STEPS
    tokens = pl.read_parquet(tmp_path / "run" / "tokens" / "*.parquet")
    assert ("rollout_logprob" in tokens.columns) == (mode in ("grpo", "grpo-rs"))
    assert ("value" in tokens.columns) == ("return" in tokens.columns) == (mode == "ppo")
