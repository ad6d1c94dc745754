"""Real TRL GRPOTrainer runs on CPU whose task accuracy collapses from a too-high learning rate.

For the slow tests: rlscope should name an early collapse of the task accuracy and its cause (the
learning rate), and stay quiet about it on the healthy run. A tiny from-scratch Qwen2 policy
(word-level vocabulary of 19 tokens, 77k parameters) answers "<verb> the number A B" with "A B"
(100 digit pairs x the verbs say, repeat, echo). Before RL a plain torch loop trains it on a noisy
teacher (right with probability 0.75, else one digit changed; a trailing filler word 20% of the
time), so it starts at ~0.8 accuracy with groups that disagree. GRPOTrainer then trains it for
STEPS steps of 8 prompts x GENERATIONS completions (beta 0.04, so `kl` is logged) with rewards
accuracy_reward (1 when the first two words are A B) and format_reward (0.25 for a two-word
answer), both times REWARD_SCALE, writing OUT_DIR/completions/completions_<step:05d>.parquet and
OUT_DIR/trainer_state.json.

MODE (measured with the defaults, seed 0, 50 steps, ~14 s each on one thread):
  healthy   lr 5e-4, constant: accuracy 0.78 at step 1 (0.78 over steps 1-3) rising to 0.94
            over steps 41-50; kl at most 0.30.
  too-high  lr 2e-2 (40x) from step 1: accuracy 0.78 at step 1, 0.00 at step 2 (kl 0 -> 5.5,
            grad_norm 10.4), 0.01 over steps 41-50, never recovering; kl ~5 throughout. The
            policy ends up repeating one digit whatever the prompt ("8 8 8").
  jump      identical to healthy (bit for bit) through step 24; from JUMP_STEP = 25 the logged
            learning_rate is 2e-2 (a LambdaLR passed through `optimizers`). Accuracy 0.87 over
            steps 1-24 (min 0.73, kl <= 0.27), then 0.89, 0.53, 0.19 at steps 26-28 (kl 1.6,
            3.5, 3.7) and 0.03 over steps 41-50.
  reward-bug  healthy's lr; from BUG_STEP = 25 the accuracy reward pays a right answer
            BUG_FACTOR = 10 times on the prompts whose two digits are equal (10 of 100 pairs):
            a verifier bug on a few prompts (run it under Dr. GRPO, TRAINER_LOSS_TYPE=dr_grpo
            TRAINER_SCALE_REWARDS=none, where advantages are not divided by the group's std).
  format-only  healthy's lr, the accuracy reward weighted 0 (GRPOConfig.reward_weights [0, 1];
            still computed and logged): the policy is trained on the format term alone. The
            reward (format) goes 0.19 → 0.25 (every answer two words by step ~30) while the
            accuracy drifts 0.78 → 0.62-0.81 (steps 41-50), untrained.
Seeds 1 and 2 (TRAINER_SEED) give the same picture. Deterministic for a seed on one machine.

With `--judge RUN_DIR STOP_ON EVERY` the run also carries rlscope's RlscopeCallback writing
RUN_DIR, judging every EVERY steps and stopping on STOP_ON (`never`, `critical`, ids joined by
commas); the trainer may then save a checkpoint (save_steps past the run: only a stop, or the
run's end, saves one) and reports to TensorBoard (OUT_DIR/runs/), where rlscope's metrics go too.
The last line printed is JSON: the steps trained, the training time, and each judgement's step,
seconds and findings.

Under `torchrun --nproc_per_node N` it trains on N CPU processes (gloo), each with its batch.

Environment (each unset: the runs above):
  TRAINER_SEED  the seed of everything (SFT data, model init, sampling); default 0.
  TRAINER_GENERATIONS
                num_generations, the group size; default 8 (the batch stays 8 prompts).
  TRAINER_REWARD_SCALE
                factor on both rewards; default 1. Where a group's equal rewards do not sum
                exactly in float32, TRL's (r - mean) / (std + 1e-4) gives them advantages of
                float noise, not 0 (measured, TRL 1.16): GENERATIONS=8 with 0.33 gives all-right
                groups (0.4125 each) |advantage| ~6e-4. 0.1 leaves those exact (0.1 + 0.025
                rounds to 0.125), only all-0.1 or all-0.025 groups get noise, and with
                GENERATIONS=4 no scale gives any (four equal values sum exactly).
  TRAINER_BETA  the KL coefficient; default 0.04 (0: no reference model, no `kl` logged).
  TRAINER_LOSS_TYPE, TRAINER_SCALE_REWARDS, TRAINER_STEPS_PER_GENERATION
                GRPOConfig's loss_type (TRL 1.16's default `dapo`; `grpo`, `dr_grpo`, ...),
                scale_rewards (`group`; `none` for Dr. GRPO) and steps_per_generation (one
                generation batch of 8 prompts x GRPOConfig's steps_per_generation, trained
                over that many optimizer steps); unset: TRL's defaults.
  TRAINER_LR_SCHEDULER_TYPE, TRAINER_WARMUP_STEPS
                the Trainer's lr schedule (`constant` unless set; `cosine`, `linear`, ...) and
                its linear warm-up steps (TRL's default 0): a healthy run's scheduled changes
                of the learning rate. The jump mode's own scheduler ignores them.
  TRAINER_TOKEN_SAMPLE
                with --judge, the callback's token_sample: `all` (its default: every
                completion's tokens, the tokens table), `none` (rollouts and steps only) or a
                share of the rollouts (0.25).
  TRAINER_JUMP_FACTOR
                mode jump's factor on the learning rate from JUMP_STEP; default 40.
  TRAINER_REPORT_TO
                the Trainer's report_to, comma-separated (tensorboard, wandb, mlflow); default
                none, or tensorboard with --judge. Every sink writes under OUT_DIR, offline, and
                the W&B and MLflow runs are named after OUT_DIR's folder:
                  tensorboard  OUT_DIR/runs/<time>_<host>/events.out.tfevents.*
                  wandb        WANDB_MODE=offline, WANDB_DIR=OUT_DIR, WANDB_PROJECT=trl_lr_collapse:
                               OUT_DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb (history and
                               TRL's completions table)
                  mlflow       MLFLOW_TRACKING_URI=file://OUT_DIR/mlruns (absolute),
                               MLFLOW_ALLOW_FILE_STORE=true (MLflow 3 refuses file stores
                               otherwise), MLFLOW_EXPERIMENT_NAME=trl_lr_collapse,
                               MLFLOW_DISABLE_TELEMETRY=true: OUT_DIR/mlruns/<experiment>/<run>/
                A variable already set wins. wandb and mlflow(-skinny) come with
                `make .venv-trl/.installed-sinks`, not with the slow tests' venv stamp.

Usage: python trl_lr_collapse.py OUT_DIR {healthy,too-high,jump} [STEPS] [--judge RUN_DIR STOP_ON
EVERY]  (STEPS defaults to 50)
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import sinks
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

DIGITS = [str(d) for d in range(10)]
VERBS = ["say", "repeat", "echo"]
FILLERS = ["please", "now"]
WORDS = [*VERBS, "the", "number", *FILLERS]

TEACHER_ACCURACY = 0.75  # the SFT teacher's share of right answers
TEACHER_FILLER = 0.2  # the SFT teacher's share of answers with a trailing filler word
SFT_STEPS = 300
SFT_LR = 3e-3
HEALTHY_LR = 5e-4
TOO_HIGH_LR = 2e-2
JUMP_STEP = 25  # mode jump: the first step trained with HEALTHY_LR * JUMP_FACTOR
JUMP_FACTOR = float(os.environ.get("TRAINER_JUMP_FACTOR", TOO_HIGH_LR / HEALTHY_LR))
MODES = ("healthy", "too-high", "jump", "format-only", "reward-bug")
#: mode reward-bug: from this step, a verifier bug pays a right answer BUG_FACTOR times on the
#: prompts whose two digits are equal (10 of the 100 pairs)
BUG_STEP = 25
BUG_FACTOR = 10.0
REWARD_BUG = {"on": False}
PROMPTS_PER_STEP = 8
SEED = int(os.environ.get("TRAINER_SEED", "0"))
GENERATIONS = int(os.environ.get("TRAINER_GENERATIONS", "8"))
REWARD_SCALE = float(os.environ.get("TRAINER_REWARD_SCALE", "1"))
BETA = float(os.environ.get("TRAINER_BETA", "0.04"))
#: GRPOConfig fields passed through when set (TRL's defaults otherwise)
CONFIG = {
    name: cast(os.environ[f"TRAINER_{name.upper()}"])
    for name, cast in (
        ("loss_type", str),
        ("scale_rewards", str),
        ("steps_per_generation", int),
        ("lr_scheduler_type", str),
        ("warmup_steps", int),
    )
    if f"TRAINER_{name.upper()}" in os.environ
}
LR_SCHEDULER_TYPE = CONFIG.pop("lr_scheduler_type", "constant")
TOKEN_SAMPLE = os.environ.get("TRAINER_TOKEN_SAMPLE", "all")
REPORT_TO = sinks.report_to()
SINK_NAME = "trl_lr_collapse"  # the W&B project and the MLflow experiment


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", *WORDS, *DIGITS])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.padding_side = "left"
    return tokenizer


def _prompts() -> list[dict[str, str]]:
    return [
        {"prompt": f"{verb} the number {a} {b}", "answer": f"{a} {b}"}
        for a in DIGITS
        for b in DIGITS
        for verb in VERBS
    ]


def _teacher(answer: str, rng: random.Random) -> str:
    """The answer with probability TEACHER_ACCURACY, else one of its digits changed; a filler
    word after it with probability TEACHER_FILLER."""
    digits = answer.split()
    if rng.random() >= TEACHER_ACCURACY:
        i = rng.randrange(2)
        digits[i] = rng.choice([d for d in DIGITS if d != digits[i]])
    if rng.random() < TEACHER_FILLER:
        digits.append(rng.choice(FILLERS))
    return " ".join(digits)


def _sft(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, batch: int = 64) -> None:
    """Plain supervised training on the noisy teacher (loss on completion tokens only)."""
    rng = random.Random(SEED)
    prompts = _prompts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    model.train()
    for _ in range(SFT_STEPS):
        rows: list[tuple[list[int], list[int]]] = []
        for row in rng.choices(prompts, k=batch):
            prompt = tokenizer(row["prompt"])["input_ids"]
            completion = tokenizer(_teacher(row["answer"], rng))["input_ids"]
            rows.append((prompt, [*completion, tokenizer.eos_token_id]))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
            mask[i, : len(p) + len(c)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _jump_optimizers(
    model: Qwen2ForCausalLM,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer TRL would build (fused AdamW, no weight decay) at HEALTHY_LR until
    JUMP_STEP, then JUMP_FACTOR times that. The scheduler's index counts the updates done, so
    step k (1-based) trains at index k - 1; TRL logs that step's learning_rate before stepping."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=HEALTHY_LR, weight_decay=0.0, fused=True)

    def factor(done: int) -> float:
        return 1.0 if done + 1 < JUMP_STEP else JUMP_FACTOR

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def accuracy_reward(
    completions: list[str], answer: list[str], trainer_state: Any = None, **_: Any
) -> list[float]:
    # TRL passes the TrainerState: global_step is the updates done, so step k scores at k - 1
    bugged = (
        REWARD_BUG["on"] and trainer_state is not None and trainer_state.global_step + 1 >= BUG_STEP
    )
    return [
        (BUG_FACTOR if bugged and len(set(a.split())) == 1 else 1.0) * REWARD_SCALE
        if c.split()[:2] == a.split()
        else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def format_reward(completions: list[str], **_: Any) -> list[float]:
    return [0.25 * REWARD_SCALE if len(c.split()) == 2 else 0.0 for c in completions]


def main(out: Path, mode: str, steps: int, judge: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    REWARD_BUG["on"] = mode == "reward-bug"
    torch.manual_seed(SEED)
    # OUT/runs/ with --judge: rlscope's metrics beside TRL's
    report_to = REPORT_TO or (["tensorboard"] if judge else [])
    sinks.point(out, report_to, SINK_NAME)
    tokenizer = _tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    sft = Qwen2ForCausalLM(config)
    _sft(sft, tokenizer)
    with tempfile.TemporaryDirectory() as sft_dir:
        # TRL builds the KL reference from the policy's config._name_or_path: load from disk.
        sft.save_pretrained(sft_dir)
        model = Qwen2ForCausalLM.from_pretrained(sft_dir)
        # After the save: the config starts torch.distributed under torchrun, and a process other
        # than the first would then save nothing (every process trains the same SFT policy).
        args = GRPOConfig(
            output_dir=str(out),
            num_generations=GENERATIONS,
            per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
            max_completion_length=4,
            max_steps=steps,
            learning_rate=TOO_HIGH_LR if mode == "too-high" else HEALTHY_LR,
            lr_scheduler_type=LR_SCHEDULER_TYPE,
            beta=BETA,
            # format-only: the accuracy reward is still computed and logged, with weight 0
            reward_weights=[0.0, 1.0] if mode == "format-only" else None,
            logging_steps=1,
            log_completions=True,
            report_to=report_to,
            run_name=out.name if REPORT_TO else None,
            save_strategy="steps" if judge else "no",
            save_steps=10 * steps,
            use_cpu=True,
            seed=SEED,
            disable_tqdm=True,
            **CONFIG,
        )
        callbacks = []
        if judge:
            from rlscope.integrations.trl import RlscopeCallback

            run_dir, stop_on, every = judge
            callbacks.append(
                RlscopeCallback(
                    run_dir,
                    correct_reward="accuracy_reward",
                    judge_every=int(every),
                    stop_on=stop_on if stop_on in ("never", "critical") else stop_on.split(","),
                    token_sample=TOKEN_SAMPLE
                    if TOKEN_SAMPLE in ("all", "none")
                    else float(TOKEN_SAMPLE),
                )
            )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[accuracy_reward, format_reward],
            args=args,
            train_dataset=Dataset.from_list(_prompts()),
            processing_class=tokenizer,
            optimizers=_jump_optimizers(model) if mode == "jump" else (None, None),
            callbacks=callbacks,
        )
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    trainer.save_state()  # OUT/trainer_state.json
    sinks.finish(report_to)  # WandbCallback leaves its run open: closed before the summary line
    judgements = [
        {"step": j.step, "seconds": j.seconds, "findings": [f.id for f in j.findings]}
        for c in callbacks
        for j in c.judgements
    ]
    summary = {"steps": trainer.state.global_step, "seconds": seconds, "judgements": judgements}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    argv, judge = sys.argv[1:], None
    if "--judge" in argv:
        at = argv.index("--judge")
        argv, judge = argv[:at], argv[at + 1 : at + 4]
    if len(argv) < 2 or argv[1] not in MODES or (judge is not None and len(judge) != 3):
        sys.exit(
            f"usage: python {Path(__file__).name} OUT_DIR {{{','.join(MODES)}}} [STEPS] "
            "[--judge RUN_DIR STOP_ON EVERY]"
        )
    main(Path(argv[0]), argv[1], int(argv[2]) if len(argv) > 2 else 50, judge)
