"""Judging a run while it is written: RunWriter.judge / LiveJudge equal the full analysis of the
run at the step judged, announce each finding once, stop on what `stop_on` names, never raise."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import polars as pl
import pytest
from conftest import run_cli, run_trainer, trainer_constant
from shapes import HEALTHY_SHAPES, write_shape

from rlscope.analysis import analyze
from rlscope.config import Config
from rlscope.engine import compute
from rlscope.errors import RlscopeError
from rlscope.evaluation import evaluate_prefix
from rlscope.integrations.trl import RlscopeCallback
from rlscope.live import (
    METRIC_PREFIX,
    STOP_FILE,
    Judgement,
    LiveJudge,
    latest_metrics,
    stop_record,
)
from rlscope.reader import open_run
from rlscope.spec import Finding
from rlscope.synth.build import generate
from rlscope.writer import RunWriter

TABLES = ("steps", "rollouts", "tokens", "probes")


def _source(tmp_path: Path, scenario: str, steps: int = 30) -> Path:
    path = tmp_path / f"source-{scenario}"
    generate(path, scenario, steps=steps, prompts_per_step=6, group_size=4, seed=3)
    return path


def _replay(source: Path, out: Path, every: int, **judge: Any) -> list[tuple[int, Judgement]]:
    """Write `source` into `out` step by step with RunWriter, as a training loop would, judging
    every `every` steps; returns (step, judgement) per judgement."""
    meta = json.loads((source / "run.json").read_text())
    meta.pop("schema_version")
    frames = {t: pl.read_parquet(source / t / "*.parquet") for t in TABLES if (source / t).is_dir()}
    judged = []
    with RunWriter(out, **judge, **meta) as writer:
        for step in sorted(frames["steps"]["step"].unique().to_list()):
            ids = frames["rollouts"].filter(pl.col("step") == step)["rollout_id"]
            for table, frame in frames.items():
                by_step = pl.col("step") == step if "step" in frame.columns else None
                rows = frame.filter(
                    by_step if by_step is not None else pl.col("rollout_id").is_in(ids.implode())
                )
                if table == "steps":
                    for row in rows.iter_rows(named=True):
                        writer.log_step(**row)
                elif rows.height:
                    getattr(writer, f"log_{table}")(rows)
            if step % every == 0:
                new = writer.judge()
                assert writer.judgement is not None and writer.judgement.error is None
                assert new == list(writer.judgement.new)
                judged.append((step, writer.judgement))
                if writer.stop is not None:
                    break
    return judged


def _key(finding: Finding) -> tuple[Any, ...]:
    return (finding.id, finding.severity, finding.onset, finding.last_good, finding.message)


def test_each_judgement_is_the_full_analysis_at_its_step(tmp_path: Path) -> None:
    """A finding raised at step s is one `analyze --steps :s` of the finished run raises, with
    the same onset and message; the metrics sent to the trainer are that analysis' values."""
    source = _source(tmp_path, "entropy-collapse")
    out = tmp_path / "live"
    judged = _replay(source, out, 5)
    assert [s for s, _ in judged] == [0, 5, 10, 15, 20, 25]  # synth counts from 0
    announced: set[str] = set()
    for step, judgement in judged:
        full = analyze(out, steps=(None, step))
        assert judgement.step == step
        assert [_key(f) for f in judgement.findings] == [_key(f) for f in full.findings]
        assert [f.caused_by for f in judgement.findings] == [f.caused_by for f in full.findings]
        assert {f.id for f in judgement.new} <= {f.id for f in full.findings}
        announced |= {f.id for f in judgement.new}
        metrics = judgement.metrics
        assert metrics == latest_metrics(full)
        assert metrics[f"{METRIC_PREFIX}behavior.entropy_p80"] == pytest.approx(
            full.metrics["behavior.entropy_p80"].values[-1]
        )
        assert not any(k.startswith(f"{METRIC_PREFIX}stability.loss") for k in metrics)
        if step:  # incremental: each table's one new file is read, the others come from caches
            read = {table: files_read for table, (_, files_read) in judgement.files.items()}
            assert read == dict.fromkeys(("tokens", "steps", "rollouts", "probes"), 1)
    # Judged again on the finished run: every finding the full analysis has.
    last = LiveJudge(out).judge()
    assert [_key(f) for f in last.findings] == [_key(f) for f in analyze(out).findings]
    assert "entropy-collapse" in announced


