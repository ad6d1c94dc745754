"""Time `rlscope analyze` against a bare streaming scan of the same token columns; peak RSS too."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".bench"
TOKEN_COLUMNS = [
    "step",
    "rollout_id",
    "logprob",
    "old_logprob",
    "ref_logprob",
    "entropy",
    "advantage",
]

BARE_SCAN = """
import sys, polars as pl
lf = pl.scan_parquet(sys.argv[1] + "/tokens/**/*.parquet")
cols = {cols!r}
lf.select([pl.col(c).cast(pl.Float64).sum() for c in cols]).collect()
"""


def ensure_run(tokens: int) -> Path:
    """A cached healthy synthetic run with about `tokens` token rows."""
    from rlscope.synth import generate

    path = CACHE / f"healthy-notext-{tokens}"
    if (path / "run.json").exists():
        return path
    prompts, group = 256, 8
    tokens_per_step = prompts * group * 48  # ~48 tokens per synthetic response on average
    steps = max(10, round(tokens / tokens_per_step))
    t0 = time.perf_counter()
    # No rollout text: this benchmark is about the token scans (bench_text.py times the text).
    generate(
        path, "healthy", steps=steps, prompts_per_step=prompts, group_size=group, seed=0, text=False
    )
    print(f"generated {path.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return path


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{cmd} failed with status {status}")
    return time.perf_counter() - t0, usage.ru_maxrss / 2**20


def token_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.read_metadata(f).num_rows for f in (path / "tokens").rglob("*.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[10_000_000, 50_000_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    rows = []
    for target in args.tokens:
        run = ensure_run(target)
        n = token_rows(run)
        analyze = [
            sys.executable,
            "-m",
            "rlscope",
            "analyze",
            str(run),
            "--format",
            "json",
            "--fail-on",
            "never",
        ]
        bare = [sys.executable, "-c", BARE_SCAN.format(cols=TOKEN_COLUMNS), str(run)]
        a = sorted(timed(analyze) for _ in range(args.repeat))[args.repeat // 2]
        b = sorted(timed(bare) for _ in range(args.repeat))[args.repeat // 2]
        rows.append((n, a, b))
        print(
            json.dumps(
                {
                    "tokens": n,
                    "analyze_s": a[0],
                    "analyze_rss_gib": a[1],
                    "bare_scan_s": b[0],
                    "bare_rss_gib": b[1],
                }
            ),
            file=sys.stderr,
        )
    lines = [
        "# rlscope analyze benchmark",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; median of {args.repeat} runs; healthy synthetic runs "
        "(`benchmarks/bench_analyze.py`).",
        "",
        "| token rows | analyze (s) | analyze peak RSS (GiB) | bare scan (s) | bare peak RSS (GiB) "
        "| analyze / scan | M tokens/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, (at, arss), (bt, brss) in rows:
        lines.append(
            f"| {n:,} | {at:.2f} | {arss:.2f} | {bt:.2f} | {brss:.2f} | {at / bt:.2f} "
            f"| {n / at / 1e6:.1f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
