"""The scorecard's corpus: genuine runs, each fault by its real mechanism, healthy twins, sinks.

Every run here is written by a real trainer on CPU (tests/trainers: TRL's GRPOTrainer, a PPO loop
with a critic logging verl's keys, a sampler/trainer pair writing tokens with RunWriter), or is
one of the genuine outputs kept in tests/genuine. A fault run names the step its mechanism starts
(`fault_start`) and the findings that name that mechanism (`expect`: any of them at warn or
above counts); a healthy run expects nothing at warn or above at any prefix past the warm-up.
A TRL run is written through every sink TRL has at once (its own files, rlscope's callback,
TensorBoard, W&B offline, MLflow), and each sink is read back by its own reader.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = ROOT / "tests" / "trainers"
GENUINE = ROOT / "tests" / "genuine"

#: The learning-rate mechanism's findings: the task outcome falls, the policy drifts from its
#: reference, its updates spike (trl_lr_collapse.py: lr 40x).
LR_FAULT = (
    "update-change",
    "performance-regression",
    "kl-high",
    "kl-runaway",
    "grad-spike",
    "divergence",
)
#: A reward the policy can raise without the task: the findings that name what it learns.
FORMAT_FAULT = ("reward-hacking", "auxiliary-reward-dominates")
#: A verifier that pays a few prompts far more: the gradient concentrates on them, spikes; from
#: the steps alone, the 0/1 accuracy reward's logged mean and std leave [0, 1].
REWARD_BUG_FAULT = (
    "reward-concentration",
    "grad-spike",
    "reward-hacking",
    "accuracy-out-of-range",
)
#: Sinks of a TRL run: (name, import format or "" for an rlscope run directory, path under the
#: trainer's output, import options).
TRL_SINKS: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    ("trl files", "trl", ".", {"correct_column": "accuracy_reward"}),
    ("RlscopeCallback", "", "rlscope", {}),
    ("TensorBoard", "tensorboard", "runs", {}),
    ("W&B offline", "wandb", "wandb", {}),
    ("MLflow", "mlflow", "mlruns", {}),
)


@dataclass(frozen=True)
class Sink:
    """One way a run reaches rlscope: an import format (or an rlscope run directory) at a path."""

    name: str
    format: str
    path: Path
    options: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """One run of the corpus: how it is made, what it must be judged."""

    name: str
    family: str  # "trl", "ppo", "mismatch", "genuine"
    healthy: bool
    fault: str = ""  # the mechanism, in words
    fault_start: int | None = None  # the first step the fault acts on
    expect: tuple[str, ...] = ()  # findings that name the fault (any, at warn or above)
    command: tuple[str, ...] = ()  # the trainer's arguments after the script (OUT is {out})
    env: dict[str, str] = field(default_factory=dict)
    source: Path | None = None  # a genuine output kept in the repository

    def sinks(self, corpus: Path) -> list[Sink]:
        out = self.output(corpus)
        if self.family == "trl":
            return [
                Sink(name, fmt, _found(out / rel), opts)
                for name, fmt, rel, opts in TRL_SINKS
                if (out / rel).exists()
            ]
        if self.family == "ppo":
            return [Sink("verl file logger", "verl-metrics", out)]
        if self.family == "mismatch":
            return [Sink("RunWriter", "", out)]
        assert self.source is not None
        if self.source.suffix == ".jsonl":
            return [Sink("verl file logger", "verl-metrics", self.source)]
        return [Sink("trl files", "trl", self.source, {"correct_column": "accuracy_reward"})]

    def output(self, corpus: Path) -> Path:
        if self.source is not None:
            return self.source
        suffix = ".jsonl" if self.family == "ppo" else ""
        return corpus / f"{self.name}{suffix}"


def _found(path: Path) -> Path:
    """The W&B offline run folder under `wandb/` (the reader takes the folder of a run)."""
    if path.name == "wandb":
        runs = sorted(path.glob("offline-run-*"))
        return runs[-1] if runs else path
    return path


def _trl(name: str, mode: str, steps: int, healthy: bool, **env: str) -> Run:
    factor = env.get("TRAINER_JUMP_FACTOR", "40")
    fault = {
        "too-high": "lr 40x from step 1",
        "jump": f"lr x{factor} from step 25",
        "format-only": "accuracy weighted 0: the format reward alone",
        "reward-bug": "accuracy reward x10 on 10% of prompts from step 25",
    }.get(mode, "")
    start = {"too-high": 1, "jump": 25, "format-only": 1, "reward-bug": 25}.get(mode)
    expect = {"format-only": FORMAT_FAULT, "reward-bug": REWARD_BUG_FAULT}.get(mode, LR_FAULT)
    return Run(
        name,
        "trl",
        healthy,
        fault,
        start,
        () if healthy else expect,
        (
            "trl_lr_collapse.py",
            "{out}",
            mode,
            str(steps),
            "--judge",
            "{out}/rlscope",
            "never",
            "1000",
        ),
        {"TRAINER_REPORT_TO": "tensorboard,wandb,mlflow", **env},
    )


def _ppo(
    name: str, mode: str, fault: str, start: int | None, expect: tuple[str, ...], **env: str
) -> Run:
    steps = env.pop("STEPS", "60")  # the trainer's argument, not its environment
    return Run(
        name,
        "ppo",
        not expect,
        fault,
        start,
        expect,
        ("torch_ppo_critic.py", "{out}", mode, steps),
        env,
    )


CORPUS: tuple[Run, ...] = (
    # TRL GRPOTrainer: healthy twins over seeds, group sizes and reward scales (0.33 in groups of
    # 8: equal rewards that do not sum exactly in float32, so zero-sigma groups carry advantages
    # of float noise, ~6e-4), and the lr faults.
    _trl("trl-healthy-s0", "healthy", 50, True),
    _trl("trl-healthy-s1", "healthy", 50, True, TRAINER_SEED="1"),
    _trl("trl-healthy-s2", "healthy", 50, True, TRAINER_SEED="2"),
    _trl("trl-healthy-g4", "healthy", 50, True, TRAINER_GENERATIONS="4"),
    _trl("trl-healthy-r0.33", "healthy", 50, True, TRAINER_REWARD_SCALE="0.33"),
    _trl(
        "trl-healthy-g4-r0.1-s1",
        "healthy",
        50,
        True,
        TRAINER_GENERATIONS="4",
        TRAINER_REWARD_SCALE="0.1",
        TRAINER_SEED="1",
    ),
    _trl("trl-healthy-kl-off", "healthy", 50, True, TRAINER_BETA="0"),
    _trl("trl-healthy-grpo-loss", "healthy", 50, True, TRAINER_LOSS_TYPE="grpo"),
    _trl(
        "trl-healthy-dr-grpo",
        "healthy",
        50,
        True,
        TRAINER_LOSS_TYPE="dr_grpo",
        TRAINER_SCALE_REWARDS="none",
    ),
    _trl("trl-healthy-spg2", "healthy", 50, True, TRAINER_STEPS_PER_GENERATION="2"),
    # Scheduled changes of the learning rate: a warm-up from 0, then a cosine or linear decay.
    _trl(
        "trl-healthy-warmup-cosine",
        "healthy",
        50,
        True,
        TRAINER_LR_SCHEDULER_TYPE="cosine",
        TRAINER_WARMUP_STEPS="10",
    ),
    _trl(
        "trl-healthy-warmup-linear",
        "healthy",
        50,
        True,
        TRAINER_LR_SCHEDULER_TYPE="linear",
        TRAINER_WARMUP_STEPS="5",
        TRAINER_SEED="2",
    ),
    _trl("trl-lr-too-high", "too-high", 50, False),
    _trl("trl-lr-jump", "jump", 50, False),
    _trl("trl-lr-jump-s1", "jump", 50, False, TRAINER_SEED="1"),
    # The case: x10, a slow decline rather than a collapse (accuracy ~0.9 to step 50,
    # 0.3-0.7 after).
    _trl("trl-lr-jump-x10", "jump", 70, False, TRAINER_JUMP_FACTOR="10"),
    _trl("trl-format-only", "format-only", 50, False),
    # A verifier bug on a few prompts under Dr. GRPO (advantages not divided by the group's std)
    _trl(
        "trl-reward-bug-dr-grpo",
        "reward-bug",
        50,
        False,
        TRAINER_LOSS_TYPE="dr_grpo",
        TRAINER_SCALE_REWARDS="none",
    ),
    # Eval sets that do not transfer: an in-distribution set rises, one of digits never trained
    # stays at 0.
    Run(
        "trl-ood-no-transfer",
        "trl",
        False,
        "OOD eval set never trained",
        1,
        ("ood-gap",),
        ("trl_two_eval_sets.py", "{out}"),
        {"TRAINER_REPORT_TO": "tensorboard,wandb,mlflow"},
    ),
    # A PPO loop with a critic, logged as verl logs it.
    _ppo("ppo-healthy-s0", "healthy", "", None, ()),
    _ppo("ppo-healthy-s1", "healthy", "", None, (), TRAINER_SEED="1"),
    _ppo("ppo-healthy-s2", "healthy", "", None, (), TRAINER_SEED="2"),
    _ppo("ppo-frozen-critic", "frozen-critic", "critic lr 0", 1, ("critic-not-learning",)),
    _ppo(
        "ppo-critic-diverges",
        "critic-diverges",
        "critic lr 1.0",
        1,
        ("critic-not-learning", "value-divergence"),
    ),
    _ppo("ppo-critic-lr-high", "critic-lr-high", "critic lr 0.3", 1, ("critic-not-learning",)),
    _ppo(
        "ppo-critic-lr-jump",
        "critic-lr-jump",
        "critic lr x1000 at step 30",
        30,
        ("update-change", "value-divergence"),
    ),
    _ppo(
        "ppo-kl-target-too-low",
        "kl-runaway",
        "adaptive KL target 1e-6",
        1,
        ("kl-coef-runaway",),
        STEPS="70",
    ),
    # A sampler and a trainer: bf16 kernels are a genuine small mismatch, a perturbed sampler a
    # broken one.
    Run("mismatch-fp32", "mismatch", True, command=("torch_mismatch.py", "{out}", "fp32")),
    Run("mismatch-bf16", "mismatch", True, command=("torch_mismatch.py", "{out}", "bf16")),
    Run(
        "mismatch-perturbed",
        "mismatch",
        False,
        "sampler weights perturbed",
        0,
        ("train-inference-mismatch",),
        ("torch_mismatch.py", "{out}", "perturbed"),
    ),
    # The genuine outputs the tests pin (tests/genuine/*/README.md).
    Run("genuine trl-real/healthy", "genuine", True, source=GENUINE / "trl-real" / "healthy"),
    Run(
        "genuine trl-real/format-weighted",
        "genuine",
        True,
        source=GENUINE / "trl-real" / "format-weighted-groupnorm",
    ),
    Run(
        "genuine trl-real/lr-too-high",
        "genuine",
        False,
        "lr 20x from step 1",
        1,
        LR_FAULT,
        source=GENUINE / "trl-real" / "lr-too-high",
    ),
    Run(
        "genuine trl-real/too-hard",
        "genuine",
        False,
        "prompts the policy cannot solve",
        1,
        ("dead-prompts",),
        source=GENUINE / "trl-real" / "too-hard",
    ),
    Run(
        "genuine ppo-critic/healthy",
        "genuine",
        True,
        source=GENUINE / "ppo-critic" / "healthy.jsonl",
    ),
    Run(
        "genuine ppo-critic/frozen",
        "genuine",
        False,
        "critic frozen",
        1,
        ("critic-not-learning",),
        source=GENUINE / "ppo-critic" / "frozen-critic.jsonl",
    ),
)


def generate(corpus: Path, python: str, runs: Sequence[Run] = CORPUS, jobs: int = 2) -> None:
    """Writes every trainer run not yet in `corpus` (a `.done` file beside it holds the command
    that made it and a digest of the code that writes it: a change to either makes it again),
    `jobs` trainers at a time, each on one thread. Fails with the trainer's stderr."""
    corpus.mkdir(parents=True, exist_ok=True)
    todo = [run for run in runs if run.command and not _made(run, corpus)]

    def make(run: Run) -> None:
        out = run.output(corpus)
        args = [a.replace("{out}", str(out)) for a in run.command]
        if out.is_dir():
            subprocess.run(["rm", "-rf", str(out)], check=True)
        out.unlink(missing_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **run.env}
        done = subprocess.run(
            [python, str(TRAINERS / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            env=env,
            cwd=TRAINERS,
            timeout=1800,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{run.name}: {shlex.join(args)} failed:\n{done.stderr[-3000:]}")
        _stamp(run, corpus).write_text(_recipe(run))
        print(f"  made {run.name}", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(make, todo))


def _stamp(run: Run, corpus: Path) -> Path:
    return corpus / f"{run.name}.done"


#: What writes a run besides its command: the trainers and rlscope's writing side (its
#: callback and hooks, RunWriter). A change to any of them makes every run again.
WRITERS = (
    TRAINERS,
    ROOT / "rlscope" / "integrations",
    ROOT / "rlscope" / "writer.py",
    ROOT / "rlscope" / "tablewriter.py",
)


def _writers_digest() -> str:
    digest = hashlib.blake2b(digest_size=8)
    for root in WRITERS:
        for path in sorted(root.rglob("*.py")) if root.is_dir() else [root]:
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _recipe(run: Run) -> str:
    env = [f"{k}={v}" for k, v in sorted(run.env.items())]
    return shlex.join([*env, *run.command, f"# writers {_writers_digest()}"])


def _made(run: Run, corpus: Path) -> bool:
    stamp = _stamp(run, corpus)
    return stamp.is_file() and stamp.read_text() == _recipe(run)