def test_findings_are_announced_once_and_again_only_when_worse(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _source(tmp_path, "entropy-collapse")
    judge = LiveJudge(source)
    caplog.set_level(logging.INFO, logger="rlscope")
    first = judge.judge()
    assert first.new and first.step == 29
    assert judge.judge().new == ()  # nothing changed: nothing announced
    assert sum("entropy-collapse" in r.getMessage() for r in caplog.records) == 1
    report = analyze(source)
    (collapse,) = [f for f in report.findings if f.id == "entropy-collapse"]
    warn = replace(collapse, severity="warn")
    judge = LiveJudge(source)
    calm = judge._judged(replace(report, findings=(warn,)), 0.0)
    assert [f.severity for f in calm.new] == ["warn"]
    worse = judge._judged(replace(report, findings=(collapse,)), 0.0)
    assert [f.severity for f in worse.new] == ["critical"]  # escalated: announced again
    gone = judge._judged(replace(report, findings=()), 0.0)
    assert gone.cleared == ("entropy-collapse",) and gone.new == ()
    back = judge._judged(replace(report, findings=(collapse,)), 0.0)
    assert back.new == () and back.cleared == ()  # flickering back is not news
    assert judge._judged(replace(report, findings=()), 0.0).cleared == ()


def test_a_critical_finding_stops_the_run_with_stop_json(tmp_path: Path) -> None:
    source = _source(tmp_path, "entropy-collapse")
    out = tmp_path / "live"
    judged = _replay(source, out, 5, stop_on="critical")
    record = stop_record(out)
    assert record is not None
    stopped_at = judged[-1][0]
    assert judged[-1][1].stop is not None and judged[-1][1].last_good == record["last_good_step"]
    assert record["step"] == stopped_at < 29  # stopped before the run's end
    finding = record["finding"]
    assert finding["severity"] == "critical" and finding["evidence"]
    assert record["last_good_step"] == finding["last_good"] == finding["onset"] - 1
    assert record["stop_on"] == "a critical finding"
    # The last good step is one at which no critical finding is raised; its onset one that is.
    assert not [
        f
        for f in analyze(out, steps=(None, record["last_good_step"])).findings
        if f.severity == "critical"
    ]
    assert finding["id"] in {f.id for f in analyze(out, steps=(None, finding["onset"])).findings}


def test_stop_on_names_findings_and_never_stops_otherwise(tmp_path: Path) -> None:
    source = _source(tmp_path, "entropy-collapse")
    judged = _replay(source, tmp_path / "named", 5, stop_on=["kl-runaway", "grad-spike"])
    assert len(judged) == 6 and stop_record(tmp_path / "named") is None
    judged = _replay(source, tmp_path / "never", 5)
    assert len(judged) == 6 and stop_record(tmp_path / "never") is None
    judged = _replay(source, tmp_path / "by-id", 5, stop_on="entropy-collapse")
    assert stop_record(tmp_path / "by-id")["finding"]["id"] == "entropy-collapse"  # type: ignore[index]


def test_a_wrong_stop_on_says_what_would_do(tmp_path: Path) -> None:
    with pytest.raises(RlscopeError, match="entropy-colapse") as error:
        RunWriter(tmp_path / "run", stop_on="entropy-colapse")
    assert "did you mean entropy-collapse" in str(error.value)
    with pytest.raises(RlscopeError, match="neither"):
        RlscopeCallback(tmp_path / "run", stop_on=["critical-ish"])
    with pytest.raises(ValueError, match="judge_every"):
        RlscopeCallback(tmp_path / "run", judge_every=0)


def test_judging_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing written yet, then a broken file: the judgement says why, logged once, and the
    next judgement of a readable run judges it."""
    out = tmp_path / "run"
    writer = RunWriter(out, algorithm="GRPO", stop_on="critical")
    caplog.set_level(logging.WARNING, logger="rlscope")
    assert writer.judge() == [] and writer.judge() == []
    assert writer.judgement is not None and writer.judgement.error
    assert sum("could not judge" in r.getMessage() for r in caplog.records) == 1
    (out / "rollouts").mkdir()
    (out / "rollouts" / "broken.parquet").write_bytes(b"not parquet")
    writer.log_step(1, loss=0.5)
    assert writer.judge() == [] and "broken.parquet" in (writer.judgement.error or "")
    (out / "rollouts" / "broken.parquet").unlink()
    for step in range(1, 4):
        writer.log_rollouts(
            {
                "rollout_id": [4 * step + i for i in range(4)],
                "step": [step] * 4,
                "prompt_id": ["p"] * 4,
                "reward": [1.0, 0.0, 1.0, 0.0],
                "response_len": [10, 12, 9, 11],
            }
        )
    writer.judge()
    assert writer.judgement.error is None and writer.judgement.step == 3
    assert writer.stop is None
    writer.close()


def test_rules_that_need_more_steps_wait_instead_of_judging(tmp_path: Path) -> None:
    source = _source(tmp_path, "healthy", steps=8)
    judgement = LiveJudge(source).judge()
    waiting = {s.metric: s.needs_steps for s in judgement.waiting}
    assert waiting["kl-stalled"] == 20 and "entropy-collapse" in waiting
    assert all(s.reason.endswith("so far") for s in judgement.waiting)
    report = analyze(source)
    assert not {f.id for f in report.findings} & set(waiting)
    shown = run_cli("analyze", str(source), "--fail-on", "never").stdout
    assert "not judged yet (steps needed):" in shown and "kl-stalled (20)" in shown
    page = tmp_path / "report.html"
    run_cli("report", str(source), "-o", str(page))
    assert "Not judged yet (steps needed)" in page.read_text()
    assert "<code>kl-stalled</code> (20)" in page.read_text()


# --- the TRL callback's judging, driven through HF's events ----------------------------------


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a trainer without TRL's buffers
def test_the_callback_judges_every_k_steps_and_stops_the_trainer(tmp_path: Path) -> None:
    """The callback on HF's events (a trainer without TRL's buffers: the run's rollouts are
    logged with its writer, as they are replayed): judgements every 5 steps, rlscope's metrics
    sent to the reporting callbacks but not to the console printer, and the stop set on the
    trainer's control with a checkpoint."""
    source = _source(tmp_path, "entropy-collapse")
    frames = {t: pl.read_parquet(source / t / "*.parquet") for t in ("steps", "rollouts")}
    meta = json.loads((source / "run.json").read_text())
    sent: list[dict[str, float]] = []

    class Reporter:  # what W&B's or TensorBoard's callback receives
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **_: Any) -> None:
            sent.append(dict(logs))

    class PrinterCallback(Reporter):
        pass

    out = tmp_path / "live"
    callback = RlscopeCallback(
        out, judge_every=5, stop_on="critical", group_size=meta["group_size"], algorithm="GRPO"
    )
    printed: list[Any] = []
    printer = PrinterCallback()
    printer.on_log = lambda *a, logs=None, **k: printed.append(logs)  # type: ignore[method-assign]
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[Reporter(), callback]))
    trainer.callback_handler.callbacks.append(printer)
    callback.bind(trainer)
    args = SimpleNamespace(save_strategy="steps")
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    callback.on_train_begin(args, state, control)
    stopped_at = None
    for step in range(1, 30):
        state.global_step = step
        callback.on_step_end(args, state, control)
        assert callback.writer is not None or step == 1
        row = frames["steps"].filter(pl.col("step") == step).row(0, named=True)
        logs = {k: v for k, v in row.items() if k != "step" and v is not None}
        if callback.writer is None:
            callback._open(args, {})
        assert callback.writer is not None
        callback.writer.log_rollouts(frames["rollouts"].filter(pl.col("step") == step))
        callback.on_log(args, state, control, logs=logs)
        if control.should_training_stop:
            stopped_at = step
            break
    callback.on_train_end(args, state, control)
    assert [j.step for j in callback.judgements] == list(range(5, (stopped_at or 0) + 1, 5))
    assert stopped_at is not None and control.should_save
    assert stop_record(out)["step"] == stopped_at  # type: ignore[index]
    assert len(sent) == len(callback.judgements) and not printed
    assert all(k.startswith(METRIC_PREFIX) for logs in sent for k in logs)
    assert sent[-1][f"{METRIC_PREFIX}findings.critical"] >= 1
    assert all(math.isfinite(v) for logs in sent for v in logs.values())
    steps = pl.read_parquet(out / "steps" / "*.parquet")
    assert not [c for c in steps.columns if c.startswith(METRIC_PREFIX)]
    assert (out / STOP_FILE).is_file()


