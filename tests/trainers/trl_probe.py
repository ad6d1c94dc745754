"""A genuine TRL GRPO run of the tiny reasoner (tiny_reasoner.py), probed in the loop by rlscope's
callback (`probe_every`): the interventions run with the trainer's own model as it trains.

Usage: python trl_probe.py MODEL_DIR RUN_DIR STEPS PROBE_EVERY [PER_STEP]
(PROBE_EVERY 0: no probing.) Environment:
  TRAINER_MAX_COMPLETION_LENGTH  GRPOConfig's max_completion_length (default 32: no completion
                reaches it; 16 cuts most `Add` chains, in their reasoning or their answer).
  TRAINER_DUMP_IDS  a file to write every train completion's token ids to, one JSON list a line
                in TRL's order (the order of its logged completions), EOS included: read from
                what `_generate_and_score_completions` returns, apart from rlscope's callback.

Prompts are the reasoner's two families (`Add a b c .`, whose answer its chain computes, and
`Copy n .`, whose answer is in the prompt), 8 prompts x 4 completions a step, the reward 1 when
the `<answer>` is right. Prints one JSON line: the training's wall seconds, the same run's
seconds without probing are not measured here (the test runs it twice), and each probing's
ProbeSummary.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from rlscope.importers.text import extract_answer
from rlscope.integrations.trl import RlscopeCallback

SEED = 0
MAX_COMPLETION_LENGTH = int(os.environ.get("TRAINER_MAX_COMPLETION_LENGTH", "32"))
DUMP_IDS = os.environ.get("TRAINER_DUMP_IDS")


def _dump_ids(trainer: GRPOTrainer, path: Path) -> None:
    """Wrap this trainer's `_generate_and_score_completions` to append each train
    completion's ids (its completion_mask's tokens) to `path`."""
    generate = trainer._generate_and_score_completions

    def dumped(inputs: Any) -> Any:
        output = generate(inputs)
        if trainer.model.training:
            ids, mask = output["completion_ids"].tolist(), output["completion_mask"].tolist()
            with path.open("a") as out:
                for row, keep in zip(ids, mask, strict=True):
                    out.write(json.dumps(row[: sum(keep)]) + "\n")
        return output

    trainer._generate_and_score_completions = dumped


def _dataset(n: int) -> Dataset:
    rng = random.Random(SEED)
    rows = []
    for i in range(n):
        if i % 2 == 0:
            a, b, c = (rng.randint(0, 9) for _ in range(3))
            rows.append({"prompt": f"Add {a} {b} {c} .", "truth": str(a + b + c)})
        else:
            m = rng.randint(0, 27)
            rows.append({"prompt": f"Copy {m} .", "truth": str(m)})
    return Dataset.from_list(rows)


def accuracy_reward(completions: list[str], truth: list[str], **_: object) -> list[float]:
    return [float(extract_answer(c) == t) for c, t in zip(completions, truth, strict=True)]


def main(model_dir: Path, run_dir: Path, steps: int, every: int, per_step: int) -> None:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = GRPOConfig(
        output_dir=str(run_dir.parent / f"{run_dir.name}-trainer"),
        per_device_train_batch_size=32,
        num_generations=4,
        max_completion_length=MAX_COMPLETION_LENGTH,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-5,
        beta=0.0,
        temperature=1.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=SEED,
        dataloader_num_workers=0,
    )
    callback = RlscopeCallback(
        run_dir,
        correct_reward="accuracy_reward",
        probe_every=every or None,
        probe_per_step=per_step,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[accuracy_reward],
        args=args,
        train_dataset=_dataset(steps * 8),
        callbacks=[callback],
    )
    if DUMP_IDS:  # before the callback's own wrapping, which then calls this one
        _dump_ids(trainer, Path(DUMP_IDS))
    callback.bind(trainer)
    began = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - began
    print(
        json.dumps(
            {"seconds": seconds, "steps": steps, "probes": [p.to_dict() for p in callback.probes]}
        )
    )


if __name__ == "__main__":
    if len(sys.argv) < 5:
        sys.exit(f"usage: python {Path(sys.argv[0]).name} MODEL_DIR RUN_DIR STEPS PROBE_EVERY")
    main(
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        int(sys.argv[5]) if len(sys.argv) > 5 else 2,
    )
