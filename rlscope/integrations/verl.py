"""`RlscopeVerlHook`: a verl RayPPOTrainer's rollouts and tokens, from its own DataProto batches.

Usage (verl 0.9, on the driver, with verl's legacy trainer: `trainer.use_v1=False`, or your own
driver around `RayPPOTrainer`)::

    from rlscope.integrations.verl import RlscopeVerlHook

    hook = RlscopeVerlHook("runs/x", algorithm="GRPO", group_size=8)
    trainer = RayPPOTrainer(config=config, ...)
    trainer.init_workers()
    hook.bind(trainer)      # wraps three of this instance's methods
    trainer.fit()
    hook.close()            # then: rlscope analyze runs/x (steps: import verl's logs)

What it relies on, all in verl/trainer/ppo/ray_trainer.py (verl 0.9.1), `RayPPOTrainer.fit`:
`_compute_old_log_prob(batch)` returns `(DataProto, mfu)` whose batch holds `old_log_probs` and
`entropys` (B, response length); fit aggregates the entropies as `actor/entropy` (`agg_loss`
over `response_mask`), pops them and unions the rest into the step's batch. Then rollout
correction may zero `response_mask` where it rejects tokens (rollout_corr_helper.py
`compute_rollout_correction_and_add_to_batch`), `compute_advantage` adds `advantages` and
`returns`, and the same batch goes to `_update_critic(batch)` (with a critic) and to
`_update_actor(batch)` (after the critic's warm-up). `bind` wraps the three on the instance:
the first keeps the entropies and the response mask fit aggregated them over, the other two
write the step's batch once, at the first of them that runs (`trainer.global_steps`), before
the update.

Rollouts: `rollout_id`, `step`, `prompt_id` (verl's `uid`, one per prompt's group), `split`
train, `reward` (Σ `token_level_scores`: the score before any KL penalty, verl's `critic/score`),
`response_len` (Σ of the response part of `attention_mask`, as verl's `response_length`;
Σ `response_mask` without one), `advantage` (the mean of `advantages` over `response_mask`).
Tokens, where the response mask (as `_compute_old_log_prob` had it, before any rejection) is 1:
`pos`, `logprob` (`old_log_probs`: the policy of the step, before its update), `ref_logprob`
(`ref_log_prob`), `rollout_logprob` (`rollout_log_probs`, unless it is `old_log_probs` itself:
rollout correction's bypass mode substitutes it, and a mismatch of 0 would be measured on
nothing), `entropy`, `value` (`values`) and `return` (`returns`, with a critic's `values` only:
GRPO's returns are its advantages), `advantage` (`advantages`), each when the batch has it. No
`old_logprob`: the update's own ratios (PPO epochs, mini-batches) happen in the workers, so the
clip fraction is verl's logged one. With rollout-correction bypass mode verl computes no
entropies. Only the driver writes.

`bind` refuses (a RuntimeWarning, and nothing wrapped: the hook then writes nothing) a trainer
that is not verl's `RayPPOTrainer` (verl 0.9's default `trainer.use_v1=True` runs
`verl.trainer.ppo.v1`'s PPOTrainer on TransferQueue batches, which this hook does not read), a
verl outside `SUPPORTED_VERL`, or wrapped methods whose parameters are not `WRAPPED`'s.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from rlscope.integrations.trl_tokens import to_numpy
from rlscope.tablewriter import next_rollout_id
from rlscope.writer import RunWriter

#: verl versions whose RayPPOTrainer the hook wraps: [low, high). Tested on 0.9.1.
SUPPORTED_VERL = ((0, 9), (0, 10))
#: The class `bind` wraps methods of (on the instance, never on the class), and their
#: parameters after `self` (verl 0.9.1, verl/trainer/ppo/ray_trainer.py).
TRAINER_CLASS = ("verl.trainer.ppo.ray_trainer", "RayPPOTrainer")
WRAPPED = {
    "_compute_old_log_prob": ("batch",),
    "_update_critic": ("batch",),
    "_update_actor": ("batch",),
}

#: verl batch key -> tokens column.
TOKEN_KEYS = {
    "old_log_probs": "logprob",
    "ref_log_prob": "ref_logprob",
    "rollout_log_probs": "rollout_logprob",
    "values": "value",
    "returns": "return",
    "advantages": "advantage",
}


def version_support(version: str) -> str | None:
    """Why the hook does not read this verl version (None: it does)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    parsed = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    low, high = SUPPORTED_VERL
    if low <= parsed < high:
        return None
    return (
        f"verl {version} is outside the supported {low[0]}.{low[1]} <= verl < {high[0]}.{high[1]}"
    )