# --- genuine TRL runs judged by the callback as they train (slow) ---------------------------------

JUMP_STEP = trainer_constant("trl_lr_collapse.py", "JUMP_STEP")  # the first step at 40x the lr


def _trl_judged(
    tmp_path: Path, mode: str, processes: int = 1, every: int = 5
) -> tuple[list[dict[str, Any]], Path, Path]:
    """A TRL GRPOTrainer run of `mode` with RlscopeCallback(judge_every=every,
    stop_on="critical") on `processes` CPU processes (torchrun, gloo): each process' summary
    (the main one's first), the trainer's output directory and the run directory the callback
    wrote."""
    out, run = tmp_path / "trainer", tmp_path / "run"
    done = run_trainer(
        "trl_lr_collapse.py",
        out,
        mode,
        "50",
        "--judge",
        run,
        "critical",
        str(every),
        processes=processes,
    )
    # Two processes share stdout: another's output can land on a summary's line, so each
    # summary is decoded from where it starts, whatever surrounds it.
    decoder = json.JSONDecoder()
    found = [
        decoder.raw_decode(line, line.index('{"steps"'))[0]
        for line in done.stdout.splitlines()
        if '{"steps"' in line
    ]
    summaries = sorted(found, key=lambda s: -len(s["judgements"]))
    assert len(summaries) == processes
    return summaries, out, run


