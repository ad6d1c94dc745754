"""Cost of the text metrics: `rlscope analyze` on a synthetic run with rollout text, with every
metric and with the text metrics left out (`--metrics`), wall time and peak RSS."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_analyze import CACHE, ROOT, timed


def ensure_run(responses: int) -> Path:
    """A cached healthy synthetic run with about `responses` train rollouts, text, no tokens."""
    from rlscope.synth import generate

    path = CACHE / f"text-{responses}"
    if (path / "run.json").exists():
        return path
    prompts, group = 512, 8
    steps = max(10, round(responses / (prompts * group)))
    t0 = time.perf_counter()
    generate(path, "healthy", steps=steps, prompts_per_step=prompts, group_size=group, tokens=False)
    print(f"generated {path.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return path


def text_free_metrics() -> str:
    """Every metric id that reads no rollout text, actions, answers or probes."""
    from rlscope.catalog import default_catalog

    METRICS = default_catalog().metrics

    text_levels = {("rollouts", "rollout"), ("probes", "")}
    return ",".join(
        m.id
        for m in METRICS.values()
        if not any((v.table, v.level) in text_levels for v in m.variants)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--responses", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS-text.md")
    args = parser.parse_args()
    base = [sys.executable, "-m", "rlscope", "analyze", "--format", "json", "--fail-on", "never"]
    rows = []
    for target in args.responses:
        run = ensure_run(target)
        full = [*base, str(run)]
        without = [*base, str(run), "--metrics", text_free_metrics()]
        a = sorted(timed(full) for _ in range(args.repeat))[args.repeat // 2]
        b = sorted(timed(without) for _ in range(args.repeat))[args.repeat // 2]
        rows.append((target, a, b))
        print(json.dumps({"responses": target, "all": a, "without_text": b}), file=sys.stderr)
    lines = [
        "# rlscope analyze with and without the text metrics",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; median of {args.repeat} runs; healthy synthetic runs with "
        "rollout text (~60 words), eval splits and probes, no token table "
        "(`benchmarks/bench_text.py`).",
        "",
        "| responses | all metrics (s) | peak RSS (GiB) | without text metrics (s) "
        "| peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, (at, arss), (bt, brss) in rows:
        lines.append(f"| {n:,} | {at:.1f} | {arss:.2f} | {bt:.1f} | {brss:.2f} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