def verl_support(trainer: Any) -> str | None:
    """Why `bind` cannot wrap this trainer (None: it can): not verl's RayPPOTrainer, a verl
    version outside SUPPORTED_VERL, or a wrapped method whose parameters are not WRAPPED's."""
    module, name = TRAINER_CLASS
    if not any(c.__module__ == module and c.__name__ == name for c in type(trainer).__mro__):
        return (
            f"{type(trainer).__qualname__} is not verl's {name} ({module}; verl 0.9's "
            "trainer.use_v1=True runs verl.trainer.ppo.v1's PPOTrainer, which this hook does "
            "not read)"
        )
    try:
        reason = version_support(importlib.metadata.version("verl"))
    except importlib.metadata.PackageNotFoundError:
        reason = "the verl version is unknown"
    if reason:
        return reason
    for method, expected in WRAPPED.items():
        found = getattr(type(trainer), method, None)
        if not callable(found):
            return f"{type(trainer).__qualname__} has no {method}"
        params = tuple(inspect.signature(found).parameters)[1:]
        if params != expected:
            return f"{method}({', '.join(params)}) is not {method}({', '.join(expected)})"
    return None


def _array(value: Any) -> np.ndarray:
    """A tensor or array-like as numpy, its dtype kept (masks, token ids)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _nonzero(value: Any) -> np.ndarray:
    return _array(value) != 0


def batch_tables(
    tensors: Mapping[str, Any],
    non_tensors: Mapping[str, Any],
    step: int,
    first_id: int,
    entropy: Any = None,
    token_mask: Any = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The rollouts and tokens columns of one verl batch (`DataProto.batch` and
    `non_tensor_batch`, tensors or arrays); rollout ids from `first_id`. `token_mask`: the
    tokens to write (default `response_mask`)."""
    mask = _nonzero(tensors["response_mask"])
    kept = mask if token_mask is None else _nonzero(token_mask)
    n, width = mask.shape
    if "attention_mask" in tensors:  # verl metric_utils.py _compute_response_info
        lengths = _nonzero(tensors["attention_mask"])[:, -width:].sum(axis=1)
    else:
        lengths = kept.sum(axis=1)
    ids = np.arange(first_id, first_id + n, dtype=np.int64)
    rollouts: dict[str, Any] = {
        "rollout_id": ids,
        "step": np.full(n, step, dtype=np.int64),
        "split": ["train"] * n,
        "response_len": lengths.astype(np.int32),
    }
    if "uid" in non_tensors:
        rollouts["prompt_id"] = [str(u) for u in non_tensors["uid"]]
    if "token_level_scores" in tensors:  # verl's critic/score: the sum over the whole row
        rollouts["reward"] = to_numpy(tensors["token_level_scores"]).sum(axis=1)
    rows, positions = np.nonzero(kept)
    tokens: dict[str, np.ndarray] = {
        "rollout_id": ids[rows],
        "step": np.full(len(rows), step, dtype=np.int64),
        "pos": positions.astype(np.int32),
    }
    per_token = {k: to_numpy(tensors[k]) for k in TOKEN_KEYS if k in tensors}
    if "returns" in per_token and "values" not in per_token:
        del per_token["returns"]  # no critic: GRPO's and REINFORCE's returns are the advantages
    sampler, trainer = per_token.get("rollout_log_probs"), per_token.get("old_log_probs")
    if sampler is not None and trainer is not None and np.array_equal(sampler, trainer):
        del per_token["rollout_log_probs"]  # bypass mode: old_log_probs = rollout_log_probs
    if entropy is not None:
        per_token["entropy"] = to_numpy(entropy)
    for key, value in per_token.items():
        tokens[TOKEN_KEYS.get(key, key)] = value[rows, positions]
    if "advantages" in per_token:
        counts = mask.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            rollouts["advantage"] = (per_token["advantages"] * mask).sum(axis=1) / counts
    return rollouts, tokens


