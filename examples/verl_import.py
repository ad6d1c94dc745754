"""verl -> rlscope: dump settings and `rlscope import`; writes a tiny fake verl output to try it.

verl writes nothing rlscope needs unless asked. Add to the `verl.trainer.main_ppo` command::

    trainer.rollout_data_dir=/path/dumps          # one <global_step>.jsonl per step (train)
    trainer.validation_data_dir=/path/val_dumps   # the same for validation generations
    trainer.logger='["console","file"]'           # step metrics as JSONL lines
    # the file logger's path: VERL_FILE_LOGGER_PATH=/path/metrics.jsonl (environment variable)

then, after (or during) training::

    rlscope import verl /path/dumps runs/x                     # rollouts (train)
    rlscope import verl /path/val_dumps runs/x --split eval_id # validation rollouts
    rlscope import verl-metrics /path/metrics.jsonl runs/x     # steps: actor/entropy, ...
    rlscope analyze runs/x

Each import appends to runs/x, and re-running one imports only the steps added since.

What verl dumps (`RayPPOTrainer._dump_generations`): per line `input` (decoded prompt),
`output` (decoded response), `gts`, `score` (sequence reward), `step`, and every reward-extra key
of the batch (math rewards add `acc`, `pred`). There is no prompt uid and no advantage: the
importer groups rollouts of one prompt by identical `input` within a step, and response lengths
come from text. The file logger writes `{"step": N, "data": {"actor/entropy": ..., ...}}` lines.

This script writes such a folder for a few fake steps (`write_fake_verl_outputs`) and, when the
importers (`rlscope.importers.import_run`) are installed, imports it (`import_into`). Run::

    python examples/verl_import.py /tmp/verl-demo --steps 8
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHAT = "<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class VerlOutputs:
    """Where the fake verl run wrote its files."""

    rollout_dir: Path  # trainer.rollout_data_dir
    validation_dir: Path  # trainer.validation_data_dir
    metrics_file: Path  # VERL_FILE_LOGGER_PATH


def write_fake_verl_outputs(
    root: str | Path, steps: int = 8, prompts: int = 4, n: int = 8, seed: int = 0
) -> VerlOutputs:
    """`steps` steps of `prompts` questions x `n` samples (`actor_rollout_ref.rollout.n`), in
    verl's formats: `<step>.jsonl` dumps (train, and validation every 4 steps) and file-logger
    lines. verl's global_steps start at 1; `n` samples of a prompt are consecutive
    (`batch.repeat(n, interleave=True)`)."""
    rng = np.random.default_rng(seed)
    root = Path(root)
    out = VerlOutputs(root / "dumps", root / "val_dumps", root / "metrics.jsonl")
    out.rollout_dir.mkdir(parents=True, exist_ok=True)
    out.validation_dir.mkdir(parents=True, exist_ok=True)
    metric_lines = []
    for step in range(1, steps + 1):
        progress = step / steps
        lines = _fake_batch(rng, step, prompts, n, skill=-0.5 + 2.0 * progress)
        _write_jsonl(out.rollout_dir / f"{step}.jsonl", lines)
        if step % 4 == 0:  # trainer.test_freq=4: validation adds `reward`
            val = _fake_batch(rng, step, prompts, 1, skill=-0.5 + 2.0 * progress)
            _write_jsonl(
                out.validation_dir / f"{step}.jsonl", [v | {"reward": v["score"]} for v in val]
            )
        lengths = [len(line["output"].split()) for line in lines]
        metric_lines.append(
            {
                "step": step,
                "data": {
                    "actor/entropy": 0.9 - 0.3 * progress,
                    "actor/pg_clipfrac": 0.002,
                    "actor/ppo_kl": 1e-4,
                    "actor/kl_loss": 0.001 + 0.01 * progress,
                    "actor/grad_norm": float(0.3 + 0.05 * rng.random()),
                    "actor/pg_loss": float(0.02 * rng.normal()),
                    "actor/lr": 1e-6,
                    "critic/score/mean": float(np.mean([x["score"] for x in lines])),
                    "response_length/mean": float(np.mean(lengths)),
                    "response_length/clip_ratio": 0.0,
                },
            }
        )
    _write_jsonl(out.metrics_file, metric_lines)
    return out


def _fake_batch(
    rng: np.random.Generator, step: int, prompts: int, n: int, skill: float
) -> list[dict]:
    lines = []
    for _ in range(prompts):
        a, b = (int(x) for x in rng.integers(10, 99, size=2))
        question = f"What is {a} + {b}? Put the final answer in \\boxed{{}}."
        p_correct = 1.0 / (1.0 + np.exp(-(skill - (a + b) / 60.0)))
        for _ in range(n):
            correct = bool(rng.random() < p_correct)
            pred = a + b if correct else a + b + int(rng.integers(1, 10))
            steps = " ".join(["then"] * int(rng.integers(3, 30)))
            lines.append(
                {
                    "input": CHAT.format(question=question),
                    "output": f"{a} plus {b}, {steps}, gives \\boxed{{{pred}}}.",
                    "gts": str(a + b),
                    "score": 1.0 if correct else 0.0,
                    "step": step,
                    "acc": correct,
                    "pred": str(pred),
                }
            )
    return lines


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def importers_available() -> bool:
    """Whether this rlscope has the importers (`rlscope.importers.import_run`)."""
    if importlib.util.find_spec("rlscope.importers") is None:
        return False
    return hasattr(importlib.import_module("rlscope.importers"), "import_run")


def import_into(outputs: VerlOutputs, run_dir: str | Path, run_id: str | None = None) -> Path:
    """`rlscope import verl` (train, then validation as `eval_id`) and `rlscope import
    verl-metrics`, as library calls; each appends to the same run directory."""
    from rlscope.importers import import_run  # type: ignore[import-not-found]

    import_run("verl", outputs.rollout_dir, run_dir, **({"run_id": run_id} if run_id else {}))
    import_run("verl", outputs.validation_dir, run_dir, split="eval_id")
    import_run("verl-metrics", outputs.metrics_file, run_dir)
    return Path(run_dir)


def main(out_dir: str | Path, steps: int = 8, seed: int = 0) -> Path | None:
    """Write the fake verl outputs under `out_dir`; import them into `out_dir/run` if possible.
    Returns the run directory, or None without the importers."""
    outputs = write_fake_verl_outputs(out_dir, steps=steps, seed=seed)
    if not importers_available():
        return None
    return import_into(outputs, Path(out_dir) / "run", run_id=Path(out_dir).name)


def _cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default="runs/verl-demo")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args()
    run = main(ns.out_dir, steps=ns.steps, seed=ns.seed)
    root = Path(ns.out_dir)
    print(f"fake verl outputs in {root}: dumps/, val_dumps/, metrics.jsonl")
    if run is None:
        print("rlscope.importers is not available in this rlscope: nothing imported")
    else:
        print(f"imported into {run}; next: rlscope analyze {run}")


if __name__ == "__main__":
    _cli()
