"""`make bench` in small: the benchmark script end to end on a 2.5M-token run (no timing is
asserted; this checks that the script runs, compares the same columns and writes its table)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("duckdb")


def _bench(script: str, out: Path, tmp_path: Path, *args: str) -> None:
    """A script of benchmarks/ on tiny runs (kept in tmp_path), one run each, into `out`."""
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / script),
            *args,
            "--repeat",
            "1",
            "--out",
            str(out),
            "--cache",
            str(tmp_path / "runs"),
        ],
        check=True,
        capture_output=True,
    )


def _bench_analyze(out: Path, tmp_path: Path, *args: str) -> None:
    _bench("bench_analyze.py", out, tmp_path, *args, "--layout-tokens", "1000000")


def test_bench_script_writes_results_with_every_baseline(tmp_path: Path) -> None:
    out = tmp_path / "RESULTS.md"
    other = "## report against analyze / compare\n\nbench_report.py's table\n"
    out.write_text("# rlscope analyze benchmark\n\nold\n\n## File layouts\n\nold\n\n" + other)
    _bench_analyze(out, tmp_path, "--tokens", "2500000")
    text = out.read_text()
    assert "| token rows | files | page cache | analyze (s)" in text
    assert text.endswith("\n\n" + other) and text.count("## File layouts") == 1  # its own kept
    assert "Start-up (Python and the imports analyze needs)" in text
    row = next(line for line in text.splitlines() if line.startswith("| 2,"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 17 and all(cells)
    assert cells[2] == "warm"  # a small run: read once, then measured from memory
    assert float(cells[-1]) > 0  # analyze CPU / bare scan CPU
    # The four file layouts of one run, with peak RSS and the ratio to the bare scan.
    section = text.split("## File layouts")[1].split("\n## ")[0]
    laid = [line for line in section.splitlines() if line.startswith("| ")]
    assert len(laid) == 1 + 4  # the header, then a row per layout
    # with Polars and DuckDB computing the same aggregates, and the ratio to the faster one
    assert all(len(line.strip("|").split("|")) == 15 for line in laid)
    assert all(float(line.strip("|").split("|")[-3]) > 0 for line in laid[1:])
    assert int(cells[1]) >= 2  # token files
    # The incremental table: after appending one file, exactly one file was read.
    incremental = text.split("## Incremental re-analysis")[1].split("\n## ")[0]
    assert incremental.rstrip().splitlines()[-1].rstrip("|").split("|")[-1].strip() == "1"
    # --only-layouts rewrites that section alone, in place.
    before = text.split("## File layouts")
    _bench_analyze(out, tmp_path, "--only-layouts")
    after = out.read_text().split("## File layouts")
    assert after[0] == before[0] and after[1].split("\n## ", 1)[1] == before[1].split("\n## ", 1)[1]
    assert len([line for line in after[1].splitlines() if line.startswith("| ")]) == 1 + 4


@pytest.mark.slow  # ~40 s: a local S3 server, two layouts, six commands each
def test_the_store_benchmark_times_every_engine_on_disk_and_in_the_store(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    out = tmp_path / "RESULTS-store.md"
    _bench("bench_store.py", out, tmp_path, "--tokens", "1000000")
    text = out.read_text()
    assert text.count("\n## ") == 2  # a table per layout: synth's files, 10k-row files
    rows = [line for line in text.splitlines() if line.startswith("| ") and "(s)" not in line]
    assert len(rows) == 2 * 3 and all("S3" not in r.split("|")[1] for r in rows)
    assert all(float(r.strip("|").split("|")[3]) > 0 for r in rows)  # S3 / disk


def test_the_report_benchmark_replaces_its_own_section_only(tmp_path: Path) -> None:
    """bench_report.py writes its table as a section of RESULTS.md: again and again in place,
    the other sections kept as they are."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_report import SECTION, write_section

    results = tmp_path / "RESULTS.md"
    results.write_text("# rlscope analyze benchmark\n\ntable\n\n## Incremental\n\nrows\n")
    for value in ("first", "second"):
        write_section(results, [SECTION, "", value])
    text = results.read_text()
    assert text.count(SECTION) == 1 and "second" in text and "first" not in text
    assert text.startswith("# rlscope analyze benchmark\n\ntable\n\n## Incremental\n\nrows\n")
