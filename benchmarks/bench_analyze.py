"""`rlscope analyze` against a bare streaming scan of the token columns it reads and DuckDB
computing the same token aggregates, at 10M / 100M / 1B token rows; then incremental re-analysis
after a token file is appended. Wall time (median), peak RSS; writes benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
CACHE = ROOT / ".bench"
RLSCOPE = [sys.executable, "-m", "rlscope"]
#: The token columns `analyze` reads on these runs (checked against its plan in `main`).
TOKEN_COLUMNS = [
    "rollout_id",
    "step",
    "logprob",
    "old_logprob",
    "ref_logprob",
    "entropy",
    "advantage",
    "clipped",
    "segment",
]

# The floor: Polars' streaming engine decoding every column analyze reads, one trivial
# aggregate per column so nothing is skipped.
BARE_SCAN = """
import sys, polars as pl
lf = pl.scan_parquet(sys.argv[1] + "/tokens/*.parquet")
cols = {cols!r}
lf.select([pl.col(c).cast(pl.Float64).sum() if c != "segment" else pl.col(c).count()
           for c in cols]).collect(engine="streaming")
"""

# What the token aggregates cost over the decode, without rlscope: Polars' streaming engine
# computing analyze's own token partials (its plan's expressions, every level: the per-step
# sums, the entropy histogram and the advantage tiers as group-bys on their bin, the segments,
# the per-rollout counts and sums) over the same files, in one collect_all, as a Polars user
# would write them.
POLARS_SAME = """
import sys, polars as pl
from rlscope.engine import token_plan
from rlscope.reader import open_run
from rlscope.tokenscan import ADVANTAGE_TIERS, HISTOGRAMS
from rlscope.tokenscan.plan import ENTROPY_BIN_OFFSET, ENTROPY_BINS_PER_EFOLD, ENTROPY_MAX_BIN
plan = token_plan(open_run(sys.argv[1]))
lf = pl.scan_parquet(sys.argv[1] + "/tokens/*.parquet")
def ok(c):
    return pl.when(pl.col(c).is_finite()).then(pl.col(c))
floats = [c for c, t in lf.collect_schema().items() if t.is_float()]
lf = lf.with_columns(ok(c).alias(c) for c in floats)  # NaN/inf as null, as rlscope reads them
stepped = lf
for name, expr in plan.prelude.items():
    stepped = stepped.with_columns(expr.alias(name))
queries = [stepped.group_by("step").agg(e.alias(n) for n, e in plan.partials[""].items())]
entropy = pl.col("entropy").cast(pl.Float64).clip(0) / ENTROPY_BIN_OFFSET
bins = {
    "entropy_bins": (entropy.log1p() * ENTROPY_BINS_PER_EFOLD).clip(upper_bound=ENTROPY_MAX_BIN),
    "advantage_tiers": pl.sum_horizontal(
        pl.col("advantage").abs() > floor for floor in ADVANTAGE_TIERS
    ),
}
for level, binned in bins.items():
    if level in plan.partials:
        column = HISTOGRAMS[level].column
        queries.append(
            lf.filter(pl.col(column).is_not_null())
            .group_by("step", binned.cast(pl.Int32).alias("bin"))
            .agg(e.alias(n) for n, e in plan.partials[level].items())
        )
if "segments" in plan.partials:
    queries.append(
        lf.filter(pl.col("segment").is_not_null())
        .group_by("step", "segment")
        .agg(e.alias(n) for n, e in plan.partials["segments"].items())
    )
if plan.has_ids:
    per_rollout = [e.alias(n) for n, e in plan.partials.get("ids", {}).items()]
    queries.append(lf.group_by("step", "rollout_id").agg(pl.len(), *per_rollout))
pl.collect_all(queries, engine="streaming")
"""

# The same token aggregates in DuckDB: per-step sums (NaN/inf as null, as rlscope reads them),
# the per-(step, entropy bin) histogram, per-(step, segment) sums with distinct rollouts,
# token rows per (step, rollout_id) (the orphan check), and the advantage tiers (tokens, Σ a²
# and the largest |a| per (step, tier)). One query per result, as a DuckDB
# user would write them; DuckDB reads the Parquet files once per query. From a store (an s3://
# URL), through a pyarrow dataset on pyarrow's S3 filesystem (DuckDB's own httpfs extension is
# downloaded on first use, which this machine cannot).
DUCKDB = """
import os, sys, duckdb
con = duckdb.connect()
con.execute("SET threads TO {threads}")
if "://" in sys.argv[1]:
    import pyarrow.dataset as ds, pyarrow.fs as fs
    s3 = fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"], region="us-east-1")
    tokens = ds.dataset(sys.argv[1].removeprefix("s3://") + "/tokens", filesystem=s3,
                        format="parquet")
    source = "tokens"
