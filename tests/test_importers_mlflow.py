"""`rlscope import mlflow`: sqlite and file stores written by mlflow's own client in the test."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

import rlscope
from rlscope.cli import app
from rlscope.errors import RlscopeError
from rlscope.importers import import_run
from rlscope.reader import open_run

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")
from conftest import genuine_eval_points
from trainer_keys import trl_logs, verl_metrics

# mlflow's own use of SQLAlchemy warns (noload); not rlscope's concern
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
runner = CliRunner()
STEPS = 20
VERL_PARAMS = {
    "actor_rollout_ref": {"rollout": {"n": 8}, "actor": {"clip_ratio": 0.2, "grad_clip": 1.0}},
    "data": {"max_response_length": 1024},
    "algorithm": {"adv_estimator": "gae"},
}


class VerlMlflow:
    """verl/utils/tracking.py: `mlflow.log_params(_compute_mlflow_params_from_objects(config))`
    (the config flattened with `/`) and `_MlflowLoggingAdapter.log` (its key sanitising, then
    `mlflow.log_metrics(metrics=results, step=step)`)."""

    invalid = re.compile(r"[^/\w.\- :]")
    slashes = re.compile(r"/+")

    def sanitize_key(self, key: str) -> str:
        sanitized = key.replace("@", "_at_")
        sanitized = self.slashes.sub("/", sanitized)
        return self.invalid.sub("_", sanitized)

    def log(self, mlflow, data: dict[str, float], step: int) -> None:
        mlflow.log_metrics(metrics={self.sanitize_key(k): v for k, v in data.items()}, step=step)


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}/")
        else:
            out[f"{prefix}{key}"] = value
    return out


def write_verl(mlflow, name: str, *, nan_at: int | None = None, agg: str = "token-mean") -> str:
    mlflow.set_experiment("rlscope-tests")
    with mlflow.start_run(run_name=name) as run:
        params = _flatten(VERL_PARAMS) | {"actor_rollout_ref/actor/loss_agg_mode": agg}
        mlflow.log_params(params)
        adapter = VerlMlflow()
        for step in range(1, STEPS + 1):
            data = verl_metrics(step) | {"actor/reward_kl_penalty": 0.001 * step}
            if step == nan_at:
                data["actor/grad_norm"] = math.nan
                data["actor/pg_loss"] = math.inf
            adapter.log(mlflow, data, step)
        return run.info.run_id


def write_trl(mlflow, name: str) -> str:
    """transformers' MLflowCallback.on_log: the Trainer's log keys as they are (sanitised),
    `log_metrics(metrics, step=state.global_step)`; its setup logs the TrainingArguments."""
    mlflow.set_experiment("rlscope-tests")
    with mlflow.start_run(run_name=name) as run:
        mlflow.log_params({"num_generations": 8, "epsilon": 0.2, "max_completion_length": 256})
        for step in range(1, STEPS + 1):
            logs = trl_logs(step)
            metrics = {re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", k): v for k, v in logs.items()}
            mlflow.log_metrics(metrics=metrics, step=step)
        return run.info.run_id


def write_trl_evals(mlflow, name: str) -> str:
    """A genuine TRL run with a dict of two eval sets (tests/genuine/trl-two-eval-sets), entry
    by entry as MLflowCallback.on_log logs it: one log_metrics call a log entry, so one
    timestamp a call; both sets' entries at a step carry TRL's same unnamed eval_ keys."""
    mlflow.set_experiment("rlscope-tests")
    with mlflow.start_run(run_name=name) as run:
        mlflow.log_params({"num_generations": 8, "max_grad_norm": 1.0})
        for entry in genuine_eval_points()[0]:
            metrics = {
                re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", k): v
                for k, v in entry.items()
                if k != "step" and isinstance(v, int | float)
            }
            mlflow.log_metrics(metrics=metrics, step=entry["step"])
        return run.info.run_id


@pytest.fixture(scope="session")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    import mlflow

    root = tmp_path_factory.mktemp("mlflow")
    out: dict[str, object] = {}
    before = {k: os.environ.get(k) for k in ("MLFLOW_ALLOW_FILE_STORE", "MLFLOW_TRACKING_URI")}
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        mlflow.set_tracking_uri(f"sqlite:///{root / 'mlruns.db'}")
        out["sqlite"] = root / "mlruns.db"
        out["sqlite_verl"] = write_verl(mlflow, "verl-sqlite", nan_at=7)
        out["sqlite_trl"] = write_trl(mlflow, "trl-sqlite")
        mlflow.set_tracking_uri((root / "mlruns").as_uri())
        out["files"] = root / "mlruns"
        out["files_verl"] = write_verl(mlflow, "verl-files", agg="seq-mean-token-sum")
        mlflow.set_tracking_uri((root / "evals").as_uri())
        out["evals"] = root / "evals"
        write_trl_evals(mlflow, "trl-evals")
        empty = root / "empty"
        mlflow.set_tracking_uri(f"sqlite:///{empty}.db")
        mlflow.set_experiment("empty")
        with mlflow.start_run() as run:
            mlflow.log_param("lr", 1e-6)
        out["empty"], out["empty_run"] = Path(f"{empty}.db"), run.info.run_id
    finally:
        mlflow.set_tracking_uri(None)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out


def test_a_dict_of_eval_sets_gives_l5(stores: dict[str, object], tmp_path: Path) -> None:
    """Each set's log call is one timestamp: the two sets at a step are told apart, their
    accuracy and size reach the L5 columns as TRL logged them, and ood-gap is judged."""
    out = tmp_path / "out"
    import_run("mlflow", stores["evals"], out)
    steps = steps_of(out)
    points = genuine_eval_points()[1]
    assert len(points) == 24
    for (step, split), (accuracy, completions) in points.items():
        row = steps.filter(pl.col("step") == step).row(0, named=True)
        assert row[f"{split}_accuracy"] == pytest.approx(accuracy)
        assert row[f"{split}_completions"] == completions
    assert "ood-gap" in {f.id for f in rlscope.analyze(out).findings}


def steps_of(out: Path) -> pl.DataFrame:
    return open_run(out).scan("steps").collect().sort("step")


def _check_verl(out: Path, result, *, token_mean: bool = True) -> None:
    frame = steps_of(out)
    assert frame["step"].to_list() == list(range(1, STEPS + 1))
    logged = [verl_metrics(s) for s in range(1, STEPS + 1)]
    entropy = [r["actor/entropy"] for r in logged]
    doc = json.loads((out / "run.json").read_text())
    if token_mean:
        assert frame["entropy"].to_list() == pytest.approx(entropy)
    else:  # seq-mean-token-sum: a per-sequence sum, not nats per token
        assert "entropy" not in frame.columns
        assert frame["actor/entropy"].to_list() == pytest.approx(entropy)
        assert "seq-mean-token-sum" in doc["provenance"]["entropy"]
    assert frame["reward"].to_list() == pytest.approx([r["critic/score/mean"] for r in logged])
    # the key verl sanitised for MLflow, read back under verl's own name
    acc = frame["val-core/openai/gsm8k/acc/mean@1"].to_list()
    assert acc == pytest.approx([r["val-core/openai/gsm8k/acc/mean@1"] for r in logged])
    # KL loss off (0 at every step): the reward's KL penalty is the KL
    assert frame["kl"].to_list() == pytest.approx([0.001 * s for s in range(1, STEPS + 1)])
    assert doc["group_size"] == 8 and doc["max_response_len"] == 1024
    assert doc["clip_ratio_low"] == 0.2 and doc["max_grad_norm"] == 1.0
    assert doc["algorithm"] == "PPO"  # adv_estimator gae
    assert doc["provenance"]["kl"].startswith("actor/reward_kl_penalty")
    assert "actor_rollout_ref.rollout.n" in doc["provenance"]["config"]
    assert any("_at_" in n for n in result.notes)


def test_sqlite_store_verl(stores: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = import_run("mlflow", stores["sqlite"], out, run=stores["sqlite_verl"])
    _check_verl(out, result)
    written = pl.read_parquet(out / "steps" / "*.parquet").sort("step")
    assert math.isnan(written["grad_norm"][6])  # step 7: NaN logged, is_nan in the store
    assert math.isnan(written["loss"][6])  # inf, stored as 1.797e308: non-finite
    assert written["loss"][5] == pytest.approx(0.06)


def test_file_store_verl(stores: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = import_run("mlflow", stores["files"], out)  # the store's only run
    _check_verl(out, result, token_mean=False)


def test_run_picked_by_name(stores: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    import_run("mlflow", stores["sqlite"], out, run="trl-sqlite")
    frame = steps_of(out)
    assert frame["grad_norm"].to_list() == pytest.approx([0.25 * s for s in range(1, 21)])
    assert frame["lr"][0] == pytest.approx(2e-6)
    assert frame["response_len"][0] == 64.0 and frame["truncation_rate"][0] == 0.5
    assert frame["frac_reward_zero_std"][0] == 0.25  # TRL's own name, read by the metrics
    doc = json.loads((out / "run.json").read_text())
    assert doc["group_size"] == 8 and doc["max_response_len"] == 256


def test_unknown_run_id(stores: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["import", "mlflow", str(stores["sqlite"]), str(out), "--run", "no-such-run"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert str(stores["sqlite"]) in message and "no run with id or name 'no-such-run'" in message
    assert "verl-sqlite" in message  # the runs it holds
    assert not out.exists()


def test_several_runs_need_a_run(stores: dict, tmp_path: Path) -> None:
    with pytest.raises(RlscopeError, match="holds 2 runs"):
        import_run("mlflow", stores["sqlite"], tmp_path / "out")


def test_run_without_metrics(stores: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["import", "mlflow", str(stores["empty"]), str(out)])
    assert result.exit_code == 2 and "has no metric" in result.output
    assert not out.exists()


def test_not_a_store(tmp_path: Path) -> None:
    (tmp_path / "x.db").write_text("hello")
    result = runner.invoke(app, ["import", "mlflow", str(tmp_path / "x.db"), str(tmp_path / "o")])
    assert result.exit_code == 2 and "not an MLflow store" in result.output


def test_reimport_adds_nothing_twice(stores: dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    import_run("mlflow", stores["sqlite"], out, run=stores["sqlite_verl"])
    again = import_run("mlflow", stores["sqlite"], out, run=stores["sqlite_verl"])
    assert again.rows["steps"] == 0
    assert steps_of(out).height == STEPS


def test_analyze_from_mlflow(stores: dict, tmp_path: Path) -> None:
    args = ["analyze", str(stores["files"]), "--from", "mlflow", "--format", "json"]
    result = runner.invoke(app, [*args, "--cache-dir", str(tmp_path / "cache")])
    assert result.exit_code in (0, 1), result.output
    report = json.loads(result.stdout)
    for metric in ("stability.loss", "stability.grad_norm", "stability.kl", "signal.reward"):
        assert metric in report["metrics"], metric
    # loss_agg_mode seq-mean-token-sum: actor/entropy is no per-token entropy, so none is judged
    assert "behavior.entropy" not in report["metrics"]
