"""The token map on a cluster from the command line: `--scheduler ADDRESS` (and RLSCOPE_SCHEDULER)
on analyze, check, compare and report, against a real Dask LocalCluster of worker processes and a
real local Ray head. The JSON is the in-process one, the chunks really ran on the cluster; a worker
that dies once is survived, one that dies on every attempt ends in one error naming its files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from typer.testing import CliRunner

from rlscope.cli import app
from rlscope.cluster import SCHEDULER_ENV
from rlscope.tokenscan import limits

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


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
    """Equal documents, to the last bit of every float (rlscope.exactsum: the same run gives
    the same bytes whatever ran the map), the first difference named."""
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
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


def test_a_scheduler_that_is_not_there_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = str(_run(tmp_path))
    missing = _cli("analyze", run, "--no-cache", "--scheduler", f"tcp://127.0.0.1:{_free_port()}")
    assert missing.exit_code == 2 and "no Dask scheduler answers" in missing.output
    results = [missing]
    if _has_ray():
        started = time.monotonic()
        ray = _cli("analyze", run, "--no-cache", "--scheduler", f"ray://127.0.0.1:{_free_port()}")
        assert ray.exit_code == 2 and "no Ray cluster answers" in ray.output, ray.output
        assert time.monotonic() - started < 15  # a refused connection is said at once
        results.append(ray)
    # Ray not installed: the extra to install, before any connection is tried
    monkeypatch.setitem(sys.modules, "ray", None)
    absent = _cli("analyze", run, "--no-cache", "--scheduler", "ray://127.0.0.1:10001")
    assert absent.exit_code == 2 and "pip install 'rlscope[ray]'" in absent.output
    for result in (*results, absent):
        assert "Traceback" not in result.output


def _has_ray() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def _rlscope(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own, as a user runs it: its exit code, and never a hang."""
    return subprocess.run(
        [sys.executable, "-m", "rlscope", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if k != SCHEDULER_ENV},
    )


def _killer(marker: str | None) -> Any:
    """A Dask worker plugin whose worker process dies (`os._exit`) as a task starts executing:
    once in all (the first worker to create `marker`), or, without a marker, every time. Defined
    here so that it is pickled by value: the workers need not import this test module."""
    from distributed import WorkerPlugin

    class DieWhenExecuting(WorkerPlugin):
        name = "die-when-executing"

        def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
            if finish != "executing":
                return
            if marker is not None:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    return  # died once already: this attempt runs
            os._exit(1)

    return DieWhenExecuting()


@pytest.fixture
def dying_cluster() -> Iterator[Any]:
    """A LocalCluster of its own for the tests that kill its workers (the module's shared one
    stays whole), on which a task is declared failed after its second worker died (Dask's
    `allowed-failures` 1; 3 by default), so that a worker dying on every attempt ends soon."""
    pytest.importorskip("distributed")
    import dask
    from distributed import LocalCluster

    with (
        dask.config.set({"distributed.scheduler.allowed-failures": 1}),
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as running,
    ):
        yield running


def _kill_workers(cluster: Any, marker: str | None) -> None:
    from distributed import Client

    with Client(cluster.scheduler_address) as client:
        client.register_plugin(_killer(marker))


def _analyze(run: str, *more: str) -> subprocess.CompletedProcess[str]:
    return _rlscope("analyze", run, "--no-cache", "--format", "json", "--fail-on", "never", *more)


def test_a_worker_that_dies_once_is_rescheduled(dying_cluster: Any, tmp_path: Path) -> None:
    run = str(_run(tmp_path))
    local = _analyze(run)
    assert local.returncode == 0, local.stderr
    marker = tmp_path / "died"
    _kill_workers(dying_cluster, str(marker))
    spread = _analyze(run, "--scheduler", dying_cluster.scheduler_address)
    assert marker.exists()  # a worker did die, running the token map
    assert spread.returncode == 0, spread.stderr
    _same(json.loads(spread.stdout), json.loads(local.stdout))


