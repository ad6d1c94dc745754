"""`rlscope probe` end to end against a real server: `transformers serve` on 127.0.0.1 serving the
tiny reasoner (tests/trainers/tiny_reasoner.py, tests/probe_server.py). The run's rollouts are
the served model's own samples; the probes go through the CLI."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import run_trainer
from probe_server import Server, sampled_run, served, tiny_reasoner_dir
from typer.testing import CliRunner

from rlscope.analysis import analyze
from rlscope.cli import app
from rlscope.integrations.trl import IN_LOOP_MODEL
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
