"""`rlscope import tensorboard`: real event files written in the test, read back as steps."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

import rlscope
from rlscope.binary import outside_unit_range
from rlscope.cli import app
from rlscope.engine import compute
from rlscope.errors import RlscopeError
from rlscope.importers import IMPORTERS, import_run
from rlscope.importers._tags import Resolved, binary_accuracy
from rlscope.reader import open_run

pytest.importorskip("tensorboard")
from conftest import GENUINE, genuine_eval_points
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util
from trainer_keys import openrlhf_status

runner = CliRunner()


def write_events(folder: Path, rows: dict[int, dict[str, float]], *, tensors: bool = False):
    """One event file in `folder`: per step, one scalar summary per tag (as `simple_value`
    like torch/tensorboardX, or as a scalar tensor like TF2 / tensorboard.summary)."""
    folder.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(folder))
    for step, values in rows.items():
        summary = summary_pb2.Summary()
        for tag, value in values.items():
            if tensors:
                item = summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(value))
                item.metadata.plugin_data.plugin_name = "scalars"
            else:
                summary.value.add(tag=tag, simple_value=value)
        writer.add_event(event_pb2.Event(step=step, wall_time=1000.0 + step, summary=summary))
    writer.close()
    return folder


def steps_of(out: Path) -> pl.DataFrame:
    run = open_run(out)
    assert "rollouts" not in run.tables
    return run.scan("steps").collect().sort("step")


def _verl_rows(n: int = 12, kl_loss: float = 0.0) -> dict[int, dict[str, float]]:
    return {
        s: {
            "actor/pg_loss": 0.01 * s,
            "actor/grad_norm": 1.0 + s,
            "actor/lr": 1e-6,
            "actor/pg_clipfrac": 0.002,
            "actor/entropy": 1.5 - 0.05 * s,
            "actor/kl_loss": kl_loss,
            "actor/ppo_kl": 0.0001,
            "critic/score/mean": 0.1 * s,
            "response_length/mean": 100.0 + s,
            "response_length/clip_ratio": 0.25,
        }
        for s in range(1, n + 1)
    }


def test_verl_tags_round_trip(tmp_path: Path) -> None:
    src = write_events(tmp_path / "tb" / "proj" / "exp", _verl_rows())
    out = tmp_path / "out"
    result = import_run("tensorboard", tmp_path / "tb", out)
    frame = steps_of(out)
    assert frame["step"].to_list() == list(range(1, 13))
    assert frame["loss"].to_list() == pytest.approx([0.01 * s for s in range(1, 13)], rel=1e-6)
    assert frame["grad_norm"][0] == pytest.approx(2.0)
    assert frame["entropy"][-1] == pytest.approx(0.9, rel=1e-6)
    assert frame["reward"][-1] == pytest.approx(1.2, rel=1e-6)
    assert frame["response_len"][0] == pytest.approx(101.0)
    assert frame["truncation_rate"].to_list() == pytest.approx([0.25] * 12)
    assert frame["clip_frac"][0] == pytest.approx(0.002, rel=1e-6)
    assert frame["lr"][0] == pytest.approx(1e-6, rel=1e-6)
    # KL loss off: 0.0 everywhere is not the KL; kept under its own name.
    assert "kl" not in frame.columns
    assert frame["actor/kl_loss"].to_list() == [0.0] * 12
    assert frame["actor/ppo_kl"][0] == pytest.approx(1e-4, rel=1e-5)
    assert any("actor/kl_loss is 0 at every step" in n for n in result.notes)
    assert src.exists()


def test_verl_kl_loss_read_when_non_zero(tmp_path: Path) -> None:
    write_events(tmp_path / "tb", _verl_rows(kl_loss=0.003))
    import_run("tensorboard", tmp_path / "tb", tmp_path / "out")
    frame = steps_of(tmp_path / "out")
    assert frame["kl"].to_list() == pytest.approx([0.003] * 12, rel=1e-6)
    assert "actor/kl_loss" not in frame.columns


def test_trl_tags_as_tensors(tmp_path: Path) -> None:
    rows = {
        s: {
            "train/loss": 0.5,
            "train/grad_norm": 0.25 * s,
            "train/learning_rate": 2e-6,
            "train/reward": 0.125 * s,
            "train/kl": 0.01,
            "train/entropy": 0.75,
            "train/clip_ratio/region_mean": 0.0,
            "train/completions/mean_length": 64.0,
            "train/completions/clipped_ratio": 0.5,
            "train/epoch": 0.1 * s,
        }
        for s in (10, 20, 30)
    }
    write_events(tmp_path / "runs" / "Dec01", rows, tensors=True)
    import_run("tensorboard", tmp_path / "runs", tmp_path / "out")
    frame = steps_of(tmp_path / "out")
    assert frame["step"].to_list() == [10, 20, 30]
    assert frame["reward"].to_list() == pytest.approx([1.25, 2.5, 3.75])
    assert frame["grad_norm"].to_list() == pytest.approx([2.5, 5.0, 7.5])
    assert frame["lr"][0] == pytest.approx(2e-6, rel=1e-6)
    assert frame["kl"][0] == pytest.approx(0.01, rel=1e-6)
    assert frame["entropy"][0] == pytest.approx(0.75)
    assert frame["response_len"][0] == pytest.approx(64.0)
    assert frame["truncation_rate"][0] == pytest.approx(0.5)
    assert frame["clip_frac"][0] == 0.0
    assert frame["train/epoch"][-1] == pytest.approx(3.0, rel=1e-6)  # unknown tag: extra column


def test_the_trainers_args_text_gives_run_json(tmp_path: Path) -> None:
    """transformers' TensorBoardCallback writes the Trainer's arguments once as text
    (`add_text("args", args.to_json_string())`, which torch's SummaryWriter stores under
    `args/text_summary`): GRPOConfig's group size, clip ratios, completion cap and gradient clip
    reach run.json, so grad-spike judges what passes the clip as for the other readers."""
    folder = write_events(
        tmp_path / "runs" / "Dec01", {s: {"train/grad_norm": 1.0} for s in (1, 2)}
    )
    args = {"num_generations": 4, "epsilon": 0.2, "epsilon_high": 0.28, "max_grad_norm": 0.5}
    args |= {"max_completion_length": 256, "learning_rate": 1e-6, "output_dir": "/x"}
    writer = EventFileWriter(str(folder))
    summary = summary_pb2.Summary()
    text = summary.value.add(
        tag="args/text_summary", tensor=tensor_util.make_tensor_proto(json.dumps(args, indent=2))
    )
    text.metadata.plugin_data.plugin_name = "text"
    writer.add_event(event_pb2.Event(step=0, wall_time=999.0, summary=summary))
    writer.close()
    result = import_run("tensorboard", tmp_path / "runs", tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "run.json").read_text())
    assert meta["group_size"] == 4 and meta["max_grad_norm"] == 0.5
    assert meta["clip_ratio_low"] == 0.2 and meta["clip_ratio_high"] == 0.28
    assert meta["max_response_len"] == 256
    assert any("`args` text summary" in n for n in result.notes)


def _trl_accuracy_rows(accuracy: list[float], n: int, scale: float = 1.0) -> dict:
    """TRL's per-reward-function statistics of `n` completions a step whose accuracy_reward is
    0/1 (times `scale`): rewards/<fn>/mean and torch's unbiased std, under `train/`."""
    rows = {}
    for step, acc in enumerate(accuracy, start=1):
        right = round(acc * n)
        values = np.array([scale] * right + [0.0] * (n - right))
        rows[step] = {
            "train/rewards/accuracy_reward/mean": float(values.mean()),
            "train/rewards/accuracy_reward/std": float(values.std(ddof=1)),
            "train/rewards/format_reward/mean": 0.25,
            "train/rewards/format_reward/std": 0.0,
            "train/reward": float(values.mean()) + 0.25,
        }
    return rows


