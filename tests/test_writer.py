"""RunWriter: round trips, validation, flushing, ranks, threads, crashes and failed writes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlscope import tablewriter as writer_module
from rlscope.schema import RUN_JSON, SCHEMA_VERSION, TABLES
from rlscope.writer import RunWriter

# ---------------------------------------------------------------- helpers


def final_files(run_dir: Path, table: str) -> list[Path]:
    """Files under a final name: `*.parquet`, not hidden."""
    folder = run_dir / table
    if not folder.exists():
        return []
    return sorted(p for p in folder.glob("*.parquet") if not p.name.startswith("."))


def visible_entries(run_dir: Path, table: str) -> list[Path]:
    folder = run_dir / table
    if not folder.exists():
        return []
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def read(run_dir: Path, table: str) -> pl.DataFrame:
    files = final_files(run_dir, table)
    assert files, f"no {table} files in {run_dir}"
    return pl.read_parquet(files)


def assert_format_v1_dtypes(table: str, frame: pl.DataFrame) -> None:
    for name, dtype in frame.schema.items():
        spec = TABLES[table].column(name)
        if spec is None:
            continue
        if isinstance(spec.dtype, pl.Categorical):
            assert dtype in (pl.String(), pl.Categorical()), f"{table}.{name}: {dtype}"
        else:
            assert dtype == spec.dtype, f"{table}.{name}: {dtype} != {spec.dtype}"


def rollout_cols(start: int, n: int) -> dict[str, list[Any]]:
    ids = list(range(start, start + n))
    return {
        "rollout_id": ids,
        "step": [i // 4 for i in ids],
        "prompt_id": [f"p{i // 2}" for i in ids],
        "split": ["train" if i % 3 else "eval_id" for i in ids],
        "reward": [i * 0.5 for i in ids],
        "correct": [i % 2 == 0 for i in ids],
        "response_len": [10 + i for i in ids],
        "n_tool_calls": [i % 3 for i in ids],
        "tool_calls": [[f"call{j}" for j in range(i % 3)] for i in ids],
        "temperature": [0.25 * (i % 4) for i in ids],  # extra column
    }


def token_cols(start: int, n: int) -> dict[str, list[Any]]:
    ids = list(range(start, start + n))
    return {
        "rollout_id": [i // 5 for i in ids],
        "step": [i // 20 for i in ids],
        "pos": [i % 5 for i in ids],
        "logprob": [-0.25 * (i % 8) for i in ids],  # exactly representable in float32
        "entropy": [0.5 + 0.125 * (i % 4) for i in ids],
        "clipped": [i % 7 == 0 for i in ids],
        "segment": ["think" if i % 5 < 3 else "answer" for i in ids],
        "extra_tag": [f"t{i}" for i in ids],  # extra column
    }


def probe_cols(start: int, n: int) -> dict[str, list[Any]]:
    ids = list(range(start, start + n))
    return {
        "rollout_id": ids,
        "intervention": [("truncate", "mistake", "filler")[i % 3] for i in ids],
        "fraction": [0.25 * (i % 4) for i in ids],
        "answer": [str(i * 3) for i in ids],
    }


def as_numpy(cols: dict[str, list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, values in cols.items():
        if values and isinstance(values[0], list):
            out[name] = values  # list columns stay python lists
        else:
            out[name] = np.asarray(values)
    return out


def as_rows(cols: dict[str, list[Any]]) -> list[dict[str, Any]]:
    names = list(cols)
    return [dict(zip(names, row, strict=True)) for row in zip(*cols.values(), strict=True)]


KINDS: dict[str, Callable[[dict[str, list[Any]]], Any]] = {
    "dict_of_lists": lambda cols: cols,
    "dict_of_numpy": as_numpy,
    "list_of_rows": as_rows,
    "pyarrow_table": pa.table,
    "polars_frame": pl.DataFrame,
}


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip_each_input_kind(tmp_path: Path, kind: str) -> None:
    convert = KINDS[kind]
    run_dir = tmp_path / "run"
    with RunWriter(run_dir, algorithm="GRPO") as writer:
        for start in (0, 6):  # two batches: concatenation in one buffer
            writer.log_rollouts(convert(rollout_cols(start, 6)))
            writer.log_tokens(convert(token_cols(start * 5, 30)))
            writer.log_probes(convert(probe_cols(start, 6)))
        for step in range(3):
            writer.log_step(step, loss=0.5 * step, grad_norm=np.float32(1.5), lr=1, reward_mean=2.0)

    expected = {
        "rollouts": pl.DataFrame(rollout_cols(0, 12)),
        "tokens": pl.DataFrame(token_cols(0, 60)),
        "probes": pl.DataFrame(probe_cols(0, 12)),
    }
    for table, want in expected.items():
        got = read(run_dir, table)
        assert_format_v1_dtypes(table, got)
        assert got.columns == want.columns, "extra columns must be carried through, in order"
        assert got.height == want.height
        for name in want.columns:
            assert got[name].to_list() == want[name].to_list(), f"{table}.{name}"

    rollouts = read(run_dir, "rollouts")
    assert rollouts.schema["response_len"] == pl.Int32()
    assert rollouts.schema["n_tool_calls"] == pl.Int32()
    assert rollouts.schema["rollout_id"] == pl.Int64()
    assert rollouts.schema["step"] == pl.Int64()
    assert rollouts.schema["reward"] == pl.Float64()
    assert rollouts.schema["correct"] == pl.Boolean()
    assert rollouts.schema["tool_calls"] == pl.List(pl.String())
    assert rollouts.schema["temperature"] == pl.Float64()
    tokens = read(run_dir, "tokens")
    assert tokens.schema["logprob"] == pl.Float32()
    assert tokens.schema["entropy"] == pl.Float32()
    assert tokens.schema["pos"] == pl.Int32()
    assert tokens.schema["step"] == pl.Int64()
    assert tokens.schema["extra_tag"] == pl.String()

    steps = read(run_dir, "steps")
    assert steps.schema["step"] == pl.Int64()
    assert steps.schema["lr"] == pl.Float64()  # logged as int 1, cast to format type
    assert steps.schema["grad_norm"] == pl.Float64()
    assert steps["step"].to_list() == [0, 1, 2]
    assert steps["loss"].to_list() == [0.0, 0.5, 1.0]
    assert steps["grad_norm"].to_list() == [1.5, 1.5, 1.5]
    assert steps["lr"].to_list() == [1.0, 1.0, 1.0]
    assert steps["reward_mean"].to_list() == [2.0, 2.0, 2.0]  # extra metric carried

    # The files themselves carry format-v1 Arrow types (not just polars' view of them).
    schema = pq.read_schema(final_files(run_dir, "tokens")[0])
    assert schema.field("logprob").type == pa.float32()
    assert schema.field("pos").type == pa.int32()
    assert schema.field("step").type == pa.int64()


def test_pyarrow_record_batch_and_zero_dim_numpy(tmp_path: Path) -> None:
    with RunWriter(tmp_path) as writer:
        writer.log_probes(pa.RecordBatch.from_pydict(probe_cols(0, 3)))
        writer.log_rollouts(
            {
                "rollout_id": np.array(7),
                "step": np.array(2),
                "prompt_id": np.array("p0"),
                "reward": np.array(1.0),
                "response_len": np.array(12),
            }
        )
    assert read(tmp_path, "probes")["rollout_id"].to_list() == [0, 1, 2]
    rollouts = read(tmp_path, "rollouts")
    assert rollouts.to_dicts() == [
        {"rollout_id": 7, "step": 2, "prompt_id": "p0", "reward": 1.0, "response_len": 12}
    ]


def test_reused_numpy_buffers_are_copied(tmp_path: Path) -> None:
    """A training loop that refills the same arrays must not rewrite rows already logged."""
    ids = np.zeros(4, dtype=np.int64)
    logprob = np.zeros(4, dtype=np.float32)
    with RunWriter(tmp_path, flush_rows={"tokens": 1_000}) as writer:
        for batch in range(3):
            ids[:] = batch
            logprob[:] = -batch
            writer.log_tokens(
                {"rollout_id": ids, "step": ids, "pos": np.arange(4), "logprob": logprob}
            )
    tokens = read(tmp_path, "tokens")
    assert tokens["rollout_id"].to_list() == [0] * 4 + [1] * 4 + [2] * 4
    assert tokens["step"].to_list() == [0] * 4 + [1] * 4 + [2] * 4
    assert tokens["logprob"].to_list() == [0.0] * 4 + [-1.0] * 4 + [-2.0] * 4


# ---------------------------------------------------------------- run.json


def test_run_json_defaults(tmp_path: Path) -> None:
    run_dir = tmp_path / "my-run-42"
    RunWriter(run_dir).close()
    doc = json.loads((run_dir / RUN_JSON).read_text())
    assert doc == {"schema_version": SCHEMA_VERSION, "run_id": "my-run-42", "algorithm": "unknown"}
    assert doc["schema_version"] == 1


def test_run_json_meta_recorded(tmp_path: Path) -> None:
    RunWriter(
        tmp_path,
        run_id="exp-7",
        algorithm="GiGPO",
        group_size=8,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        max_response_len=4096,
        correct_threshold=0.5,
        max_tool_calls=None,  # None: not recorded
    ).close()
    doc = json.loads((tmp_path / RUN_JSON).read_text())
    assert doc == {
        "schema_version": 1,
        "run_id": "exp-7",
        "algorithm": "GiGPO",
        "group_size": 8,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "max_response_len": 4096,
        "correct_threshold": 0.5,
    }
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_run_json_not_overwritten_by_later_writer(tmp_path: Path) -> None:
    RunWriter(tmp_path, run_id="first", algorithm="PPO", group_size=4).close()
    RunWriter(tmp_path, run_id="second", algorithm="GRPO", rank=1).close()
    doc = json.loads((tmp_path / RUN_JSON).read_text())
    assert doc["run_id"] == "first"
    assert doc["algorithm"] == "PPO"
    assert doc["group_size"] == 4


def test_unknown_meta_field_is_type_error(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(TypeError, match="group_szie"):
        RunWriter(run_dir, group_szie=8)
    assert not run_dir.exists()


def test_schema_version_cannot_be_overridden(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="schema_version"):
        RunWriter(tmp_path, schema_version=2)
    assert not (tmp_path / RUN_JSON).exists()


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("table", "column"),
    [(t, c) for t in ("rollouts", "tokens", "probes") for c in TABLES[t].required_columns],
)
def test_missing_required_column(tmp_path: Path, table: str, column: str) -> None:
    cols = {"rollouts": rollout_cols, "tokens": token_cols, "probes": probe_cols}[table](0, 3)
    del cols[column]
    writer = RunWriter(tmp_path)
    with pytest.raises(ValueError, match=rf"\b{column}\b"):
        getattr(writer, f"log_{table}")(cols)
    writer.close()
    assert final_files(tmp_path, table) == []


@pytest.mark.parametrize(
    ("table", "column", "bad"),
    [
        ("rollouts", "reward", ["high", "low", "none"]),
        ("rollouts", "response_len", [2**40, 1, 2]),  # overflows int32
        ("rollouts", "rollout_id", ["a", "b", "c"]),
        ("tokens", "pos", ["x", "y", "z"]),
        ("tokens", "logprob", [[1.0], [2.0], [3.0]]),
        ("probes", "fraction", [{"a": 1}, {"a": 2}, {"a": 3}]),
    ],
)
def test_uncastable_column(tmp_path: Path, table: str, column: str, bad: list[Any]) -> None:
    cols = {"rollouts": rollout_cols, "tokens": token_cols, "probes": probe_cols}[table](0, 3)
    cols[column] = bad
    writer = RunWriter(tmp_path)
    with pytest.raises(ValueError):
        getattr(writer, f"log_{table}")(cols)
    writer.close()
    assert final_files(tmp_path, table) == []  # the rejected batch was not buffered


def test_unsupported_input_type(tmp_path: Path) -> None:
    with RunWriter(tmp_path) as writer, pytest.raises(TypeError):
        writer.log_rollouts(42)


def test_incompatible_extra_column_does_not_wedge_the_writer(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path, flush_rows={"probes": 4})
    writer.log_probes(probe_cols(0, 1) | {"extra": [[1, 2]]})
    writer.log_probes(probe_cols(1, 1))  # no `extra`
    with pytest.raises(ValueError, match="incompatible"):
        writer.log_probes(probe_cols(2, 2) | {"extra": [5, 6]})  # list vs int: cannot merge
    writer.log_probes(probe_cols(4, 1))  # the writer still works
    writer.close()
    probes = read(tmp_path, "probes")
    assert probes["rollout_id"].to_list() == [0, 1, 4]
    assert probes["extra"].to_list() == [[1, 2], None, None]


# ---------------------------------------------------------------- flushing


def test_flush_rows_makes_one_complete_zstd_file_per_flush(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path, flush_rows={"tokens": 100})
    for start in range(0, 1000, 10):
        writer.log_tokens(token_cols(start, 10))
    files = final_files(tmp_path, "tokens")  # before close: flushed by size alone
    assert len(files) >= 10
    assert len(files) == 10
    for path in files:
        meta = pq.ParquetFile(path).metadata
        assert meta.num_rows == 100
        assert meta.num_row_groups == 1
        for rg in range(meta.num_row_groups):
            for col in range(meta.num_columns):
                assert meta.row_group(rg).column(col).compression == "ZSTD"
        assert pq.read_table(path).num_rows == 100
    writer.close()
    assert len(final_files(tmp_path, "tokens")) == 10  # nothing left to flush
    tokens = read(tmp_path, "tokens")
    assert tokens["extra_tag"].to_list() == [f"t{i}" for i in range(1000)]


def test_close_flushes_remainder(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path, flush_rows={"rollouts": 100})
    for start in range(0, 250, 50):
        writer.log_rollouts(rollout_cols(start, 50))
    writer.log_step(0, loss=1.0)
    assert [pq.read_metadata(p).num_rows for p in final_files(tmp_path, "rollouts")] == [100, 100]
    assert final_files(tmp_path, "steps") == []
    writer.close()
    counts = [pq.read_metadata(p).num_rows for p in final_files(tmp_path, "rollouts")]
    assert counts == [100, 100, 50]
    assert read(tmp_path, "rollouts")["rollout_id"].to_list() == list(range(250))
    assert read(tmp_path, "steps")["step"].to_list() == [0]


def test_flush_writes_all_tables_and_empty_flush_writes_nothing(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path)
    writer.flush()
    assert all(final_files(tmp_path, t) == [] for t in TABLES)
    writer.log_rollouts(rollout_cols(0, 2))
    writer.log_tokens(token_cols(0, 3))
    writer.log_probes(probe_cols(0, 1))
    writer.log_step(5, kl=0.01)
    writer.flush()
    assert {t: len(final_files(tmp_path, t)) for t in TABLES} == dict.fromkeys(TABLES, 1)
    writer.flush()
    writer.close()
    assert {t: len(final_files(tmp_path, t)) for t in TABLES} == dict.fromkeys(TABLES, 1)


def test_closed_writer_rejects_logging_and_close_is_idempotent(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path)
    writer.log_rollouts(rollout_cols(0, 3))
    writer.close()
    writer.close()
    assert len(final_files(tmp_path, "rollouts")) == 1
    with pytest.raises(RuntimeError):
        writer.log_rollouts(rollout_cols(3, 3))
    with pytest.raises(RuntimeError):
        writer.log_tokens(token_cols(0, 3))
    with pytest.raises(RuntimeError):
        writer.log_probes(probe_cols(0, 3))
    with pytest.raises(RuntimeError):
        writer.log_step(1, loss=0.1)
    writer.close()
    assert len(final_files(tmp_path, "rollouts")) == 1
    assert final_files(tmp_path, "tokens") == []


def test_context_manager_closes(tmp_path: Path) -> None:
    with RunWriter(tmp_path) as writer:
        writer.log_rollouts(rollout_cols(0, 3))
        assert final_files(tmp_path, "rollouts") == []
    assert read(tmp_path, "rollouts")["rollout_id"].to_list() == [0, 1, 2]
    with pytest.raises(RuntimeError):
        writer.log_rollouts(rollout_cols(3, 3))


def test_context_manager_flushes_on_exception(tmp_path: Path) -> None:
    with pytest.raises(KeyError), RunWriter(tmp_path) as writer:
        writer.log_rollouts(rollout_cols(0, 3))
        raise KeyError("boom")
    assert read(tmp_path, "rollouts")["rollout_id"].to_list() == [0, 1, 2]


# ---------------------------------------------------------------- ranks


def test_two_ranks_never_share_a_file_name(tmp_path: Path) -> None:
    w0 = RunWriter(tmp_path, rank=0, flush_rows={"rollouts": 10, "tokens": 20})
    w1 = RunWriter(tmp_path, rank=1, flush_rows={"rollouts": 10, "tokens": 20})
    for i in range(10):
        w0.log_rollouts(rollout_cols(i * 5, 5))
        w1.log_rollouts(rollout_cols(1000 + i * 5, 5))
        w0.log_tokens(token_cols(i * 10, 10))
        w1.log_tokens(token_cols(1000 + i * 10, 10))
    w0.close()
    w1.close()
    for table in ("rollouts", "tokens"):
        names = [p.name for p in final_files(tmp_path, table)]
        r0 = {n for n in names if n.startswith("r000-")}
        r1 = {n for n in names if n.startswith("r001-")}
        assert r0 and r1
        assert r0.isdisjoint(r1)
        assert r0 | r1 == set(names)
    ids = sorted(read(tmp_path, "rollouts")["rollout_id"].to_list())
    assert ids == list(range(50)) + list(range(1000, 1050))
    assert read(tmp_path, "tokens").height == 200


def test_same_rank_later_writer_continues_numbering(tmp_path: Path) -> None:
    first = RunWriter(tmp_path, flush_rows={"rollouts": 5})
    first.log_rollouts(rollout_cols(0, 5))
    first.log_rollouts(rollout_cols(5, 5))
    first.log_step(0, loss=1.0)
    first.close()
    before = {p.name: p.read_bytes() for t in TABLES for p in final_files(tmp_path, t)}
    assert len(before) == 3

    second = RunWriter(tmp_path, flush_rows={"rollouts": 5})
    second.log_rollouts(rollout_cols(10, 5))
    second.log_step(1, loss=0.5)
    second.close()
    after = {p.name: p.read_bytes() for t in TABLES for p in final_files(tmp_path, t)}
    assert len(after) == 5
    for name, data in before.items():
        assert after[name] == data, f"{name} was overwritten"
    assert read(tmp_path, "rollouts")["rollout_id"].to_list() == list(range(15))
    assert read(tmp_path, "steps")["step"].to_list() == [0, 1]


# ---------------------------------------------------------------- threads


def test_threads_log_concurrently(tmp_path: Path) -> None:
    n_threads, batches, batch = 8, 40, 7
    writer = RunWriter(tmp_path, flush_rows={"tokens": 50, "rollouts": 13, "steps": 9})
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            barrier.wait()
            for b in range(batches):
                base = (t * batches + b) * batch
                writer.log_tokens(
                    token_cols(base, batch) | {"uid": list(range(base, base + batch))}
                )
                writer.log_rollouts(rollout_cols(base, batch))
                writer.log_step(t * batches + b, loss=float(t))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.close()
    assert not errors, errors

    total = n_threads * batches * batch
    uids = read(tmp_path, "tokens")["uid"].to_list()
    assert len(uids) == total
    assert sorted(uids) == list(range(total))
    ids = read(tmp_path, "rollouts")["rollout_id"].to_list()
    assert sorted(ids) == list(range(total))
    steps = read(tmp_path, "steps")["step"].to_list()
    assert sorted(steps) == list(range(n_threads * batches))
    for table in ("tokens", "rollouts", "steps"):
        names = [p.name for p in final_files(tmp_path, table)]
        assert len(names) == len(set(names))


# ---------------------------------------------------------------- crash safety

CRASH_FLUSH = 2_000
CRASH_BATCH = 500  # divides CRASH_FLUSH: every flush writes exactly CRASH_FLUSH rows

CHILD = f"""
import itertools, sys
import numpy as np
from rlscope.writer import RunWriter