def test_a_worker_that_dies_on_every_attempt_is_one_error_naming_its_files(
    dying_cluster: Any, tmp_path: Path
) -> None:
    run = _run(tmp_path)
    _kill_workers(dying_cluster, None)
    started = time.monotonic()
    failed = _analyze(str(run), "--scheduler", dying_cluster.scheduler_address)
    assert failed.returncode == 2, failed.stderr
    assert time.monotonic() - started < 180
    error = failed.stderr
    assert error.count("error:") == 1 and "Traceback" not in error, error
    assert "the token map failed on the cluster (KilledWorker" in error, error
    # the three token files are one chunk (16 MB of Parquet to a chunk), the task that died
    for part in sorted((run / "tokens").glob("*.parquet")):
        assert str(part) in error, error
    assert failed.stdout == ""


@pytest.fixture(scope="module")
def ray_head() -> Iterator[tuple[str, Path]]:
    with ray_head_started() as started:
        yield started


@contextmanager
def ray_head_started(env: Mapping[str, str] | None = None) -> Iterator[tuple[str, Path]]:
    """A real Ray head on 127.0.0.1 (`ray start --head --block`, two CPUs, no dashboard) in a
    process group of its own, killed at the end: its Ray client address and its temp dir. Its
    workers have this process' environment and `env`."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'rlscope[ray]')")
    # Short: Ray's socket paths under it must fit in 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="rlray-"))
    client_port = _free_port()
    log = (temp / "head.log").open("w")
    head = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={_free_port()}",
            f"--ray-client-server-port={client_port}",
            "--num-cpus=2",
            "--include-dashboard=false",
            f"--dashboard-port={_free_port()}",
            f"--dashboard-agent-listen-port={_free_port()}",
            "--object-store-memory=100000000",
            # workers on ports of the OS's choosing (not 10002-19999, which another head shares)
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: every Ray process ends with it
        # Without it, the server the head's client server starts for a connection (a fork of a
        # process running gRPC) crashed right away in 3 of 10 first connections (a segfault in
        # cygrpc; Ray 2.60, grpcio 1.85), and the connection failed: in none of 10 with it.
        env={**os.environ, **(env or {}), "GRPC_ENABLE_FORK_SUPPORT": "false"},
    )
    try:
        deadline = time.monotonic() + 120
        # Started, and its client server listening (it opens its port a moment after)
        while "Ray runtime started" not in (temp / "head.log").read_text() or not _listens(
            client_port
        ):
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not start:\n{(temp / 'head.log').read_text()}")
            time.sleep(0.5)
        yield f"ray://127.0.0.1:{client_port}", temp
    finally:
        _end_group(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _end_group(head: subprocess.Popen[Any]) -> None:
    """The head and every process it started ended: its process group and its descendants (a
    Ray worker may start a process group of its own), asked first, then killed (the GCS server
    and the raylet may outlive a SIGTERM)."""
    pids = _descendants(head.pid)
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        with suppress(ProcessLookupError):
            os.killpg(head.pid, sig)
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            head.poll()
            pids = {pid for pid in pids if _alive(pid)}
            if not pids and not _alive(-head.pid):
                break
            time.sleep(0.2)
    head.wait(timeout=10)


def _alive(pid: int) -> bool:
    """A process (a process group, for a negative `pid`) that is there and not a zombie."""
    if pid > 0:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
        except OSError:
            return False
    try:
        os.killpg(-pid, 0)
    except ProcessLookupError:
        return False
    return True


def _descendants(root: int) -> set[int]:
    """The processes under `root` (children, theirs, …), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, ValueError, IndexError):
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _ray_tasks(temp: Path) -> int:
    """The token-map tasks the Ray head's workers have started: each writes its task's name into
    its log as it starts it (`:task_name:`, what Ray prefixes forwarded output with)."""
    return sum(
        log.read_text(errors="replace").count(":task_name:_token_map")
        for log in temp.glob("session_latest/logs/worker-*.out")
    )


