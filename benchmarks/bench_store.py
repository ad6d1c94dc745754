"""A run on disk against the same run in a local S3 API (moto's server on 127.0.0.1): rlscope
analyze, and the same token aggregates in Polars and DuckDB, on a file layout of
benchmarks/layouts.py; writes benchmarks/RESULTS-store.md."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_analyze import (  # noqa: E402
    CACHE,
    DUCKDB,
    POLARS_SAME,
    RLSCOPE,
    _version,
    ensure_run,
    measure,
    summary,
    token_rows,
)
from layouts import LAYOUTS, ensure_layout  # noqa: E402
from s3server import s3_server  # noqa: E402

#: The commands timed on disk and from the store ("{}": where the run is).
TOOLS = {
    "rlscope analyze --no-cache (every metric)": [
        *RLSCOPE,
        "analyze",
        "{}",
        "--no-cache",
        "--format",
        "json",
        "--fail-on",
        "never",
    ],
    "Polars: the same token aggregates": [sys.executable, "-c", POLARS_SAME, "{}"],
    "DuckDB: the same token aggregates": [
        sys.executable,
        "-c",
        DUCKDB.format(threads=os.cpu_count()),
        "{}",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS-store.md")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the run is kept")
    parser.add_argument(
        "--layout",
        nargs="+",
        choices=[layout.name for layout in LAYOUTS],
        default=["synth-files", "10k-files"],
        help="the token files' layouts (benchmarks/layouts.py)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    lines = [
        "# A run on disk against the same run in a local S3 server",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, polars {_version('polars')}, pyarrow "
        f"{_version('pyarrow')}, DuckDB {_version('duckdb')}, moto {_version('moto')}. Median "
        f"of {args.repeat} runs of each command, round robin, a fresh process each "
        "(`benchmarks/bench_store.py`): a healthy synthetic run in a layout of "
        "`benchmarks/layouts.py`, read from its folder (in the page cache) and from moto's S3 "
        "server on 127.0.0.1 (a single Python process on the same two cores: what a store "
        "costs over a local read here is moto's, not a network's; against AWS or MinIO the "
        "ratios differ). Polars and DuckDB compute the token aggregates analyze computes "
        "(`POLARS_SAME`, `DUCKDB` in `benchmarks/bench_analyze.py`); DuckDB reads the store "
        "through a pyarrow dataset (its httpfs extension cannot be downloaded on this machine).",
    ]
    for name in args.layout:
        layout = next(layout for layout in LAYOUTS if layout.name == name)
        run = ensure_layout(ensure_run(args.tokens, args.cache), layout)
        n, files = token_rows(run)
        rows = _measured(run, args.repeat)
        lines += [
            "",
            f"## {layout.what}: {n:,} token rows in {files:,} files",
            "",
            "| command | disk (s) | S3 (s) | S3 / disk | disk peak RSS (GiB) | S3 peak RSS (GiB) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for tool, (disk, disk_rss, _), (s3, s3_rss, _) in rows:
            lines.append(
                f"| {tool} | {disk:.1f} | {s3:.1f} | {s3 / disk:.2f} | {disk_rss:.2f} "
                f"| {s3_rss:.2f} |"
            )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _measured(run: Path, repeat: int) -> list[tuple[str, tuple, tuple]]:
    """Each of TOOLS on `run`'s folder and on its copy in a fresh local S3 server, round robin
    (a slow spell of the machine hits every command alike): (tool, disk, S3) summaries."""
    runs: dict[tuple[str, str], list] = {}
    with s3_server() as server:
        url = server.upload(run, "bench", run.name)
        env = {**os.environ, **server.env}
        for _ in range(repeat):
            for tool, command in TOOLS.items():
                for where, location in (("disk", str(run)), ("S3", url)):
                    cmd = [location if part == "{}" else part for part in command]
                    runs.setdefault((tool, where), []).append(measure(cmd, env=env))
                    print(tool, where, runs[tool, where][-1], file=sys.stderr)
    return [(tool, summary(runs[tool, "disk"]), summary(runs[tool, "S3"])) for tool in TOOLS]


if __name__ == "__main__":
    main()
