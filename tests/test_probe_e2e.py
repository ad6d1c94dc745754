"""`rlscope probe` end to end against a real server: `transformers serve` on 127.0.0.1 serving the
tiny reasoner (tests/trainers/tiny_reasoner.py, tests/probe_server.py). The run's rollouts are
the served model's own samples; the probes go through the CLI. A server that dies or hangs mid-run
is given up on after --give-up-after seconds."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import selectors
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import run_cli, run_trainer
from probe_server import (
    HOST,
    Server,
    add_task,
    free_port,
    sampled_run,
    served,
    tiny_reasoner_dir,
)
from typer.testing import CliRunner

from rlscope.analysis import analyze
from rlscope.cli import app
from rlscope.integrations.trl import IN_LOOP_MODEL
from rlscope.probe.client import Breaker, Endpoint, Usage
from rlscope.writer import RunWriter

pytestmark = pytest.mark.slow

STEPS, PER_STEP = 3, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = tiny_reasoner_dir()
    with served(model_dir, log=tmp_path_factory.mktemp("serve") / "serve.log") as running:
        yield running


def _probe(path: Path, server: Server, *args: str) -> Any:
    result = CliRunner().invoke(
        app,
        ["probe", str(path), "--endpoint", server.url, "--model", server.model, *args],
    )
    return result


def _probes(path: Path) -> pl.DataFrame:
    return pl.read_parquet(path / "probes" / "*.parquet")


def test_probes_through_a_real_server_resume_without_duplicates(
    server: Server, tmp_path: Path
) -> None:
    run = sampled_run(server, tmp_path / "run", STEPS, PER_STEP)
    rollouts = pl.read_parquet(run / "rollouts" / "*.parquet")
    before = server.requests("POST", "/v1/completions")
    args = [
        "--kinds",
        "truncate,filler,bias",
        "--per-step",
        "4",
        "--format",
        "json",
        "--retries",
        "0",
        "--max-tokens",
        "16",
    ]
    plan = json.loads(_probe(run, server, *args, "--dry-run").output)
    assert plan["probes_planned"] > 0 and plan["requests"] == 0
    assert server.requests("POST", "/v1/completions") == before  # the dry run sent nothing

    first = _probe(run, server, *args, "--concurrency", "1")
    assert first.exit_code == 0, first.output
    done = json.loads(first.output)
    assert done["probes_written"] == plan["probes_planned"] and done["failures"] == {}
    sent = server.requests("POST", "/v1/completions") - before
    assert sent == done["requests"] + 1  # + the check of the endpoint

    probes = _probes(run)
    keys = probes.select("rollout_id", "intervention", "fraction", "model")
    assert keys.n_unique() == probes.height  # no duplicate
    assert set(probes["model"]) == {server.model}
    assert probes["prompt_tokens"].min() > 0 and probes["completion_tokens"].min() > 0

    # Early answering at fraction 0 changes the answers the chain carries (`Add`), not the
    # ones the prompt carries (`Copy`).
    joined = probes.join(
        rollouts.select("rollout_id", pl.col("answer").alias("original"), "prompt"),
        on="rollout_id",
    ).with_columns(
        pl.col("prompt").str.split(" ").list.first().alias("family"),
        (pl.col("answer") == pl.col("original")).alias("unchanged"),
    )
    cut = joined.filter((pl.col("intervention") == "truncate") & (pl.col("fraction") == 0.0))
    share = dict(cut.group_by("family").agg(pl.col("unchanged").mean()).iter_rows())
    print("unchanged at fraction 0 by family:", share)
    assert share["Copy"] >= 0.75 and share["Add"] <= 0.5
    whole = joined.filter((pl.col("intervention") == "truncate") & (pl.col("fraction") == 1.0))
    assert whole["unchanged"].mean() >= 0.75  # the whole chain: the model's own answer

    # Run again: nothing left to ask, nothing sent but the check.
    again = json.loads(_probe(run, server, *args).output)
    assert again["probes_planned"] == 0 and again["probes_already"] == plan["probes_planned"]
    assert _probes(run).height == probes.height

    report = analyze(run)
    assert "reasoning.early_answer_aoc" in report.metrics
    assert report.metrics["reasoning.early_answer_aoc"].extra["curves_by_step"]


def test_a_server_stopped_mid_run_then_restarted_completes_without_duplicates(
    server: Server, tmp_path: Path
) -> None:
    run = sampled_run(server, tmp_path / "run", STEPS, PER_STEP)
    args = [
        "--kinds",
        "truncate",
        "--per-step",
        "8",
        "--format",
        "json",
        "--retries",
        "0",
        "--max-tokens",
        "8",
        "--concurrency",
        "1",
    ]
    plan = json.loads(_probe(run, server, *args, "--dry-run").output)
    start = server.requests("POST", "/v1/completions")

    def stop_after_some() -> None:
        while server.requests("POST", "/v1/completions") - start < 6:
            time.sleep(0.05)
        server.stop()

    stopper = threading.Thread(target=stop_after_some)
    stopper.start()
    first = json.loads(_probe(run, server, *args).output)
    stopper.join()
    assert 0 < first["probes_written"] < plan["probes_planned"]
    # A server going down answers 503 for a moment, then no more: connection errors.
    causes = set(first["failures"])
    assert causes and all(c in ("connection", "timeout") or c.startswith("HTTP 5") for c in causes)
    server.start()
    second = json.loads(_probe(run, server, *args).output)
    assert second["probes_already"] == first["probes_written"]
    assert first["probes_written"] + second["probes_written"] == plan["probes_planned"]
    probes = _probes(run)
    assert probes.height == plan["probes_planned"]
    assert probes.select("rollout_id", "intervention", "fraction").n_unique() == probes.height


# --- a server gone or hung mid-run: given up on after --give-up-after seconds ------------------

GIVE_UP = 5
#: Seconds past the window a give-up may take: the watch's tick, cancelling, the message's
#: connection, and (process=True) the interpreter's start.
MARGIN = 15
GONE = re.compile(r"(\d+) of (\d+) probes were written and are kept; (\d+) are left")


def _stalled(server: Server, stop: Any, run: Path, *args: str) -> tuple[Any, float]:
    """`rlscope probe` in a process of its own (bounded by run_cli's timeout), `stop` applied to
    the server once it has answered a few probes; the result and the seconds from stop's return
    to the command's exit."""
    start = server.requests("POST", "/v1/completions")
    stopped: list[float] = []

    def stop_after_some() -> None:
        deadline = time.monotonic() + 60
        while server.requests("POST", "/v1/completions") - start < 6:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        stop()
        stopped.append(time.monotonic())

    stopper = threading.Thread(target=stop_after_some)
    stopper.start()
    base = ["probe", str(run), "--endpoint", server.url, "--model", server.model]
    result = run_cli(*base, *args, process=True)
    ended = time.monotonic()
    stopper.join()
    assert stopped, "the run ended before the server answered 6 probes"
    return result, ended - stopped[0]


def _resumed(server: Server, run: Path, args: list[str], result: Any) -> None:
    """The probes the failed command reported written are on disk; a rerun asks the rest, none
    twice."""
    found = GONE.search(result.stderr)
    assert found, result.stderr
    written, planned, left = map(int, found.groups())
    assert 0 < written < planned and written + left == planned
    assert _probes(run).height == written  # kept
    again = _probe(run, server, *args)
    assert again.exit_code == 0, again.output
    second = json.loads(again.output)
    assert second["probes_already"] == written and second["probes_written"] == left
    probes = _probes(run)
    assert probes.height == planned
    assert probes.select("rollout_id", "intervention", "fraction").n_unique() == probes.height


STALL_ARGS = [
    "--kinds",
    "truncate",
    "--per-step",
    "8",
    "--format",
    "json",
    "--max-tokens",
    "8",
    "--concurrency",
    "2",
]
GIVE_UP_ARGS = [*STALL_ARGS, "--give-up-after", str(GIVE_UP)]


def test_a_server_killed_mid_run_is_given_up_on_and_a_rerun_resumes(
    server: Server, tmp_path: Path
) -> None:
    """The issue's case: the server killed mid-run, its port then refusing, and the default
    retries with backoff for every probe left. The command gives up GIVE_UP s after the last
    answer, keeps what was answered, and says so."""
    run = sampled_run(server, tmp_path / "run", STEPS, PER_STEP)
    try:
        result, after = _stalled(server, server.stop, run, *GIVE_UP_ARGS)
        print(f"gave up {after:.1f} s after the server stopped:", result.stderr)
        assert result.returncode == 2, result.stderr
        assert after < GIVE_UP + MARGIN
        assert result.stdout == "" and "Traceback" not in result.stderr
        message = " ".join(result.stderr.split())
        assert f"{server.url} stopped answering: connection refused for {GIVE_UP} s" in message
        assert "run the same command again" in message and "resumes" in message
    finally:
        if not server.running:
            server.start()
    _resumed(server, run, STALL_ARGS, result)


def test_a_server_frozen_mid_run_is_given_up_on_and_a_rerun_resumes(
    server: Server, tmp_path: Path
) -> None:
    """An engine that hangs: the server's processes stopped (SIGSTOP), so its port still accepts
    connections (the kernel completes them) and nothing answers; the requests in flight are
    cancelled, not left to their 120 s timeout."""
    run = sampled_run(server, tmp_path / "run", STEPS, PER_STEP)
    assert server.process is not None
    group = server.process.pid
    try:
        result, after = _stalled(
            server, lambda: os.killpg(group, signal.SIGSTOP), run, *GIVE_UP_ARGS
        )
    finally:
        os.killpg(group, signal.SIGCONT)
    print(f"gave up {after:.1f} s after the server froze:", result.stderr)
    assert result.returncode == 2, result.stderr
    assert after < GIVE_UP + MARGIN
    message = " ".join(result.stderr.split())
    assert f"{server.url} stopped answering: no answer for {GIVE_UP} s" in message
    assert "accepts connections" in message
    _resumed(server, run, STALL_ARGS, result)


def test_a_server_restarted_within_the_window_is_used_again(server: Server, tmp_path: Path) -> None:
    """The default window (60 s) outlasts a restart of the server (a few seconds): the command
    never gives up, the retries carry the probes over the gap, and any that failed meanwhile are
    counted and asked by the next run."""
    run = sampled_run(server, tmp_path / "run", STEPS, PER_STEP)

    def restart() -> None:
        server.stop()
        server.start()

    result, _ = _stalled(server, restart, run, *STALL_ARGS)
    print(f"restarted in {server.start_seconds:.1f} s:", result.stdout)
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout)
    assert done["probes_written"] > 0
    left = done["probes_planned"] - done["probes_written"]
    again = json.loads(_probe(run, server, *STALL_ARGS).output)
    assert again["probes_already"] == done["probes_written"] and again["probes_written"] == left
    probes = _probes(run)
    assert probes.height == done["probes_planned"]
    assert probes.select("rollout_id", "intervention", "fraction").n_unique() == probes.height


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A TCP peer on 127.0.0.1 (its port yielded) that accepts connections and reads what is
    sent, and never writes a byte: an engine whose front end is up and whose generation is
    stuck. Not an OpenAI server: nothing of the API is imitated."""
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(64)
    listener.setblocking(False)
    done = threading.Event()

    def serve() -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ)
            while not done.is_set():
                for key, _ in selector.select(timeout=0.1):
                    sock: socket.socket = key.fileobj  # type: ignore[assignment]
                    if sock is listener:
                        selector.register(listener.accept()[0], selectors.EVENT_READ)
                    elif not sock.recv(65536):
                        selector.unregister(sock)
                        sock.close()
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        done.set()
        thread.join(5)


def test_a_server_that_accepts_and_never_answers_is_given_up_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    tasks = [add_task(i, i + 1, 2) for i in range(6)]
    with RunWriter(run, run_id="silent", algorithm="GRPO") as writer:
        writer.log_rollouts(
            {
                "rollout_id": list(range(len(tasks))),
                "step": [0] * len(tasks),
                "prompt_id": [prompt for prompt, _, _ in tasks],
                "reward": [1.0] * len(tasks),
                "response_len": [12] * len(tasks),
                "prompt": [prompt for prompt, _, _ in tasks],
                "response": [f" <think> {c} </think> <answer> {a} </answer>" for _, c, a in tasks],
                "answer": [answer for _, _, answer in tasks],
            }
        )
    with silent_listener() as port:
        url = f"http://{HOST}:{port}/v1"
        began = time.monotonic()
        result = run_cli(
            "probe",
            str(run),
            "--endpoint",
            url,
            "--model",
            "m",
            "--give-up-after",
            "2",
            process=True,
        )
        took = time.monotonic() - began
    assert result.returncode == 2, result.stderr
    assert took < 2 + MARGIN
    message = " ".join(result.stderr.split())
    assert f"{url} stopped answering: no answer for 2 s, though it accepts connections" in message
    assert "None of the" in message and "run the same command again" in message
    assert not (run / "probes").exists()


def test_the_message_tells_how_the_server_stopped_answering() -> None:
    """A port that refuses, one that accepts and never answers, and one that answered 5xx."""

    async def how(url: str, failure: str | None = None) -> str:
        breaker = Breaker(2)
        if failure is not None:
            breaker.failed(failure)
        endpoint = Endpoint(
            url,
            "m",
            api_key_env="RLSCOPE_TEST_NO_KEY",
            limit=asyncio.Semaphore(1),
            usage=Usage(),
            timeout=1,
            retries=0,
            breaker=breaker,
        )
        try:
            return (await endpoint.gone()).how
        finally:
            await endpoint.close()

    with silent_listener() as port:
        url = f"http://{HOST}:{port}/v1"
        assert asyncio.run(how(url)) == "no answer for 2 s, though it accepts connections"
        assert asyncio.run(how(url, "HTTP 503")) == "HTTP 503 to every request for 2 s"
    assert asyncio.run(how(f"http://{HOST}:{free_port()}/v1")) == "connection refused for 2 s"


def test_bad_input_exits_2_and_writes_nothing(server: Server, tmp_path: Path) -> None:
    run = sampled_run(server, tmp_path / "run", STEPS, PER_STEP)
    files = sorted(p.relative_to(run) for p in run.rglob("*"))
    unknown = CliRunner().invoke(
        app, ["probe", str(run), "--endpoint", server.url, "--model", "gpt-9"]
    )
    assert unknown.exit_code == 2 and "does not offer model 'gpt-9'" in unknown.output
    assert server.model in unknown.output  # what it offers
    wrong_root = CliRunner().invoke(
        app, ["probe", str(run), "--endpoint", server.base, "--model", server.model]
    )
    assert wrong_root.exit_code == 2 and "HTTP 404" in wrong_root.output, wrong_root.output
    # Chat messages need the assistant turn continued: transformers serve cannot.
    messages = tmp_path / "messages"
    frame = pl.read_parquet(run / "rollouts" / "*.parquet")
    with RunWriter(messages, run_id="m", algorithm="GRPO") as writer:
        writer.log_rollouts(
            frame.drop("prompt").with_columns(
                pl.col("rollout_id")
                .map_elements(
                    lambda _: json.dumps([{"role": "user", "content": "Add 1 2 3 ."}]),
                    return_dtype=pl.String,
                )
                .alias("messages")
            )
        )
    chat = CliRunner().invoke(
        app, ["probe", str(messages), "--endpoint", server.url, "--model", server.model]
    )
    assert chat.exit_code == 2 and "cannot continue an assistant turn" in chat.output
    assert not (messages / "probes").exists()
    for result in (unknown, wrong_root, chat):
        assert "Traceback" not in result.output
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == files


def test_the_training_loop_probes_its_own_policy(tmp_path: Path) -> None:
    """TRL GRPO on the tiny reasoner with RlscopeCallback(probe_every=2): at steps 2, 4 and 6 the
    trainer's own model answers truncate and filler probes of that step's rollouts, written as
    probes of that step; cutting an `Add` chain changes its answer, a `Copy` one's not."""
    model_dir = tiny_reasoner_dir()
    run = tmp_path / "run"
    done = run_trainer("trl_probe.py", model_dir, run, 6, 2, 4)
    summaries = json.loads(done.stdout.strip().splitlines()[-1])["probes"]
    assert len(summaries) == 3 and all(s["failures"] == {} for s in summaries)
    probes = _probes(run)
    assert set(probes["checkpoint_step"]) == {2, 4, 6}
    assert set(probes["model"]) == {IN_LOOP_MODEL}
    assert set(probes["intervention"]) == {"truncate", "filler"}
    rollouts = pl.read_parquet(run / "rollouts" / "*.parquet")
    probed = probes.join(
        rollouts.select("rollout_id", "step", "prompt", "answer"),
        on="rollout_id",
        suffix="_original",
    )
    assert (probed["step"] == probed["checkpoint_step"]).all()  # probes of that step's rollouts
    cut = probed.filter((pl.col("intervention") == "truncate") & (pl.col("fraction") == 0.0))
    family = pl.col("prompt").str.split(" ").list.first()
    same = cut.with_columns(
        family.alias("family"), (pl.col("answer") == pl.col("answer_original")).alias("unchanged")
    )
    share = dict(same.group_by("family").agg(pl.col("unchanged").mean()).iter_rows())
    assert share.get("Copy", 1.0) == 1.0 and share.get("Add", 0.0) <= 0.5
    assert analyze(run).metrics["reasoning.early_answer_aoc"].values