def test_a_binary_accuracy_reward_is_pass_at_1_without_rollouts(tmp_path: Path) -> None:
    """Steps only (TensorBoard), TRL's accuracy_reward mean of 16 completions a step is the
    task outcome: pass@1 equals it step for step, with 16 responses a step counted from its
    std, and a collapse is named on it (not on the mean reward). The same reward scaled by
    0.33 is no 0/1 reward: not read, and provenance says why."""
    accuracy = [0.75, 0.8125, 0.75] + [0.0625] * 27
    write_events(tmp_path / "runs" / "a", _trl_accuracy_rows(accuracy, 16))
    result = import_run("tensorboard", tmp_path / "runs", tmp_path / "out")
    assert any("-> correct_rate" in n for n in result.notes)
    report = rlscope.analyze(tmp_path / "out")
    pass_1 = report.metrics["signal.pass_at_1"]
    assert list(pass_1.values) == pytest.approx(accuracy, abs=1e-6)
    frame = compute(open_run(tmp_path / "out")).frames["signal.pass_at_1"]
    assert frame["groups"].to_list() == [16.0] * 30
    found = next(f for f in report.findings if f.id == "performance-regression")
    assert found.severity == "critical" and found.evidence["measure"] == "pass@1"
    write_events(tmp_path / "scaled" / "a", _trl_accuracy_rows(accuracy, 16, scale=0.33))
    import_run("tensorboard", tmp_path / "scaled", tmp_path / "scaled-out")
    meta = json.loads((tmp_path / "scaled-out" / "run.json").read_text())
    assert meta["provenance"]["correct_rate"].startswith("not read")
    assert "signal.pass_at_1" not in rlscope.analyze(tmp_path / "scaled-out").metrics


