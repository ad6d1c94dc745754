"""The token map on a Dask or Ray cluster, from an address (--scheduler, RLSCOPE_SCHEDULER)."""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import urlsplit

from rlscope.errors import RlscopeError
from rlscope.tokenscan import Mapper, TokenFile

#: The environment variable a scheduler address is read from when `--scheduler` is not given.
SCHEDULER_ENV = "RLSCOPE_SCHEDULER"
#: The optional extra that brings Dask's distributed scheduler client.
EXTRA = "scale"
#: The optional extra that brings Ray's client (`ray[client]`), for `ray://` addresses.
RAY_EXTRA = "ray"
#: Times a chunk that raised is run again (Dask `retries`; Ray `max_retries` with
#: `retry_exceptions`). A chunk whose worker died is rescheduled by Dask itself
#: (`distributed.scheduler.allowed-failures`, 3 by default); on Ray, a worker's death is one of
#: the same `max_retries`.
RETRIES = 2
#: Seconds to reach the scheduler (Dask), or the Ray client server's port (Ray; the Ray client's
#: own handshake then retries for at most ~30 s more when something else answers there).
CONNECT_TIMEOUT = 20
#: The Ray client server's port when a `ray://HOST` address names none (`ray start`'s default).
RAY_CLIENT_PORT = 10001
#: Files named in the error of a failed map; the rest are counted.
SHOWN_FILES = 5

Task = Callable[[list[TokenFile]], Any]


def scheduler_mapper(address: str | None) -> Mapper | None:
    """A Mapper running the per-file token reduction on the cluster at `address` (else
    RLSCOPE_SCHEDULER's): a Dask scheduler (`tcp://HOST:8786`) or, for `ray://HOST:PORT`, a Ray
    cluster through Ray Client; None when neither names one: the map then runs in process. The
    workers read the run's files themselves: at the same paths (a shared filesystem), or, for a
    run in a store (s3://...), from the store with their own environment's credentials; only
    the partials come back to the driver, which merges and caches them as in process."""
    address = address or os.environ.get(SCHEDULER_ENV) or None
    if address is None:
        return None
    if address.startswith("ray://"):
        return _ray_mapper(address)
    return _dask_mapper(address)


def _dask_mapper(address: str) -> Mapper:
    try:
        from dask.distributed import Client
    except ImportError:
        raise RlscopeError(
            "--scheduler needs Dask's distributed scheduler client",
            hint=f"pip install 'rlscope[{EXTRA}]'  (or: pip install distributed)",
        ) from None

    def mapper(task: Task, chunks: list[Any]) -> list[Any]:
        try:
            client = Client(address, timeout=CONNECT_TIMEOUT, set_as_default=False)
        except (OSError, TimeoutError) as exc:
            raise RlscopeError(
                f"--scheduler {address}: no Dask scheduler answers ({exc})",
                hint="start one (dask scheduler; dask worker ADDRESS) or check the address",
            ) from None
        with client:
            futures = client.map(task, chunks, pure=False, retries=RETRIES)
            try:
                return list(client.gather(futures))
            except Exception as exc:
                failed = [i for i, f in enumerate(futures) if f.status == "error"]
                raise _map_failed(
                    address,
                    exc,
                    [chunks[i] for i in failed],
                    hint="check the workers' logs (a task whose workers died on every attempt "
                    "ends as KilledWorker) and that they see these files at the same paths (or, "
                    "for a store's URL, have its credentials and endpoint in their environment)",
                ) from None

    return mapper


def _ray_mapper(address: str) -> Mapper:
    # Ray Client's transport is gRPC: `ray[client]`, not plain `ray`.
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("grpc") is None:
        raise RlscopeError(
            f"--scheduler {address} needs Ray's client",
            hint=f"pip install 'rlscope[{RAY_EXTRA}]'  (or: pip install 'ray[client]')",
        )
    import ray

    parts = urlsplit(address)
    try:
        host, port = parts.hostname, parts.port or RAY_CLIENT_PORT
    except ValueError:
        host = None
    if not host:
        raise RlscopeError(
            f"--scheduler {address}: not a Ray client address",
            hint=f"ray://HOST:PORT, the head's Ray client server (port {RAY_CLIENT_PORT} "
            "by default)",
        )
    address = f"ray://[{host}]:{port}" if ":" in host else f"ray://{host}:{port}"

    def mapper(task: Task, chunks: list[Any]) -> list[Any]:
        with _ray_client(address, host, port):
            remote = ray.remote(max_retries=RETRIES, retry_exceptions=True)(_token_map)
            shared = ray.put(task)  # the task (the plan) is sent once, not once per chunk
            refs = [remote.remote(shared, chunk) for chunk in chunks]
            try:
                return list(ray.get(refs))
            except Exception as exc:
                raise _map_failed(
                    address,
                    getattr(exc, "cause", None) or exc,  # RayTaskError: the task's own error
                    [chunks[i] for i in _ray_failed(refs)],
                    hint="check the workers' logs (on the head: ray logs, or "
                    "/tmp/ray/session_latest/logs) and that they see these files at the "
                    "same paths (or, for a store's URL, have its credentials and endpoint in "
                    "their environment)",
                ) from None

    return mapper


