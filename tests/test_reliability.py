"""Bad input, one test per case: a clear error (CLI exit 2, file and column named, no traceback)
or a usable report whose numbers are right and whose warnings count what was left out."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import rlscope
from rlscope.engine import compute
from rlscope.errors import RlscopeError
from rlscope.reader import open_run
from rlscope.report import Report
from rlscope.writer import RunWriter

META = {"schema_version": 1, "run_id": "r1", "algorithm": "GRPO"}


def rollouts(n: int = 8, start: int = 0, **overrides: Any) -> pa.Table:
    """Rollouts `start..start+n`: step 1 + i // 4, prompts p0/p1 (groups of 2), reward i % 2."""
    ids = range(start, start + n)
    cols: dict[str, Any] = {
        "rollout_id": pa.array(ids, pa.int64()),
        "step": pa.array([1 + i // 4 for i in ids], pa.int64()),
        "prompt_id": pa.array([f"p{(i // 2) % 2}" for i in ids], pa.string()),
        "reward": pa.array([float(i % 2) for i in ids], pa.float64()),
        "response_len": pa.array([10 + i for i in ids], pa.int32()),
    }
    for name, value in overrides.items():
        if value is None:
            cols.pop(name)
        else:
            cols[name] = value
    return pa.table(cols)


def tokens(rollout_ids: list[int], steps: list[int], **cols: Any) -> pa.Table:
    base: dict[str, Any] = {
        "rollout_id": pa.array(rollout_ids, pa.int64()),
        "step": pa.array(steps, pa.int64()),
        "pos": pa.array(range(len(rollout_ids)), pa.int32()),
    }
    return pa.table({**base, **cols})


def make_run(root: Path, meta: dict[str, Any] | None = None, **files: pa.Table | bytes) -> Path:
    """run.json and files by relative path (`__` = `/`, `.parquet` appended)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.json").write_text(json.dumps(META if meta is None else meta))
    for rel, content in files.items():
        path = root / rel.replace("__", "/")
        path = path.with_name(path.name + ".parquet")
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            pq.write_table(content, path)
    return root


def cli_error(run: Path, *needles: str, command: str = "analyze") -> str:
    """`python -m rlscope <command> RUN` fails with exit 2, one message naming every needle."""
    proc = subprocess.run(
        [sys.executable, "-m", "rlscope", command, str(run)],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "panicked" not in out, out
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return proc.stderr


def warning(report: Report, *needles: str) -> str:
    found = [w for w in report.warnings if all(n in w for n in needles)]
    assert len(found) == 1, (needles, report.warnings)
    return found[0]


def series(report: Report, metric: str) -> dict[int, float | None]:
    result = report.metrics[metric]
    assert list(result.steps) == sorted(result.steps)
    return dict(zip(result.steps, result.values, strict=True))


def close(got: dict[int, float | None], want: dict[int, float]) -> None:
    assert sorted(k for k, v in got.items() if v is not None) == sorted(want), (got, want)
    for step, value in want.items():
        assert math.isclose(got[step], value, rel_tol=1e-9, abs_tol=1e-12), (step, got, want)  # type: ignore[arg-type]


# ---------------------------------------------------------------- layout and run.json


def test_missing_run_dir(tmp_path: Path) -> None:
    cli_error(tmp_path / "nope", str(tmp_path / "nope"), "no such run directory")


def test_empty_run_dir(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    cli_error(tmp_path / "empty", "run.json", "missing")


def test_no_run_json(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts=rollouts())
    (run / "run.json").unlink()
    cli_error(run, str(run / "run.json"), "missing")


def test_invalid_run_json(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts=rollouts())
    (run / "run.json").write_text('{"schema_version": 1, "run_id": ')
    cli_error(run, str(run / "run.json"), "not valid JSON")


def test_unknown_schema_version(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", {**META, "schema_version": 7}, rollouts=rollouts())
    cli_error(run, str(run / "run.json"), "unknown schema_version 7")


# ---------------------------------------------------------------- broken files


def test_truncated_parquet(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=rollouts(start=8))
    path = run / "rollouts" / "b.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    cli_error(run, str(path), "not a readable Parquet file")
    cli_error(run, str(path), command="validate")


def test_zero_byte_file(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=b"")
    cli_error(run, str(run / "rollouts" / "b.parquet"), "empty file")


def test_not_parquet(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=b"step,reward\n1,0.5\n" * 9)
    cli_error(run, str(run / "rollouts" / "b.parquet"), "not a readable Parquet file")


def test_wrong_column_type(tmp_path: Path) -> None:
    bad = rollouts(reward=pa.array(["high"] * 8, pa.string()))
    run = make_run(tmp_path / "r", rollouts=bad)
    cli_error(run, str(run / "rollouts.parquet"), "`reward`", "expected float64")


def test_required_column_missing_in_one_of_many_files(tmp_path: Path) -> None:
    files = {f"rollouts__part{i}": rollouts(start=8 * i) for i in range(5)}
    files["rollouts__part3"] = rollouts(start=24, prompt_id=None)
    run = make_run(tmp_path / "r", **files)
    cli_error(run, str(run / "rollouts" / "part3.parquet"), "`prompt_id`", "missing")


def test_duplicate_rollout_ids(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=rollouts(n=4, start=6))
    cli_error(run, "duplicate rollout_id", "6, 7")


def test_non_utf8_bytes(tmp_path: Path) -> None:
    # A binary column where a string is expected: a type error at open.
    binary = rollouts(prompt_id=pa.array([b"p\xff"] * 8, pa.binary()))
    run = make_run(tmp_path / "bin", rollouts=binary)
    cli_error(run, str(run / "rollouts.parquet"), "`prompt_id`", "Binary", "expected string")
    # Invalid UTF-8 inside a string column (pyarrow writes it unchecked): found at scan time,
    # with the file, column and row range.
    data = b"".join(b"p0" if i != 5 else b"p\xff\xfe" for i in range(8))
    offsets = np.cumsum([0] + [2 if i != 5 else 3 for i in range(8)]).astype(np.int32)
    bad = pa.Array.from_buffers(pa.string(), 8, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    run = make_run(tmp_path / "utf8", rollouts__ok=rollouts(start=8), rollouts__bad=rollouts())
    table = rollouts().set_column(2, "prompt_id", bad)
    pq.write_table(table, run / "rollouts" / "bad.parquet")
    cli_error(run, str(run / "rollouts" / "bad.parquet"), "`prompt_id`", "rows 0-7", "UTF-8")


# ---------------------------------------------------------------- lenient reads, right numbers


def test_schema_drift(tmp_path: Path) -> None:
    # File a: int32 lengths, an `advantage` column; file b: int64 lengths and int rewards, no
    # advantage, an extra column.
    a = rollouts(advantage=pa.array([0.5] * 8, pa.float64()))
    b = rollouts(
        start=8,
        response_len=pa.array([10 + i for i in range(8, 16)], pa.int64()),
        reward=pa.array([i % 2 for i in range(8, 16)], pa.int64()),
        extra=pa.array(["x"] * 8),
    )
    run = make_run(tmp_path / "r", rollouts__a=a, rollouts__b=b)
    report = rlscope.analyze(run)
    want = {1 + s: float(np.mean([10 + i for i in range(4 * s, 4 * s + 4)])) for s in range(4)}
    close(series(report, "behavior.response_len"), want)
    close(series(report, "signal.reward"), {s: 0.5 for s in want})
    assert report.run.n_rollouts == 16


def test_nan_and_inf_in_float_columns(tmp_path: Path) -> None:
    n = 16
    reward = [float(i % 2) for i in range(n)]
    reward[3], reward[9] = math.nan, math.inf
    advantage = [1.0] * n
    advantage[0] = -math.inf
    logprob = [-(i % 5) / 4 for i in range(4 * n)]
    for i in (1, 7, 30):
        logprob[i] = math.nan
    logprob[40] = math.inf
    steps = pa.table(
        {
            "step": pa.array([1, 2, 3, 4], pa.int64()),
            "loss": pa.array([0.5, math.nan, 0.25, -math.inf], pa.float64()),
        }
    )
    token_ids = [i // 4 for i in range(4 * n)]
    run = make_run(
        tmp_path / "r",
        rollouts=rollouts(
            n, reward=pa.array(reward, pa.float64()), advantage=pa.array(advantage, pa.float64())
        ),
        tokens=tokens(
            token_ids,
            [1 + r // 4 for r in token_ids],
            logprob=pa.array(logprob, pa.float32()),
        ),
        steps=steps,
    )
    report = rlscope.analyze(run)
    warning(report, "tokens.logprob", "4 NaN/inf value(s) ignored")
    warning(report, "steps.loss", "2 NaN/inf value(s) ignored")
    warning(report, "rollouts.advantage", "1 NaN/inf value(s) ignored")
    warning(report, "rollouts: 2 row(s)", "reward")
    # Metrics use the valid values only.
    close(series(report, "stability.loss"), {1: 0.5, 3: 0.25})
    valid = {i for i in range(n) if math.isfinite(reward[i])}
    close(
        series(report, "signal.reward"),
        {s: float(np.mean([reward[i] for i in valid if 1 + i // 4 == s])) for s in range(1, 5)},
    )
    want_ent = {}
    lp = np.array(logprob, dtype=np.float32).astype(np.float64)
    tok_steps = np.array([1 + r // 4 for r in token_ids])
    for s in range(1, 5):
        values = lp[(tok_steps == s) & np.isfinite(lp)]
        want_ent[s] = float(-values.mean())
    got = series(report, "behavior.entropy")
    for s, v in want_ent.items():
        assert math.isclose(got[s], v, rel_tol=1e-6), (s, got, want_ent)  # type: ignore[arg-type]
    assert report.run.n_rollouts == n - 2


def test_negative_or_absurd_lengths(tmp_path: Path) -> None:
    lengths = [10 + i for i in range(12)]
    lengths[2], lengths[7], lengths[8] = -5, 20_000_000, -1
    run = make_run(
        tmp_path / "r", rollouts=rollouts(12, response_len=pa.array(lengths, pa.int64()))
    )
    report = rlscope.analyze(run)
    warning(report, "rollouts: 3 row(s)", "negative or absurd response_len")
    kept = [i for i in range(12) if 0 <= lengths[i] <= 10_000_000]
    want = {s: float(np.mean([lengths[i] for i in kept if 1 + i // 4 == s])) for s in (1, 2, 3)}
    close(series(report, "behavior.response_len"), want)
    assert report.run.n_rollouts == 9


def test_tokens_without_rollout(tmp_path: Path) -> None:
    ids = [0, 0, 1, 1, 50, 50, 50, 51]  # 50 and 51 are not rollouts
    entropy = pa.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], pa.float32())
    run = make_run(
        tmp_path / "r", rollouts=rollouts(), tokens=tokens(ids, [1] * 8, entropy=entropy)
    )
    report = rlscope.analyze(run)
    warning(report, "tokens: 4 row(s) with 2 rollout_id value(s)", "not in the rollouts table")
    close(series(report, "behavior.entropy"), {1: 4.5})


def test_probes_with_unknown_rollouts(tmp_path: Path) -> None:
    probes = pa.table(
        {
            "rollout_id": pa.array([0, 1, 90, 90, 91], pa.int64()),
            "intervention": pa.array(["truncate"] * 5),
            "answer": pa.array(["4"] * 5),
        }
    )
    run = make_run(tmp_path / "r", rollouts=rollouts(), probes=probes)
    report = rlscope.analyze(run)
    warning(report, "probes: 3 row(s) reference 2 rollout_id value(s)")


def test_steps_out_of_order(tmp_path: Path) -> None:
    # Files and rows in no particular step order; the steps table unsorted too.
    table = rollouts(16)
    order = [13, 2, 9, 0, 15, 6, 11, 4, 1, 14, 8, 3, 12, 7, 10, 5]
    shuffled = table.take(order)
    steps = pa.table({"step": [4, 1, 3, 2], "loss": [0.4, 0.1, 0.3, 0.2]})
    run = make_run(
        tmp_path / "r",
        rollouts__z=shuffled.slice(0, 8),
        rollouts__a=shuffled.slice(8),
        steps=steps,
    )
    report = rlscope.analyze(run)
    lens = [10 + i for i in range(16)]
    close(
        series(report, "behavior.response_len"),
        {s: float(np.mean(lens[4 * (s - 1) : 4 * s])) for s in range(1, 5)},
    )
    close(series(report, "stability.loss"), {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})
    assert report.metrics["stability.loss"].value == pytest.approx(0.3)  # steps 2-4


def test_group_of_size_one(tmp_path: Path) -> None:
    # Step 1: group p0 of 3 (rewards 0, 1, 1), group p1 of 1 (reward 1). Step 2: only singles.
    table = pa.table(
        {
            "rollout_id": pa.array(range(7), pa.int64()),
            "step": pa.array([1, 1, 1, 1, 2, 2, 2], pa.int64()),
            "prompt_id": ["p0", "p0", "p0", "p1", "p0", "p1", "p2"],
            "reward": [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5],
            "response_len": pa.array([5] * 7, pa.int32()),
        }
    )
    report = rlscope.analyze(make_run(tmp_path / "r", rollouts=table))
    close(series(report, "signal.group_std"), {1: float(np.std([0.0, 1.0, 1.0], ddof=1))})
    close(series(report, "signal.zero_std_frac"), {1: 0.0})
    close(series(report, "signal.reward"), {1: 0.75, 2: 0.5})


def test_step_with_no_rollouts(tmp_path: Path) -> None:
    table = rollouts(16).filter(pc.not_equal(rollouts(16).column("step"), 3))
    steps = pa.table({"step": [1, 2, 3, 4], "loss": [1.0, 2.0, 3.0, 4.0]})
    report = rlscope.analyze(make_run(tmp_path / "r", rollouts=table, steps=steps))
    lens = [10 + i for i in range(16)]
    close(
        series(report, "behavior.response_len"),
        {s: float(np.mean(lens[4 * (s - 1) : 4 * s])) for s in (1, 2, 4)},
    )
    close(series(report, "stability.loss"), {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0})
    assert report.run.n_rollouts == 12


def test_megabyte_strings(tmp_path: Path) -> None:
    big = ["<think>" + "x" * (3 << 20) + f"</think>{i}" for i in range(8)]
    table = rollouts(
        response=pa.array(big, pa.large_string()), answer=pa.array(["a" * 1_000_000] * 8)
    )
    report = rlscope.analyze(make_run(tmp_path / "r", rollouts=table))
    assert report.run.n_rollouts == 8
    close(series(report, "signal.reward"), {1: 0.5, 2: 0.5})


def test_deeply_nested_hive_folders(tmp_path: Path) -> None:
    files = {}
    for step in (1, 2):
        parts = [f"k{d}={d}" for d in range(29)] + [f"step={step:06d}"]
        ids = list(range(4 * (step - 1), 4 * step))
        table = tokens(ids, [step] * 4, entropy=pa.array([float(step)] * 4, pa.float32()))
        files["tokens__" + "__".join(parts) + "__part-0"] = table.drop(["step"])
    run = make_run(tmp_path / "r", rollouts=rollouts(), **files)
    assert len(next((run / "tokens").rglob("*.parquet")).relative_to(run).parts) == 32
    report = rlscope.analyze(run)
    assert report.run.n_tokens == 8
    close(series(report, "behavior.entropy"), {1: 1.0, 2: 2.0})


def test_symlink_outside_run_dir(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.parquet"
    pq.write_table(rollouts(start=100), outside)
    run = make_run(tmp_path / "r", rollouts__a=rollouts())
    (run / "rollouts" / "b.parquet").symlink_to(outside)
    (run / "tokens").symlink_to(tmp_path, target_is_directory=True)
    report = rlscope.analyze(run)
    warning(report, "b.parquet", "outside the run directory")
    warning(report, "tokens", "outside the run directory")
    assert report.run.n_rollouts == 8 and "tokens" not in report.run.tables


# ---------------------------------------------------------------- files changing under the reader


def test_file_removed_or_rewritten_after_open(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", rollouts__a=rollouts(), rollouts__b=rollouts(start=8))
    opened = open_run(run)
    (run / "rollouts" / "b.parquet").unlink()
    with pytest.raises(RlscopeError) as info:
        compute(opened)
    assert str(run / "rollouts" / "b.parquet") in info.value.message
    assert "removed" in info.value.message

    run = make_run(tmp_path / "s", rollouts__a=rollouts(), rollouts__b=rollouts(start=8))
    opened = open_run(run)
    pq.write_table(rollouts(n=12, start=8), run / "rollouts" / "b.parquet")
    with pytest.raises(RlscopeError) as info:
        compute(opened)
    assert str(run / "rollouts" / "b.parquet") in info.value.message
    assert "rewritten" in info.value.message


LIVE_FLUSH = 40
# The writer logs at most this many batches of 8 rollouts (a file per 5 batches and table), but
# goes on until the first analysis is over. Bounded: each analysis reads every file, so a writer
# adding a file every few ms makes each analysis slower than the last, without end on a slow
# machine.
LIVE_BATCHES = 1000


def test_live_run_snapshot(tmp_path: Path) -> None:
    run = tmp_path / "live"
    stop = threading.Event()
    errors: list[BaseException] = []
    writer = RunWriter(run, flush_rows={"rollouts": LIVE_FLUSH, "tokens": 4 * LIVE_FLUSH})
    first_flush = threading.Event()
    first_analysis = threading.Event()

    def rows_on_disk() -> int:
        return sum(pq.read_metadata(p).num_rows for p in (run / "rollouts").glob("*.parquet"))

    def write() -> None:
        try:
            i = 0
            # Writes go on until the first analysis is over (so that later ones see more rows).
            while not stop.is_set() and (i < LIVE_BATCHES or not first_analysis.is_set()):
                ids = np.arange(i * 8, (i + 1) * 8, dtype=np.int64)
                writer.log_rollouts(
                    {
                        "rollout_id": ids,
                        "step": ids // 16,
                        "prompt_id": [f"p{j // 4}" for j in ids.tolist()],
                        "reward": (ids % 2).astype(float),
                        "response_len": (ids % 50).astype(np.int32),
                    }
                )
                tok = np.repeat(ids, 4)
                writer.log_tokens(
                    {
                        "rollout_id": tok,
                        "step": tok // 16,
                        "pos": np.tile(np.arange(4, dtype=np.int32), 8),
                        "entropy": np.full(tok.size, 0.5, np.float32),
                    }
                )
                if i * 8 >= LIVE_FLUSH:
                    first_flush.set()
                i += 1
                time.sleep(0.001)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
            first_flush.set()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    try:
        assert first_flush.wait(30)
        seen = []
        for _ in range(25):
            before = rows_on_disk()
            report = rlscope.analyze(run)
            after = rows_on_disk()
            n = report.run.n_rollouts
            assert before <= n <= after, (before, n, after)
            assert n % LIVE_FLUSH == 0
            assert report.metrics["signal.reward"].value is not None
            seen.append(n)
            first_analysis.set()
        assert seen[-1] > seen[0], "the writer made no progress during the analyses"
    finally:
        stop.set()
        thread.join(10)
        writer.close()
    assert not errors, errors


# ---------------------------------------------------------------- writer killed


KILL_FLUSH = 500
KILL_BATCH = 100
KILL_CHILD = f"""
import itertools, sys
import numpy as np
from rlscope.writer import RunWriter

run_dir, offset = sys.argv[1], int(sys.argv[2])
writer = RunWriter(run_dir, flush_rows={{"rollouts": {KILL_FLUSH}, "tokens": {KILL_FLUSH}}})
n = {KILL_BATCH}
print("ready", flush=True)
for i in itertools.count():
    ids = offset + np.arange(i * n, (i + 1) * n, dtype=np.int64)
    writer.log_tokens({{"rollout_id": ids, "step": ids % 64, "pos": (ids % 7).astype(np.int32)}})
    writer.log_rollouts({{"rollout_id": ids, "step": ids % 64,
                         "prompt_id": [f"p{{j}}" for j in ids.tolist()],
                         "reward": (ids % 2).astype(float), "response_len": ids % 512}})
"""
KILL_WORKERS = 10
KILL_ROUNDS = 5  # per worker, each into the same run directory: 50 kills


@pytest.mark.slow  # 11 s; the fast suite keeps test_writer's SIGKILL test
def test_writer_killed_50_times(tmp_path: Path) -> None:
    rng = random.Random()
    seed = rng.randrange(2**32)
    rng.seed(seed)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    kills = 0
    started = time.monotonic()
    for round_ in range(KILL_ROUNDS):
        procs = []
        for w in range(KILL_WORKERS):
            proc = subprocess.Popen(
                [sys.executable, "-c", KILL_CHILD, str(tmp_path / f"w{w}"), str(round_ * 10**8)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            procs.append(proc)
        try:
            for proc in procs:
                assert proc.stdout is not None
                assert proc.stdout.readline().strip() == "ready", proc.stderr.read()  # type: ignore[union-attr]
            # Kill at random points: before any flush, between flushes, mid-write.
            for proc in rng.sample(procs, len(procs)):
                time.sleep(rng.uniform(0.0, 0.06))
                assert proc.poll() is None, "child exited before being killed"
                proc.send_signal(signal.SIGKILL)
            for proc in procs:
                assert proc.wait(timeout=10) == -signal.SIGKILL
                kills += 1
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
    elapsed = time.monotonic() - started
    assert kills >= 50

    for w in range(KILL_WORKERS):
        run_dir = tmp_path / f"w{w}"
        for table in ("rollouts", "tokens"):
            folder = run_dir / table
            if not folder.exists():
                continue
            visible = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
            assert all(p.suffix == ".parquet" for p in visible), (seed, visible)
            assert all(p.name.endswith(".tmp") for p in folder.iterdir() if p.name[0] == ".")
            ids: list[int] = []
            for path in visible:
                data = pq.read_table(path)  # complete: footer and all pages present
                assert data.num_rows % KILL_FLUSH == 0 and data.num_rows, (seed, path)
                ids.extend(data.column("rollout_id").to_pylist())
            assert len(ids) == len(set(ids)), f"seed={seed}: duplicate rollout ids in {folder}"
            # Each round's ids are a prefix of that round's range: no flushed batch lost.
            for round_ in range(KILL_ROUNDS):
                mine = sorted(i - round_ * 10**8 for i in ids if i // 10**8 == round_)
                assert mine == list(range(len(mine))), (seed, folder, round_)
        rollouts = run_dir / "rollouts"
        if any(p.suffix == ".parquet" for p in rollouts.glob("[!.]*")):
            report = rlscope.analyze(run_dir)  # the crashed run is readable
            assert report.run.n_rollouts % KILL_FLUSH == 0
        elif rollouts.exists():  # killed before its first rollouts file was renamed into place
            with pytest.raises(rlscope.RlscopeError, match="no `rollouts` table"):
                rlscope.analyze(run_dir)
    print(f"writer killed {kills} times in {elapsed:.1f}s, every run dir intact (seed={seed})")


# ---------------------------------------------------------------- read-only


def fingerprint(root: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns, digest)
    return out


def test_analyze_and_validate_do_not_write(tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "r",
        rollouts__a=rollouts(),
        rollouts__b=rollouts(start=8, reward=pa.array([math.nan] + [1.0] * 7)),
        tokens__step_1__p=tokens([0, 1], [1, 1], entropy=pa.array([1.0, 2.0], pa.float32())),
        steps=pa.table({"step": [1, 2], "loss": [0.1, math.inf]}),
    )
    before = fingerprint(run)
    rlscope.analyze(run)
    for args in (
        ["analyze", str(run), "--format", "json"],
        ["analyze", str(run)],
        ["validate", str(run)],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "rlscope", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode in (0, 1), proc.stderr
        assert "Traceback" not in proc.stderr
    assert fingerprint(run) == before


def test_nan_entropy_counted_when_only_the_histogram_scan_runs(tmp_path: Path) -> None:
    entropy = pa.array([1.0, math.nan, 2.0, math.inf, 3.0, 3.0], pa.float32())
    run = make_run(
        tmp_path / "r",
        rollouts=rollouts(),
        tokens=tokens([0, 0, 1, 1, 2, 2], [1] * 6, entropy=entropy),
    )
    for metrics in (["behavior.entropy_p80"], None):
        report = rlscope.analyze(run, metrics=metrics)
        warning(report, "tokens.entropy: 2 NaN/inf value(s) ignored")
        assert report.metrics["behavior.entropy_p80"].values[0] is not None
    close(series(report, "behavior.entropy"), {1: 9.0 / 4})


@pytest.mark.parametrize("table", ["rollouts", "steps", "tokens"])
def test_null_step_rows_left_out(tmp_path: Path, table: str) -> None:
    files: dict[str, pa.Table] = {"rollouts": rollouts()}
    if table == "rollouts":
        files["rollouts"] = rollouts(step=pa.array([1, None, 1, 1, 2, 2, 2, 2], pa.int64()))
    elif table == "steps":
        files["steps"] = pa.table({"step": pa.array([1, None, 2]), "loss": [0.5, 9.0, 0.25]})
    else:
        entropy = pa.array([1.0, 9.0, 3.0], pa.float32())
        files["tokens"] = tokens([0, 1, 4], [1, None, 2], entropy=entropy)  # type: ignore[list-item]
    report = rlscope.analyze(make_run(tmp_path / "r", **files))
    warning(report, f"{table}: 1 row(s) with a null step are left out")
    if table == "rollouts":
        assert report.run.n_rollouts == 7
        close(series(report, "behavior.response_len"), {1: (10 + 12 + 13) / 3, 2: 15.5})
    elif table == "steps":
        close(series(report, "stability.loss"), {1: 0.5, 2: 0.25})
    else:
        close(series(report, "behavior.entropy"), {1: 1.0, 2: 3.0})


def test_extra_column_with_the_reserved_prefix(tmp_path: Path) -> None:
    table = rollouts(__invalid__reward=pa.array([True] * 8))
    report = rlscope.analyze(make_run(tmp_path / "r", rollouts=table))
    warning(report, "`__invalid__reward`", "reserved prefix", "not read")
    assert report.run.n_rollouts == 8 and not any("NaN" in w for w in report.warnings)
