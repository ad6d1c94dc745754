"""`rlscope import wandb`: run files written by the wandb package itself (offline) in the test."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

import rlscope
from rlscope.cli import app
from rlscope.errors import RlscopeError
from rlscope.importers import IMPORTERS, import_run
from rlscope.importers.wandb_log import read_run_log
from rlscope.reader import open_run

pytest.importorskip("wandb")
from trainer_keys import openrlhf_status, verl_metrics
from wandb_writer import (
    GENERATIONS,
    GENUINE_EVALS,
    GENUINE_TRL,
    OPENRLHF_STEPS,
    PROMPTS,
    TRL_STEPS,
    VERL_STEPS,
    WIDE_KEYS,
    WIDE_STEPS,
    WRITERS,
)

runner = CliRunner()
WRITER = Path(__file__).parent / "wandb_writer.py"


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One offline W&B run per trainer, written by wandb (a process per run, at once)."""
    root = tmp_path_factory.mktemp("wandb-runs")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WRITER), str(root), name],
            cwd=WRITER.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in WRITERS
    ]
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
    return {
        name: next((root / name / "wandb").glob("offline-run-*/run-*.wandb")) for name in WRITERS
    }


def steps_of(out: Path) -> pl.DataFrame:
    return open_run(out).scan("steps").collect().sort("step")


