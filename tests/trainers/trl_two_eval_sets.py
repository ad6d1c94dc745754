"""A real TRL GRPOTrainer run on CPU with a dict of two eval sets (run by the slow tests).

A tiny from-scratch Qwen2 policy (word-level vocabulary of 21 tokens, ~20k parameters) learns
to answer "<verb> the digit D" with D. Training prompts use digits 0-4 with the verbs say,
repeat and echo; the `in_dist` eval set asks digits 0-4 with other verbs, the `ood` set digits
5-9, never trained. Rewards: accuracy_reward (1 when the first word is D) and format_reward
(0.25 for a one-word answer). Deterministic for a seed on one machine (about 20 s).

TRAINER_REPORT_TO (tensorboard, wandb, mlflow, comma-separated) writes the run through those
sinks too, under OUT_DIR, offline (sinks.py), as trl_lr_collapse.py does.

Usage: python trl_two_eval_sets.py OUT_DIR [STEPS]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import sinks
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

DIGITS = [str(d) for d in range(10)]
WORDS = ["say", "repeat", "echo", "copy", "the", "digit", "number", "please", "now"]


def _prompts(digits: list[str], verbs: list[str]) -> list[dict[str, str]]:
    return [{"prompt": f"{verb} the digit {d}", "answer": d} for d in digits for verb in verbs]


def accuracy_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [1.0 if c.split()[:1] == [a] else 0.0 for c, a in zip(completions, answer, strict=True)]


def format_reward(completions: list[str], **_: Any) -> list[float]:
    return [0.25 if len(c.split()) == 1 else 0.0 for c in completions]


def main(out: Path, steps: int) -> None:
    torch.manual_seed(0)
    report_to = sinks.report_to()
    sinks.point(out, report_to, "trl_two_eval_sets")
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", *WORDS, *DIGITS])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.padding_side = "left"
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    train = Dataset.from_list(_prompts(DIGITS[:5], ["say", "repeat", "echo"]) * 8)
    evals = {
        "in_dist": Dataset.from_list(_prompts(DIGITS[:5], ["copy", "please"])),
        "ood": Dataset.from_list(_prompts(DIGITS[5:], ["copy", "please"])),
    }
    args = GRPOConfig(
        output_dir=str(out),
        num_generations=8,
        per_device_train_batch_size=32,
        per_device_eval_batch_size=8,
        max_completion_length=3,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=max(1, steps // 12),
        log_completions=True,
        report_to=report_to,
        run_name=out.name if report_to else None,
        save_strategy="no",
        use_cpu=True,
        beta=0.0,
        seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=Qwen2ForCausalLM(config),
        reward_funcs=[accuracy_reward, format_reward],
        args=args,
        train_dataset=train,
        eval_dataset=evals,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_state()  # OUT/trainer_state.json
    sinks.finish(report_to)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 240)
