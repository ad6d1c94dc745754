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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_analyze import CACHE, ROOT, timed


def ensure_run(responses: int, prompts: int = 512) -> Path:
    """A cached healthy synthetic run with about `responses` train rollouts (`prompts` groups
    of 8 per step), text, no tokens."""
    from rlscope.synth import generate

    path = CACHE / (f"text-{responses}" if prompts == 512 else f"text-{responses}-{prompts}p")
    if (path / "run.json").exists():
        return path
    group = 8
    steps = max(10, round(responses / (prompts * group)))
    t0 = time.perf_counter()
    generate(path, "healthy", steps=steps, prompts_per_step=prompts, group_size=group, tokens=False)
    print(f"generated {path.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return path


#: The tables a live run grows by: a file of each per flush.
LIVE_TABLES = ("rollouts", "steps", "probes")


def live_copy(run: Path, steps_per_file: int = 10) -> Path:
    """The run as a trainer flushing every `steps_per_file` steps writes it: its rollouts,
    steps and probes tables in files of that many steps (probes by their rollout's step)."""
    import polars as pl

    path = run.parent / f"{run.name}-live-{steps_per_file}"
    if (path / "run.json").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(run, path, ignore=shutil.ignore_patterns(*LIVE_TABLES))
    rollouts = pl.scan_parquet(sorted((run / "rollouts").glob("*.parquet")))
    steps = rollouts.select(pl.col("step").unique().sort()).collect()["step"].to_list()
    for table in LIVE_TABLES:
        (path / table).mkdir()
        rows = pl.scan_parquet(sorted((run / table).glob("*.parquet")))
        if table == "probes":
            rows = rows.join(rollouts.select("rollout_id", "step"), on="rollout_id")
        for index in range(0, len(steps), steps_per_file):
            lo, hi = steps[index], steps[min(index + steps_per_file, len(steps)) - 1]
            part = rows.filter(pl.col("step").is_between(lo, hi)).collect()
            part = part.drop("step") if table == "probes" else part
            part.write_parquet(path / table / f"part-{index // steps_per_file:05d}.parquet")
    return path


def incremental(run: Path) -> dict[str, Any]:
    """A live run's re-analysis (`check --watch` does one per poll): without the last file of
    each of its tables, analysed once to fill a fresh cache, again with nothing new, then with
    the files added (as the trainer writes them): seconds, peak RSS and files read."""
    work = run.parent / f"{run.name}-growing"
    cache = run.parent / f"{run.name}-cache"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(run, work, copy_function=os.link)
    held = {t: sorted((work / t).glob("*.parquet"))[-1] for t in LIVE_TABLES}
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
        "files": {t: after[t]["total"] for t in LIVE_TABLES},
        "fill": fill,
        "cached": cached,
        "appended": appended,
        "uncached": uncached,
    }


def one_file_copy(run: Path) -> Path:
    """The run with its rollouts table in one file of 1Mi-row row groups (what pyarrow >= 15
    writes for a whole table): a 100k-rollout range of steps sits inside one row group."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    path = run.parent / f"{run.name}-one-file"
    if (path / "run.json").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(run, path, ignore=shutil.ignore_patterns("rollouts"), copy_function=os.link)
    (path / "rollouts").mkdir()
    table = ds.dataset(sorted((run / "rollouts").glob("*.parquet"))).to_table()
    pq.write_table(table, path / "rollouts" / "rollouts.parquet", row_group_size=1 << 20)
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
    parser.add_argument("--responses", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000])
    parser.add_argument(
        "--live", type=int, default=1_000_000, help="the run of the incremental re-analysis"
    )
    parser.add_argument(
        "--many",
        type=int,
        default=100_000,
        help="the run of the incremental re-analysis with a file per step (8 prompts x 8)",
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
        f"{platform.python_version()}; median of {args.repeat} runs, each a fresh process (its "
        "own peak RSS: forked from a small launcher); healthy synthetic runs with "
        "rollout text (~60 words), eval splits and probes, no token table "
        "(`benchmarks/bench_text.py`).",
        "",
        "| responses | all metrics (s) | peak RSS (GiB) | without text metrics (s) "
        "| peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, (at, arss), (bt, brss) in rows:
        lines.append(f"| {n:,} | {at:.1f} | {arss:.2f} | {bt:.1f} | {brss:.2f} |")
    largest = max(args.responses)
    one_file = timed([*base, str(one_file_copy(ensure_run(largest)))])
    print(json.dumps({"one_file": one_file}), file=sys.stderr)
    lines += [
        "",
        f"The {largest:,}-response run with its rollouts table in one file of 1Mi-row row "
        f"groups (one run, all metrics): {one_file[0]:.1f} s, peak RSS {one_file[1]:.2f} GiB. "
        "Polars decodes a whole row group of the columns a range of steps reads, so the "
        "per-rollout level's memory grows with the row group's text, not with the responses.",
    ]
    lives = [live_copy(ensure_run(args.live)), live_copy(ensure_run(args.many, prompts=8), 1)]
    measured = []
    for live in lives:
        measured.append(incremental(live))
        print(json.dumps(measured[-1]), file=sys.stderr)
    lines += [
        "",
        "## Incremental re-analysis of a live run",
        "",
        f"Two live runs: the {args.live:,}-response run with its rollouts, steps and probes "
        "tables in files of 10 steps (as a trainer flushing every 10 steps writes them), and "
        f"a {args.many:,}-response run of 8 prompts x 8 per step with a file per step in each "
        "table (thousands of files). Each without the last file of each table: analysed once "
        "(filling a fresh cache), again with nothing new, then after those files are added: "
        "one file of each table is read (`run.table_files` in the JSON; checked). The "
        "rollouts checks (duplicate ids, invalid values, probes and token rows without a "
        "rollout) and the probes' join come from each file's cached index. `check --watch` does "
        "one such re-analysis per poll. Each is one run of a fresh process.",
        "",
        "| responses | rollouts / steps / probes files | no cache (s) "
        "| first analysis, cache empty (s) | nothing new (s) | a file of each appended (s) "
        "| its peak RSS (GiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, incr in zip((args.live, args.many), measured, strict=True):
        files = " / ".join(f"{incr['files'][t]:,}" for t in LIVE_TABLES)
        lines.append(
            f"| {n:,} | {files} | {incr['uncached'][0]:.1f} | {incr['fill'][0]:.1f} "
            f"| {incr['cached'][0]:.1f} | {incr['appended'][0]:.1f} "
            f"| {incr['appended'][1]:.2f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
