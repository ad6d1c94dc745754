"""`rlscope import wandb` of a long W&B history (100k steps x 200 keys by default, written once by
wandb itself, offline): wall time and peak RSS; writes its section of benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_analyze import CACHE, ROOT, measure, summary
from bench_report import write_section

RLSCOPE = [sys.executable, "-m", "rlscope"]
SECTION = "## W&B import"
#: verl's own names first (the mapped ones), then extra keys up to the count.
VERL_KEYS = (
    "actor/pg_loss",
    "actor/grad_norm",
    "actor/lr",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/kl_loss",
    "actor/ppo_kl",
    "critic/score/mean",
    "response_length/mean",
    "response_length/clip_ratio",
)
WRITER = """
import os, random, sys, wandb
steps, keys, folder = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
run = wandb.init(project="rlscope-bench", dir=folder, mode="offline",
                 settings=wandb.Settings(console="off", x_disable_stats=True))
rnd = random.Random(0)
for step in range(1, steps + 1):
    run.log({k: rnd.random() for k in keys}, step=step)
run.finish()
"""


def keys(count: int) -> list[str]:
    extra = [f"perf/metric_{i:03d}" for i in range(max(0, count - len(VERL_KEYS)))]
    return [*VERL_KEYS, *extra][:count]


def ensure_file(steps: int, count: int, cache: Path) -> tuple[Path, float | None]:
    """The run file (written on first use, kept under `cache`), and the seconds wandb took to
    write it when it was written now."""
    folder = cache / f"wandb-{steps}x{count}"
    found = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
    if found:
        return found[0], None
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", WRITER, str(steps), ",".join(keys(count)), str(folder)],
        check=True,
        env=env,
    )
    return next(folder.glob("wandb/offline-run-*/run-*.wandb")), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "RESULTS.md",
        help="written as its section `## W&B import` (the rest of the file is kept)",
    )
    args = parser.parse_args()
    path, wrote = ensure_file(args.steps, args.keys, args.cache)
    size = path.stat().st_size / 2**30
    load = os.getloadavg()[0]
    runs = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as out:
            runs.append(measure([*RLSCOPE, "import", "wandb", str(path), str(Path(out) / "o")]))
    seconds, rss, cpu = summary(runs)
    written = f" (wandb {wrote:.0f} s to write it)" if wrote is not None else ""
    loads = f"{load:.1f} before, {os.getloadavg()[0]:.1f} after"
    lines = [
        SECTION,
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; median of {args.repeat} runs, each a fresh process "
        "(`benchmarks/bench_wandb.py`). The run file is written once by wandb itself, offline "
        f"(`wandb.log` of {args.keys} keys with step=, verl's names first){written}, and kept "
        "under .bench/. The import reads the whole file (its CRC-checked chunks, summary records "
        "skipped by field number), decodes the history rows as columns and writes the steps "
        "table, with the file's manifest hash on a thread of its own. Load average (1 min): "
        f"{loads} (the wall time is the machine's, shared). Target: 100k steps x 200 keys in "
        "at most 10 s and 0.5 GiB.",
        "",
        "| steps | keys | file (GiB) | import (s) | CPU (s) | peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {args.steps:,} | {args.keys} | {size:.2f} | {seconds:.1f} | {cpu:.1f} | {rss:.2f} |",
    ]
    write_section(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