class RlscopeVerlHook:
    """Writes each RayPPOTrainer step's batch as rollouts and tokens (see the module's doc).
    `run_meta` goes to RunWriter (`algorithm`, `group_size`, `correct_threshold`, ...)."""

    def __init__(self, run_dir: str | os.PathLike[str], **run_meta: Any) -> None:
        self.writer = RunWriter(run_dir, **run_meta)
        self.trainer: Any = None
        self._next_id = next_rollout_id(self.writer.run_dir)
        #: From the step's `_compute_old_log_prob`: (entropys, response_mask, responses).
        self._old: tuple[Any, Any, Any] | None = None
        self._last: Any = None  # the batch last written: a weak reference, else (step, id)
        self._warned: set[str] = set()

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"RlscopeVerlHook: {message}", RuntimeWarning, 3)

    def bind(self, trainer: Any) -> RlscopeVerlHook:
        """Wrap this trainer's `_compute_old_log_prob`, `_update_critic` and `_update_actor`.
        Refuses (a RuntimeWarning, nothing wrapped) what `verl_support` gives a reason for.
        Returns self."""
        reason = verl_support(trainer)
        if reason is not None:
            self._warn("bind", f"{reason}; nothing is wrapped and nothing will be written")
            return self
        self.trainer = trainer
        old_log_prob = trainer._compute_old_log_prob
        update_critic, update_actor = trainer._update_critic, trainer._update_actor

        def compute_old_log_prob(batch: Any, *args: Any, **kwargs: Any) -> Any:
            result = old_log_prob(batch, *args, **kwargs)
            output = result[0] if isinstance(result, tuple) else result
            # A TensorDict refuses `in` and iterates over its batch dimension: keys() it is.
            keys, inputs = output.batch.keys(), batch.batch.keys()
            self._old = (
                output.batch["entropys"] if "entropys" in keys else None,
                batch.batch["response_mask"] if "response_mask" in inputs else None,
                batch.batch["responses"] if "responses" in inputs else None,
            )
            return result

        def write_once(batch: Any) -> None:
            step = int(getattr(trainer, "global_steps", 0) or 0)
            if self._last == (step, id(batch)) or (
                isinstance(self._last, weakref.ref) and self._last() is batch
            ):
                return  # _update_critic wrote it; _update_actor gets the same batch
            try:
                self._last = weakref.ref(batch)
            except TypeError:  # no weak references: the batch is alive for the step
                self._last = (step, id(batch))
            self.log_batch(batch, step)

        def critic(batch: Any, *args: Any, **kwargs: Any) -> Any:
            write_once(batch)
            return update_critic(batch, *args, **kwargs)

        def actor(batch: Any, *args: Any, **kwargs: Any) -> Any:
            write_once(batch)
            return update_actor(batch, *args, **kwargs)

        trainer._compute_old_log_prob = compute_old_log_prob
        trainer._update_critic = critic
        trainer._update_actor = actor
        return self

    def log_batch(self, batch: Any, step: int) -> None:
        """One step's DataProto as rollouts and tokens. Never raises for the run's sake."""
        (entropy, old_mask, old_responses), self._old = self._old or (None, None, None), None
        try:
            tensors = {k: batch.batch[k] for k in batch.batch.keys()}  # noqa: SIM118 (TensorDict)
            mask = _array(tensors["response_mask"])
            # The old-log-prob pass's rows are this batch's when its responses are (fit reorders
            # nothing in between, but pf_ppo resamples rows in compute_advantage).
            same_rows = old_mask is not None and _array(old_mask).shape == mask.shape
            if same_rows and old_responses is not None and "responses" in tensors:
                same_rows = np.array_equal(_array(old_responses), _array(tensors["responses"]))
            if not same_rows:
                if entropy is not None:
                    self._warn(
                        "rows",
                        "the batch's rows changed after the old log-probs: no entropy written",
                    )
                entropy, old_mask = None, None
            elif entropy is not None and tuple(entropy.shape) != mask.shape:
                entropy = None
            rollouts, tokens = batch_tables(
                tensors, dict(batch.non_tensor_batch), step, self._next_id, entropy, old_mask
            )
        except Exception as exc:  # verl's batch layout is not ours to promise
            self._warn("read", f"cannot read the batch ({exc!r})")
            return
        self._next_id += len(rollouts["rollout_id"])
        self.writer.log_rollouts(rollouts)
        self.writer.log_tokens(tokens)

    def close(self) -> None:
        self.writer.close()