else:
    source = "read_parquet('" + sys.argv[1] + "/tokens/*.parquet')"
def ok(c):
    return f"CASE WHEN isfinite({{c}}) THEN {{c}}::DOUBLE END"
lp, old, ref, adv, ent = (ok(c) for c in ("logprob", "old_logprob", "ref_logprob", "advantage",
                                           "entropy"))
queries = [
    f\"\"\"SELECT step, count(*), sum(clipped::DOUBLE), count(clipped),
        sum((exp({{lp}} - {{old}}) < 0.8 AND {{adv}} < 0)::INT),
        sum((exp({{lp}} - {{old}}) > 1.28 AND {{adv}} > 0)::INT),
        count(exp({{lp}} - {{old}}) + {{adv}}),
        sum(exp({{ref}} - {{lp}}) - ({{ref}} - {{lp}}) - 1), count({{ref}} - {{lp}}),
        sum({{old}} - {{lp}}), count({{old}} - {{lp}}), sum({{ent}}), count({{ent}}),
        sum(-{{lp}}), count({{lp}}), count({{lp}} + {{adv}}), sum({{lp}} + 0 * {{adv}}),
        sum({{adv}} + 0 * {{lp}}), sum({{lp}} * {{adv}}),
        sum((NOT isfinite(logprob))::INT), sum((NOT isfinite(entropy))::INT)
      FROM {{source}} GROUP BY step\"\"\",
    f\"\"\"SELECT step, least(floor(ln(1 + greatest({{ent}}, 0) / 0.05) * 100), 1000) AS bin,
        count(*) FROM {{source}} WHERE {{ent}} IS NOT NULL GROUP BY ALL\"\"\",
    f\"\"\"SELECT step, segment, count(*), count(DISTINCT rollout_id), sum({{ent}}),
        count({{ent}}) FROM {{source}} WHERE segment IS NOT NULL
        GROUP BY ALL\"\"\",
    f\"\"\"SELECT step, rollout_id, count(*) FROM {{source}} GROUP BY ALL\"\"\",
    f\"\"\"SELECT step, ({{adv}} <> 0)::INT + (abs({{adv}}) > 1e-12)::INT
        + (abs({{adv}}) > 1e-9)::INT + (abs({{adv}}) > 1e-6)::INT + (abs({{adv}}) > 1e-3)::INT,
        count(*), sum({{adv}} * {{adv}}), max(abs({{adv}}))
        FROM {{source}} WHERE {{adv}} IS NOT NULL GROUP BY ALL\"\"\",
]
for q in queries:
    con.execute(q).fetchall()
