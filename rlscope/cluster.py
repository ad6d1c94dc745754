"""The token map on a Dask cluster, from a scheduler's address (--scheduler, RLSCOPE_SCHEDULER)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from rlscope.errors import RlscopeError
from rlscope.tokenscan import Mapper, TokenFile

#: The environment variable a scheduler address is read from when `--scheduler` is not given.
SCHEDULER_ENV = "RLSCOPE_SCHEDULER"
#: The optional extra that brings Dask's distributed scheduler client.
EXTRA = "scale"
#: Times a chunk that raised is run again (Dask `retries`); a chunk whose worker died is
#: rescheduled by Dask itself (`distributed.scheduler.allowed-failures`, 3 by default).
RETRIES = 2
#: Seconds to reach the scheduler.
CONNECT_TIMEOUT = 20


def scheduler_mapper(address: str | None) -> Mapper | None:
    """A Mapper running the per-file token reduction on the Dask cluster at `address` (else
    RLSCOPE_SCHEDULER's), None when neither names one: the map then runs in process. The workers
    must see the run's files at the same paths (a shared filesystem); the partials come back to
    the driver, which merges and caches them as in process."""
    address = address or os.environ.get(SCHEDULER_ENV) or None
    if address is None:
        return None
    if address.startswith("ray://"):
        raise RlscopeError(
            f"--scheduler {address}: Ray clusters are not taken from the command line yet",
            hint="use a Dask scheduler (tcp://HOST:8786), or Ray from Python: "
            "examples/scale_out.py --engine ray",
        )
    try:
        from dask.distributed import Client
    except ImportError:
        raise RlscopeError(
            "--scheduler needs Dask's distributed scheduler client",
            hint=f"pip install 'rlscope[{EXTRA}]'  (or: pip install distributed)",
        ) from None

    def mapper(task: Callable[[list[TokenFile]], Any], chunks: list[Any]) -> list[Any]:
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
                files = [str(getattr(f, "path", f)) for i in failed for f in chunks[i]]
                shown = ", ".join(files[:5]) + (
                    f" and {len(files) - 5} more" if len(files) > 5 else ""
                )
                raise RlscopeError(
                    f"--scheduler {address}: the token map failed on the cluster "
                    f"({type(exc).__name__}: {exc}) for the files {shown or '(unknown)'}",
                    hint="check the workers' logs (a worker that died repeatedly ends as "
                    "KilledWorker) and that they see these files at the same paths",
                ) from None

    return mapper
