"""Judging in the loop: what `RunWriter.judge()` costs as a run grows. A synthetic run is written
step by step with RunWriter, as a training loop would, and judged every K steps; the table gives
a judgement's wall time at several run lengths (and the writing time per step), and its section
of benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_analyze import CACHE, ROOT
from bench_report import write_section

from rlscope.writer import RunWriter

SECTION = "## Judging in the loop"


def source_run(steps: int, prompts: int, cache: Path = CACHE) -> Path:
    """A healthy synthetic run of `steps` steps x `prompts` prompts x 8, with tokens and text."""
    from rlscope.synth import generate

    path = cache / f"live-{steps}x{prompts}"
    if not (path / "run.json").exists():
        generate(path, "healthy", steps=steps, prompts_per_step=prompts, group_size=8, seed=4)
    return path


def replay(source: Path, out: Path, every: int) -> list[tuple[int, float, int]]:
    """(step, judgement seconds, findings) of each judgement of `source` replayed into `out`."""
    import json

    meta = json.loads((source / "run.json").read_text())
    meta.pop("schema_version")
    frames = {
        t: pl.read_parquet(source / t / "*.parquet")
        for t in ("steps", "rollouts", "tokens")
        if (source / t).is_dir()
    }
    judged = []
    with RunWriter(out, stop_on="never", **meta) as writer:
        for step in sorted(frames["steps"]["step"].unique().to_list()):
            for table, frame in frames.items():
                rows = frame.filter(pl.col("step") == step)
                if table == "steps":
                    for row in rows.iter_rows(named=True):
                        writer.log_step(**row)
                else:
                    getattr(writer, f"log_{table}")(rows)
            if step and step % every == 0:
                started = time.perf_counter()
                writer.judge()
                judgement = writer.judgement
                assert judgement is not None and judgement.error is None, judgement
                judged.append((step, time.perf_counter() - started, len(judgement.findings)))
    return judged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    source = source_run(args.steps, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["RLSCOPE_CACHE_DIR"] = str(Path(tmp) / "cache")
        judged = replay(source, Path(tmp) / "run", args.every)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    marks = sorted({args.every, *(s for s, _, _ in judged if s % (args.steps // 8) == 0)})
    lines = [
        SECTION,
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()} (`benchmarks/bench_live.py`). A healthy synthetic run of "
        f"{args.steps} steps x {args.prompts} prompts x 8 rollouts (tokens and text) written "
        f"step by step with RunWriter and judged every {args.every} steps "
        "(`writer.judge()`: flush, analysis of the run so far with the per-file caches, onsets "
        f"of its findings). Peak RSS of the whole process: {rss:.2f} GiB.",
        "",
        "| judged at step | judgement (s) | findings |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {s} | {t:.2f} | {n} |" for s, t, n in judged if s in marks]
    total = sum(t for _, t, _ in judged)
    slowest = max(judged, key=lambda j: j[1])
    lines += [
        "",
        f"All {len(judged)} judgements: {total:.1f} s in all, {total / len(judged):.2f} s on "
        f"average, the slowest {slowest[1]:.2f} s (step {slowest[0]}).",
    ]
    write_section(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
