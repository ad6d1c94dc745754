"""A genuine PPO run with a learned critic on CPU, logged as verl logs it (file logger).

A tiny from-scratch Qwen2 policy (vocabulary of 16 tokens) answers a one-token prompt with LENGTH
tokens; the score is 1 at the last token when the first answer token is even. One
sample per prompt (no groups), BATCH prompts a step. As verl's RayPPOTrainer with
adv_estimator=gae and use_kl_in_reward: the KL penalty in the reward (k1 against the initial
policy, `apply_kl_penalty`, with verl's AdaptiveKLController or a fixed β), GAE (γ 1, λ 0.95) from
a critic (a second Qwen2 backbone with a zero-initialised value head), whitened advantages, the
clipped policy loss (ε 0.2) and the clipped value loss (cliprange_value 0.5), one epoch of two
mini-batches. Each step's metrics are computed as verl's `compute_data_metrics`
(trainer/ppo/metric_utils.py), its actor and critic workers and `apply_kl_penalty` compute
them, and written as verl's FileLogger writes them (utils/tracking.py): one JSON line
{"step": s, "data": {...}} per step.

MODE (measured, seed 0, 60 steps, ~7 s each on one thread; score 0.5 at step 1):
  healthy         critic lr 3e-3, adaptive KL (β 0.02, target 0.1, horizon 100): explained
                  variance 0 for ~20 steps while the value loss falls (0.25 → 0.17), then
                  0.1–0.3; score 0.88 over the last steps; the in-reward KL ~0 for 20 steps,
                  then rising to 0.26 nats/token by step 50 and flat after (β 0.0027 → 0.0086).
  frozen-critic   critic lr 0: the value head stays 0 (explained variance 1e-4 at every
                  step), the advantages are the returns; the value loss rises 0.24 → 0.45.
  critic-diverges critic lr 1.0: the value loss is 215 at step 1, then 0.2–1 with spikes; the
                  critic never explains anything (explained variance −0.03 to 0.001).
  critic-lr-high  critic lr 0.3: the value loss is 5 at step 1, 0.2 from step 7 on (the
                  blow-up's decay, no learning); explained variance within ±0.01 of 0 throughout.
  critic-lr-jump  as healthy until step 29, then critic lr 3.0: the value loss goes 0.13 → 2e5
                  at step 30 and settles near 2 (×10 the first steps); explained variance −10
                  to −30 from then on.
  kl-runaway      adaptive KL with a target of 1e-6, far below any KL the policy reaches: β
                  grows by the controller's largest factor, ×1.064 a step (×4 its start by
                  step 47, ×10 by step 61, ×100 by step 100); from step ~60 the penalty
                  outweighs the task and the score falls from 0.9 to 0.55.
The healthy mode's KL target (0.1) is below the KL its task settles at (~0.3): run for 100 steps,
its controller raises β from step 40 on and passes ×4 its start at step 92 (kl-coef-runaway warns
there, rightly); the tests run it for 60 steps, where β is still below its start.

Usage: python torch_ppo_critic.py OUT.jsonl MODE [STEPS]  (STEPS defaults to 60)
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from pathlib import Path

import torch
from tiny_qwen import sample, tiny_config
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

MODES = (
    "healthy",
    "frozen-critic",
    "critic-diverges",
    "critic-lr-high",
    "critic-lr-jump",
    "kl-runaway",
)
VOCAB, LENGTH, BATCH = 16, 8, 32
ACTOR_LR, GAMMA, LAM, CLIP, VALUE_CLIP = 1e-3, 1.0, 0.95, 0.2, 0.5
CRITIC_LR = {
    "healthy": 3e-3,
    "frozen-critic": 0.0,
    "critic-diverges": 1.0,
    "critic-lr-high": 0.3,
    "kl-runaway": 3e-3,
    "critic-lr-jump": 3e-3,
}
KL = {"init": 0.02, "target": 0.1, "horizon": 100}
CRITIC_EPOCHS = 4  # verl critic.ppo_epochs
MAX_RESPONSE = 16  # the response length cap (data.max_response_length)
SEED = int(os.environ.get("TRAINER_SEED", "0"))  # the run's seed (environment: TRAINER_SEED)
JUMP_STEP, JUMP_LR = 30, 3.0  # critic-lr-jump: the critic's learning rate from that step


class AdaptiveKLController:
    """verl trainer/ppo/core_algos.py `AdaptiveKLController` (Ziegler et al. 2019)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