def test_a_binary_accuracy_reward_that_leaves_0_1_is_named_and_left_out(tmp_path: Path) -> None:
    """The scorecard's Dr. GRPO reward bug as TRL logs it: accuracy_reward 0/1 on 16 completions
    a step, then ×10 on a few of them at some steps (mean and std no [0, 1] rewards can give).
    Still read as the run's accuracy (0/1 at its other steps); the broken steps are named by
    accuracy-out-of-range and left out of pass@1; partial credit (0.5) in range is not a
    break, and no break is named where the reward stays 0/1."""
    accuracy = [0.5, 0.5625, 0.625, 0.6875] * 5
    rows = _trl_accuracy_rows(accuracy, 16)
    broken = {6: [10.0] * 2 + [1.0] * 8 + [0.0] * 6, 13: [10.0] + [1.0] * 11 + [0.0] * 4}
    # A step whose mean stays in [0, 1] but whose spread no [0, 1] rewards reach.
    broken[17] = [10.0] + [0.0] * 15
    for step, values in broken.items():
        v = np.array(values)
        rows[step]["train/rewards/accuracy_reward/mean"] = float(v.mean())
        rows[step]["train/rewards/accuracy_reward/std"] = float(v.std(ddof=1))
    assert 0 <= rows[17]["train/rewards/accuracy_reward/mean"] <= 1
    write_events(tmp_path / "runs" / "a", rows)
    import_run("tensorboard", tmp_path / "runs", tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "run.json").read_text())
    assert "but 3 where its values left [0, 1]" in meta["provenance"]["correct_rate"]
    report = rlscope.analyze(tmp_path / "out")
    found = next(f for f in report.findings if f.id == "accuracy-out-of-range")
    assert found.severity == "warn" and found.evidence["steps"] == [6, 13, 17]
    pass_1 = report.metrics["signal.pass_at_1"]
    expected = {s: a for s, a in enumerate(accuracy, start=1) if s not in broken}
    got = dict(zip(pass_1.steps, pass_1.values, strict=True))
    assert sorted(s for s, v in got.items() if v is None) == sorted(broken)
    assert {s: v for s, v in got.items() if v is not None} == pytest.approx(expected, abs=1e-6)
    # In range throughout: a clean run, and one with partial credit (not a 0/1 reward at all).
    write_events(tmp_path / "clean" / "a", _trl_accuracy_rows(accuracy, 16))
    import_run("tensorboard", tmp_path / "clean", tmp_path / "clean-out")
    assert "accuracy-out-of-range" not in {
        f.id for f in rlscope.analyze(tmp_path / "clean-out").findings
    }
    partial = _trl_accuracy_rows(accuracy, 16)
    v = np.array([0.5] * 4 + [1.0] * 6 + [0.0] * 6)
    partial[9]["train/rewards/accuracy_reward/mean"] = float(v.mean())
    partial[9]["train/rewards/accuracy_reward/std"] = float(v.std(ddof=1))
    write_events(tmp_path / "partial" / "a", partial)
    import_run("tensorboard", tmp_path / "partial", tmp_path / "partial-out")
    meta = json.loads((tmp_path / "partial-out" / "run.json").read_text())
    assert meta["provenance"]["correct_rate"].startswith("not read")
    report = rlscope.analyze(tmp_path / "partial-out")
    assert "accuracy-out-of-range" not in {f.id for f in report.findings}
    assert any("accuracy-out-of-range" in m.findings for m in report.inputs_missing)