@pytest.mark.slow
def test_a_genuine_trl_run_that_diverges_is_stopped(tmp_path: Path) -> None:
    """The learning rate jumps 40x at step 25 and accuracy collapses from step 26 (0.89, 0.53,
    0.19): the callback stops training at the first judgement after, with stop.json naming
    the collapse and a checkpoint of the step it stopped at (measured: stopped at 30, the
    collapse since step 28, last good step 27)."""
    (summary,), out, run = _trl_judged(tmp_path, "jump")
    record = stop_record(run)
    assert record is not None, summary
    assert record["finding"]["id"] == "performance-regression"
    assert record["finding"]["severity"] == "critical"
    assert JUMP_STEP < record["step"] <= JUMP_STEP + 10 and summary["steps"] == record["step"]
    assert JUMP_STEP <= record["last_good_step"] < record["finding"]["onset"] <= record["step"]
    assert (out / f"checkpoint-{record['step']}").is_dir()
    # What stopped it is what the full analysis of the run at that step finds.
    full = analyze(run, steps=(None, record["step"]))
    (collapse,) = [f for f in full.findings if f.id == "performance-regression"]
    assert collapse.onset == record["finding"]["onset"]
    assert "learning rate" in collapse.message
    for judgement in summary["judgements"][:-1]:  # before the stop: nothing critical
        assert "performance-regression" not in judgement["findings"]
    # rlscope's metrics went to TensorBoard beside TRL's, at each judged step.
    scalars = _tensorboard_scalars(out)
    judged = [j["step"] for j in summary["judgements"]]
    # HF prefixes train logs with train/ (transformers integration_utils.rewrite_logs)
    assert [s for s, _ in scalars["train/rlscope/signal.pass_at_1"]] == judged
    assert scalars["train/rlscope/findings.critical"][-1][1] >= 1
    assert scalars["train/rlscope/findings.critical"][0][1] == 0
    assert len(scalars["train/loss"]) == record["step"]


