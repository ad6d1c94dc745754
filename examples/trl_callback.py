"""TRL GRPOTrainer + `RlscopeCallback`; runnable without TRL by driving the callback with fakes.

With TRL (>= 0.28) the whole integration is::

    from trl import GRPOConfig, GRPOTrainer
    from rlscope.integrations.trl import RlscopeCallback

    callback = RlscopeCallback("runs/x", group_size=8, correct_reward="accuracy_reward")
    trainer = GRPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        reward_funcs=[accuracy_reward, format_reward],
        args=GRPOConfig(output_dir="out", num_generations=8, logging_steps=1),
        train_dataset=dataset,
        callbacks=[callback],
    )
    callback.bind(trainer)  # without it only the steps table is written (no rollouts)
    trainer.train()         # then: rlscope analyze runs/x

This script replaces the trainer by the few things the callback reads: HF's `args` / `state` /
`control` objects, the `processing_class` keyword HF passes to every event, and GRPOTrainer's
completion buffers `trainer._logs` (bounded deques holding the latest generation batch: prompt,
completion, rewards per function, advantages). It fires the events in HF's order for a few steps
(`on_train_begin`; per step `on_step_end`, `on_log`; an evaluation log every few steps;
`on_save`; the end-of-training summary log; `on_train_end`), like `Trainer.train()` does.

    python examples/trl_callback.py runs/trl-fake --steps 12
    rlscope analyze runs/trl-fake
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from rlscope.integrations.trl import RlscopeCallback

PROMPTS_PER_STEP = 4
NUM_GENERATIONS = 8
REWARD_FUNCS = ("accuracy_reward", "format_reward")
REWARD_WEIGHTS = (1.0, 0.2)


class FakeTokenizer:
    """Stands in for `trainer.processing_class`: words and punctuation are tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [hash(t) % 50_000 for t in re.findall(r"\w+|[^\w\s]", text)]


class FakeGRPOTrainer:
    """The attributes of `trl.GRPOTrainer` the callback reads."""

    def __init__(self, args: SimpleNamespace) -> None:
        self.args = args
        self.num_generations = args.num_generations
        self.reward_func_names = list(REWARD_FUNCS)
        self.reward_weights = list(REWARD_WEIGHTS)  # a tensor in TRL; `.tolist()` works on both
        self.processing_class = FakeTokenizer()
        size = args.generation_batch_size
        self._logs: dict[str, Any] = {
            "prompt": deque(maxlen=size),
            "completion": deque(maxlen=size),
            "rewards": defaultdict(lambda: deque(maxlen=size)),
            "advantages": deque(maxlen=size),
        }

    def generate_and_score(self, rng: np.random.Generator, skill: float) -> dict[str, float]:
        """One generation batch into the buffers (as `_generate_and_score_completions` does);
        returns the metrics TRL logs for it."""
        g = self.num_generations
        texts, totals, per_func = [], [], {name: [] for name in REWARD_FUNCS}
        for _ in range(PROMPTS_PER_STEP):
            a, b = (int(x) for x in rng.integers(10, 99, size=2))
            prompt = f"What is {a} + {b}? Think step by step, then answer."
            p_correct = 1.0 / (1.0 + np.exp(-(skill - (a + b) / 60.0)))
            for _ in range(g):
                correct = rng.random() < p_correct
                answer = a + b if correct else a + b + int(rng.integers(1, 10))
                steps = " ".join(["so"] * int(rng.integers(3, 30)))
                well_formed = rng.random() < 0.9
                think = f"<think>{a} plus {b}, {steps}.</think> " if well_formed else ""
                texts.append((prompt, f"{think}The answer is {answer}."))
                per_func["accuracy_reward"].append(float(correct))
                per_func["format_reward"].append(float(well_formed))
                totals.append(float(correct) + REWARD_WEIGHTS[1] * float(well_formed))
        rewards = np.array(totals).reshape(-1, g)
        std = rewards.std(axis=1, ddof=1, keepdims=True)
        advantages = ((rewards - rewards.mean(axis=1, keepdims=True)) / (std + 1e-4)).ravel()
        for (prompt, completion), adv in zip(texts, advantages, strict=True):
            self._logs["prompt"].append(prompt)
            self._logs["completion"].append(completion)
            self._logs["advantages"].append(float(adv))
        for name, values in per_func.items():
            self._logs["rewards"][name].extend(values)
        lengths = [len(self.processing_class.encode(c)) for _, c in texts]
        return {
            "num_tokens": float(sum(lengths)),
            "completions/mean_length": float(np.mean(lengths)),
            "completions/clipped_ratio": 0.0,
            **{f"rewards/{n}/mean": float(np.mean(v)) for n, v in per_func.items()},
            "reward": float(rewards.mean()),
            "reward_std": float(std.mean()),
            "frac_reward_zero_std": float(np.mean(std == 0)),
        }


def main(out_dir: str | Path, steps: int = 12, seed: int = 0) -> Path:
    """Drive `RlscopeCallback` through `steps` fake GRPO steps; returns the run directory."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    args = SimpleNamespace(  # the GRPOConfig fields the callback reads
        num_generations=NUM_GENERATIONS,
        generation_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS,
        epsilon=0.2,
        epsilon_high=0.28,
        max_completion_length=64,
        logging_steps=1,
    )
    state = SimpleNamespace(global_step=0, epoch=0.0, is_world_process_zero=True)
    control = SimpleNamespace()
    trainer = FakeGRPOTrainer(args)
    callback = RlscopeCallback(out, correct_reward="accuracy_reward").bind(trainer)

    def fire(event: str, **kwargs: Any) -> None:
        # transformers' CallbackHandler.call_event passes these keywords to every callback.
        getattr(callback, event)(
            args, state, control, processing_class=trainer.processing_class, **kwargs
        )

    fire("on_train_begin")
    for step in range(1, steps + 1):
        progress = step / steps
        metrics = trainer.generate_and_score(rng, skill=-0.5 + 2.0 * progress)
        state.global_step, state.epoch = step, step / steps
        fire("on_step_end")
        logs = {
            "loss": float(0.02 * rng.normal()),
            "grad_norm": float(0.3 + 0.05 * rng.random()),
            "learning_rate": 1e-6 * (1 - progress),
            **metrics,
            "entropy": 0.9 - 0.3 * progress,
            "kl": 0.002 + 0.02 * progress,
            "clip_ratio/low_mean": 0.001,
            "clip_ratio/high_mean": 0.002,
            "clip_ratio/region_mean": 0.003,
            "epoch": state.epoch,
        }
        fire("on_log", logs=logs)
        if step % 6 == 0:  # an evaluation: eval completions replace the buffers
            eval_metrics = trainer.generate_and_score(rng, skill=-0.5 + 2.0 * progress)
            fire("on_log", logs={f"eval_{k}": v for k, v in eval_metrics.items()})
            fire("on_save")
    fire(
        "on_log",
        logs={"train_runtime": 12.3, "train_samples_per_second": 40.0, "train_loss": 0.01},
    )
    fire("on_train_end")
    return out


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="runs/trl-fake", help="run directory")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    out = main(ns.out_dir, steps=ns.steps, seed=ns.seed)
    print(f"wrote {out}; next: rlscope analyze {out}")


if __name__ == "__main__":
    _cli()
