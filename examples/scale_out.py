"""Analyse a run with the per-file token reduction on other workers (processes, Ray or Dask).

rlscope's token scan is a map over chunks of token files (`tokenscan.chunk_tagged`, a pure
function of the files and the plan, returning small per-step partials) and a merge by
summation on the driver. Any engine with a `map` can run the first half; rlscope never needs
it installed, and nothing here is a scheduler of its own:

    python examples/scale_out.py RUN --engine process   # a local process pool (no cluster)
    python examples/scale_out.py RUN --engine ray       # RAY_ADDRESS's cluster, else a local one
    python examples/scale_out.py RUN --engine dask      # dask.distributed, local or DASK_SCHEDULER

The workers must see the run's files at the same paths (a shared filesystem or object store
mount). The rollouts, steps and probes tables, which are small next to the tokens, are read on
the driver; the token partials cached in the user cache dir are reused as usual.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import rlscope

Task = Callable[[Any], Any]


def process_map(task: Task, chunks: list[Any]) -> Iterable[Any]:
    """A local process pool: the map/merge split on one machine, as the test suite runs it."""
    context = multiprocessing.get_context("spawn")  # Polars' threads do not survive fork
    with ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=context) as pool:
        return list(pool.map(task, chunks))


def apply(task: Task, chunk: Any) -> Any:
    """`task` on `chunk`: Ray remotes plain functions, and the task is a partial."""
    return task(chunk)


def ray_map(task: Task, chunks: list[Any]) -> Iterable[Any]:
    import ray  # optional, not an rlscope dependency

    if not ray.is_initialized():
        ray.init()  # RAY_ADDRESS's cluster (ray://HEAD:10001 through Ray Client), else a local one
    remote, shared = ray.remote(apply), ray.put(task)  # the task (the plan) sent once
    return ray.get([remote.remote(shared, chunk) for chunk in chunks])


def dask_map(task: Task, chunks: list[Any]) -> Iterable[Any]:
    from dask.distributed import Client  # optional, not an rlscope dependency

    with Client(os.environ.get("DASK_SCHEDULER")) as client:
        return client.gather(client.map(task, chunks, pure=False))


ENGINES = {"process": process_map, "ray": ray_map, "dask": dask_map}


def analyze_on(run: str, engine: str, **options: Any) -> rlscope.Report:
    return rlscope.analyze(run, mapper=ENGINES[engine], **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run")
    parser.add_argument("--engine", choices=sorted(ENGINES), default="process")
    args = parser.parse_args()
    report = analyze_on(args.run, args.engine)
    print(f"{report.run.n_tokens:,} token rows, {report.run.token_files_read} file(s) reduced")
    for finding in report.findings:
        print(f"{finding.severity}: {finding.id}")


if __name__ == "__main__":
    main()