class Critic(torch.nn.Module):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__()
        self.backbone = Qwen2Model(config)
        self.head = torch.nn.Linear(config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(ids).last_hidden_state
        return self.head(hidden)[..., 0]


def _logprobs(model: Qwen2ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the entropy at each response position."""
    logits = model(ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    taken = logp.gather(-1, ids[:, 1:].unsqueeze(-1))[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return taken, entropy


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    return {
        f"{prefix}/mean": x.mean().item(),
        f"{prefix}/max": x.max().item(),
        f"{prefix}/min": x.min().item(),
    }


def main(out: Path, mode: str, steps: int) -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    config = tiny_config(VOCAB)
    actor = Qwen2ForCausalLM(config)
    reference = copy.deepcopy(actor).eval()
    critic = Critic(config)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=ACTOR_LR, weight_decay=0.0)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=CRITIC_LR[mode], weight_decay=0.0)
    target = 1e-6 if mode == "kl-runaway" else KL["target"]
    kl_ctrl = AdaptiveKLController(KL["init"], target, KL["horizon"])
    with out.open("w") as log:
        for step in range(1, steps + 1):
            if mode == "critic-lr-jump" and step == JUMP_STEP:
                for group in critic_opt.param_groups:
                    group["lr"] = JUMP_LR
            prompts = torch.randint(2, VOCAB, (BATCH, 1))
            with torch.no_grad():
                ids = sample(actor, prompts, LENGTH).sequences
                old_logp, _ = _logprobs(actor, ids)
                ref_logp, _ = _logprobs(reference, ids)
                values = critic(ids)[:, :-1]  # the value before each response token
            score = (ids[:, 1] % 2 == 0).float()
            scores = torch.zeros(BATCH, LENGTH)
            scores[:, -1] = score
            kld = old_logp - ref_logp  # verl kl_penalty "kl" (k1)
            beta = kl_ctrl.value
            rewards = scores - beta * kld
            current_kl = kld.mean(-1).mean().item()
            kl_ctrl.update(current_kl, BATCH)
            # GAE (core_algos.py compute_gae_advantage_return)
            advantages = torch.zeros_like(rewards)
            last = torch.zeros(BATCH)
            for t in reversed(range(LENGTH)):
                following = values[:, t + 1] if t + 1 < LENGTH else torch.zeros(BATCH)
                delta = rewards[:, t] + GAMMA * following - values[:, t]
                last = delta + GAMMA * LAM * last
                advantages[:, t] = last
            returns = advantages + values
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

            metrics = {}
            pg_losses, pg_clip, ppo_kl, entropies, grad_norms = [], [], [], [], []
            vf_losses, vf_clip, vpreds, critic_norms = [], [], [], []
            for batch in torch.arange(BATCH).chunk(2):
                logp, entropy = _logprobs(actor, ids[batch])
                ratio = torch.exp(logp - old_logp[batch])
                adv = advantages[batch]
                loss1, loss2 = -adv * ratio, -adv * ratio.clamp(1 - CLIP, 1 + CLIP)
                pg_loss = torch.max(loss1, loss2).mean()
                actor_opt.zero_grad()
                pg_loss.backward()
                grad_norms.append(torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0).item())
                actor_opt.step()
                pg_losses.append(pg_loss.item())
                pg_clip.append((loss2 > loss1).float().mean().item())
                ppo_kl.append((old_logp[batch] - logp).mean().item())
                entropies.append(entropy.mean().item())

                for _ in range(CRITIC_EPOCHS):
                    vpred = critic(ids[batch])[:, :-1]
                    old_v = values[batch]
                    clipped = old_v + (vpred - old_v).clamp(-VALUE_CLIP, VALUE_CLIP)
                    ret = returns[batch]
                    vf1, vf2 = (vpred - ret) ** 2, (clipped - ret) ** 2
                    vf_loss = 0.5 * torch.max(vf1, vf2).mean()
                    critic_opt.zero_grad()
                    vf_loss.backward()
                    norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), 1e9).item()
                    critic_opt.step()
                    critic_norms.append(norm)
                    vf_losses.append(vf_loss.item() / CRITIC_EPOCHS)
                    vf_clip.append((vf2 > vf1).float().mean().item())
                    vpreds.append(vpred.mean().item())

            def mean(xs: list[float]) -> float:
                return sum(xs) / len(xs)

            return_var = returns.var().item()
            metrics |= _stats("critic/score", score)
            metrics |= _stats("critic/rewards", rewards.sum(-1))
            metrics |= _stats("critic/advantages", advantages)
            metrics |= _stats("critic/returns", returns)
            metrics |= _stats("critic/values", values)
            metrics["critic/vf_explained_var"] = 1.0 - (returns - values).var().item() / (
                return_var + 1e-5
            )
            metrics |= {
                "response_length/mean": float(LENGTH),
                "response_length/max": float(LENGTH),
                # A fixed-length answer (min = max new tokens) under a cap of MAX_RESPONSE:
                # nothing is cut, as verl's share of responses at the cap says.
                "response_length/clip_ratio": 0.0,
                "actor/pg_loss": mean(pg_losses),
                "actor/pg_clipfrac": mean(pg_clip),
                "actor/ppo_kl": mean(ppo_kl),
                "actor/entropy": mean(entropies),
                "actor/grad_norm": mean(grad_norms),
                "actor/lr": ACTOR_LR,
                "critic/vf_loss": sum(vf_losses),  # summed over micro-batches, as dp_critic
                "critic/vf_clipfrac": mean(vf_clip),
                "critic/vpred_mean": mean(vpreds),
                "critic/grad_norm": mean(critic_norms),
                "critic/lr": critic_opt.param_groups[0]["lr"],
                "actor/reward_kl_penalty": current_kl,
                "actor/reward_kl_penalty_coeff": beta,
                "training/global_step": step,
            }
            clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
            log.write(json.dumps({"step": step, "data": clean}) + "\n")  # orjson: NaN -> null


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] not in MODES:
        sys.exit(f"usage: python {Path(sys.argv[0]).name} OUT.jsonl {{{','.join(MODES)}}} [STEPS]")
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 60)
