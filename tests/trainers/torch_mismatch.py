"""A genuine training–inference mismatch: a small policy-gradient run on CPU whose rollouts are
sampled by one copy of the policy (the "inference engine") and trained by another (fp32).

A tiny from-scratch Qwen2 policy (vocabulary of 16 tokens) learns to answer a prompt token with
a token of the same parity (reward 1, else 0). Each step samples GROUPS prompts x GROUP
completions of LENGTH tokens with the sampler copy (HF `generate`, temperature 1, no top-k: the
sampler's log-prob of each sampled token is the log-softmax of its logits), recomputes every
log-prob with the trainer in fp32 (one full forward pass), takes one group-normalised
policy-gradient step (GRPO without clipping: on-policy, old_logprob = logprob) and copies the
trained weights back into the sampler. Everything is written with rlscope's RunWriter: tokens
with `rollout_logprob` (sampler), `old_logprob`, `logprob`.

MODE (measured, seed 0, 30 steps, ~8 s each on one thread; pass@1 ~0.45 at the start):
  fp32       the sampler is an fp32 copy: the only mismatch is the numerics of cached
             generation against one full forward pass (k3 ~4e-15 nats/token, mean |Δ log p|
             3e-8); pass@1 0.72 over the last steps.
  bf16       the sampler is a bf16 copy, as vLLM or SGLang sample in bf16: a genuine small
             mismatch (k3 1.3e-6 nats/token over the last steps, ~2e-5 a 12-token sequence;
             mean |Δ log p| 1.2e-3); pass@1 0.73.
  perturbed  the sampler's weights get Gaussian noise of 3 x each tensor's std after every
             sync, a sampler that does not hold the trainer's weights: k3 0.05 nats/token at
             the start rising to 0.19 as the policy sharpens (2.2 a sequence); pass@1 0.55.

Usage: python torch_mismatch.py RUN_DIR {fp32,bf16,perturbed} [STEPS]  (STEPS defaults to 30)
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from tiny_qwen import sample, tiny_config
from transformers import Qwen2ForCausalLM

from rlscope.writer import RunWriter

MODES = ("fp32", "bf16", "perturbed")
VOCAB = 16
GROUPS, GROUP, LENGTH = 8, 4, 12
LR = 3e-3
NOISE = 3.0  # perturbed: noise std as a share of each weight tensor's std
SEED = 0


def _sync(trainer: Qwen2ForCausalLM, sampler: Qwen2ForCausalLM, mode: str) -> None:
    """Copy the trainer's weights into the sampler (cast to its dtype; perturbed: plus noise)."""
    with torch.no_grad():
        for target, source in zip(sampler.parameters(), trainer.parameters(), strict=True):
            value = source.detach().clone()
            if mode == "perturbed":
                value += NOISE * value.std() * torch.randn_like(value)
            target.copy_(value.to(target.dtype))


def main(run_dir: Path, mode: str, steps: int) -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    config = tiny_config(VOCAB)
    trainer = Qwen2ForCausalLM(config)
    sampler = copy.deepcopy(trainer)
    if mode == "bf16":
        sampler = sampler.to(torch.bfloat16)
    _sync(trainer, sampler, mode)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=LR, weight_decay=0.0)
    rid = 0
    with RunWriter(run_dir, algorithm="GRPO", group_size=GROUP) as out:
        for step in range(1, steps + 1):
            prompts = torch.randint(2, VOCAB - 1, (GROUPS,))
            inputs = prompts.repeat_interleave(GROUP).unsqueeze(1)  # one-token prompts
            generated = sample(sampler, inputs, LENGTH, logits=True)
            completions = generated.sequences[:, 1:]
            logits = torch.stack(generated.logits, dim=1).float()
            rollout_lp = torch.log_softmax(logits, -1).gather(-1, completions.unsqueeze(-1))[..., 0]
            full = generated.sequences
            trainer_logits = trainer(full, attention_mask=torch.ones_like(full)).logits[:, :-1]
            trainer_lp = torch.log_softmax(trainer_logits.float(), -1)
            trainer_lp = trainer_lp.gather(-1, full[:, 1:].unsqueeze(-1))[..., 0]
            reward = (completions[:, 0] % 2 == inputs[:, 0] % 2).float()
            grouped = reward.view(GROUPS, GROUP)
            advantage = (grouped - grouped.mean(1, keepdim=True)) / (
                grouped.std(1, keepdim=True) + 1e-4
            )
            advantage = advantage.view(-1)
            loss = -(advantage.unsqueeze(1) * trainer_lp).mean()
            optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
            optimizer.step()
            _sync(trainer, sampler, mode)

            n = GROUPS * GROUP
            ids = list(range(rid, rid + n))
            rid += n
            out.log_step(step, loss=loss.item(), grad_norm=grad_norm.item(), lr=LR)
            out.log_rollouts(
                {
                    "rollout_id": ids,
                    "step": [step] * n,
                    "prompt_id": [f"{step}-{i // GROUP}" for i in range(n)],
                    "reward": reward.tolist(),
                    "correct": (reward > 0).tolist(),
                    "response_len": [LENGTH] * n,
                    "advantage": advantage.tolist(),
                }
            )
            lp = trainer_lp.detach()
            out.log_tokens(
                {
                    "rollout_id": [i for i in ids for _ in range(LENGTH)],
                    "step": [step] * (n * LENGTH),
                    "pos": list(range(LENGTH)) * n,
                    "logprob": lp.flatten().numpy(),
                    "old_logprob": lp.flatten().numpy(),
                    "rollout_logprob": rollout_lp.flatten().numpy(),
                }
            )


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[2] not in MODES:
        sys.exit(f"usage: python {Path(__file__).name} RUN_DIR {{{','.join(MODES)}}} [STEPS]")
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 30)
