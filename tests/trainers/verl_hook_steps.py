"""RlscopeVerlHook on verl 0.9.1's own RayPPOTrainer, DataProto and core_algos (CPU, no Ray).

There is no GPU and no Ray cluster here, so the trainer is the real `RayPPOTrainer` class made
with `object.__new__` (its `__init__` builds Ray resource pools), given the attributes its
methods read (`config`, `global_steps`, `ref_in_actor`, the worker groups), and `fit()`'s body is
driven step by step in fit's own order (verl/trainer/ppo/ray_trainer.py, RayPPOTrainer.fit):
the real `_compute_old_log_prob`, `_compute_ref_log_prob`, `_compute_values`, `_update_critic`
and `_update_actor` run (DataProto to TensorDict, verl's no-padding conversions both ways,
`tu.assign_non_tensor`), as do `compute_response_mask`, `agg_loss` for `actor/entropy`,
`calculate_debug_metrics`, `compute_rollout_correction_and_add_to_batch`, `apply_kl_penalty`,
`compute_advantage` (GRPO: `compute_grpo_outcome_advantage`; GAE:
`compute_gae_advantage_return`) and `compute_data_metrics`. What stands in are the worker
groups (the GPU processes): `Workers` answers `compute_log_prob`, `compute_ref_log_prob`,
`infer_batch`, `update_actor` and `train_mini_batch` on verl's no-padding TensorDicts with a
bigram policy, a frozen reference, a perturbed sampler and a per-token value head, and updates
them with verl's own `get_policy_loss_fn("vanilla")`, `kl_penalty` and `agg_loss`; and the
rollout (vLLM): a batch sampled from the sampler, left-padded prompts and right-padded
responses as the agent loop returns them, with `rollout_log_probs`.

MODE:
  grpo      GRPO, groups of N, rollout_log_probs (the mismatch), a reference.
  grpo-rs   as grpo, with rollout correction's token-level rejection sampling (token_k3), which
            zeroes response_mask where it rejects, after the entropies were aggregated.
  grpo-bypass  as grpo, with rollout correction's bypass mode (apply_bypass_mode): the old
            log-probs are the sampler's, `_compute_old_log_prob` is not called, no entropies.
  ppo       GAE with a critic (critic_warmup 1: step 1 updates the critic only), the KL penalty
            in the reward (apply_kl_penalty, k1, β 0.05), no rollout_log_probs.
  bind      no run: the real methods' signatures, and bind's refusals.

Writes OUT/run (the hook's run) and prints one JSON line: per step, what verl computes of the
same tensors with its own functions (`expected`), and the wrapped methods' outputs compared with
the unwrapped ones.

Usage: python verl_hook_steps.py OUT MODE [STEPS]
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's rlscope

import numpy as np
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import AdvantageEstimator, agg_loss, kl_penalty
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import (
    RayPPOTrainer,
    apply_kl_penalty,
    compute_advantage,
    compute_response_mask,
)
from verl.trainer.ppo.rollout_corr_helper import (
    apply_bypass_mode,
    compute_rollout_correction_and_add_to_batch,
)
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.utils.debug.metrics import calculate_debug_metrics
from verl.workers.utils.padding import no_padding_2_padding

import rlscope.integrations.verl as verl_hook
from rlscope.integrations.verl import RlscopeVerlHook

VOCAB, PROMPTS, N, PROMPT_LEN, RESPONSE_LEN = 12, 4, 4, 4, 7
EOS, TARGET = 1, 5  # a response ends at EOS; the score is 1 when it holds TARGET
GAMMA, LAM, KL_COEF = 1.0, 0.95, 0.05


def nested_apply(fn: Any, nested: torch.Tensor) -> torch.Tensor:
    """`fn` over each sequence of a jagged nested tensor, as a jagged nested tensor."""
    offsets = nested.offsets()
    values = nested.values()
    parts = [fn(values[a:b]) for a, b in itertools.pairwise(offsets.tolist())]
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets=offsets)


def next_token_stats(logits_table: torch.Tensor, ids: torch.Tensor) -> tuple[Any, Any]:
    """Per position t of one sequence: log p(ids[t+1] | ids[t]) and the entropy at t (0 at the
    last position), under a bigram table of logits: what an LM's forward gives verl, shifted
    as verl's no_padding_2_padding expects (position t predicts token t+1)."""
    logp = torch.log_softmax(logits_table[ids], dim=-1)
    nxt = torch.cat([ids[1:], ids[:1]])
    lp = logp.gather(-1, nxt[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    last = torch.zeros_like(lp)
    last[-1] = 1
    return lp * (1 - last), ent * (1 - last)


class Workers:
    """The worker groups verl's RayPPOTrainer calls (the GPU side), on CPU: their methods
    take and return verl's TensorDicts as the FSDP workers do."""

    def __init__(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.policy = torch.randn(VOCAB, VOCAB, generator=gen).requires_grad_()
        self.reference = self.policy.detach().clone()
        self.value_head = torch.zeros(VOCAB, requires_grad=True)
        self.sampler_noise = 0.05 * torch.randn(VOCAB, VOCAB, generator=gen)
        self.actor_config = OmegaConf.create(
            {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": None,
             "clip_ratio_c": 3.0, "global_batch_info": {}}
        )  # fmt: skip
        self.received: list[tuple[str, tuple[str, ...]]] = []

    def _log_probs(self, table: torch.Tensor, td: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids = td["input_ids"]
        lp = nested_apply(lambda x: next_token_stats(table, x)[0], ids)
        ent = nested_apply(lambda x: next_token_stats(table, x)[1], ids)
        return lp, ent

    def _record(self, name: str, td: Any) -> None:
        self.received.append((name, tuple(sorted(td.keys()))))

    def compute_log_prob(self, td: Any) -> Any:  # actor_rollout_wg
        self._record("compute_log_prob", td)
        with torch.no_grad():
            lp, ent = self._log_probs(self.policy, td)
        return tu.get_tensordict({"log_probs": lp, "entropy": ent}, {"metrics": {"mfu": 0.0}})

    def compute_ref_log_prob(self, td: Any) -> Any:  # ref_policy_wg
        self._record("compute_ref_log_prob", td)
        lp, _ = self._log_probs(self.reference, td)
        return tu.get_tensordict({"log_probs": lp})

    def infer_batch(self, td: Any) -> Any:  # critic_wg
        self._record("infer_batch", td)
        with torch.no_grad():
            values = nested_apply(lambda x: self.value_head[x], td["input_ids"])
        return Done(tu.get_tensordict({"values": values}))

    def train_mini_batch(self, td: Any) -> Any:  # critic_wg
        self._record("train_mini_batch", td)
        values = nested_apply(lambda x: self.value_head[x], td["input_ids"])
        values = no_padding_2_padding(values, td)
        loss = agg_loss((values - td["returns"]) ** 2, td["response_mask"], "token-mean")
        loss.backward()
        with torch.no_grad():
            self.value_head -= 0.5 * self.value_head.grad
            self.value_head.grad = None
        return Done(tu.get_tensordict({}, {"metrics": {"mfu": 0.0, "vf_loss": loss.item()}}))

    def update_actor(self, td: Any) -> Any:  # actor_rollout_wg: one epoch, one mini-batch
        self._record("update_actor", td)
        lp = nested_apply(lambda x: next_token_stats(self.policy, x)[0], td["input_ids"])
        log_prob = no_padding_2_padding(lp, td)
        mask = td["response_mask"]
        policy_loss = core_algos.get_policy_loss_fn("vanilla")
        pg_loss, pg_metrics = policy_loss(
            old_log_prob=td["old_log_probs"],
            log_prob=log_prob,
            advantages=td["advantages"],
            response_mask=mask,
            loss_agg_mode="token-mean",
            config=self.actor_config,
        )
        kl = agg_loss(kl_penalty(log_prob, td["ref_log_prob"], "low_var_kl"), mask, "token-mean")
        (pg_loss + 0.01 * kl).backward()
        with torch.no_grad():
            self.policy -= 2.0 * self.policy.grad
            self.policy.grad = None
        metrics = {"mfu": 0.0, "pg_loss": pg_loss.item(), "kl_loss": kl.item(), **pg_metrics}
        return tu.get_tensordict({}, {"metrics": {k.split("/")[-1]: v for k, v in metrics.items()}})


class Done:
    """What `critic_wg.infer_batch(...)` and `.train_mini_batch(...)` return: `.get()` it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


def make_trainer(mode: str, seed: int) -> tuple[RayPPOTrainer, Workers]:
    """The real RayPPOTrainer class, its __init__ skipped (it builds Ray resource pools), with
    what its wrapped and called methods read."""
    trainer = object.__new__(RayPPOTrainer)
    workers = Workers(seed)
    trainer.config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "actor": {
                    "calculate_entropy": False, "entropy_coeff": 0.0,
                    "ppo_mini_batch_size": PROMPTS, "ppo_epochs": 1, "data_loader_seed": 0,
                    "shuffle": False,
                    "loss_agg_mode": "token-mean", "loss_scale_factor": None,
                },
                "rollout": {"n": N, "temperature": 1.0, "multi_turn": {"enable": False}},
            },
            "critic": {"ppo_mini_batch_size": PROMPTS, "ppo_epochs": 1, "data_loader_seed": 0,
                       "shuffle": False},
        }
    )  # fmt: skip
    trainer.global_steps = 0
    trainer.ref_in_actor = False
    trainer.actor_rollout_wg = trainer.ref_policy_wg = trainer.critic_wg = workers
    trainer.use_reference_policy = True
    trainer.use_critic = mode == "ppo"
    return trainer, workers


def rollout(workers: Workers, step: int, rng: np.random.Generator) -> DataProto:
    """A step's generation as fit() has it after `batch.union(gen_batch_output)`: PROMPTS
    prompts (left-padded) repeated N times (interleaved, one uid each), responses sampled from
    the sampler (right-padded after EOS), full input_ids / attention_mask / position_ids, and
    the sampler's `rollout_log_probs`."""
    sampler = (workers.policy.detach() + workers.sampler_noise).double()
    rows = PROMPTS * N
    prompts = torch.zeros(rows, PROMPT_LEN, dtype=torch.long)
    responses = torch.zeros(rows, RESPONSE_LEN, dtype=torch.long)
    attention = torch.zeros(rows, PROMPT_LEN + RESPONSE_LEN, dtype=torch.long)
    rollout_lp = torch.zeros(rows, RESPONSE_LEN)
    for p in range(PROMPTS):
        length = int(rng.integers(1, PROMPT_LEN + 1))
        prompt = torch.as_tensor(rng.integers(2, VOCAB, size=length))
        for i in range(p * N, (p + 1) * N):
            prompts[i, PROMPT_LEN - length :] = prompt
            attention[i, PROMPT_LEN - length : PROMPT_LEN] = 1
            token = int(prompt[-1])
            for t in range(RESPONSE_LEN):
                probs = torch.softmax(sampler[token], -1).numpy()
                token = int(rng.choice(VOCAB, p=probs / probs.sum()))
                responses[i, t] = token
                attention[i, PROMPT_LEN + t] = 1
                rollout_lp[i, t] = float(np.log(probs[token]))
                if token == EOS:
                    break
    input_ids = torch.cat([prompts, responses], dim=1) * attention
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0) * attention
    uid = np.array([f"s{step}-p{i // N}" for i in range(rows)], dtype=object)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "rollout_log_probs": rollout_lp,
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def scores_of(batch: DataProto) -> torch.Tensor:
    """The rule reward at the last response token (as verl's reward managers place it)."""
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    lengths = mask.sum(-1).long()
    scores = torch.zeros(responses.shape, dtype=torch.float32)
    hit = ((responses == TARGET) & mask.bool()).any(-1).float()
    scores[torch.arange(len(lengths)), lengths - 1] = hit
    return scores


def advantage_extreme(advantages: torch.Tensor, mask: torch.Tensor) -> float:
    """max |advantage| / RMS over the tokens carrying one (|a| ≥ 1e-3: rlscope's noise floor
    at an RMS near 1), with verl's masked_mean."""
    carrying = mask.bool() & (advantages.abs() >= 1e-3)
    rms = verl_F.masked_mean(advantages.double() ** 2, carrying).sqrt().item()
    return advantages[carrying].abs().max().item() / rms


def run(out: Path, mode: str, steps: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    trainer, workers = make_trainer(mode, seed=0)
    # the same trainer unwrapped, fed the same batches: what the wrapping must not change
    plain, plain_workers = make_trainer(mode, seed=0)
    hook = RlscopeVerlHook(out / "run", algorithm="PPO" if mode == "ppo" else "GRPO", group_size=N)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # bind must accept the real class
        hook.bind(trainer)
    wrapped = sorted(k for k in vars(trainer) if k.startswith("_"))
    rs_config = RolloutCorrectionConfig(
        rollout_is=None, rollout_rs="token_k3", rollout_rs_threshold=0.002
    )
    algo = AlgoConfig(adv_estimator="gae" if mode == "ppo" else "grpo", gamma=GAMMA, lam=LAM)
    kl_ctrl = core_algos.FixedKLController(kl_coef=KL_COEF)
    expected: dict[str, dict[str, float]] = {}
    same_outputs = True
    rejected = 0
    for step in range(1, steps + 1):
        trainer.global_steps = plain.global_steps = step
        batch = rollout(workers, step, rng)
        if mode == "ppo":
            batch.pop(batch_keys=["rollout_log_probs"])  # calculate_log_probs off
        batch.batch["response_mask"] = compute_response_mask(batch)
        twin = DataProto.from_dict(
            tensors={k: v.clone() for k, v in batch.batch.items()},
            non_tensors={k: v.copy() for k, v in batch.non_tensor_batch.items()},
        )
        metrics: dict[str, float] = {}
        if mode == "grpo-bypass":  # fit(): old_log_probs = rollout_log_probs, nothing recomputed
            bypass = RolloutCorrectionConfig(rollout_is=None, rollout_rs=None, bypass_mode=True)
            apply_bypass_mode(batch, bypass, OmegaConf.create({"loss_mode": "vanilla"}))
        else:  # fit(): old log-probs, actor/entropy, the entropies popped, the union
            old_log_prob, _ = trainer._compute_old_log_prob(batch)
            old_plain, _ = plain._compute_old_log_prob(twin)
            same_outputs &= all(
                torch.equal(old_log_prob.batch[k], old_plain.batch[k])
                for k in old_plain.batch.keys()  # noqa: SIM118 (a TensorDict iterates rows)
            )
            entropys = old_log_prob.batch["entropys"]
            entropy = agg_loss(entropys, batch.batch["response_mask"], "token-mean")
            metrics["actor/entropy"] = entropy.item()
            old_log_prob.batch.pop("entropys")
            batch = batch.union(old_log_prob)
        if "rollout_log_probs" in batch.batch.keys() and mode != "grpo-bypass":  # noqa: SIM118
            metrics.update(calculate_debug_metrics(batch))
            offpolicy = compute_rollout_correction_and_add_to_batch(
                batch, RolloutCorrectionConfig(rollout_is=None, rollout_rs=None)
            )[1]
            metrics["rollout_corr/k3_kl"] = offpolicy["rollout_corr/k3_kl"]
        batch = batch.union(trainer._compute_ref_log_prob(batch))
        if trainer.use_critic:
            batch = batch.union(trainer._compute_values(batch))
        batch.batch["token_level_scores"] = scores_of(batch)
        # the KL to the reference, k3, as verl's low_var_kl and agg_loss token-mean compute it
        metrics["k3"] = agg_loss(
            kl_penalty(batch.batch["old_log_probs"], batch.batch["ref_log_prob"], "low_var_kl"),
            batch.batch["response_mask"],
            "token-mean",
        ).item()
        if mode == "ppo":
            batch, kl_metrics = apply_kl_penalty(batch, kl_ctrl=kl_ctrl, kl_penalty="kl")
            metrics.update(kl_metrics)
        else:
            batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        if mode == "grpo-rs":
            before = batch.batch["response_mask"].sum().item()
            batch, _ = compute_rollout_correction_and_add_to_batch(batch, rs_config)
            rejected += int(before - batch.batch["response_mask"].sum().item())
        batch = compute_advantage(
            batch,
            adv_estimator=AdvantageEstimator.GAE if mode == "ppo" else AdvantageEstimator.GRPO,
            gamma=GAMMA,
            lam=LAM,
            num_repeat=N,
            config=algo,
        )
        if trainer.use_critic:
            trainer._update_critic(batch)
        if not (mode == "ppo" and step == 1):  # critic_warmup = 1
            actor_output = trainer._update_actor(batch)
            metrics.update(actor_output.meta_info["metrics"])
        metrics.update(compute_data_metrics(batch=batch, use_critic=trainer.use_critic))
        metrics["advantage_extreme"] = advantage_extreme(
            batch.batch["advantages"], batch.batch["response_mask"]
        )
        plain_workers.policy = workers.policy.detach().clone().requires_grad_()
        plain_workers.value_head = workers.value_head.detach().clone().requires_grad_()
        expected[str(step)] = {k: float(v) for k, v in metrics.items() if _is_number(v)}
    hook.close()
    return {
        "expected": expected,
        "same_outputs": same_outputs,
        "wrapped": wrapped,
        "rejected_tokens": rejected,
        "worker_calls": sorted({name for name, _ in workers.received}),
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.number) and math.isfinite(float(value))


def bind_checks(out: Path) -> dict[str, Any]:
    """The real methods' parameters, and what bind does with what it must refuse."""
    signatures = {
        name: [str(p) for p in list(inspect.signature(getattr(RayPPOTrainer, name)).parameters)[1:]]
        for name in verl_hook.WRAPPED
    }

    def refusal(trainer: Any, name: str) -> str:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hook = RlscopeVerlHook(out / name).bind(trainer)
        hook.close()
        untouched = not any(k in vars(trainer) for k in verl_hook.WRAPPED)
        messages = [str(w.message) for w in caught if w.category is RuntimeWarning]
        wrote = (out / name / "rollouts").exists()
        return f"untouched={untouched} wrote={wrote} {' | '.join(messages)}"

    class Changed(RayPPOTrainer):  # a subclass whose _update_actor takes more
        def _update_actor(self, batch: DataProto, metrics: dict[str, Any]) -> DataProto:
            return batch

    results = {
        "version": __import__("verl").__version__,
        "signatures": signatures,
        "accepted": verl_hook.verl_support(object.__new__(RayPPOTrainer)),
        "not_ray_trainer": refusal(type("Plain", (), {})(), "plain"),
        "changed_signature": refusal(object.__new__(Changed), "changed"),
    }
    verl_hook.SUPPORTED_VERL = ((0, 10), (0, 11))  # the installed 0.9.1 is now outside it
    results["outside_range"] = refusal(object.__new__(RayPPOTrainer), "outside")
    return results


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    torch.manual_seed(0)
    result = bind_checks(out) if mode == "bind" else run(out, mode, steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
