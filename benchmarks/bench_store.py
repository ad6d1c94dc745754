"""A run on disk against the same run in a local S3 API (moto's server on 127.0.0.1): rlscope
analyze, and per-step token sums in Polars and DuckDB; writes benchmarks/RESULTS-store.md."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_analyze import CACHE, RLSCOPE, _version, ensure_run, measure, token_rows  # noqa: E402
from s3server import s3_server  # noqa: E402

# Per-step token sums (rows, and the sums of logprob, entropy and advantage) in Polars'
# streaming engine, from a folder or a URL (Polars reads the store itself, AWS_* from the
# environment).
POLARS = """
import sys, polars as pl
lf = pl.scan_parquet(sys.argv[1] + "/tokens/*.parquet")
lf.group_by("step").agg(pl.len(), pl.col("logprob").sum(), pl.col("entropy").sum(),
                        pl.col("advantage").sum()).collect(engine="streaming")
"""

# The same in DuckDB: read_parquet on disk; from the store, through a pyarrow dataset on
# pyarrow's S3 filesystem (DuckDB's own httpfs extension is downloaded on first use, which
# this machine cannot).
DUCKDB = """
import sys, duckdb
con = duckdb.connect()
query = '''SELECT step, count(*), sum(logprob), sum(entropy), sum(advantage) FROM {}
           GROUP BY step'''
if "://" in sys.argv[1]:
    import os, pyarrow.dataset as ds, pyarrow.fs as fs
    s3 = fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"], region="us-east-1")
    tokens = ds.dataset(sys.argv[1].removeprefix("s3://") + "/tokens", filesystem=s3,
                        format="parquet")
    con.execute(query.format("tokens")).fetchall()
else:
    con.execute(query.format(f"read_parquet('{sys.argv[1]}/tokens/*.parquet')")).fetchall()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=10_000_000)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS-store.md")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the run is kept")
    args = parser.parse_args()
    run = ensure_run(args.tokens, args.cache)
    n, files = token_rows(run)
    rows = []
    with s3_server() as server:
        url = server.upload(run, "bench", run.name)
        env = {**os.environ, **server.env}
        tools = {
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
            "Polars: per-step token sums": [sys.executable, "-c", POLARS, "{}"],
            "DuckDB: per-step token sums": [sys.executable, "-c", DUCKDB, "{}"],
        }
        for tool, command in tools.items():
            times = {}
            for where, location in (("disk", str(run)), ("S3", url)):
                cmd = [location if part == "{}" else part for part in command]
                times[where] = measure(cmd, env=env)
                print(tool, where, times[where], file=sys.stderr)
            rows.append((tool, times["disk"], times["S3"]))
    lines = [
        "# A run on disk against the same run in a local S3 server",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores (shared with other work while "
        f"measured), Python {platform.python_version()}, polars {_version('polars')}, pyarrow "
        f"{_version('pyarrow')}, DuckDB {_version('duckdb')}, moto {_version('moto')}. One run "
        f"of each command, a fresh process each (`benchmarks/bench_store.py`): a healthy "
        f"synthetic run of {n:,} token rows in {files} token files, read from its folder (in "
        "the page cache) and from moto's S3 server on 127.0.0.1 (a single Python process on "
        "the same two cores: what a store costs over a local read here is moto's, not a "
        "network's; against AWS or MinIO the ratios differ). DuckDB reads the store through "
        "a pyarrow dataset (its httpfs extension cannot be downloaded on this machine).",
        "",
        "| command | disk (s) | S3 (s) | S3 / disk | disk peak RSS (GiB) | S3 peak RSS (GiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for tool, disk, s3 in rows:
        lines.append(
            f"| {tool} | {disk.seconds:.1f} | {s3.seconds:.1f} | {s3.seconds / disk.seconds:.2f} "
            f"| {disk.rss_gib:.2f} | {s3.rss_gib:.2f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