writer = RunWriter(sys.argv[1], flush_rows={{"tokens": {CRASH_FLUSH}, "rollouts": {CRASH_FLUSH}}})
n = {CRASH_BATCH}
for i in itertools.count():
    ids = np.arange(i * n, (i + 1) * n, dtype=np.int64)
    writer.log_tokens({{"rollout_id": ids, "step": ids // 64, "pos": ids % 64,
                       "logprob": (-(ids % 97) / 8).astype(np.float32)}})
    writer.log_rollouts({{"rollout_id": ids, "step": ids // 64,
                         "prompt_id": [f"p{{j}}" for j in ids.tolist()],
                         "reward": (ids % 2).astype(float), "response_len": ids % 512}})
    if i == {CRASH_FLUSH // CRASH_BATCH}:
        print("ready", flush=True)  # at least one flush of each table is on disk
"""


def check_crashed_run(run_dir: Path) -> None:
    for table in ("tokens", "rollouts"):
        visible = visible_entries(run_dir, table)
        files = final_files(run_dir, table)
        assert files, f"{table}: nothing flushed before the kill"
        assert visible == files, f"{table}: non-Parquet visible files {set(visible) - set(files)}"
        hidden = [p for p in (run_dir / table).iterdir() if p.name.startswith(".")]
        assert all(p.name.endswith(".tmp") for p in hidden), hidden
        ids: list[int] = []
        for path in files:
            data = pq.read_table(path)  # complete: footer and all pages present
            assert data.num_rows > 0
            assert data.num_rows % CRASH_FLUSH == 0, (path.name, data.num_rows)
            ids.extend(data.column("rollout_id").to_pylist())
        # Flushes land in order and none is lost: the ids on disk are exactly a prefix.
        assert ids == list(range(len(ids))), f"{table}: a flushed batch is missing or repeated"
        assert pl.read_parquet(run_dir / table / "*.parquet").height == len(ids)


def test_sigkill_never_leaves_partial_files(tmp_path: Path) -> None:
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    delays = [0.2, 0.4, 0.6, 0.8, 1.0]
    delays = [d + rng.uniform(-0.05, 0.05) for d in delays]
    rng.shuffle(delays)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[tuple[Path, float, subprocess.Popen[str]]] = []
    for i, delay in enumerate(delays):
        run_dir = tmp_path / f"crash{i}"
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        procs.append((run_dir, delay, proc))
    try:
        deadlines: list[tuple[float, subprocess.Popen[str]]] = []
        for _, delay, proc in procs:
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                proc.kill()
                pytest.fail(f"child failed: {proc.stderr.read()}")
            deadlines.append((time.monotonic() + delay, proc))
        for deadline, proc in sorted(deadlines, key=lambda d: d[0]):
            time.sleep(max(0.0, deadline - time.monotonic()))
            assert proc.poll() is None, "child exited before being killed"
            proc.send_signal(signal.SIGKILL)
        for _, proc in deadlines:
            assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        for _, _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()

    for run_dir, delay, _ in procs:
        try:
            check_crashed_run(run_dir)
        except AssertionError as exc:
            raise AssertionError(f"seed={seed} delay={delay:.2f}s: {exc}") from exc

        # A new process of the same rank continues numbering; nothing is overwritten.
        old = {p.name: p.stat().st_size for p in final_files(run_dir, "rollouts")}
        with RunWriter(run_dir) as writer:
            writer.log_rollouts(rollout_cols(0, 3))
        new = {p.name: p.stat().st_size for p in final_files(run_dir, "rollouts")}
        assert {k: new[k] for k in old} == old
        added = sorted(set(new) - set(old))
        assert len(added) == 1
        assert added[0] > max(old), (added, max(old))


def test_token_row_groups_are_cut_at_steps_of_many_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step of at least STEP_ROW_GROUP_ROWS token rows gets a row group of its own (its
    statistics then say one step), the rows between such steps one row group; unsorted rows
    one row group; the rows and their order unchanged."""
    monkeypatch.setattr(writer_module, "STEP_ROW_GROUP_ROWS", 100)
    steps = [1] * 150 + [2] * 30 + [3] * 200 + [4] * 120 + [5] * 40
    rows = token_cols(0, len(steps)) | {"step": steps}
    with RunWriter(tmp_path) as writer:
        writer.log_tokens(rows)
    (path,) = final_files(tmp_path, "tokens")
    meta = pq.read_metadata(path)
    index = meta.schema.names.index("step")
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    spans = [
        (g.num_rows, g.column(index).statistics.min, g.column(index).statistics.max) for g in groups
    ]
    assert spans == [(150, 1, 1), (30, 2, 2), (200, 3, 3), (120, 4, 4), (40, 5, 5)]
    assert pl.read_parquet(path)["step"].to_list() == steps
    bounds = writer_module.row_group_bounds
    assert bounds(pl.DataFrame({"step": [3, 1, 3, 1] * 100})) == [0, 400]
    assert bounds(pl.DataFrame({"step": [1] * 100 + [2, 3] * 10 + [4] * 100})) == [0, 100, 120, 220]
    assert bounds(pl.DataFrame({"step": [1] * 250})) == [0, 250]
    assert bounds(pl.DataFrame({"step": []})) == [0, 0]


# ---------------------------------------------------------------- failed writes


def test_failed_write_keeps_buffer_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write_table = pq.ParquetWriter.write_table
    attempts: list[str] = []

    def disk_full(self: pq.ParquetWriter, table: pa.Table, *args: Any, **kwargs: Any) -> None:
        attempts.append(str(self.where))  # the file is open (and partly written) under it
        raise OSError(28, "disk full")

    writer = RunWriter(tmp_path, flush_rows={"tokens": 100})
    writer.log_tokens(token_cols(0, 60))
    monkeypatch.setattr(pq.ParquetWriter, "write_table", disk_full)
    with pytest.raises(OSError, match="disk full"):
        writer.log_tokens(token_cols(60, 60))  # crosses flush_rows: flush fails
    with pytest.raises(OSError, match="disk full"):
        writer.flush()
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert len(attempts) == 3
    assert all(Path(a).name.startswith(".") for a in attempts), "must write to a hidden temp name"
    assert visible_entries(tmp_path, "tokens") == []
    assert list((tmp_path / "tokens").iterdir()) == [], "temp file not cleaned up"

    monkeypatch.setattr(pq.ParquetWriter, "write_table", real_write_table)
    writer.flush()
    files = final_files(tmp_path, "tokens")
    assert len(files) == 1
    tokens = pl.read_parquet(files)
    assert tokens["extra_tag"].to_list() == [f"t{i}" for i in range(120)]
    writer.close()
    assert len(final_files(tmp_path, "tokens")) == 1


def test_failed_rename_keeps_buffer_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_replace = os.replace

    def no_rename(src: Any, dst: Any) -> None:
        raise OSError(5, "I/O error on rename")

    writer = RunWriter(tmp_path)
    writer.log_probes(probe_cols(0, 4))
    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError, match="rename"):
        writer.flush()
    monkeypatch.setattr(os, "replace", real_replace)
    assert list((tmp_path / "probes").iterdir()) == []
    writer.close()
    assert read(tmp_path, "probes")["rollout_id"].to_list() == [0, 1, 2, 3]