@pytest.mark.parametrize(
    ("fixture", "read"),
    [
        ("trl-real/healthy/checkpoint-200", True),
        ("trl-real/too-hard/checkpoint-200", True),
        ("trl-real/lr-too-high/checkpoint-200", True),
        ("trl-real/format-weighted-groupnorm/checkpoint-200", True),
        ("trl-tiny-grpo/checkpoint-150", True),
        ("trl-two-eval-sets", True),
        ("trl-float-noise", False),  # accuracy_reward scaled to 0.1: no 0/1 reward
    ],
)
def test_genuine_trl_logs_read_as_0_1_without_a_break(fixture: str, read: bool) -> None:
    """TRL 1.16's own log_history (its float32 means and unbiased stds): the accuracy reward is
    read as the run's accuracy exactly where it is 0/1, and no step of any genuine run crosses
    the bound accuracy-out-of-range judges on."""
    history = json.loads((GENUINE / fixture / "trainer_state.json").read_text())["log_history"]
    rows = [
        {k: v for k, v in e.items() if k.startswith("rewards/accuracy_reward/")}
        for e in history
        if "rewards/accuracy_reward/mean" in e
    ]
    frame = pl.DataFrame(rows)
    resolved = Resolved({})
    binary_accuracy(frame, resolved)
    assert (resolved.mapping.get("rewards/accuracy_reward/mean") == "correct_rate") is read
    assert "left [0, 1]" not in resolved.provenance["correct_rate"]
    mean, std = (pl.col(f"rewards/accuracy_reward/{s}").cast(pl.Float64) for s in ("mean", "std"))
    assert not frame.select(outside_unit_range(mean, std)).to_series().any()


def test_a_dict_of_eval_sets_gives_l5(tmp_path: Path) -> None:
    """A genuine TRL run with a dict of two eval sets (tests/genuine/trl-two-eval-sets), entry by
    entry as TensorBoardCallback.on_log writes it (rewrite_logs, then add_scalar key after key):
    a set's own keys come before TRL's unnamed eval/ ones, so the events of one call are told
    apart; each set's accuracy and size reach the L5 columns and ood-gap is judged."""
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    writer = EventFileWriter(str(folder))
    args = summary_pb2.Summary()  # on_train_begin: add_text("args", args.to_json_string())
    text = args.value.add(
        tag="args/text_summary", tensor=tensor_util.make_tensor_proto('{"num_generations": 8}')
    )
    text.metadata.plugin_data.plugin_name = "text"
    writer.add_event(event_pb2.Event(step=0, wall_time=1.0, summary=args))
    for entry in genuine_eval_points()[0]:
        for key, value in entry.items():
            if key == "step" or not isinstance(value, int | float):
                continue
            tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
            summary = summary_pb2.Summary()
            summary.value.add(tag=tag, simple_value=value)
            writer.add_event(event_pb2.Event(step=entry["step"], wall_time=1.0, summary=summary))
    writer.close()
    import_run("tensorboard", tmp_path / "runs", tmp_path / "out")
    steps = steps_of(tmp_path / "out")
    points = genuine_eval_points()[1]
    for (step, split), (accuracy, completions) in points.items():
        row = steps.filter(pl.col("step") == step).row(0, named=True)
        assert row[f"{split}_accuracy"] == pytest.approx(accuracy, rel=1e-6)  # float32 events
        assert row[f"{split}_completions"] == completions
    assert "ood-gap" in {f.id for f in rlscope.analyze(tmp_path / "out").findings}