def run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_verl_history(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = import_run("wandb", runs["verl"].parent, out)
    frame = steps_of(out)
    assert frame["step"].to_list() == list(range(1, VERL_STEPS + 1))
    logged = [verl_metrics(s) for s in range(1, VERL_STEPS + 1)]
    # read values equal the logged values, mapped or under their own names
    assert frame["loss"].to_list() == [r["actor/pg_loss"] for r in logged]
    assert frame["grad_norm"].to_list() == [r["actor/grad_norm"] for r in logged]
    assert frame["entropy"].to_list() == [r["actor/entropy"] for r in logged]
    assert frame["reward"].to_list() == [r["critic/score/mean"] for r in logged]
    assert frame["response_len"].to_list() == [r["response_length/mean"] for r in logged]
    assert frame["truncation_rate"].to_list() == [0.25] * VERL_STEPS
    assert frame["val-core/openai/gsm8k/acc/mean@1"].to_list() == [
        r["val-core/openai/gsm8k/acc/mean@1"] for r in logged
    ]
    assert frame["actor/kl_loss"].to_list() == [0.0] * VERL_STEPS and "kl" not in frame.columns
    assert not any(c.startswith("_") for c in frame.columns)  # W&B's _step, _runtime, ...
    doc = run_json(out)
    assert doc["group_size"] == 5 and doc["max_response_len"] == 512
    assert (doc["clip_ratio_low"], doc["clip_ratio_high"]) == (0.2, 0.28)
    assert doc["algorithm"] == "GRPO"
    assert doc["provenance"]["step"].startswith("W&B's _step")
    assert "actor_rollout_ref.rollout.n" in doc["provenance"]["config"]
    assert doc["provenance"]["kl"].startswith("not computed: actor/kl_loss")
    assert any("val/generations" in n and "not imported" in n for n in result.notes)
    assert any("wandb 0.31" in n or "written by wandb" in n for n in result.notes)


@pytest.mark.slow  # ~1 s: runs wandb's Go reader
def test_history_equals_wandbs_own_reader(runs: dict[str, Path]) -> None:
    """Every history row as `wandb leet inspect --json` (wandb's own reader) prints it."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    if not wandb_cli.is_file():
        pytest.skip("no wandb command beside this Python")
    for name in ("verl", "openrlhf"):
        shown = subprocess.run(
            [str(wandb_cli), "leet", "inspect", "--json", str(runs[name])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if shown.returncode != 0:
            pytest.skip(f"wandb leet inspect failed: {shown.stderr[-300:]}")
        theirs = [
            r["history"]["item"]
            for r in map(json.loads, shown.stdout.splitlines())
            if r.get("type") == "history"
        ]
        ours = read_run_log(runs[name]).history.frame().sort("_row").drop("_row")
        assert len(theirs) == ours.height
        for row, items in zip(ours.iter_rows(named=True), theirs, strict=True):
            # leet shows a table's fields as `<key>.size`, `<key>.nrows`...: not history values
            shown_values = {
                k: v
                for k, v in items.items()
                if isinstance(v, int | float) and not k.startswith(TABLE_KEYS)
            }
            assert {k: v for k, v in row.items() if v is not None} == shown_values


TABLE_KEYS = ("val/generations.", "train/generated_samples.")


def test_trl_completions_table_becomes_rollouts(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = import_run("wandb", runs["trl"].parent, out)
    run = open_run(out)
    rollouts = run.scan("rollouts").collect().sort("rollout_id")
    assert rollouts.height == TRL_STEPS * len(PROMPTS) * GENERATIONS
    assert sorted(set(rollouts["step"].to_list())) == list(range(1, TRL_STEPS + 1))
    # the train batch of each step (the eval table logged after it at steps 6, 12 left out)
    assert "eval prompt" not in rollouts["prompt"].to_list()
    first = rollouts.filter(pl.col("step") == 1)
    assert first["reward"].to_list() == [
        float((g + 1 + p) % 2 == 0) for p in (0, 1) for g in range(4)
    ]
    assert first["correct"].to_list() == [r > 0 for r in first["reward"].to_list()]
    assert first["advantage"].to_list() == [r - 0.5 for r in first["reward"].to_list()]
    assert rollouts.group_by("step", "prompt_id").len()["len"].unique().to_list() == [GENERATIONS]
    steps = steps_of(out)
    assert steps["step"].to_list() == list(range(1, TRL_STEPS + 1))  # train/global_step
    assert steps["grad_norm"].to_list() == pytest.approx([0.25 * s for s in range(1, 13)])
    assert "response_len" not in steps.columns  # tokens; the rollouts' length counts words
    assert steps["completions/mean_length_logged"][0] == 64.0
    # same length, same first and last 8 bytes: two keys all the same
    terminated = "train/completions/{}_terminated_length"
    assert steps[terminated.format("min")].to_list() == [9.0 + s for s in range(1, 13)]
    assert steps[terminated.format("max")].to_list() == [100.0 + s for s in range(1, 13)]
    assert steps["eval/loss"].drop_nulls().to_list() == [0.4, 0.4]
    doc = run_json(out)
    assert doc["group_size"] == GENERATIONS and doc["max_grad_norm"] == 0.5
    assert doc["correct_source"] == "accuracy_reward > 0"
    assert doc["provenance"]["step"].startswith("train/global_step: declared")
    assert "W&B train/rewards" in doc["provenance"]["reward"]
    assert (
        doc["scale_rewards"] == "none" and "W&B config" in doc["provenance"]["frac_reward_zero_std"]
    )
    assert any("num_generations = 4 (the W&B config)" in n for n in result.notes)
    assert any("later completions table" in n for n in result.notes)


def test_genuine_trl_log_equals_trainer_state(runs: dict[str, Path], tmp_path: Path) -> None:
    """A genuine TRL 1.16 run's every logged key and value, sent through W&B as transformers'
    callback sends them, comes back as TRL's own trainer_state.json has it, step for step."""
    import_run("wandb", runs["trl-genuine"].parent, tmp_path / "out")
    steps = steps_of(tmp_path / "out")
    (state,) = GENUINE_TRL.glob("checkpoint-*/trainer_state.json")
    history = json.loads(state.read_text())["log_history"]
    assert steps["step"].to_list() == [e["step"] for e in history]
    renamed = {"learning_rate": "lr", "clip_ratio/region_mean": "clip_frac"}
    renamed |= {"completions/mean_length": "response_len"}
    renamed |= {"completions/clipped_ratio": "truncation_rate"}
    renamed |= {k: k for k in ("loss", "grad_norm", "kl", "entropy", "reward")}
    # accuracy_reward is 0/1: its mean is pass@1, its std counts the responses
    renamed |= {"rewards/accuracy_reward/mean": "correct_rate"}
    renamed |= {"rewards/accuracy_reward/std": "correct_rate_std"}
    for key in {k for e in history for k in e} - {"step"}:
        column = renamed.get(key, f"train/{key}")
        assert column in steps.columns, key
        assert steps[column].to_list() == [e.get(key) for e in history], key


def test_a_dict_of_eval_sets_gives_l5(runs: dict[str, Path], tmp_path: Path) -> None:
    """TRL's dict of eval sets through W&B (a genuine log_history): two log calls at one step
    carry the same unnamed TRL keys, told apart by each set's own `eval/<name>_runtime`. Each
    set's accuracy and size reach the L5 columns as TRL's own log has them, and ood-gap is
    judged (the OOD digits were never trained)."""
    import_run("wandb", runs["trl-evals"].parent, tmp_path / "out")
    steps = steps_of(tmp_path / "out")
    (state,) = GENUINE_EVALS.glob("trainer_state.json")
    checked = 0
    for entry in json.loads(state.read_text())["log_history"]:
        for name, split in (("in_dist", "eval_id"), ("ood", "eval_ood")):
            if f"eval_{name}_runtime" not in entry:
                continue
            row = steps.filter(pl.col("step") == entry["step"]).row(0, named=True)
            assert row[f"{split}_accuracy"] == entry["eval_rewards/accuracy_reward/mean"]
            size = entry[f"eval_{name}_samples_per_second"] * entry[f"eval_{name}_runtime"]
            assert row[f"{split}_completions"] == round(size) * 8
            checked += 1
    assert checked == 24
    report = rlscope.analyze(tmp_path / "out")
    assert "ood-gap" in {f.id for f in report.findings}


def test_openrlhf_global_step_axis(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = import_run("wandb", runs["openrlhf"].parent, out)
    frame = steps_of(out)
    # _step counts two log calls a step (the samples table first); the step is global_step
    assert frame["step"].to_list() == list(range(1, OPENRLHF_STEPS + 1))
    logged = [openrlhf_status(s) for s in range(1, OPENRLHF_STEPS + 1)]
    assert frame["loss"].to_list() == [r["policy_loss"] for r in logged]
    assert frame["grad_norm"].to_list() == [r["actor_grad_norm"] for r in logged]
    assert frame["entropy"].to_list() == [r["entropy_loss"] for r in logged]
    assert frame["response_len"].to_list() == [r["response_length"] for r in logged]
    assert frame["truncation_rate"].to_list() == [0.0625] * OPENRLHF_STEPS
    assert frame["train/truncated"].to_list() == [0.05] * OPENRLHF_STEPS
    assert "kl" not in frame.columns and frame["train/kl"].to_list() == [0.0] * OPENRLHF_STEPS
    evals = frame.filter(pl.col("eval/eval_gsm8k_pass1").is_not_null())
    assert evals["step"].to_list() == [10, 20]  # eval rows by their eval/global_step
    assert "train/global_step" not in frame.columns and "eval/epoch" not in frame.columns
    doc = run_json(out)
    assert doc["group_size"] == 8 and doc["max_response_len"] == 1024
    assert doc["algorithm"] == "GRPO"  # algo.advantage.estimator group_norm
    assert doc["provenance"]["kl"].startswith("not computed: train/kl")
    assert "rollouts" not in open_run(out).tables
    assert any("generated_samples" in n and "OpenRLHF" in n for n in result.notes)


def test_records_across_blocks(runs: dict[str, Path], tmp_path: Path) -> None:
    """Rows larger than a 32 KiB block; NaN and infinities kept as NaN, strings dropped."""
    log = read_run_log(runs["wide"])
    assert log.cut is None and log.history.rows == WIDE_STEPS
    out = tmp_path / "out"
    result = import_run("wandb", runs["wide"], out)
    frame = steps_of(out)
    assert frame["step"].to_list() == list(range(WIDE_STEPS))
    for k in (0, 1234, WIDE_KEYS - 1):
        assert frame[f"group_{k % 7}/key_{k:04d}"].to_list() == [k * 0.5 + s for s in range(3)]
    assert frame["count"].to_list() == [0.0, 1.0, 2.0]
    written = pl.read_parquet(out / "steps" / "*.parquet")  # (the reader reads NaN as null)
    assert all(math.isnan(v) for v in written["nan"].to_list() + written["inf"].to_list())
    assert "text" not in frame.columns
    assert any("not numbers dropped" in n and "`text`" in n for n in result.notes)


def _cut(path: Path, dest: Path, keep: float) -> Path:
    """A copy of the run file holding its first `keep` share of bytes, cut inside a chunk."""
    dest.mkdir(parents=True)
    data = path.read_bytes()
    copy = dest / path.name
    copy.write_bytes(data[: int(len(data) * keep)])
    return copy


def test_file_cut_mid_write(runs: dict[str, Path], tmp_path: Path) -> None:
    cut = _cut(runs["verl"], tmp_path / "cut", 0.6)
    out = tmp_path / "out"
    result = import_run("wandb", cut, out)
    frame = steps_of(out)
    n = frame.height
    assert 0 < n < VERL_STEPS
    assert frame["step"].to_list() == list(range(1, n + 1))
    assert frame["loss"].to_list() == [0.01 * s for s in range(1, n + 1)]
    assert any("read up to the last whole record" in w for w in result.warnings)
    # the run goes on: the same file, grown, adds only the steps after the cut
    shutil.copyfile(runs["verl"], cut)
    again = import_run("wandb", cut, out)
    assert again.first_step == n + 1 and again.last_step == VERL_STEPS
    assert steps_of(out)["step"].to_list() == list(range(1, VERL_STEPS + 1))
    assert not again.warnings


def _no_output(args: list[str], out: Path) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert not out.exists()
    return " ".join(result.output.split())


def test_corrupt_chunk_in_the_middle(runs: dict[str, Path], tmp_path: Path) -> None:
    data = bytearray(runs["verl"].read_bytes())
    data[len(data) // 3] ^= 0xFF
    bad = tmp_path / "run-bad.wandb"
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    message = _no_output(["import", "wandb", str(bad), str(out)], out)
    assert str(bad) in message and "corrupt W&B run file" in message


def test_not_a_wandb_file(tmp_path: Path) -> None:
    fake = tmp_path / "run-x.wandb"
    fake.write_bytes(b"not a wandb file" * 10)
    out = tmp_path / "out"
    message = _no_output(["import", "wandb", str(fake), str(out)], out)
    assert str(fake) in message and "not a W&B run file" in message


def test_empty_history(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    message = _no_output(["import", "wandb", str(runs["empty"].parent), str(out)], out)
    assert str(runs["empty"]) in message and "has no history" in message


def test_two_runs_in_one_folder(runs: dict[str, Path], tmp_path: Path) -> None:
    both = tmp_path / "wandb"
    for name in ("verl", "openrlhf"):
        shutil.copytree(runs[name].parent, both / runs[name].parent.name)
    with pytest.raises(RlscopeError, match="holds 2 W&B runs"):
        import_run("wandb", both, tmp_path / "out")


@pytest.mark.parametrize("name", ["verl", "trl", "openrlhf"])
def test_analyze_from_wandb(runs: dict[str, Path], tmp_path: Path, name: str) -> None:
    cache = ["--cache-dir", str(tmp_path / "cache")]
    result = runner.invoke(
        app, ["analyze", str(runs[name].parent), "--from", "wandb", "--format", "json", *cache]
    )
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout)
    for metric in ("stability.loss", "stability.grad_norm", "signal.reward"):
        assert metric in report["metrics"], metric
    if name == "trl":
        assert "signal.zero_std_share" in report["metrics"] or report["run"]["rollouts"]


def test_import_cli_and_formats(runs: dict[str, Path], tmp_path: Path) -> None:
    result = runner.invoke(app, ["import", "wandb", str(runs["verl"]), str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "20 steps" in result.output
    doc = runner.invoke(app, ["formats", "wandb"])
    assert doc.exit_code == 0
    for name in ("logging_utils.py", "tracking.py", "integration_utils.py", "record.go"):
        assert name in doc.output
    assert "wandb" in IMPORTERS


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from rlscope.importers import wandb_log

    real = builtins.__import__

    def fake(name: str, *args, **kwargs):
        if name.startswith("wandb"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(RlscopeError) as info:
        wandb_log.proto()
    assert "pip install wandb" in (info.value.hint or "")


FIXTURES = Path(__file__).parent / "fixtures" / "wandb"


def test_files_of_older_wandb(tmp_path: Path) -> None:
    """Files wandb 0.16.6 wrote (its Python writer: a table reference is one item of JSON
    text, not nested keys), read with the dev venv's wandb protobuf classes."""
    out = tmp_path / "trl"
    result = import_run("wandb", FIXTURES / "0.16.6-trl", out)
    assert "written by wandb 0.16.6" in result.notes
    rollouts = open_run(out).scan("rollouts").collect()
    assert rollouts.height == TRL_STEPS * len(PROMPTS) * GENERATIONS
    assert steps_of(out)["step"].to_list() == list(range(1, TRL_STEPS + 1))
    out = tmp_path / "openrlhf"
    result = import_run("wandb", FIXTURES / "0.16.6-openrlhf", out)
    frame = steps_of(out)
    assert frame["step"].to_list() == list(range(1, OPENRLHF_STEPS + 1))
    assert frame["loss"].to_list() == [openrlhf_status(s)["policy_loss"] for s in frame["step"]]
    assert any("train/generated_samples" in n and "not there" in n for n in result.notes)
