"""`rlscope report` against `analyze` (one run) and `compare` (two runs) of the same runs: wall
time (median) and peak RSS, each a fresh process; writes its section of benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_analyze import CACHE, ROOT, timed

RLSCOPE = [sys.executable, "-m", "rlscope"]


def ensure_runs(cache: Path = CACHE) -> list[Path]:
    """Two synthetic 200-step runs (32 prompts x 8, with tokens and text): healthy and a
    collapsing one, as a comparison would have them."""
    from rlscope.synth import generate

    runs = []
    for scenario, seed in (("healthy", 1), ("entropy-collapse", 2)):
        path = cache / f"report-{scenario}"
        if not (path / "run.json").exists():
            generate(path, scenario, steps=200, prompts_per_step=32, group_size=8, seed=seed)
        runs.append(path)
    return runs


def median(cmd: list[str], repeat: int) -> tuple[float, float]:
    """Median wall time and largest peak RSS, each run with an empty cache dir of its own."""
    runs = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as cache:
            runs.append(timed(cmd, {**os.environ, "RLSCOPE_CACHE_DIR": cache}))
    return sorted(t for t, _ in runs)[repeat // 2], max(r for _, r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "RESULTS.md",
        help="written as its section `## report` (the rest of the file is kept)",
    )
    args = parser.parse_args()
    sample = ROOT / "sample_logs" / "healthy"
    two = ensure_runs()
    page = Path(tempfile.mkdtemp()) / "report.html"
    cases = [
        (
            "`sample_logs/healthy` (60 steps)",
            [*RLSCOPE, "analyze", str(sample), "--fail-on", "never"],
            [*RLSCOPE, "report", str(sample), "-o", str(page)],
        ),
        (
            "two synthetic runs of 200 steps x 32 prompts x 8, tokens and text",
            [*RLSCOPE, "compare", *map(str, two)],
            [*RLSCOPE, "report", *map(str, two), "-o", str(page)],
        ),
    ]
    lines = [
        SECTION,
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; median of {args.repeat} runs, each a fresh process with "
        "an empty cache (`benchmarks/bench_report.py`). The report is the analysis plus the "
        "page: its charts are drawn by rlscope itself (`rlscope/render/svg.py`).",
        "",
        "| runs | analyze or compare (s) | peak RSS (GiB) | report (s) | peak RSS (GiB) "
        "| report / analysis | page (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for what, analysis, report in cases:
        (at, arss), (rt, rrss) = median(analysis, args.repeat), median(report, args.repeat)
        size = page.stat().st_size / 1e6
        lines.append(
            f"| {what} | {at:.2f} | {arss:.2f} | {rt:.2f} | {rrss:.2f} | {rt / at:.2f} "
            f"| {size:.2f} |"
        )
    write_section(args.out, lines)
    print("\n".join(lines))


SECTION = "## report against analyze / compare"


def write_section(path: Path, lines: list[str]) -> None:
    """`lines` (a section: its first line the `## ` heading) in place of that section of
    `path`, or at its end; the rest of the file as it was."""
    text = path.read_text() if path.exists() else ""
    head, _, tail = text.partition(lines[0])
    rest = tail.split("\n## ", 1)[1] if "\n## " in tail else ""
    kept = head.rstrip("\n") + ("\n\n## " + rest.rstrip("\n") if rest else "")
    path.write_text((kept + "\n\n" if kept else "") + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
