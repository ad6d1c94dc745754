"""Writes W&B runs offline the way verl, TRL and OpenRLHF log them: `python wandb_writer.py DIR`."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import wandb
from trainer_keys import openrlhf_status, trl_logs, verl_metrics

VERL_STEPS = 20
TRL_STEPS = 12
OPENRLHF_STEPS = 20
WIDE_STEPS = 3
WIDE_KEYS = 3000
GENERATIONS = 4
PROMPTS = ("What is 2+2?", "What is 3*3?")
VERL_CONFIG = {
    "actor_rollout_ref": {
        "rollout": {"n": 5},
        "actor": {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
    },
    "data": {"max_response_length": 512},
    "algorithm": {"adv_estimator": "grpo"},
}
TRL_CONFIG = {
    "num_generations": GENERATIONS,
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "max_completion_length": 64,
    "max_grad_norm": 0.5,  # not transformers' default: the config must win
    "beta": 0.04,
    "scale_rewards": "none",
}
OPENRLHF_CONFIG = {
    "rollout": {"n_samples_per_prompt": 8, "max_new_tokens": 1024},
    "actor": {"eps_clip": 0.2, "eps_clip_low_high": [0.2, 0.28]},
    "algo": {"advantage": {"estimator": "group_norm"}},
}


def init(root: Path, name: str, config: dict) -> wandb.Run:
    folder = root / name
    folder.mkdir(parents=True)
    return wandb.init(
        project="rlscope-tests",
        name=name,
        dir=str(folder),
        config=config,
        mode="offline",
        settings=settings(),
    )


def settings() -> wandb.Settings:
    try:
        return wandb.Settings(console="off", x_disable_stats=True, save_code=False)
    except Exception:  # wandb < 0.17 has no x_disable_stats (the writer can run any version)
        return wandb.Settings(console="off", save_code=False)


def verl(root: Path) -> None:
    """verl/utils/tracking.py: `wandb.init(config=config)`, `wandb.log(data, step=step)` per
    step; ValidationGenerationsLogger logs `val/generations` at validation steps."""
    run = init(root, "verl", VERL_CONFIG)
    table = wandb.Table(columns=["step", "input_1", "output_1", "score_1"])
    for step in range(1, VERL_STEPS + 1):
        if step % 10 == 0:
            table = wandb.Table(columns=table.columns, data=table.data)
            table.add_data(step, "What is 2+2?", "4", 1.0)
            run.log({"val/generations": table}, step=step)
        run.log(verl_metrics(step), step=step)
    run.finish()


def trl_completions(step: int, prompts: tuple[str, ...] = PROMPTS) -> list[list]:
    """One batch: GENERATIONS rows per prompt, half of each group correct (advantage = the
    centred reward, scale_rewards="none")."""
    rows = []
    for p, prompt in enumerate(prompts):
        for g in range(GENERATIONS):
            correct = float((g + step + p) % 2 == 0)
            answer = f"step {step}: the answer is <answer>{g}</answer>"
            rows.append([step, prompt, answer, correct, correct - 0.5])
    return rows


def trl(root: Path) -> None:
    """transformers' WandbCallback (integration_utils.py: define_metric("train/global_step"),
    define_metric("*", step_metric="train/global_step", step_sync=True); on_log logs
    rewrite_logs(logs) + train/global_step) and TRL's GRPOTrainer.log (grpo_trainer.py: the
    completions table in a call of its own, after the metrics; at an evaluation a second one,
    the eval batch)."""
    run = init(root, "trl", TRL_CONFIG)
    run.define_metric("train/global_step")
    run.define_metric("*", step_metric="train/global_step", step_sync=True)
    columns = ["step", "prompt", "completion", "accuracy_reward", "advantage"]
    for step in range(1, TRL_STEPS + 1):
        batch = trl_completions(step)
        logs = trl_logs(step)
        mean = sum(r[3] for r in batch) / len(batch)
        logs |= {"reward": mean, "rewards/accuracy_reward/mean": mean, "frac_reward_zero_std": 0}
        run.log({**{f"train/{k}": v for k, v in logs.items()}, "train/global_step": step})
        run.log({"completions": wandb.Table(columns=columns, data=batch)})
        if step % 6 == 0:
            run.log({"eval/loss": 0.4, "eval/reward": 0.5, "train/global_step": step})
            mixed = trl_completions(step, ("eval prompt",)) + batch[GENERATIONS:]
            run.log({"completions": wandb.Table(columns=columns, data=mixed)})
    run.finish()


#: A genuine TRL 1.16 GRPOTrainer run (tests/genuine/trl-real/healthy): its log_history is
#: what the trainer passed to every callback's on_log.
GENUINE_TRL = Path(__file__).parent / "genuine" / "trl-real" / "healthy"


def trl_genuine(root: Path, source: Path = GENUINE_TRL, name: str = "trl-genuine") -> None:
    """The genuine run's log_history, entry by entry, as transformers' WandbCallback.on_log
    logs it (integration_utils.py: `rewrite_logs` puts `eval_` keys under `eval/` and the
    rest under `train/`, then `train/global_step`); the run's own keys and floats."""
    import json

    (state,) = source.glob("**/trainer_state.json")
    run = init(root, name, TRL_CONFIG | {"scale_rewards": "group", "num_generations": 8})
    run.define_metric("train/global_step")
    run.define_metric("*", step_metric="train/global_step", step_sync=True)
    for entry in json.loads(state.read_text())["log_history"]:
        logs = {k: v for k, v in entry.items() if k != "step"}
        rewritten = {
            (f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"): v for k, v in logs.items()
        }
        run.log({**rewritten, "train/global_step": entry["step"]})
    run.finish()


def openrlhf(root: Path) -> None:
    """OpenRLHF v0.11.0's WandbLogger (openrlhf/utils/logging_utils.py), call for call."""
    run = init(root, "openrlhf", OPENRLHF_CONFIG)
    wandb.define_metric("train/global_step")
    wandb.define_metric("train/*", step_metric="train/global_step", step_sync=True)
    wandb.define_metric("eval/epoch")
    wandb.define_metric("eval/*", step_metric="eval/epoch", step_sync=True)
    samples_table = wandb.Table(columns=["global_step", "text", "reward"])
    for global_step in range(1, OPENRLHF_STEPS + 1):
        logs_dict = {
            **openrlhf_status(global_step),
            "generated_samples": [f"q{global_step} a{global_step}", 0.5],
        }
        generated_samples = logs_dict.pop("generated_samples", None)
        if generated_samples:
            new_table = wandb.Table(columns=samples_table.columns, data=samples_table.data)
            new_table.add_data(global_step, *generated_samples)
            samples_table = new_table
            wandb.log({"train/generated_samples": new_table})
        metrics = {k: v for k, v in logs_dict.items() if v is not None}
        wandb.log({"train/%s" % k: v for k, v in {**metrics, "global_step": global_step}.items()})  # noqa: UP031
        if global_step % 10 == 0:
            eval_logs = {"eval_gsm8k_pass1": 0.5, "eval_response_length_mean": 210.0}
            wandb.log(
                {"eval/%s" % k: v for k, v in {**eval_logs, "global_step": global_step}.items()}  # noqa: UP031
            )
    run.finish()


def empty(root: Path) -> None:
    run = init(root, "empty", {"lr": 1e-6})
    run.finish()


def wide(root: Path) -> None:
    """Rows of WIDE_KEYS keys: records larger than a 32 KiB block (FIRST, MIDDLE, LAST chunks),
    values of every JSON kind W&B writes for a number (ints, floats, NaN, infinities)."""
    run = init(root, "wide", {})
    for step in range(WIDE_STEPS):
        row: dict = {f"group_{k % 7}/key_{k:04d}": k * 0.5 + step for k in range(WIDE_KEYS)}
        row |= {"count": step, "nan": math.nan, "inf": math.inf, "text": f"step {step}"}
        run.log(row, step=step)
    run.finish()


#: A genuine TRL run with a dict of two eval sets (tests/genuine/trl-two-eval-sets).
GENUINE_EVALS = Path(__file__).parent / "genuine" / "trl-two-eval-sets"


def trl_evals(root: Path) -> None:
    """The two-eval-sets run's log_history as WandbCallback logs it: each set's evaluation is
    one log call at its step, its own `eval/<name>_runtime` beside TRL's unnamed keys."""
    trl_genuine(root, GENUINE_EVALS, "trl-evals")


WRITERS = {
    "verl": verl,
    "trl": trl,
    "trl-genuine": trl_genuine,
    "trl-evals": trl_evals,
    "openrlhf": openrlhf,
    "empty": empty,
    "wide": wide,
}


def main() -> None:
    root, names = Path(sys.argv[1]), sys.argv[2:] or list(WRITERS)
    os.environ.update(WANDB_SILENT="true", WANDB_MODE="offline", WANDB_DIR=str(root))
    for name in names:
        WRITERS[name](root)


if __name__ == "__main__":
    main()
