"""Shared fixtures: writing small synthetic run directories and checking metric series."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from rlscope.report import MetricResult
from rlscope.writer import RunWriter

#: table -> one batch (dict of columns) or a list of batches, each written to its own file;
#: "steps" -> a list of row dicts (each with `step`).
Tables = Mapping[str, Any]
WriteRun = Callable[..., Path]
CheckSeries = Callable[..., None]


#: A Python with torch, transformers, TRL and rlscope (`make test-slow` sets it): the genuine
#: trainers in tests/trainers run with it.
TRL_PYTHON = os.environ.get("RLSCOPE_TRL_PYTHON", "")
TRAINERS = Path(__file__).parent / "trainers"
#: Genuine trainer output (each folder's README says how it was made): kept in the repository
#: so that every clone tests the same thing.
GENUINE = Path(__file__).parent / "genuine"


def genuine_eval_points() -> tuple[list[dict[str, Any]], dict[tuple[int, str], tuple[float, int]]]:
    """tests/genuine/trl-two-eval-sets' log_history and, per (step, split), each eval set's
    accuracy and completions as TRL logged them (8 completions a prompt)."""
    history = json.loads((GENUINE / "trl-two-eval-sets" / "trainer_state.json").read_text())
    points = {}
    for entry in history["log_history"]:
        for name, split in (("in_dist", "eval_id"), ("ood", "eval_ood")):
            if f"eval_{name}_runtime" in entry:
                size = entry[f"eval_{name}_samples_per_second"] * entry[f"eval_{name}_runtime"]
                points[entry["step"], split] = (
                    entry["eval_rewards/accuracy_reward/mean"],
                    round(size) * 8,
                )
    return history["log_history"], points


def run_trainer(
    script: str, *args: str | Path, processes: int = 1, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """tests/trainers/`script` with `args`, on TRL_PYTHON (skipped without it), on one thread
    per process; `processes` > 1 launches it with torchrun. Fails with its stderr's tail."""
    if not Path(TRL_PYTHON).is_file():
        pytest.skip("RLSCOPE_TRL_PYTHON (a Python with torch, trl and rlscope; `make test-slow`)")
    launch = [TRL_PYTHON]
    if processes > 1:
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    done = subprocess.run(
        [*launch, str(TRAINERS / script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def trainer_constant(script: str, name: str) -> int:
    """An integer constant `NAME = N` of tests/trainers/`script` (read, not imported: the
    trainers need torch)."""
    found = re.search(rf"^{name} = (\d+)", (TRAINERS / script).read_text(), re.M)
    assert found is not None, f"{script} has no {name}"
    return int(found.group(1))


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    columns: int = 200,
    process: bool = False,
) -> CliResult:
    """The `rlscope` command with `args`, its output captured (stdout and stderr apart) and no
    colour unless `env` asks for it. In this process by default (the same Typer app, ~50x
    cheaper than starting Python and Polars); an exception the CLI lets escape is raised here.
    `process=True` runs the installed entry point in a real process, for what only a process
    shows (the console script, interpreter start-up)."""
    overrides: dict[str, str | None] = {
        "COLUMNS": str(columns),
        "FORCE_COLOR": None,
        "NO_COLOR": None,
        **(env or {}),
    }
    if process:
        script = Path(sys.executable).with_name("rlscope")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "rlscope"]
        environ = {k: v for k, v in {**os.environ, **overrides}.items() if v is not None}
        done = subprocess.run(
            [*command, *args], capture_output=True, text=True, env=environ, cwd=cwd, timeout=120
        )
        return CliResult(done.returncode, done.stdout, done.stderr)
    from typer.testing import CliRunner

    from rlscope.cli import app

    here = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args), env=overrides, prog_name="rlscope")
    finally:
        os.chdir(here)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return CliResult(result.exit_code, result.stdout, result.stderr)


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """No test reads or writes the user's own cache (token-file partials, imports)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLSCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("rlscope-cache")))
        yield


@pytest.fixture
def write_run(tmp_path: Path) -> WriteRun:
    """`write_run(tables, **run_json_fields) -> run dir`, written with RunWriter."""
    names = count()

    def write(tables: Tables, *, name: str | None = None, **meta: Any) -> Path:
        path = tmp_path / (name or f"run{next(names)}")
        with RunWriter(path, run_id=path.name, algorithm="GRPO", **meta) as writer:
            for table, data in tables.items():
                if table == "steps":
                    for row in data:
                        writer.log_step(**row)
                    writer.flush()
                    continue
                for batch in [data] if isinstance(data, Mapping) else data:
                    getattr(writer, f"log_{table}")(batch)
                    writer.flush()  # one file per batch
        return path

    return write


def final_window(values: Sequence[float]) -> float:
    """The summary, computed independently: mean of the last 10% of values, at least 3 (all
    of them when there are fewer)."""
    n = min(len(values), max(3, math.ceil(len(values) / 10)))
    tail = list(values)[-n:]
    return sum(tail) / len(tail)


def _close(a: float, b: float, rel: float, abs_: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


@pytest.fixture
def check_series() -> CheckSeries:
    """`check_series(result, {step: value}, rel=, abs=)`: the defined per-step values are exactly
    the expected ones (steps with an expected None must be undefined) and the summary is their
    final-window mean."""

    def check(
        result: MetricResult,
        expected: Mapping[int, float | None],
        *,
        rel: float = 1e-9,
        abs: float = 1e-12,
    ) -> None:
        got = {s: v for s, v in zip(result.steps, result.values, strict=True) if v is not None}
        want = {s: v for s, v in expected.items() if v is not None}
        assert list(result.steps) == sorted(result.steps), f"{result.id}: steps not sorted"
        assert sorted(got) == sorted(want), f"{result.id}: defined at {sorted(got)}"
        bad = {s: (got[s], want[s]) for s in want if not _close(got[s], want[s], rel, abs)}
        assert not bad, f"{result.id}: (got, expected) per step {bad}"
        summary = final_window([want[s] for s in sorted(want)])
        assert result.value is not None
        assert _close(result.value, summary, rel, abs), (result.id, result.value, summary)

    return check


@pytest.fixture(scope="session")
def s3() -> Any:
    """A real S3 API (moto's server, tests/s3server.py) on 127.0.0.1 for the session (per
    xdist worker): upload a run with `s3.upload(folder, bucket, prefix)`, point rlscope at it
    with `s3.env`."""
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    from s3server import s3_server

    with s3_server() as server:
        yield server
