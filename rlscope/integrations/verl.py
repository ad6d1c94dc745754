"""`RlscopeVerlHook`: a verl RayPPOTrainer's rollouts and tokens, from its own DataProto batches.

Usage (verl 0.9.1, on the driver)::

    from rlscope.integrations.verl import RlscopeVerlHook

    hook = RlscopeVerlHook("runs/x", algorithm="GRPO", group_size=8)
    trainer = RayPPOTrainer(config=config, ...)
    trainer.init_workers()
    hook.bind(trainer)      # wraps two of this instance's methods
    trainer.fit()
    hook.close()            # then: rlscope analyze runs/x (steps: import verl's logs)

`bind` wraps, on the trainer instance (verl/trainer/ppo/ray_trainer.py, RayPPOTrainer.fit):
`_compute_old_log_prob`, to keep the per-token entropies verl computes with the old log-probs
(it logs their aggregate as `actor/entropy`, then pops them before `batch.union`), and
`_update_actor`, whose batch holds every per-token tensor of the step before the update. Per
step (`trainer.global_steps`), rollouts: `rollout_id`, `step`, `prompt_id` (verl's `uid`, one per
prompt's group), `split` train, `reward` (Σ `token_level_scores`: the score before any KL
penalty, verl's `critic/score`), `response_len` (Σ `response_mask`), `advantage` (its mean over
the response); tokens, where the response mask is 1: `pos`, `logprob` (`old_log_probs`: the
policy of the step, before its update), `ref_logprob` (`ref_log_prob`), `rollout_logprob`
(`rollout_log_probs`), `entropy`, `value` (`values`), `return` (`returns`), `advantage`
(`advantages`), each when the batch has it. No `old_logprob`: the update's own ratios (PPO
epochs, mini-batches) happen in the workers, so the clip fraction is verl's logged one. With
rollout-correction bypass mode verl computes no entropies. Only the driver writes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlscope.integrations.trl_tokens import to_numpy
from rlscope.tablewriter import next_rollout_id
from rlscope.writer import RunWriter

#: verl batch key -> tokens column.
TOKEN_KEYS = {
    "old_log_probs": "logprob",
    "ref_log_prob": "ref_logprob",
    "rollout_log_probs": "rollout_logprob",
    "values": "value",
    "returns": "return",
    "advantages": "advantage",
}


def batch_tables(
    tensors: Mapping[str, Any],
    non_tensors: Mapping[str, Any],
    step: int,
    first_id: int,
    entropy: Any = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The rollouts and tokens columns of one verl batch (`DataProto.batch` and
    `non_tensor_batch`, tensors or arrays); rollout ids from `first_id`."""
    mask = to_numpy(tensors["response_mask"]) > 0
    n = mask.shape[0]
    lengths = mask.sum(axis=1)
    ids = np.arange(first_id, first_id + n, dtype=np.int64)
    rollouts: dict[str, Any] = {
        "rollout_id": ids,
        "step": np.full(n, step, dtype=np.int64),
        "split": ["train"] * n,
        "response_len": lengths.astype(np.int32),
    }
    if "uid" in non_tensors:
        rollouts["prompt_id"] = [str(u) for u in non_tensors["uid"]]
    if "token_level_scores" in tensors:
        rollouts["reward"] = (to_numpy(tensors["token_level_scores"]) * mask).sum(axis=1)
    rows, positions = np.nonzero(mask)
    tokens: dict[str, np.ndarray] = {
        "rollout_id": ids[rows],
        "step": np.full(len(rows), step, dtype=np.int64),
        "pos": positions.astype(np.int32),
    }
    per_token = {k: tensors[k] for k in TOKEN_KEYS if k in tensors}
    if entropy is not None:
        per_token["entropy"] = entropy
    for key, value in per_token.items():
        tokens[TOKEN_KEYS.get(key, key)] = to_numpy(value)[rows, positions]
    if "advantages" in per_token:
        advantages = to_numpy(per_token["advantages"])
        with np.errstate(invalid="ignore", divide="ignore"):
            rollouts["advantage"] = (advantages * mask).sum(axis=1) / lengths
    return rollouts, tokens


class RlscopeVerlHook:
    """Writes each RayPPOTrainer step's batch as rollouts and tokens (see the module's doc).
    `run_meta` goes to RunWriter (`algorithm`, `group_size`, `correct_threshold`, ...)."""

    def __init__(self, run_dir: str | os.PathLike[str], **run_meta: Any) -> None:
        self.writer = RunWriter(run_dir, **run_meta)
        self.trainer: Any = None
        self._next_id = next_rollout_id(self.writer.run_dir)
        self._entropy: Any = None
        self._warned = False

    def bind(self, trainer: Any) -> RlscopeVerlHook:
        """Wrap this trainer's `_compute_old_log_prob` and `_update_actor`. Returns self."""
        self.trainer = trainer
        old_log_prob, update_actor = trainer._compute_old_log_prob, trainer._update_actor

        def compute_old_log_prob(batch: Any, *args: Any, **kwargs: Any) -> Any:
            result = old_log_prob(batch, *args, **kwargs)
            output = result[0] if isinstance(result, tuple) else result
            # A TensorDict refuses `in` and iterates over its batch dimension: keys() it is.
            keys = output.batch.keys()
            self._entropy = output.batch["entropys"] if "entropys" in keys else None
            return result

        def update(batch: Any, *args: Any, **kwargs: Any) -> Any:
            self.log_batch(batch, int(getattr(trainer, "global_steps", 0) or 0))
            return update_actor(batch, *args, **kwargs)

        trainer._compute_old_log_prob = compute_old_log_prob
        trainer._update_actor = update
        return self

    def log_batch(self, batch: Any, step: int) -> None:
        """One step's DataProto as rollouts and tokens. Never raises for the run's sake."""
        entropy, self._entropy = self._entropy, None
        try:
            tensors = {k: batch.batch[k] for k in batch.batch.keys()}  # noqa: SIM118 (TensorDict)
            if (
                entropy is not None
                and to_numpy(entropy).shape != to_numpy(tensors["response_mask"]).shape
            ):
                entropy = None
            rollouts, tokens = batch_tables(
                tensors, dict(batch.non_tensor_batch), step, self._next_id, entropy
            )
        except Exception as exc:  # verl's batch layout is not ours to promise
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"RlscopeVerlHook: cannot read the batch ({exc!r})", RuntimeWarning, 2
                )
            return
        self._next_id += len(rollouts["rollout_id"])
        self.writer.log_rollouts(rollouts)
        self.writer.log_tokens(tokens)

    def close(self) -> None:
        self.writer.close()
