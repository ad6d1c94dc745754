"""The same run gives the same JSON bytes whatever the worker count, the chunking of its files,
their order on disk, the order chunks finish in, a warm or partly warm cache, or Polars' thread
count: float sums are ordered by value where rows may come in any order (rlscope.exactsum)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from rlscope.analysis import analyze
from rlscope.render.json import render_json
from rlscope.synth import generate
from rlscope.tokenscan import limits

#: What an analysis says of how it read the run, not of the run (files read, the cache).
READ_FIELDS = ("token_files", "table_files")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose token rows are cut into files across step boundaries: most steps' sums
    add parts from three or four files, so the order of files changes the last bits of a naive
    sum."""
    root = tmp_path_factory.mktemp("determinism")
    out = generate(root / "run", "healthy", steps=20, prompts_per_step=8, seed=11)
    (single,) = (out / "tokens").glob("*.parquet")
    tokens = pl.read_parquet(single)
    single.unlink()
    rows = tokens.height // 61 + 1
    for n, start in enumerate(range(0, tokens.height, rows)):
        tokens.slice(start, rows).write_parquet(out / "tokens" / f"part-{n:03d}.parquet")
    return out


def _json(run: Path, **options: Any) -> dict[str, Any]:
    report = json.loads(render_json(analyze(run, **options)))
    for field in READ_FIELDS:
        report.get("run", {}).pop(field, None)
    return report


def _without_tokens(run: Path, copy: Path) -> Path:
    """`run`'s other tables hard-linked at `copy`, and an empty token folder."""
    shutil.copytree(run, copy, copy_function=os.link, ignore=shutil.ignore_patterns("tokens"))
    (copy / "tokens").mkdir()
    return copy


def _bytes(document: dict[str, Any]) -> str:
    return json.dumps(document, sort_keys=True)


def test_worker_count_chunking_and_folding_change_no_bit(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cold = _bytes(_json(run, use_cache=False))
    monkeypatch.setattr(limits, "WORKERS", 1)
    assert _bytes(_json(run, use_cache=False)) == cold
    # A chunk per file, blocks of two files folded, and blocks of blocks.
    monkeypatch.setattr(limits, "WORKERS", 3)
    monkeypatch.setattr(limits, "CHUNK_BYTES", 1)
    monkeypatch.setattr(limits, "FOLD_FILES", 2)
    assert _bytes(_json(run, use_cache=False)) == cold


def test_the_order_chunks_finish_in_changes_no_bit(run: Path) -> None:
    cold = _bytes(_json(run, use_cache=False))

    def backwards(task: Callable[[Any], Any], chunks: list[Any]) -> list[Any]:
        done = {i: task(chunk) for i, chunk in reversed(list(enumerate(chunks)))}
        return [done[i] for i in range(len(chunks))]

    assert _bytes(_json(run, use_cache=False, mapper=backwards)) == cold


def test_file_order_on_disk_changes_no_bit(run: Path, tmp_path: Path) -> None:
    """The same token rows in files named in the reverse order."""
    cold = _json(run, use_cache=False)
    copy = _without_tokens(run, tmp_path / "run")
    files = sorted((run / "tokens").glob("*.parquet"))
    for n, file in enumerate(reversed(files)):
        os.link(file, copy / "tokens" / f"part-{n:03d}.parquet")
    moved = _json(copy, use_cache=False)
    moved["run"]["path"] = cold["run"]["path"]
    assert _bytes(moved) == _bytes(cold)


def test_a_warm_or_partly_warm_cache_changes_no_bit(run: Path, tmp_path: Path) -> None:
    cold = _bytes(_json(run, use_cache=False))
    cache = tmp_path / "cache"
    assert _bytes(_json(run, cache_dir=cache)) == cold  # filling it
    assert _bytes(_json(run, cache_dir=cache)) == cold  # from it
    # A live run: half its files analysed (and cached), then the rest appended.
    live = _without_tokens(run, tmp_path / "live")
    files = sorted((run / "tokens").glob("*.parquet"))
    for file in files[: len(files) // 2]:
        os.link(file, live / "tokens" / file.name)
    _json(live, cache_dir=cache)
    for file in files[len(files) // 2 :]:
        os.link(file, live / "tokens" / file.name)
    warm = _json(live, cache_dir=cache)
    warm["run"]["path"] = json.loads(cold)["run"]["path"]
    assert _bytes(warm) == cold


def test_polars_thread_count_changes_no_bit(run: Path) -> None:
    """Analyses in fresh processes with 1 and 3 Polars threads."""
    outputs = []
    for threads in ("1", "3"):
        env = {**os.environ, "POLARS_MAX_THREADS": threads}
        command = [sys.executable, "-m", "rlscope", "analyze", str(run), "--format", "json"]
        done = subprocess.run(
            [*command, "--no-cache", "--fail-on", "never"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]


def test_a_file_read_in_pieces_gives_the_same_bits_cold_and_warm(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large file is reduced in pieces of row groups by every worker; its rows in the run's
    merge are the file's (the sum of its pieces'), cached or not."""
    whole = _without_tokens(run, tmp_path / "whole")
    tokens = pl.read_parquet(sorted((run / "tokens").glob("*.parquet")))
    tokens.write_parquet(whole / "tokens" / "all.parquet", row_group_size=tokens.height // 7)
    monkeypatch.setattr(limits, "PIECE_FILE_BYTES", 1)
    monkeypatch.setattr(limits, "PIECE_ROWS", tokens.height // 3)
    cold = _bytes(_json(whole, use_cache=False))
    cache = tmp_path / "cache"
    assert _bytes(_json(whole, cache_dir=cache)) == cold
    assert _bytes(_json(whole, cache_dir=cache)) == cold
