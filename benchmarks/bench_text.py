"""Cost of the text metrics: `rlscope analyze` on a synthetic run with rollout text, with every
metric and with the text metrics left out (`--metrics`), wall time and peak RSS."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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


def live_copy(run: Path, steps_per_file: int = 10) -> Path:
    """The run as a trainer flushing every `steps_per_file` steps writes it: its rollouts and
    steps tables in files of that many steps (the text is hard-linked in no way: rewritten)."""
    import polars as pl

    path = run.parent / f"{run.name}-live"
    if (path / "run.json").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(run, path, ignore=shutil.ignore_patterns("rollouts", "steps"))
    for table in ("rollouts", "steps"):
        (path / table).mkdir()
        rows = pl.scan_parquet(sorted((run / table).glob("*.parquet")))
        steps = rows.select(pl.col("step").unique().sort()).collect()["step"].to_list()
        for index in range(0, len(steps), steps_per_file):
            lo, hi = steps[index], steps[min(index + steps_per_file, len(steps)) - 1]
            part = rows.filter(pl.col("step").is_between(lo, hi)).collect()
            part.write_parquet(path / table / f"part-{index // steps_per_file:05d}.parquet")
    return path


def incremental(run: Path) -> dict[str, float]:
    """A live run's re-analysis (`check --watch` does one per poll): without its last rollouts
    and steps files, analysed once to fill a fresh cache, again with nothing new, then with the
    files added (as the trainer writes them): seconds, peak RSS and files read."""
    work = run.parent / f"{run.name}-growing"
    cache = run.parent / f"{run.name}-cache"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(run, work, copy_function=os.link)
    held = {t: sorted((work / t).glob("*.parquet"))[-1] for t in ("rollouts", "steps")}
    for table, path in held.items():
        os.replace(path, run.parent / f"held-{table}.parquet")
    env = {**os.environ, "RLSCOPE_CACHE_DIR": str(cache)}
    base = [sys.executable, "-m", "rlscope", "analyze", str(work), "--format", "json"]
    base += ["--fail-on", "never"]
    output = run.parent / "analysis.json"
    fill = timed(base, env, output)
    cached = timed(base, env, output)
    before = json.loads(output.read_text())["run"]["table_files"]
    for table, path in held.items():
        os.replace(run.parent / f"held-{table}.parquet", path)
    appended = timed(base, env, output)
    after = json.loads(output.read_text())["run"]["table_files"]
    uncached = timed([*base, "--no-cache"], None, output)
    output.unlink()
    shutil.rmtree(work)
    shutil.rmtree(cache)
    if any(v["read"] for v in before.values()) or any(v["read"] != 1 for v in after.values()):
        raise SystemExit(f"incremental re-analysis read {before} then {after}")
    return {
        "files": after["rollouts"]["total"],
        "fill": fill,
        "cached": cached,
        "appended": appended,
        "uncached": uncached,
    }


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
    parser.add_argument("--responses", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000])
    parser.add_argument(
        "--live", type=int, default=1_000_000, help="the run of the incremental re-analysis"
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS-text.md")
    args = parser.parse_args()
    base = [sys.executable, "-m", "rlscope", "analyze", "--format", "json", "--fail-on", "never"]
    base.append("--no-cache")  # every file read, every time
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
    live = live_copy(ensure_run(args.live))
    incr = incremental(live)
    print(json.dumps(incr), file=sys.stderr)
    lines += [
        "",
        "## Incremental re-analysis of a live run",
        "",
        f"The {args.live:,}-response run with its rollouts and steps tables in files of 10 steps "
        "(as a trainer flushing every 10 steps writes them), without its last two files: "
        "analysed once (filling a fresh cache), again with nothing new, then after its last "
        "rollouts and steps files are added: only those are read (`run.table_files` in the "
        "JSON). `check --watch` does one such re-analysis per poll. Each is one run of a fresh "
        "process.",
        "",
        "| rollouts files | no cache (s) | first analysis, cache empty (s) | nothing new (s) "
        "| a file appended (s) | its peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {incr['files']} | {incr['uncached'][0]:.1f} | {incr['fill'][0]:.1f} "
        f"| {incr['cached'][0]:.1f} | {incr['appended'][0]:.1f} | {incr['appended'][1]:.2f} |",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