@pytest.mark.slow
def test_judged_every_step_the_jump_is_named_at_once_and_the_run_stopped_by_half_way(
    tmp_path: Path,
) -> None:
    """Judged at every step: the learning rate's jump is a warning at the step it is logged
    (update-change), and the run stops by step 28, where its accuracy (0.89, 0.53, 0.19 at
    steps 26-28) has fallen half-way, on the collapse filed under the jump (measured: warned
    at 25, stopped at 28)."""
    (summary,), _, run = _trl_judged(tmp_path, "jump", every=1)
    judged = {j["step"]: j["findings"] for j in summary["judgements"]}
    assert "update-change" in judged[JUMP_STEP]
    assert all("update-change" not in found for step, found in judged.items() if step < JUMP_STEP)
    record = stop_record(run)
    assert record is not None and JUMP_STEP < record["step"] <= JUMP_STEP + 3
    assert record["finding"]["id"] == "performance-regression"
    assert record["finding"]["caused_by"] == ["update-change"]


def _tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the TensorBoard event files under `out`: (step, value) in order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(out.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


@pytest.mark.slow
def test_its_healthy_twin_trains_to_the_end(tmp_path: Path) -> None:
    (summary,), out, run = _trl_judged(tmp_path, "healthy")
    assert summary["steps"] == 50 and stop_record(run) is None
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-50"]  # HF's, at the end
    assert [j["step"] for j in summary["judgements"]] == list(range(5, 51, 5))
    critical = [f for f in analyze(run).findings if f.severity == "critical"]
    assert critical == []
    # The prompts are kept with the rollouts, for `rlscope probe` to continue them.
    rollouts = pl.read_parquet(run / "rollouts" / "*.parquet")
    assert rollouts["prompt"].null_count() == 0
    assert all(" the number " in text for text in rollouts["prompt"])


@pytest.mark.slow
def test_every_process_of_a_distributed_run_stops_together(tmp_path: Path) -> None:
    """Two processes (torchrun, gloo): the main one judges and writes; the other gets its
    decision and stops at the same step instead of waiting for it forever."""
    summaries, out, run = _trl_judged(tmp_path, "jump", processes=2)
    record = stop_record(run)
    assert record is not None and record["finding"]["id"] == "performance-regression"
    main, other = summaries
    assert main["steps"] == other["steps"] == record["step"] < 50
    assert other["judgements"] == []  # only the main process judges
    assert (out / f"checkpoint-{record['step']}").is_dir()


# --- what stop_on="critical" may stop: no critical verdict on any prefix of a healthy shape -----


@pytest.mark.parametrize("shape", HEALTHY_SHAPES)
def test_no_healthy_shape_is_critical_at_any_prefix(tmp_path: Path, shape: str) -> None:
    """A stop on a critical finding needs critical verdicts that no prefix of a healthy run
    raises (the genuine runs: tests/test_onsets.py). Every prefix from the first step here:
    a stop is judged from the first judgement."""
    run = write_shape(tmp_path / shape, shape, seed=11, steps=40, prompts=8, group=8)
    computed = compute(open_run(run))
    steps = sorted({s for r in computed.results.values() for s in r.steps})
    critical = {}
    for step in steps:
        found = evaluate_prefix(computed, step, Config()).findings
        if any(f.severity == "critical" for f in found):
            critical[step] = [f.id for f in found if f.severity == "critical"]
    assert critical == {}
