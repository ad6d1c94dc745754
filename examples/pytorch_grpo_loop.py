"""A PyTorch-style GRPO loop logging to rlscope, runnable with numpy alone (the policy is faked).

Each step draws P prompts x G samples from a "tiny fake batch": per-token log-probabilities under
the current, behaviour (old) and reference policy, token entropies, binary rewards and GRPO
advantages (r - mean) / (std + 1e-6) within each prompt's group. The loop computes the GRPO loss,
KL (k3), entropy and clip fraction from those arrays exactly as a real loop does from tensors, and
logs all three tables with `rlscope.RunWriter`:

* `log_step`: the trainer's own scalars (loss, grad_norm, kl, entropy, clip_frac, lr);
* `log_rollouts`: one row per sampled response (reward, correct, response_len, advantage);
* `log_tokens`: one row per generated token (logprob, old_logprob, ref_logprob, entropy,
  advantage), so rlscope recomputes KL, entropy and clip fraction itself and compares them with
  the logged values.

Comments marked `REAL LOOP` show where a torch loop moves tensors to numpy
(`.detach().cpu().numpy()`, after selecting the valid tokens with the completion mask).

    python examples/pytorch_grpo_loop.py runs/fake-grpo --steps 40
    rlscope analyze runs/fake-grpo
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rlscope import RunWriter

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # PPO epsilon_low / epsilon_high (DAPO-style clip-higher)
BETA = 0.04  # KL penalty coefficient
LR = 1e-6


@dataclass
class FakeBatch:
    """What one GRPO step has after generation, scoring and the forward passes."""

    prompt_ids: list[str]  # per response, the prompt's id (G consecutive responses each)
    rewards: np.ndarray  # [B] float64, B = P * G
    lengths: np.ndarray  # [B] int, generated tokens per response
    logprob: list[np.ndarray]  # per response, [len] float32: current policy
    old_logprob: list[np.ndarray]  # behaviour policy (the one that sampled)
    ref_logprob: list[np.ndarray]  # frozen reference policy
    entropy: list[np.ndarray]  # full-vocabulary entropy per token, nats


def fake_batch(
    rng: np.random.Generator, step: int, steps: int, prompts: int, group: int
) -> FakeBatch:
    """A batch whose statistics move like a healthy run: skill up, entropy and KL drift slowly.

    REAL LOOP: this is `generate()` + reward functions + the policy / old / reference forward
    passes; everything below is [B, T] tensors there, padded, with a `completion_mask`.
    """
    progress = step / max(1, steps - 1)
    # A pool of 64 prompts with fixed difficulty; the policy's skill grows over the run.
    pool = np.random.default_rng(0).normal(0.0, 1.2, size=64)
    chosen = rng.choice(len(pool), size=prompts, replace=False)
    skill = -0.6 + 1.6 * progress
    p_correct = 1.0 / (1.0 + np.exp(-2.0 * (skill - pool[chosen])))
    rewards = (rng.random((prompts, group)) < p_correct[:, None]).astype(np.float64).ravel()
    lengths = rng.integers(16, 65, size=prompts * group)  # 64 = the cap

    mean_entropy = 0.35 + 0.8 * np.exp(-1.2 * progress)  # slow decline, no collapse
    drift = 0.03 + 0.12 * progress  # the policy moves away from the reference, gently
    logprob, old_logprob, ref_logprob, entropy = [], [], [], []
    for n in lengths:
        ent = rng.gamma(2.0, mean_entropy / 2.0, size=n)  # a few high-entropy forking tokens
        logp = -ent * rng.uniform(0.3, 1.7, size=n)  # E[-logprob] ~ entropy
        entropy.append(ent.astype(np.float32))
        logprob.append(logp.astype(np.float32))
        # One earlier update separates the behaviour policy: ratio = exp(logp - old) ~ 1.
        old_logprob.append((logp + rng.normal(0.0, 0.1, size=n)).astype(np.float32))
        ref_logprob.append((logp + rng.normal(-drift, 0.15, size=n)).astype(np.float32))
    prompt_ids = [f"p{chosen[i // group]:03d}" for i in range(prompts * group)]
    return FakeBatch(prompt_ids, rewards, lengths, logprob, old_logprob, ref_logprob, entropy)


def grpo_advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """(r - group mean) / (group std + 1e-6); std unbiased, like `torch.std` in TRL."""
    grouped = rewards.reshape(-1, group)
    mean = grouped.mean(axis=1, keepdims=True)
    std = grouped.std(axis=1, ddof=1, keepdims=True)
    return ((grouped - mean) / (std + 1e-6)).ravel()


def main(
    out_dir: str | Path,
    steps: int = 40,
    prompts: int = 8,
    group: int = 8,
    seed: int = 0,
) -> Path:
    """Run the fake GRPO loop for `steps` steps and write the run directory `out_dir`."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    next_rollout_id = 0
    with RunWriter(
        out,
        algorithm="GRPO",
        group_size=group,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        max_response_len=64,
        correct_threshold=1.0,
        rank=0,  # with several ranks: rank=dist.get_rank(), and offset rollout ids by rank
    ) as writer:
        for step in range(steps):
            batch = fake_batch(rng, step, steps, prompts, group)
            adv = grpo_advantages(batch.rewards, group)
            n_rollouts = len(batch.rewards)
            rollout_ids = np.arange(next_rollout_id, next_rollout_id + n_rollouts)
            next_rollout_id += n_rollouts

            # Flatten the valid tokens of every response: one row per generated token.
            # REAL LOOP: mask = completion_mask.bool()               # [B, T]
            #            logp = per_token_logps[mask].detach().cpu().numpy()
            #            rid  = rollout_ids_t[:, None].expand_as(mask)[mask].cpu().numpy()
            #            pos  = (mask.cumsum(-1) - 1)[mask].cpu().numpy()
            logp = np.concatenate(batch.logprob)
            old = np.concatenate(batch.old_logprob)
            ref = np.concatenate(batch.ref_logprob)
            ent = np.concatenate(batch.entropy)
            tok_rid = np.repeat(rollout_ids, batch.lengths)
            tok_adv = np.repeat(adv, batch.lengths).astype(np.float32)
            pos = np.concatenate([np.arange(n) for n in batch.lengths])

            # The GRPO objective and the trainer's scalars, from the same float32 values.
            ratio = np.exp(logp.astype(np.float64) - old)
            clipped_ratio = np.clip(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH)
            d = ref.astype(np.float64) - logp
            k3 = np.exp(d) - d - 1  # per-token KL to the reference (TRL's `kl`)
            per_token = -np.minimum(ratio * tok_adv, clipped_ratio * tok_adv) + BETA * k3
            # loss_type="grpo": mean over each response's tokens, then over responses.
            starts = np.cumsum(batch.lengths) - batch.lengths
            loss = float(np.mean(np.add.reduceat(per_token, starts) / batch.lengths))
            is_clipped = ((ratio < 1 - CLIP_LOW) & (tok_adv < 0)) | (
                (ratio > 1 + CLIP_HIGH) & (tok_adv > 0)
            )
            # REAL LOOP: loss.backward(); grad_norm = clip_grad_norm_(params, 1.0).item()
            grad_norm = float(0.2 + 0.6 * np.mean(np.abs(adv)) * rng.lognormal(0.0, 0.1))

            # REAL LOOP: pass Python floats (`.item()`), not tensors.
            writer.log_step(
                step,
                loss=loss,
                grad_norm=grad_norm,
                lr=LR,
                kl=float(k3.mean()),
                entropy=float(ent.mean()),
                clip_frac=float(is_clipped.mean()),
            )
            # REAL LOOP: rewards / advantages are [B] tensors: `.detach().cpu().numpy()`;
            # prompt ids are the dataset's uid per response (the G samples share it).
            writer.log_rollouts(
                {
                    "rollout_id": rollout_ids,
                    "step": step,
                    "prompt_id": batch.prompt_ids,
                    "reward": batch.rewards,
                    "correct": batch.rewards >= 1.0,
                    "response_len": batch.lengths,
                    "advantage": adv,
                }
            )
            writer.log_tokens(
                {
                    "rollout_id": tok_rid,
                    "step": step,
                    "pos": pos,
                    "logprob": logp,
                    "old_logprob": old,
                    "ref_logprob": ref,
                    "entropy": ent,
                    "advantage": tok_adv,
                }
            )
            if step % 10 == 9:
                writer.flush()  # e.g. at each checkpoint: a crash loses at most the buffer
    return out


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="runs/fake-grpo", help="run directory")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    out = main(ns.out_dir, steps=ns.steps, prompts=ns.prompts, group=ns.group, seed=ns.seed)
    print(f"wrote {out}; next: rlscope analyze {out}")


if __name__ == "__main__":
    _cli()