@contextmanager
def _ray_client(address: str, host: str, port: int) -> Iterator[None]:
    """Connected to the Ray cluster at `address` through Ray Client for the block: its port is
    tried first, so that an address where nothing listens is said at once (a connection
    refused) or after CONNECT_TIMEOUT seconds (nothing answers), never waited on."""
    import ray

    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT).close()
    except OSError as exc:
        raise RlscopeError(
            f"--scheduler {address}: no Ray cluster answers ({exc})",
            hint="start one (ray start --head; ray start --address HEAD:6379 on the other "
            f"machines); the address is the head's Ray client server, port {RAY_CLIENT_PORT} "
            "by default",
        ) from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Ray's own "connection timed out" advice
            # The workers' output stays in the cluster's logs: forwarded, it would be printed
            # on this process' stdout, into a JSON report.
            context = ray.init(address, log_to_driver=False, logging_level=logging.ERROR)
    except Exception as exc:  # ConnectionError, a Python or Ray version mismatch (RuntimeError)
        hint = (
            "the address is the head's Ray client server (ray start --head "
            f"--ray-client-server-port, {RAY_CLIENT_PORT} by default); the cluster runs the "
            "same Python and Ray versions as here"
        )
        if "Starting Ray client server failed" in str(exc):
            hint = (
                "the head's client server could not start the server of this connection (its "
                "logs say why); try again. With Ray 2.60 and grpcio 1.85 that server crashed in "
                "gRPC right after its fork in 3 of 10 first connections to a new head, and in "
                "none once the head was started with GRPC_ENABLE_FORK_SUPPORT=false "
                "(GRPC_ENABLE_FORK_SUPPORT=false ray start --head)"
            )
        raise RlscopeError(
            f"--scheduler {address}: could not connect to a Ray cluster there "
            f"({type(exc).__name__}: {_one_line(exc)})",
            hint=hint,
        ) from None
    with context:
        yield


def _token_map(task: Task, chunk: list[TokenFile]) -> Any:
    """`task` on `chunk`, on a Ray worker (Ray remotes functions, not the task's partial)."""
    return task(chunk)


def _ray_failed(refs: Sequence[Any]) -> list[int]:
    """The chunks (indices into `refs`) whose Ray task ended in an error once the map did (Ray
    raises the first error it sees): the tasks still running are cancelled, not waited on."""
    import ray

    try:
        done, running = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in running:
            with suppress(Exception):
                ray.cancel(ref)
        done_ids = {ref.hex() for ref in done}
        failed = []
        for i, ref in enumerate(refs):
            if ref.hex() in done_ids:
                try:
                    ray.get(ref)
                except Exception:
                    failed.append(i)
        return failed
    except Exception:  # the connection itself went: which chunks failed is not known
        return []


def _map_failed(
    address: str, exc: BaseException, failed: Sequence[Sequence[Any]], *, hint: str
) -> RlscopeError:
    """The error of a map that failed on the cluster (`exc`, the first error seen), naming the
    files of the chunks known to have failed after their retries (`failed`)."""
    files = [str(getattr(piece, "path", piece)) for chunk in failed for piece in chunk]
    files = list(dict.fromkeys(files))  # a large file's pieces: named once
    shown = ", ".join(files[:SHOWN_FILES]) + (
        f" and {len(files) - SHOWN_FILES} more" if len(files) > SHOWN_FILES else ""
    )
    return RlscopeError(
        f"--scheduler {address}: the token map failed on the cluster "
        f"({type(exc).__name__}: {_one_line(exc)}) for the files {shown or '(unknown)'}",
        hint=hint,
    )


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line: a message that quotes a remote traceback (Ray's) is
    its first line and its last (the error itself)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return "no message"
    return lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"
