"""The token map on a Dask cluster from the command line: `--scheduler ADDRESS` (and
RLSCOPE_SCHEDULER) on analyze, check, compare and report, against a real LocalCluster of worker
processes. The JSON is the in-process one, the chunks really ran on the cluster."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from typer.testing import CliRunner

from rlscope.cli import app
from rlscope.cluster import SCHEDULER_ENV
from rlscope.tokenscan import limits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    pytest.importorskip("distributed")
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as running:
        yield running


def _run(tmp_path: Path) -> Path:
    """A synthetic run whose tokens are three files (a chunk each, with CHUNK_BYTES 1)."""
    from rlscope.synth import generate

    run = generate(tmp_path / "run", "healthy", steps=30, prompts_per_step=8, seed=5, text=False)
    (single,) = (run / "tokens").glob("*.parquet")
    tokens = pl.read_parquet(single)
    single.unlink()
    chunked = tokens.with_columns(third=pl.col("step") // 10)
    for n, part in enumerate(chunked.partition_by("third", include_key=False)):
        part.write_parquet(run / "tokens" / f"part-{n}.parquet")
    return run


def _tasks_on(cluster: Any) -> int:
    """Tasks the cluster's scheduler has seen (every prefix, every state)."""
    from distributed import Client

    with Client(cluster.scheduler_address) as client:
        counts = client.run_on_scheduler(
            lambda dask_scheduler: sum(
                sum(p.state_counts.values()) for p in dask_scheduler.task_prefixes.values()
            )
        )
    return int(counts)


def _same(a: Any, b: Any, path: str = "") -> None:
    """Equal documents, the first difference named; floats to 1e-12 relative: Polars' threaded
    group-bys sum in an order of their own, so the last bit of a mean can differ from one
    analysis to the next, on a cluster or not (byte-identical output is issue #31's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-15), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def test_analyze_check_compare_report_on_a_cluster(
    cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "CHUNK_BYTES", 1)
    monkeypatch.delenv(SCHEDULER_ENV, raising=False)
    run = str(_run(tmp_path))
    address = cluster.scheduler_address
    local = _cli("analyze", run, "--no-cache", "--format", "json", "--fail-on", "never")
    before = _tasks_on(cluster)
    remote = _cli(
        "analyze",
        run,
        "--no-cache",
        "--format",
        "json",
        "--fail-on",
        "never",
        "--scheduler",
        address,
    )
    assert remote.exit_code == 0, remote.output
    assert _tasks_on(cluster) - before >= 3  # a task per token file, at least
    _same(json.loads(remote.output), json.loads(local.output))
    # RLSCOPE_SCHEDULER, as a CI job would set it
    monkeypatch.setenv(SCHEDULER_ENV, address)
    before = _tasks_on(cluster)
    by_env = _cli("analyze", run, "--no-cache", "--format", "json", "--fail-on", "never")
    _same(json.loads(by_env.output), json.loads(local.output))
    assert _tasks_on(cluster) - before >= 3
    monkeypatch.delenv(SCHEDULER_ENV)
    for command in (
        ["check", run],
        ["compare", run, run, "--format", "json"],
        ["report", run, "-o", str(tmp_path / "report.html")],
    ):
        alone = _cli(*command)
        spread = _cli(*command, "--scheduler", address)
        assert spread.exit_code == alone.exit_code, spread.output
        if "json" in command:
            _same(json.loads(spread.output), json.loads(alone.output))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_scheduler_that_is_not_there_is_a_clear_error(tmp_path: Path) -> None:
    run = str(_run(tmp_path))
    missing = _cli("analyze", run, "--no-cache", "--scheduler", f"tcp://127.0.0.1:{_free_port()}")
    assert missing.exit_code == 2 and "no Dask scheduler answers" in missing.output
    ray = _cli("analyze", run, "--scheduler", "ray://127.0.0.1:10001")
    assert ray.exit_code == 2 and "examples/scale_out.py --engine ray" in ray.output
    for result in (missing, ray):
        assert "Traceback" not in result.output
