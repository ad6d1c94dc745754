"""Where the tests' TRL trainers report: transformers' callbacks pointed at files, offline."""

from __future__ import annotations

import os
from pathlib import Path


def report_to() -> list[str]:
    """TRAINER_REPORT_TO: the Trainer's report_to, comma-separated (tensorboard, wandb,
    mlflow); empty when unset."""
    return [s for s in os.environ.get("TRAINER_REPORT_TO", "").replace(" ", "").split(",") if s]


def point(out: Path, sinks: list[str], name: str) -> None:
    """Point W&B and MLflow (read by transformers' WandbCallback and MLflowCallback, and by the
    libraries themselves) at files under `out`, offline, the W&B project and the MLflow
    experiment named `name`; a variable already set wins. TensorBoard writes OUT/runs/."""
    out = out.resolve()
    if "wandb" in sinks:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(out))
        os.environ.setdefault("WANDB_PROJECT", name)
    if "mlflow" in sinks:
        os.environ.setdefault("MLFLOW_TRACKING_URI", (out / "mlruns").as_uri())
        # MLflow 3 refuses a file store without it
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", name)
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def finish(sinks: list[str]) -> None:
    """Close the W&B run, so that its file is whole before the process ends."""
    if "wandb" in sinks:
        import wandb

        wandb.finish()
