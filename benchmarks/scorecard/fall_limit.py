"""How early a fall of the task outcome can be sure: the genuine lr-too-high run's evidence at
the step its accuracy is half-way down, against the same statistic on every healthy TRL run.

The statistic is the one a stop at that step would rest on: the fall of the mean per-group
accuracy over the `fall` steps after a start from the `reference` steps before it, in units of
its standard error (each step's groups: 8 consecutive completions of one prompt). Usage:
`python benchmarks/scorecard/fall_limit.py` (after `make scorecard` made `.scorecard/`).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[2]
GROUP = 8


def group_accuracy(run: Path) -> list[np.ndarray]:
    """Per step (in order), the mean accuracy of each prompt's group, from TRL's completions."""
    files = sorted((run / "completions").glob("*.parquet"))
    rows = pl.concat([pl.read_parquet(f, columns=["step", "accuracy_reward"]) for f in files])
    steps = []
    for _, at in sorted(rows.group_by("step"), key=lambda kv: kv[0][0]):
        values = at["accuracy_reward"].to_numpy()
        steps.append(values[: values.size // GROUP * GROUP].reshape(-1, GROUP).mean(axis=1))
    return steps


def fall_z(steps: list[np.ndarray], reference: int = 1, fall: int = 2) -> list[float]:
    """For each start: (reference mean − fall mean) / its standard error."""
    out = []
    for start in range(reference, len(steps) - fall + 1):
        ref = np.concatenate(steps[start - reference : start])
        post = np.concatenate(steps[start : start + fall])
        se = math.sqrt(ref.var(ddof=1) / ref.size + post.var(ddof=1) / post.size)
        out.append((ref.mean() - post.mean()) / se if se > 0 else 0.0)
    return out


def main() -> int:
    faulty = fall_z(group_accuracy(ROOT / "tests/genuine/trl-real/lr-too-high"))[0]
    print(f"genuine lr-too-high: step 1 against steps 2-3, z = {faulty:.2f}")
    genuine = ROOT / "tests/genuine/trl-real"
    healthy = [genuine / "healthy", genuine / "format-weighted-groupnorm"]
    healthy += sorted((ROOT / ".scorecard").glob("trl-healthy-*"))
    healthy = [run for run in healthy if (run / "completions").is_dir()]
    every: list[float] = []
    reached = 0
    for run in healthy:
        z = fall_z(group_accuracy(run))
        every += z
        reached += max(z) >= faulty
        print(f"{run.name:32s} largest z {max(z):5.2f} over {len(z)} starts")
    share = np.mean(np.asarray(every) >= faulty)
    print(
        f"healthy: {reached} of {len(healthy)} runs reach z >= {faulty:.2f} at some start; "
        f"{share:.1%} of {len(every)} starts"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
