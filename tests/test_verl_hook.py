"""RlscopeVerlHook: a verl batch's rollouts and tokens, on numpy stand-ins for DataProto (checked
by hand against verl 0.9.1's own DataProto: see the module's doc)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import polars as pl
import pytest

from rlscope.analysis import analyze
from rlscope.integrations.verl import RlscopeVerlHook, batch_tables

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


def test_the_hook_writes_what_fit_hands_the_actor(tmp_path: Path) -> None:
    """fit()'s order: `_compute_old_log_prob` (entropies kept, then popped by fit), then
    `_update_actor(batch)` at `global_steps`: rollouts and tokens per step, the token entropy
    what verl aggregates as actor/entropy (token-mean)."""
    rng = np.random.default_rng(1)
    expected: dict[int, float] = {}

    class Trainer:
        global_steps = 0

        def _compute_old_log_prob(self, batch: Any) -> tuple[Any, float]:
            entropy = (0.5 + rng.random((B, T))).astype(np.float32)
            mask = batch.batch["response_mask"]
            expected[self.global_steps] = float((entropy * mask).sum() / mask.sum())
            return SimpleNamespace(batch={"entropys": entropy}), 0.0

        def _update_actor(self, batch: Any) -> Any:
            return batch

    trainer = Trainer()
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


def test_a_batch_it_cannot_read_warns_and_training_goes_on(tmp_path: Path) -> None:
    hook = RlscopeVerlHook(tmp_path / "run")
    with pytest.warns(RuntimeWarning, match="cannot read the batch"):
        hook.log_batch(SimpleNamespace(batch={}, non_tensor_batch={}), 1)
    hook.close()