def write_openrlhf(folder: Path, steps: range, *, kl: float = 0.0) -> None:
    """OpenRLHF's TensorboardLogger.log_train (openrlhf/utils/logging_utils.py, v0.11.0) on the
    writer under torch's SummaryWriter (tensorboard's EventFileWriter): add_scalar("train/<k>")
    for the status dict, add_text("train/generated_samples") for the sample."""
    folder.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(folder))
    for step in steps:
        summary = summary_pb2.Summary()
        for key, value in openrlhf_status(step, kl=kl, critic=True).items():
            summary.value.add(tag=f"train/{key}", simple_value=value)
        text = summary.value.add(
            tag="train/generated_samples",
            tensor=tensor_util.make_tensor_proto(f"Sample:\\nq{step} a{step}\n\nReward: 0.5"),
        )
        text.metadata.plugin_data.plugin_name = "text"
        writer.add_event(event_pb2.Event(step=step, wall_time=1000.0 + step, summary=summary))
    writer.close()


def test_openrlhf_tags(tmp_path: Path) -> None:
    write_openrlhf(tmp_path / "logs" / "run", range(1, 4))
    result = import_run("tensorboard", tmp_path / "logs", tmp_path / "out")
    frame = steps_of(tmp_path / "out")
    assert frame["loss"].to_list() == pytest.approx([-0.01, -0.02, -0.03], rel=1e-6)
    assert frame["response_len"][0] == pytest.approx(201.0)
    assert frame["lr"][0] == pytest.approx(5e-7, rel=1e-6)
    assert frame["grad_norm"][0] == pytest.approx(0.51, rel=1e-6)
    assert frame["entropy"][0] == pytest.approx(1.49, rel=1e-6)
    assert frame["clip_frac"][0] == pytest.approx(0.002, rel=1e-6)
    assert frame["reward"][-1] == pytest.approx(0.3, rel=1e-6)
    # the whole rollout batch's rate is read; the per-sample flag's mean stays an extra column
    assert frame["truncation_rate"].to_list() == pytest.approx([0.0625] * 3)
    assert frame["train/truncated"][0] == pytest.approx(0.05, rel=1e-6)
    assert frame["critic_loss"][0] == pytest.approx(0.3, rel=1e-6)
    assert frame["ppo_kl"][0] == pytest.approx(1e-4, rel=1e-5)
    assert frame["critic_grad_norm"][0] == pytest.approx(0.7, rel=1e-6)
    assert frame["critic_lr"][0] == pytest.approx(1e-6, rel=1e-6)
    # no reference model: train/kl is 0.0 at every step, "not computed", not a KL of 0
    assert "kl" not in frame.columns
    assert frame["train/kl"].to_list() == [0.0] * 3
    assert any("train/kl is 0 at every step" in n for n in result.notes)
    assert any("generated_samples" in n for n in result.notes)  # the text sample, skipped
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["provenance"]["kl"].startswith("not computed: train/kl")
    assert run["provenance"]["truncation"] == "train/rollout/truncated_rate as logged"


