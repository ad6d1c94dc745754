"""A run in a bucket analysed on a cluster: each worker (a Dask LocalCluster's worker process, a
local Ray head's worker) reads its own token files from the S3 server (moto's, on 127.0.0.1)
with its own credentials; only partials travel; the run is nowhere on disk. The JSON is that
of the same files on disk, analysed in process."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from s3server import s3_server
from test_cluster import _cli, _ray_tasks, _run, _same, _tasks_on, ray_head_started

from rlscope.cluster import SCHEDULER_ENV
from rlscope.tokenscan import limits

pytestmark = pytest.mark.slow

OPTIONS = ("--no-cache", "--format", "json", "--fail-on", "never")


def _without_path(doc: dict[str, Any]) -> dict[str, Any]:
    """The report with the run's path (or URL) left out: the one field that says where it
    was read."""
    doc["run"].pop("path")
    return doc


def _in_bucket_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: Any
) -> tuple[str, Any]:
    """A three-token-file run uploaded to the server, its local JSON (in process), and no
    copy of it left on disk; rlscope and the workers started from now on point at the
    server."""
    monkeypatch.setattr(limits, "CHUNK_BYTES", 1)  # a chunk (a task) per token file
    monkeypatch.delenv(SCHEDULER_ENV, raising=False)
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    run = _run(tmp_path)
    local = _cli("analyze", str(run), *OPTIONS)
    assert local.exit_code == 0, local.output
    url = server.upload(run, "bkt", "runs/three-token-files")
    shutil.rmtree(run)
    return url, _without_path(json.loads(local.output))


def test_dask_workers_read_the_run_from_the_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("distributed")
    pytest.importorskip("moto.server")
    from distributed import LocalCluster

    with s3_server() as server:
        url, local = _in_bucket_only(tmp_path, monkeypatch, server)
        # Worker processes started now: the server's AWS_* variables are in their environment.
        with LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster:
            before = _tasks_on(cluster)
            remote = _cli("analyze", url, *OPTIONS, "--scheduler", cluster.scheduler_address)
            assert remote.exit_code == 0, remote.output
            assert _tasks_on(cluster) - before >= 3  # a task per token file, at least
    doc = json.loads(remote.output)
    assert doc["run"]["path"] == url and doc["run"]["token_files"]["read"] == 3
    _same(_without_path(doc), local)


def test_ray_workers_read_the_run_from_the_bucket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'rlscope[ray]')")
    pytest.importorskip("moto.server")
    with s3_server() as server:
        url, local = _in_bucket_only(tmp_path, monkeypatch, server)
        with ray_head_started(server.env) as (address, temp):
            before = _ray_tasks(temp)
            remote = _cli("analyze", url, *OPTIONS, "--scheduler", address)
            assert remote.exit_code == 0, remote.output
            deadline = time.monotonic() + 30  # the workers' logs are written as they go
            while _ray_tasks(temp) - before < 3 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _ray_tasks(temp) - before >= 3
    _same(_without_path(json.loads(remote.output)), local)