def test_analyze_and_compare_on_a_ray_cluster(
    ray_head: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, temp = ray_head
    monkeypatch.setattr(limits, "CHUNK_BYTES", 1)  # a chunk (a Ray task) per token file
    monkeypatch.delenv(SCHEDULER_ENV, raising=False)
    run = str(_run(tmp_path))
    options = ("--no-cache", "--format", "json", "--fail-on", "never")
    local = _cli("analyze", run, *options)
    before = _ray_tasks(temp)
    remote = _cli("analyze", run, *options, "--scheduler", address)
    assert remote.exit_code == 0, remote.output
    _same(json.loads(remote.output), json.loads(local.output))
    deadline = time.monotonic() + 30  # the workers' logs are written as they go
    while _ray_tasks(temp) - before < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_tasks(temp) - before >= 3  # a task per token file, at least
    # The example's Ray mapper (examples/scale_out.py), reached as README shows: RAY_ADDRESS
    example = subprocess.run(
        [sys.executable, str(EXAMPLES / "scale_out.py"), run, "--engine", "ray"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "RAY_ADDRESS": address, "RLSCOPE_CACHE_DIR": str(tmp_path / "c0")},
    )
    assert example.returncode == 0, example.stderr[-3000:]
    assert "3 file(s) reduced" in example.stdout, example.stdout
    # Two runs: two connections in one process, one after the other (each command with a cache
    # of its own, so that each reads the token files)
    monkeypatch.setenv("RLSCOPE_CACHE_DIR", str(tmp_path / "c1"))
    alone = _cli("compare", run, run, "--format", "json")
    monkeypatch.setenv("RLSCOPE_CACHE_DIR", str(tmp_path / "c2"))
    before = _ray_tasks(temp)
    spread = _cli("compare", run, run, "--format", "json", "--scheduler", address)
    assert spread.exit_code == alone.exit_code, spread.output
    _same(json.loads(spread.output), json.loads(alone.output))
    deadline = time.monotonic() + 30
    while _ray_tasks(temp) - before < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_tasks(temp) - before >= 3


#: Tasks for the Ray mapper, run by a Python of its own (a bounded time; its functions, in
#: __main__, go to the workers by value): their results, or the error each map ended in.
RAY_TASKS = """
import json, os, sys
from rlscope.cluster import scheduler_mapper
from rlscope.errors import RlscopeError

address, markers = sys.argv[1], sys.argv[2]

def once(name):
    try:
        os.close(os.open(os.path.join(markers, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True

def raises_once(chunk):
    if once("raised"):
        raise RuntimeError("a transient failure")
    return chunk[0]

def dies_once(chunk):
    if once("died"):
        os._exit(1)
    return chunk[0]

def dies(chunk):
    os._exit(1)

mapper = scheduler_mapper(address)
chunks = [[f"part-{n}.parquet"] for n in range(4)]
out = {}
for name, task in (("raises_once", raises_once), ("dies_once", dies_once), ("raises", int),
                   ("dies", dies)):
    try:
        out[name] = mapper(task, chunks if "once" in name else chunks[:1])
    except RlscopeError as exc:
        out[name] = exc.message
print(json.dumps(out))
"""


def test_ray_retries_a_task_that_raised_or_whose_worker_died(
    ray_head: tuple[str, Path], tmp_path: Path
) -> None:
    address, _ = ray_head
    script = tmp_path / "ray_tasks.py"
    script.write_text(RAY_TASKS)
    done = subprocess.run(
        [sys.executable, str(script), address, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    expected = [f"part-{n}.parquet" for n in range(4)]
    assert out["raises_once"] == expected and (tmp_path / "raised").exists()
    assert out["dies_once"] == expected and (tmp_path / "died").exists()
    # After its retries: one error naming the files of the chunk
    assert "the token map failed on the cluster (TypeError" in out["raises"]
    assert "for the files part-0.parquet" in out["raises"]
    assert "the token map failed on the cluster" in out["dies"]
    assert "for the files part-0.parquet" in out["dies"]