def test_openrlhf_kl_read_with_a_reference_model(tmp_path: Path) -> None:
    write_openrlhf(tmp_path / "logs", range(1, 4), kl=0.004)
    import_run("tensorboard", tmp_path / "logs", tmp_path / "out")
    frame = steps_of(tmp_path / "out")
    assert frame["kl"].to_list() == pytest.approx([0.004] * 3, rel=1e-6)


def test_verl_reward_kl_penalty_is_the_kl_without_a_kl_loss(tmp_path: Path) -> None:
    rows = _verl_rows(6)
    for step, row in rows.items():
        row["actor/reward_kl_penalty"] = 0.001 * step
    write_events(tmp_path / "tb", rows)
    import_run("tensorboard", tmp_path / "tb", tmp_path / "out")
    frame = steps_of(tmp_path / "out")
    assert frame["kl"].to_list() == pytest.approx([0.001 * s for s in range(1, 7)], rel=1e-6)
    assert frame["actor/kl_loss"].to_list() == [0.0] * 6
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["provenance"]["kl"].startswith("actor/reward_kl_penalty")


def test_nan_grad_norm_is_kept_and_fires_divergence(tmp_path: Path) -> None:
    rows = _verl_rows(20)
    rows[7]["actor/grad_norm"] = math.nan
    write_events(tmp_path / "tb", rows)
    out = tmp_path / "out"
    import_run("tensorboard", tmp_path / "tb", out)
    result = runner.invoke(app, ["analyze", str(out), "--format", "json"])
    report = json.loads(result.stdout)
    divergence = [f for f in report["findings"] if f["id"] == "divergence"]
    assert divergence and "7" in divergence[0]["message"]


def test_analyze_from_tensorboard(tmp_path: Path) -> None:
    write_events(tmp_path / "tb", _verl_rows(20))
    result = runner.invoke(
        app, ["analyze", str(tmp_path / "tb"), "--from", "tensorboard", "--format", "json"]
    )
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout)
    metrics = report["metrics"]
    for metric_id in (
        "stability.loss",
        "stability.grad_norm",
        "behavior.entropy",
        "behavior.response_len",
        "behavior.truncation_rate",
        "signal.reward",
    ):
        assert metric_id in metrics, metric_id
    assert "as logged" in metrics["behavior.truncation_rate"]["source"]
    assert "stability.kl" not in metrics  # verl's KL loss was off
    assert "truncation" in {f["id"] for f in report["findings"]}  # 0.25 > the 5% band


def test_import_cli_and_formats(tmp_path: Path) -> None:
    write_events(tmp_path / "tb", _verl_rows(3))
    result = runner.invoke(
        app, ["import", "tensorboard", str(tmp_path / "tb"), str(tmp_path / "o")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "o" / "run.json").is_file()
    doc = runner.invoke(app, ["formats", "tensorboard"])
    assert doc.exit_code == 0
    for name in ("tracking.py", "integration_utils.py", "ppo_trainer.py", "train/policy_loss"):
        assert name in doc.output
    assert "tensorboard" in IMPORTERS


def test_reimport_adds_only_new_steps(tmp_path: Path) -> None:
    write_events(tmp_path / "tb" / "a", {s: {"train/loss": float(s)} for s in (1, 2)})
    out = tmp_path / "out"
    import_run("tensorboard", tmp_path / "tb", out)
    write_events(tmp_path / "tb" / "b", {s: {"train/loss": float(s)} for s in (2, 3)})
    import_run("tensorboard", tmp_path / "tb", out)
    frame = steps_of(out)
    assert frame["step"].to_list() == [1, 2, 3]


def test_no_event_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(RlscopeError, match="no TensorBoard event file"):
        import_run("tensorboard", tmp_path / "empty", tmp_path / "out")


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from rlscope.importers import tensorboard as tb

    real = builtins.__import__

    def fake(name: str, *args, **kwargs):
        if name.startswith("tensorboard"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(RlscopeError) as info:
        tb._loader()
    assert "pip install tensorboard" in (info.value.hint or "")