"""


#: What `analyze` imports before it reads anything (`rlscope --help` imports much less).
STARTUP = "import rlscope.analysis, rlscope.cli, rlscope.render.terminal"

#: The run shape: 128 prompts x 8 rollouts per step, responses of ~1.1k tokens (the synthetic
#: lengths x 20), i.e. ~1.14M token rows per step and ~1M rollouts per billion tokens.
PROMPTS, GROUP, LENGTH_SCALE, TOKENS_PER_STEP = 128, 8, 20.0, 1_140_000


def ensure_run(tokens: int, cache: Path = CACHE) -> Path:
    """A cached healthy synthetic run (no text) with about `tokens` token rows: the shape above,
    or fewer prompts per step for runs of under 10 steps' worth."""
    path = cache / f"long-{tokens}"
    if (path / "run.json").exists():
        return path
    steps = max(10, round(tokens / TOKENS_PER_STEP))
    prompts = min(PROMPTS, max(1, round(tokens / steps / (TOKENS_PER_STEP / PROMPTS))))
    t0 = time.perf_counter()
    # No rollout text: this benchmark is about the token scans (bench_text.py times the text).
    subprocess.run(
        [
            *RLSCOPE,
            "synth",
            str(path),
            "--steps",
            str(steps),
            "--prompts",
            str(prompts),
            "--group-size",
            str(GROUP),
            "--length-scale",
            str(LENGTH_SCALE),
            "--no-text",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"generated {path.name} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return path


#: Runs a command and writes its wall seconds, peak RSS (KiB) and CPU seconds (user + system, its
#: threads and children) to argv[1]. Linux counts in a child's peak RSS its parent's resident
#: memory at fork (the copied address space's high-water mark survives exec): forked from this
#: small process, the child's own peak is what is read, whatever the benchmark process holds.
LAUNCHER = """
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as out:
    out.write(f"{time.perf_counter() - start} {usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


class Measured(NamedTuple):
    seconds: float  # wall
    rss_gib: float  # peak
    cpu_seconds: float  # user + system


def measure(
    cmd: list[str], env: dict[str, str] | None = None, stdout: Path | None = None
) -> Measured:
    """One child process (its output to `stdout` if given): wall and CPU seconds, peak RSS."""
    with tempfile.TemporaryDirectory() as folder:
        measured = Path(folder) / "measured"
        with open(stdout or os.devnull, "wb") as out:
            launched = [sys.executable, "-c", LAUNCHER, str(measured), *cmd]
            status = subprocess.run(launched, stdout=out, env=env).returncode
        if status != 0:
            raise SystemExit(f"{cmd} failed with status {status}")
        seconds, rss, cpu = measured.read_text().split()
    return Measured(float(seconds), int(rss) / 2**20, float(cpu))


def timed(
    cmd: list[str], env: dict[str, str] | None = None, stdout: Path | None = None
) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of one child process (its output to `stdout` if given)."""
    seconds, rss, _ = measure(cmd, env, stdout)
    return seconds, rss


def summary(runs: list[Measured]) -> tuple[float, float, float]:
    """Median wall seconds, largest peak RSS, median CPU seconds of repeated runs."""
    middle = len(runs) // 2
    return (
        sorted(r.seconds for r in runs)[middle],
        max(r.rss_gib for r in runs),
        sorted(r.cpu_seconds for r in runs)[middle],
    )


def median(cmd: list[str], repeat: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Median wall time over `repeat` runs, and the largest peak RSS."""
    seconds, rss, _ = summary([measure(cmd, env) for _ in range(repeat)])
    return seconds, rss


#: A run whose token files take more than this share of the machine's memory does not stay in
#: the page cache from one command to the next (on the 24 GiB VM of RESULTS.md the cache holds
#: ~14.5 GB, the 1B run's columns 15 GB): left as it is, each command would find whatever the
#: previous one left (a command after DuckDB read 40% from disk, one after the bare scan 5%),
#: and the ratios would measure the order of the commands. Such a run is measured cold: the
#: page cache dropped before every command (root only). A smaller run is read once before
#: the round robin: every command then reads it from memory.
COLD_RUN_SHARE = 0.5


def page_cache(run: Path) -> str:
    """How `run`'s commands are measured: "warm" (read once first), "cold" (the page cache
    dropped before each), or "as left" (too large to stay cached, and not allowed to drop)."""
    size = sum(f.stat().st_size for f in (run / "tokens").glob("*.parquet"))
    if size <= COLD_RUN_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"):
        for path in (run / "tokens").glob("*.parquet"):
            with open(path, "rb") as handle:
                while handle.read(1 << 24):
                    pass
        return "warm"
    return "cold" if drop_page_cache() else "as left"


def drop_page_cache() -> bool:
    """Empty the kernel's page cache (written data synced first); False where not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def round_robin(
    commands: dict[str, list[str]], repeat: int, cache: str
) -> dict[str, tuple[float, float, float]]:
    """Each command `repeat` times, in turn (a slower spell of a shared machine hits every
    command alike), the page cache dropped before each when `cache` is "cold"."""
    runs: dict[str, list[Measured]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, cmd in commands.items():
            if cache == "cold":
                drop_page_cache()
            runs[name].append(measure(cmd))
    return {name: summary(measured) for name, measured in runs.items()}


def token_rows(path: Path) -> tuple[int, int]:
    import pyarrow.parquet as pq

    files = sorted((path / "tokens").glob("*.parquet"))
    return sum(pq.read_metadata(f).num_rows for f in files), len(files)


def analyze_cmd(run: Path, *extra: str) -> list[str]:
    return [*RLSCOPE, "analyze", str(run), "--format", "json", "--fail-on", "never", *extra]


def check_columns(run: Path) -> None:
    """The bare scan and DuckDB read what analyze reads."""
    from rlscope.engine import token_plan
    from rlscope.reader import open_run

    opened = open_run(run)
    read = token_plan(opened).columns(opened.tables["tokens"].schema)
    if sorted(read) != sorted(TOKEN_COLUMNS):
        raise SystemExit(f"analyze reads {read}, the baselines {TOKEN_COLUMNS}")


def incremental(run: Path, repeat: int) -> dict[str, float]:
    """A copy of the run (hard links) without its last token file is analysed once to fill a
    fresh cache; then the file is linked in (a trainer appending a file) and re-analysed."""
    work = run.parent / f"incremental-{run.name}"
    cache = run.parent / f"partials-{run.name}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.copytree(run, work, copy_function=os.link)
    last = sorted((work / "tokens").glob("*.parquet"))[-1]
    held = run.parent / "held.parquet"
    os.replace(last, held)
    env = {**os.environ, "RLSCOPE_CACHE_DIR": str(cache)}
    fill = timed(analyze_cmd(work), env)
    cached = median(analyze_cmd(work), repeat, env)
    output = run.parent / "analysis.json"
    timed(analyze_cmd(work), env, output)
    if json.loads(output.read_text())["run"]["token_files"]["read"] != 0:
        raise SystemExit("re-analysis with a warm cache read token files again")
    os.replace(held, last)
    appended = timed(analyze_cmd(work), env, output)
    token_files = json.loads(output.read_text())["run"]["token_files"]
    output.unlink()
    if token_files["read"] != 1:
        raise SystemExit(f"after appending one file, {token_files['read']} files were read")
    shutil.rmtree(work)
    shutil.rmtree(cache)
    return {
        "fill_s": fill[0],
        "cached_s": cached[0],
        "appended_s": appended[0],
        "appended_rss_gib": appended[1],
        "files": token_files["total"],
        "appended_read": token_files["read"],
    }


def layouts(tokens: int, repeat: int, cache: Path) -> list[dict[str, Any]]:
    """A run of `tokens` token rows in each file layout (benchmarks/layouts.py): analyze with
    every metric, the bare scan, Polars and DuckDB computing the same token aggregates, round
    robin, median of `repeat` runs (peak RSS: the largest)."""

    import pyarrow.parquet as pq
    from layouts import LAYOUTS, ensure_layout

    base = ensure_run(tokens, cache)
    rows = []
    for layout in LAYOUTS:
        run = ensure_layout(base, layout)
        files = sorted((run / "tokens").glob("*.parquet"))
        bare = [sys.executable, "-c", BARE_SCAN.format(cols=TOKEN_COLUMNS), str(run)]
        commands = {
            "analyze": analyze_cmd(run, "--no-cache"),
            "bare": bare,
            "polars": [sys.executable, "-c", POLARS_SAME, str(run)],
            "duckdb": [sys.executable, "-c", DUCKDB.format(threads=os.cpu_count()), str(run)],
        }
        cache = page_cache(run)
        n, _ = token_rows(run)
        result: dict[str, Any] = {
            "layout": layout.what,
            "tokens": n,
            "files": len(files),
            "row_group": pq.read_metadata(files[0]).row_group(0).num_rows,
            "cache": cache,
            **round_robin(commands, repeat, cache),
        }
        rows.append(result)
        print(json.dumps(result), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=[10_000_000, 100_000_000, 1_000_000_000]
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the runs are kept")
    parser.add_argument(
        "--layout-tokens",
        type=int,
        default=200_000_000,
        help="token rows of the run timed in four file layouts (0: none)",
    )
    parser.add_argument(
        "--only-layouts",
        action="store_true",
        help="time the file layouts only, and rewrite only their section of --out",
    )
    args = parser.parse_args()
    threads = os.cpu_count() or 1
    rows, incr = [], {}
    steal_before = cpu_times()
    args.startup = median([sys.executable, "-c", STARTUP], args.repeat)[0]
    if args.only_layouts:
        laid = layouts(args.layout_tokens, args.repeat, args.cache)
        args.steal = steal_share(steal_before, cpu_times())
        write_layouts(args, laid)
        return
    for target in args.tokens:
        run = ensure_run(target, args.cache)
        check_columns(run)
        n, files = token_rows(run)
        bare = [sys.executable, "-c", BARE_SCAN.format(cols=TOKEN_COLUMNS), str(run)]
        duck = [sys.executable, "-c", DUCKDB.format(threads=threads), str(run)]
        commands = {"analyze": analyze_cmd(run, "--no-cache"), "bare": bare, "duckdb": duck}
        cache = page_cache(run)
        result: dict[str, Any] = {"tokens": n, "files": files, "cache": cache}
        result |= round_robin(commands, args.repeat, cache)
        rows.append(result)
        print(json.dumps(result), file=sys.stderr)
    # Incremental re-analysis on the largest run.
    incr = incremental(ensure_run(args.tokens[-1], args.cache), args.repeat)
    print(json.dumps(incr), file=sys.stderr)
    laid = layouts(args.layout_tokens, args.repeat, args.cache) if args.layout_tokens else []
    args.steal = steal_share(steal_before, cpu_times())
    write_results(args, rows, incr, laid)


def cpu_times() -> list[int]:
    """The machine's cumulative CPU times (Linux /proc/stat), or none elsewhere."""
    try:
        return [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return []


def steal_share(before: list[int], after: list[int]) -> float | None:
    """The share of CPU time the hypervisor gave to other guests meanwhile (steal)."""
    if len(before) < 8 or len(after) < 8:
        return None
    delta = [b - a for a, b in zip(before, after, strict=False)]
    return delta[7] / sum(delta) if sum(delta) else None


def write_results(
    args: argparse.Namespace, rows: list[dict], incr: dict[str, float], laid: list[dict]
) -> None:

    lines = [
        "# rlscope analyze benchmark",
        "",
        f"Machine: {platform.platform()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
        f"Python {platform.python_version()}, polars {_version('polars')}, "
        f"pyarrow {_version('pyarrow')}, DuckDB {_version('duckdb')}. Median of {args.repeat} "
        "runs, each a fresh process (peak RSS: the largest of them, each the process's own: "
        "it is forked from a small launcher, as Linux counts the forking process's memory in "
        "a child's peak). Healthy synthetic runs "
        f"from `rlscope synth --length-scale {LENGTH_SCALE:g} --no-text` ({PROMPTS} prompts x "
        f"{GROUP} rollouts per step, ~1.1k tokens per response, ~{TOKENS_PER_STEP / 1e6:.2f}M "
        f"token rows per step, ~{rows[-1]['tokens'] / rows[-1]['files'] / 1e6:.1f}M per file). "
        "`analyze` runs every metric that the run can "
        "feed, with `--no-cache` (every token file read); the bare scan is Polars' streaming "
        "engine decoding the same 9 token columns; DuckDB computes the same token aggregates "
        "(`benchmarks/bench_analyze.py`)."
        + (
            f" CPU steal during the benchmark (a shared VM): {args.steal:.0%} of CPU time."
            if args.steal is not None
            else ""
        )
        + f" Start-up (Python and the imports analyze needs) takes {args.startup:.2f} s of "
        "every analyze; the per-100M cost is also given without it. CPU: user + system "
        "seconds of the process, median of the runs. Page cache: a run that fits in half the "
        "machine's memory is read once before its runs, so that every command reads it from "
        "memory (warm: the CPU-bound case); a larger one would not stay cached from one command "
        "to the next (each would find what the previous one left), so the page cache is "
        "dropped before every command (cold: read from disk, as a first analysis of a large "
        "run is).",
        "",
        "| token rows | files | page cache | analyze (s) | s per 100M tokens "
        "| same, less start-up | M tokens/s | peak RSS (GiB) | bare scan (s) | bare RSS (GiB) "
        "| DuckDB (s) | DuckDB RSS (GiB) | analyze / scan | analyze / DuckDB | analyze CPU (s) "
        "| bare scan CPU (s) | CPU: analyze / scan |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        (at, arss, acpu), (bt, brss, bcpu), (dt, drss, _) = r["analyze"], r["bare"], r["duckdb"]
        n = r["tokens"]
        lines.append(
            f"| {n:,} | {r['files']:,} | {r['cache']} | {at:.1f} | {at / n * 1e8:.2f} "
            f"| {(at - args.startup) / n * 1e8:.2f} | {n / at / 1e6:.1f} "
            f"| {arss:.2f} | {bt:.1f} | {brss:.2f} | {dt:.1f} | {drss:.2f} | {at / bt:.2f} "
            f"| {at / dt:.2f} | {acpu:.1f} | {bcpu:.1f} | {acpu / bcpu:.2f} |"
        )
    lines += [
        "",
        "## Incremental re-analysis",
        "",
        f"The {rows[-1]['tokens']:,}-row run without its last token file is analysed once "
        "(filling a fresh partials cache), then re-analysed with nothing new, then the last file "
        "is added (as a trainer appends one) and the run re-analysed: only that file is read "
        "(`run.token_files.read` = 1 in the JSON).",
        "",
        "| token files | first analysis, cache empty (s) | re-analysis, nothing new (s) "
        "| re-analysis after appending a file (s) | its peak RSS (GiB) | files it read |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {incr['files']:,} | {incr['fill_s']:.1f} | {incr['cached_s']:.1f} "
        f"| {incr['appended_s']:.1f} | {incr['appended_rss_gib']:.2f} | {incr['appended_read']} |",
    ]
    lines += layout_lines(args, laid)
    # The sections other benchmarks write (bench_report.py's) are kept, after these.
    own = {"# rlscope analyze benchmark", "## Incremental re-analysis", "## File layouts"}
    previous = args.out.read_text().split("\n## ") if args.out.exists() else []
    kept = [part for part in previous[1:] if "## " + part.split("\n", 1)[0] not in own]
    args.out.write_text(
        "\n".join(lines) + "".join("\n\n## " + part.rstrip("\n") for part in kept) + "\n"
    )
    print("\n".join(lines))


def layout_lines(args: argparse.Namespace, laid: list[dict]) -> list[str]:
    """The "File layouts" section (none without layouts)."""
    from rlscope.tokenscan import limits

    if not laid:
        return []
    lines = [
        "",
        "## File layouts",
        "",
        f"The same ~{laid[0]['tokens'] / 1e6:.0f}M-token run with its token table written in "
        "the layouts trainers use (`benchmarks/layouts.py`; the other tables unchanged), each "
        f"timed {args.repeat} times, round robin: `analyze --no-cache` with every metric; the "
        "bare scan of the same columns; and the same token aggregates computed by Polars "
        "(`POLARS_SAME`: analyze's own plan, every level, in one streaming `collect_all`) and "
        "by DuckDB (`DUCKDB`: one query per level). The goal is analyze at most 1.0x the "
        "faster of the two, with peak RSS at most 0.5 GiB. The working set is bounded by rows "
        f"in flight (batches of at most {limits.BATCH_ROWS // 1000}k rows and "
        f"{limits.BATCH_BYTES >> 20} MiB decoded, read through a "
        f"{limits.READ_BUFFER_BYTES >> 20} MiB buffer per column, or, where Polars decodes "
        "faster (no byte-stream-split column), a row group at a time if it is at most "
        f"{limits.WHOLE_GROUP_BYTES >> 20} MiB decoded; a large file is reduced in pieces of "
        "row groups by every worker), not by files or large row groups; thousands of files' "
        "partials are folded as they come. CPU steal during the runs: "
        + (f"{args.steal:.0%}." if getattr(args, "steal", None) is not None else "unknown."),
        "",
        "| layout | token rows | files | rows in the first row group | page cache "
        "| analyze (s) | peak RSS (GiB) | bare scan (s) | Polars (s) | Polars RSS (GiB) "
        "| DuckDB (s) | DuckDB RSS (GiB) | analyze / faster engine | analyze / scan "
        "| CPU: analyze / faster engine |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in laid:
        (at, arss, acpu), (bt, _, _) = r["analyze"], r["bare"]
        (pt, prss, pcpu), (dt, drss, dcpu) = r["polars"], r["duckdb"]
        ft, fcpu = (pt, pcpu) if pt <= dt else (dt, dcpu)
        lines.append(
            f"| {r['layout']} | {r['tokens']:,} | {r['files']:,} | {r['row_group']:,} "
            f"| {r['cache']} | {at:.1f} | {arss:.2f} | {bt:.1f} | {pt:.1f} | {prss:.2f} "
            f"| {dt:.1f} | {drss:.2f} | {at / ft:.2f} | {at / bt:.2f} | {acpu / fcpu:.2f} |"
        )
    return lines


def write_layouts(args: argparse.Namespace, laid: list[dict]) -> None:
    """The "File layouts" section of --out replaced (or added), the other sections kept."""
    previous = args.out.read_text().split("\n## ") if args.out.exists() else [""]
    section = "\n".join(layout_lines(args, laid)).lstrip("\n").removeprefix("## ")
    parts = [section if p.startswith("File layouts\n") else p for p in previous]
    if section not in parts:
        parts.insert(min(3, len(parts)), section)
    args.out.write_text("\n\n## ".join(p.rstrip("\n") for p in parts) + "\n")
    print(section)


def _version(module: str) -> str:
    from importlib.metadata import version

    return version(module)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
