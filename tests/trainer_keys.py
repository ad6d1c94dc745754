"""What verl, TRL and OpenRLHF log per step, key for key (from their sources), for the tests."""

from __future__ import annotations


def openrlhf_status(step: int, *, kl: float = 0.0, critic: bool = False) -> dict[str, float]:
    """OpenRLHF v0.11.0's status dict for one step, as `log_train` receives it without
    `generated_samples` (ppo_trainer.py `train_step`: ray/ppo_actor.py `ppo_train` means of
    `training_step`'s metrics, experience_maker.py's info, the episode fields, timings and
    `_compute_rollout_stats`; ray/ppo_critic.py with a critic). `kl` is 0.0 without a
    reference model."""
    row = {
        "policy_loss": -0.01 * step,
        "entropy_loss": 1.5 - 0.01 * step,
        "actor_lr": 5e-7,
        "actor_grad_norm": 0.5 + 0.01 * step,
        "ppo_clip_ratio": 0.002,
        "ppo_kl": 1e-4,
        "kl": kl,
        "logprobs_diff": 0.0,
        "reward": 0.1 * step,
        "return": 0.1 * step,
        "group_reward_std": 0.3,
        "response_length": 200.0 + step,
        "truncated": 0.05,
        "total_length": 300.0 + step,
        "timing/make_experience": 1.5,
        "timing/ppo_train": 2.5,
        "timing/broadcast": 0.5,
        "rollout/reward_mean": 0.1 * step,
        "rollout/reward_std": 0.3,
        "rollout/response_length_mean": 200.0 + step,
        "rollout/truncated_rate": 0.0625,
        "rollout/num_samples": 64.0,
    }
    if critic:
        row |= {"critic_loss": 0.3, "values": 0.2, "critic_lr": 1e-6, "critic_grad_norm": 0.7}
    return row


def verl_metrics(step: int, *, kl_loss: float = 0.0) -> dict[str, float]:
    """A verl step's metrics as `Tracking.log(data, step=global_steps)` sends them to every
    logger (ray_trainer.py fit: update_actor, compute_data_metrics, timing, val-core)."""
    return {
        "actor/pg_loss": 0.01 * step,
        "actor/grad_norm": 1.0 + step,
        "actor/lr": 1e-6,
        "actor/pg_clipfrac": 0.002,
        "actor/entropy": 1.5 - 0.05 * step,
        "actor/kl_loss": kl_loss,
        "actor/ppo_kl": 0.0001,
        "critic/score/mean": 0.1 * step,
        "critic/rewards/mean": 0.1 * step,
        "response_length/mean": 100.0 + step,
        "response_length/clip_ratio": 0.25,
        "timing_s/gen": 3.0,
        "val-core/openai/gsm8k/acc/mean@1": 0.5 + 0.01 * step,
    }


def trl_logs(step: int) -> dict[str, float]:
    """TRL 1.16 GRPOTrainer's train log at one step, every key it logs with one reward function
    `accuracy_reward` (the key set of tests/genuine/trl-real's trainer_state.json log_history:
    grpo_trainer.py `_generate_and_score_completions` and `_compute_loss`, Trainer's loss,
    grad_norm, learning_rate, num_tokens, epoch, step_time). Two of its keys,
    completions/min_terminated_length and completions/max_terminated_length, have the same
    length and the same first and last 8 bytes."""
    return {
        "loss": 0.5,
        "grad_norm": 0.25 * step,
        "learning_rate": 2e-6,
        "num_tokens": 1000.0 * step,
        "completions/mean_length": 64.0,
        "completions/min_length": 10.0,
        "completions/max_length": 128.0,
        "completions/clipped_ratio": 0.5,
        "completions/mean_terminated_length": 60.0,
        "completions/min_terminated_length": 9.0 + step,
        "completions/max_terminated_length": 100.0 + step,
        "rewards/accuracy_reward/mean": 0.125 * step,
        "rewards/accuracy_reward/std": 0.3,
        "reward": 0.125 * step,
        "reward_std": 0.3,
        "frac_reward_zero_std": 0.25,
        "kl": 0.01,
        "entropy": 0.75,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/low_min": 0.0,
        "clip_ratio/high_mean": 0.0,
        "clip_ratio/high_max": 0.0,
        "clip_ratio/region_mean": 0.0,
        "epoch": 0.1 * step,
        "step_time": 2.4,
    }
