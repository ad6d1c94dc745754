"""Runs whose trainer logged step metrics only: a steps table and no rollouts table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import GENUINE
from typer.testing import CliRunner

from rlscope.analysis import analyze
from rlscope.cli import app
from rlscope.engine import STEPS_ONLY, compute
from rlscope.errors import RlscopeError
from rlscope.importers._common import StepRows
from rlscope.reader import open_run

runner = CliRunner()
FIXTURE = GENUINE / "verl-dapo/metrics-verl-0.5.jsonl"


def _steps(n: int = 30, *, nan_at: int | None = None, **overrides: float) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        row = {
            "step": s,
            "loss": 0.1,
            "grad_norm": 1.0 + 0.01 * s,
            "lr": 1e-6,
            "kl": 0.001 * s,
            "clip_frac": 0.01,
            "entropy": 1.5 - 0.02 * s,
            "response_len": 300.0 + s,
            "truncation_rate": 0.02,
            "reward": 0.1 + 0.01 * s,
            **overrides,
        }
        if s == nan_at:
            row["grad_norm"] = math.nan
        rows.append(row)
    return rows


@pytest.fixture
def steps_run(write_run) -> Path:
    return write_run({"steps": _steps()})


def test_open_and_validate(steps_run: Path) -> None:
    run = open_run(steps_run)
    assert set(run.tables) == {"steps"} and run.steps_only
    result = runner.invoke(app, ["validate", str(steps_run)])
    assert result.exit_code == 0, result.output


def test_neither_table_is_exit_2_naming_the_dir(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text(
        '{"schema_version": 1, "run_id": "r", "algorithm": "GRPO"}'
    )
    for command in ("validate", "analyze"):
        result = runner.invoke(app, [command, str(tmp_path / "r")])
        assert result.exit_code == 2
        assert str(tmp_path / "r") in result.output
    with pytest.raises(RlscopeError, match="no `rollouts` table"):
        open_run(tmp_path / "r")


def test_logged_metrics_are_computed_as_logged(steps_run: Path) -> None:
    computed = compute(open_run(steps_run))
    results = computed.results
    for metric_id in (
        "stability.loss",
        "stability.grad_norm",
        "stability.kl",
        "stability.clip_frac",
        "stability.nonfinite",
        "behavior.entropy",
        "behavior.response_len",
        "behavior.truncation_rate",
        "signal.reward",
    ):
        assert metric_id in results, metric_id
    for metric_id in (
        "behavior.entropy",
        "behavior.response_len",
        "behavior.truncation_rate",
        "signal.reward",
    ):
        assert "as logged" in results[metric_id].source
        assert results[metric_id].logged is None  # no self-comparison
    assert results["signal.reward"].values[0] == pytest.approx(0.11)
    assert results["behavior.response_len"].value == pytest.approx(329.0)
    assert results["behavior.truncation_rate"].value == pytest.approx(0.02)
    reasons = {s.metric: s.reason for s in computed.skipped}
    for metric_id in ("signal.pass_at_k", "signal.group_std", "behavior.format_ok"):
        assert reasons[metric_id] == STEPS_ONLY


def test_verl_names_in_a_steps_only_run(write_run) -> None:
    rows = [
        {
            "step": s,
            "critic/score/mean": 0.5,
            "response_length/mean": 200.0,
            "response_length/clip_ratio": 0.2,
        }
        for s in range(1, 11)
    ]
    results = compute(open_run(write_run({"steps": rows}))).results
    assert results["signal.reward"].value == pytest.approx(0.5)
    assert results["behavior.response_len"].value == pytest.approx(200.0)
    assert results["behavior.truncation_rate"].value == pytest.approx(0.2)
    assert "critic/score/mean" in results["signal.reward"].source


def test_divergence_fires_on_nan_grad_norm(write_run) -> None:
    report = analyze(write_run({"steps": _steps(nan_at=12)}))
    found = {f.id: f for f in report.findings}
    assert "divergence" in found
    assert found["divergence"].severity == "critical"
    assert "12" in found["divergence"].message


def test_grad_spike_on_a_steps_only_run(write_run) -> None:
    rows = _steps(40)
    rows[24]["grad_norm"] = 80.0
    report = analyze(write_run({"steps": rows}))
    assert "grad-spike" in {f.id for f in report.findings}


def test_rollouts_still_compared_with_logged(write_run) -> None:
    rollouts = {
        "rollout_id": list(range(8)),
        "step": [1] * 4 + [2] * 4,
        "prompt_id": ["a", "a", "b", "b"] * 2,
        "reward": [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0],
        "response_len": [10, 20, 30, 40, 10, 20, 30, 40],
        "truncated": [False, True, False, False] * 2,
    }
    steps = [
        {"step": s, "reward": 0.6, "response_length/mean": 25.0, "truncation_rate": 0.9}
        for s in (1, 2)
    ]
    results = compute(open_run(write_run({"rollouts": rollouts, "steps": steps}))).results
    reward = results["signal.reward"]
    assert reward.source.startswith("rollouts")
    assert reward.values == pytest.approx((0.75, 0.25))
    assert reward.logged is not None and reward.logged.column == "reward"
    length = results["behavior.response_len"]
    assert length.value == pytest.approx(25.0)
    assert length.logged is not None and length.logged.column == "response_length/mean"
    trunc = results["behavior.truncation_rate"]
    assert trunc.value == pytest.approx(0.25)  # from the rollouts, not the logged 0.9
    assert trunc.logged is not None and trunc.logged.column == "truncation_rate"


def test_commands_on_a_steps_only_run(steps_run: Path, tmp_path: Path, write_run) -> None:
    other = write_run({"steps": _steps(reward=0.2)})
    result = runner.invoke(app, ["analyze", str(steps_run)])
    assert result.exit_code == 0, result.output
    assert "the trainer logged step metrics only" in result.output
    result = runner.invoke(app, ["check", str(steps_run)])
    assert result.exit_code in (0, 1), result.output
    result = runner.invoke(app, ["compare", str(steps_run), str(other)])
    assert result.exit_code == 0, result.output
    html = tmp_path / "r.html"
    result = runner.invoke(app, ["report", str(steps_run), "-o", str(html)])
    assert result.exit_code == 0, result.output
    assert html.stat().st_size > 0
    for args in (["show", str(steps_run), "1"], ["rollouts", str(steps_run)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2
        assert "no rollouts table: the trainer logged step metrics only" in result.output


def test_trl_reward_key_keeps_its_name() -> None:
    rows = StepRows({"loss": "loss"})
    rows.add(1, {"reward": 0.5, "response_len": 3.0})
    row = rows.sorted_rows()[0]
    assert row["reward"] == 0.5  # TRL's `reward` is the mean sequence reward
    assert row["raw_response_len"] == 3.0  # unmapped, reserved: not taken as tokens


def test_smoke_verl_metrics_fixture(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "analyze",
            str(FIXTURE),
            "--from",
            "verl-metrics",
            "--format",
            "json",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
    )
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout)
    assert report["run"]["tables"] == ["steps"]
    assert {"stability.grad_norm", "behavior.entropy"} <= set(report["metrics"])
    assert any(s["reason"] == STEPS_ONLY for s in report["skipped"])


def test_quiet_says_only_what_fired_and_the_full_report_groups_the_missing_inputs(
    steps_run: Path,
) -> None:
    """`-q` is the verdict and the findings; the findings a steps-only run cannot judge are in
    the full report once, grouped by the input that would let rlscope judge them, and in the
    JSON under `inputs_missing` (the `skipped` list unchanged)."""
    quiet = runner.invoke(app, ["analyze", str(steps_run), "-q"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.output.startswith("verdict: ")
    assert "not checked" not in quiet.output and "dead-prompts" not in quiet.output
    assert "skipped" not in quiet.output and "note:" not in quiet.output
    full = runner.invoke(app, ["analyze", str(steps_run)], env={"COLUMNS": "200"})
    text = full.output
    assert text.count("not checked, inputs missing:") == 1
    line = next(ln for ln in text.splitlines() if "log a rollouts table to judge" in ln)
    assert "dead-prompts" in line and "mode-collapse" in line
    assert text.count("dead-prompts") == 1  # named once, in its group
    doc = json.loads(runner.invoke(app, ["analyze", str(steps_run), "--format", "json"]).stdout)
    # one line per reason in a layer panel, not one per metric
    lacking = sum(STEPS_ONLY in s["reason"] for s in doc["skipped"])
    assert text.count(STEPS_ONLY) < lacking / 2
    groups = doc["inputs_missing"]
    assert list(doc)[-1] == "inputs_missing"  # a new key, after the existing ones
    rollouts = next(g for g in groups if g["needs"] == ["a rollouts table"])
    assert "dead-prompts" in rollouts["findings"] and rollouts["text"].startswith("log a rollouts")
    grouped = [f for g in groups for f in g["findings"]]
    assert len(grouped) == len(set(grouped))  # each finding in one group
    skipped = {s["metric"] for s in doc["skipped"]}
    assert set(grouped) <= skipped  # the same findings `skipped` lists, with their reasons


def test_missing_input_lines() -> None:
    from rlscope.report import MissingInput

    assert (
        MissingInput(("a tokens table",), ("a", "b")).line()
        == "log a tokens table to judge 2 more findings: a, b"
    )
    assert (
        MissingInput(("a rollouts table", "run.json max_tool_calls"), ("c",)).line()
        == "log a rollouts table and set run.json max_tool_calls to judge 1 more finding: c"
    )
    assert MissingInput((), ("d",), "needs x.*").line() == "needs x.*: d"


def test_a_finding_that_needs_what_the_run_lacks_is_not_judged_but_says_so(write_run) -> None:
    """A rule judged only with every one of its `requires` (spurious-length-growth needs the
    within-prompt correlation of length and correctness, from rollouts) is skipped as not
    judged on a steps-only run, never passed as healthy in silence, and the missing input
    says what would let it be judged."""
    steps_run = write_run({"steps": _steps(correct_rate=0.5, correct_rate_std=0.5)})
    report = analyze(steps_run)
    skipped = {s.metric: s.reason for s in report.skipped}
    assert skipped["spurious-length-growth"] == "needs behavior.len_correct_corr"
    assert skipped["mode-collapse"] == "needs signal.pass_at_k"
    assert "signal.reward" in report.metrics  # reward-hacking reads what it requires: judged
    assert "reward-hacking" not in skipped
    doc = json.loads(runner.invoke(app, ["analyze", str(steps_run), "--format", "json"]).stdout)
    rollouts = next(g for g in doc["inputs_missing"] if g["needs"] == ["a rollouts table"])
    assert {"spurious-length-growth", "overthinking", "mode-collapse"} <= set(rollouts["findings"])


def test_a_logged_accuracy_is_judged_for_a_fall_on_its_prompts(write_run) -> None:
    """TRL's logged accuracy p and its std over 64 responses (8 prompts x 8): its units are the
    64 responses (Σ a² = p·64), and with run.json's group size also the 8 prompts that a fall
    is judged on, each a 0/1 draw (the largest spread prompts' groups can have); without the
    group size, no prompts."""
    rows = [
        {"step": s, "correct_rate": p, "correct_rate_std": math.sqrt(p * (1 - p) * 64 / 63)}
        for s, p in enumerate([0.5, 0.625, 0.75], start=1)
    ]
    for meta, prompts in (({"group_size": 8}, [8.0] * 3), ({}, None)):
        computed = compute(open_run(write_run({"steps": rows}, **meta)), ["signal.pass_at_1"])
        frame = computed.frames["signal.pass_at_1"]
        assert frame["groups"].to_list() == [64.0] * 3, meta
        assert frame["acc_sq"].to_list() == pytest.approx([p * 64 for p in (0.5, 0.625, 0.75)])
        found = frame["extra_prompts"].to_list() if "extra_prompts" in frame.columns else None
        assert found == prompts, meta
