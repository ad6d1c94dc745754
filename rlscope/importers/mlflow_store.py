"""MLflow importer: one run of a tracking store (sqlite file or `mlruns/` folder) -> steps."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.importers import trl as trl_importer
from rlscope.importers._tags import (
    TRL_NAMES,
    VERL_TAGS,
    binary_accuracy_key,
    config_fields,
    mapped_once,
    step_columns,
    with_mapping,
)
from rlscope.importers.options import COMMON_OPTIONS, OOD_SETS_OPTION, Option
from rlscope.importers.session import MAX_STEP, Importer, Session

SQLITE_MAGIC = b"SQLite format 3\0"
#: MLflow stores ±inf as ±sys.float_info.max in sqlite (mlflow/store/tracking/
#: sqlalchemy_store.py `_log_metrics`) and NaN as 0 with is_nan = 1.
FLOAT_MAX = 1.7976931348623157e308
#: verl's own key prefixes (metric_utils.py, ray_trainer.py): a store with them was written
#: by verl, whose keys are sanitised for MLflow.
VERL_PREFIXES = ("actor/", "critic/", "response_length/", "timing_s/", "val-core/", "perf/")
#: Names read from the store: verl's keys (logged as they are but sanitised) and the
#: transformers Trainer's log keys (MLflowCallback logs them with no `train/` prefix).
NAMES = {**VERL_TAGS, **TRL_NAMES}


def import_mlflow(session: Session) -> None:
    """One run of an MLflow tracking store -> the steps table. STORE is a sqlite store's file
    (verl's default MLFLOW_TRACKING_URI is sqlite:////tmp/mlruns.db: pass /tmp/mlruns.db), a
    file store's `mlruns/` folder (MLflow 3 refuses to write these unless
    MLFLOW_ALLOW_FILE_STORE=true), one of its experiment folders, or a run's folder. `run`
    (`--run RUN_ID`) picks the run by id or name; a store holding one run needs none. Read with
    Python's sqlite3 (read-only) or from the files (`mlruns/<experiment>/<run>/metrics/<key>`:
    lines `timestamp value step`; `params/<key>`): no mlflow package is needed, and the store
    is never written to.

    Step: MLflow's step (verl: verl/utils/tracking.py `_MlflowLoggingAdapter.log`,
    `mlflow.log_metrics(metrics, step=step)` with verl's global step; transformers:
    integration_utils.py `MLflowCallback.on_log`, step=state.global_step). Several values of
    a key at one step keep the last logged. NaN (is_nan) stays NaN; the ±1.797e308 MLflow
    stores for ±inf are read as non-finite (NaN, like every importer).

    Keys: verl sanitises its keys for MLflow (`@` -> `_at_`, runs of `/` -> one, any other
    character outside letters, digits, `_ - . : / space` -> `_`): `_at_` is read back as `@`
    in a store written by verl (so `val-core/<source>/acc/mean_at_1` is
    `val-core/<source>/acc/mean@1` again); the other replaced characters cannot be told from a
    real `_` and stay as stored (none of the keys rlscope maps has one). transformers logs the
    Trainer's keys as they are (loss, grad_norm, learning_rate, reward, kl, entropy,
    clip_ratio/region_mean, completions/mean_length, completions/clipped_ratio: read as the
    `train/` keys below), with its own sanitising of characters outside `[0-9A-Za-z_-. :/]`.

    {MAPPING}

    A dict of eval sets (TRL through transformers' MLflowCallback: one log_metrics call a set,
    at one timestamp, the set's own `eval_<name>_runtime` beside TRL's unnamed `eval_...`
    keys): each call is its (step, timestamp), TRL's keys renamed `eval_<name>_<key>`, and
    each set's accuracy and size go to the L5 columns as the `trl` importer reads them
    (`ood_sets`, else `ood` in a set's name).

    run.json from the run's params, where the key is there (verl logs its config flattened
    with `/`, `actor_rollout_ref/rollout/n`; transformers logs the TrainingArguments):
    group_size, clip ratios, max_response_len, max_grad_norm and algorithm as the `wandb`
    importer reads them (`rlscope formats wandb`). An unknown run id, a store with several runs
    and no `run`, or a run with no metric is an error, and nothing is written. Re-running adds
    only steps after the last imported one."""
    source = session.source
    store = _open(source)
    try:
        run = store.pick(session.options["run"])
        long = store.metrics(run)
        params = store.params(run)
    finally:
        store.close()
    if long.height == 0:
        raise RlscopeError(
            f"{source}: MLflow run {run['id']} has no metric",
            hint="rlscope reads the metrics a trainer logs each step (mlflow.log_metric)",
        )
    verl = any(k.startswith(VERL_PREFIXES) for k in long["key"].unique().to_list())
    notes = []
    if verl:
        long = long.with_columns(pl.col("key").str.replace_all("_at_", "@", literal=True))
        notes.append("verl's MLflow key sanitising undone: `_at_` read as `@`")
    config = {k.replace("/", "."): _param(v) for k, v in params.items()}
    frame, l5 = _with_eval_sets(long, session, config)
    state = session.state()
    provenance: dict[str, str] = {
        "step": "MLflow's step (verl tracking.py _MlflowLoggingAdapter.log and transformers "
        "MLflowCallback.on_log log the global step)"
    }
    provenance.update(config_fields(config, session, f"the MLflow run's params ({run['id']})"))
    session.notes += mapped_once(state, frame, NAMES, config)
    provenance.update(state.get("provenance", {}))
    session.meta["provenance"] = provenance
    session.notes += notes
    frame = step_columns(frame, state["mapping"])
    if l5:
        columns = pl.DataFrame([{"step": k, **v} for k, v in sorted(l5.items())])
        frame = frame.join(columns.cast({"step": pl.Int64}), on="step", how="full", coalesce=True)
    frame = session.add_step_frame(frame.sort("step"))
    session.notes.append(
        f"MLflow run {run['id']}" + (f" ({run['name']})" if run.get("name") else "")
    )
    session.file_done(run["file"], frame.height)
    session.checkpoint()
    session.tick(1, 1)


import_mlflow.__doc__ = with_mapping(import_mlflow.__doc__)


def _param(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _with_eval_sets(
    long: pl.DataFrame, session: Session, config: dict[str, Any]
) -> tuple[pl.DataFrame, dict[int, dict[str, float]]]:
    """The wide steps frame, with a dict of eval sets told apart: transformers' MLflowCallback
    logs each log call's metrics at one timestamp, so the calls of the `eval_` keys are their
    (step, timestamp) rows (trl_importer.eval_set_calls: each set's TRL keys renamed by the
    set, its accuracy and size the L5 columns, returned by step)."""
    is_eval = pl.col("key").str.starts_with("eval_")
    train = _wide(long.filter(~is_eval), session)
    evals = trl_importer.EvalSets.of_config(binary_accuracy_key(train), session, config)
    calls = long.filter(is_eval).pivot(
        on="key", index=["step", "timestamp"], values="value", aggregate_function="last"
    )
    calls = trl_importer.eval_set_calls(calls, "eval_", "step", evals)
    if not evals.points.points:
        return _wide(long, session), {}
    session.notes += evals.notes()
    keys = [c for c in calls.columns if c not in ("step", "timestamp")]
    renamed = calls.unpivot(keys, index=["step", "timestamp"], variable_name="key").drop_nulls(
        "value"
    )
    both = pl.concat([long.filter(~is_eval), renamed.select(long.columns)], how="vertical_relaxed")
    return _wide(both, session), evals.points.columns()


def _wide(long: pl.DataFrame, session: Session) -> pl.DataFrame:
    """(key, value, step, timestamp) rows -> one row per step, one column per key."""
    bad = long.filter(~pl.col("step").is_between(0, MAX_STEP))
    if bad.height:
        session.notes.append(f"{bad.height:,} metric value(s) at a step out of range skipped")
        long = long.filter(pl.col("step").is_between(0, MAX_STEP))
    long = long.with_columns(
        pl.when(pl.col("value").abs() >= FLOAT_MAX)
        .then(math.nan)
        .otherwise(pl.col("value"))
        .alias("value")
    )
    return (
        long.sort("step", "timestamp", maintain_order=True)
        .pivot(on="key", index="step", values="value", aggregate_function="last")
        .sort("step")
    )


class _Store:
    def pick(self, wanted: str | None) -> dict[str, Any]:
        runs = self.runs()
        if wanted is not None:
            found = [r for r in runs if wanted in (r["id"], r.get("name"))]
            if len(found) == 1:
                return found[0]
            why = "several runs are named" if found else "no run with id or name"
            raise RlscopeError(
                f"{self.where}: {why} {wanted!r}",
                hint=_listing(runs) if runs else "the store holds no run",
            )
        if len(runs) == 1:
            return runs[0]
        if not runs:
            raise RlscopeError(f"{self.where}: the MLflow store holds no run")
        raise RlscopeError(
            f"{self.where}: the MLflow store holds {len(runs)} runs; pick one with --run RUN_ID",
            hint=_listing(runs),
        )

    where: Path

    def runs(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def metrics(self, run: dict[str, Any]) -> pl.DataFrame:
        raise NotImplementedError

    def params(self, run: dict[str, Any]) -> dict[str, str]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _listing(runs: list[dict[str, Any]]) -> str:
    shown = ", ".join(f"{r['id']}" + (f" ({r['name']})" if r.get("name") else "") for r in runs[:8])
    return f"runs: {shown}{' ...' if len(runs) > 8 else ''}"


SCHEMA = {"key": pl.String, "value": pl.Float64, "step": pl.Int64, "timestamp": pl.Int64}


class _Sqlite(_Store):
    """A sqlite store (mlflow/store/tracking/dbmodels/models.py: tables runs, metrics, params)."""

    def __init__(self, path: Path) -> None:
        self.where = path
        try:
            self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master")}
        except sqlite3.Error as exc:
            raise RlscopeError(f"{path}: not a readable sqlite file ({exc})") from None
        if not {"runs", "metrics"} <= tables:
            self.db.close()
            raise RlscopeError(
                f"{path}: a sqlite file without MLflow's `runs` and `metrics` tables",
                hint="pass an MLflow tracking store (verl's default is /tmp/mlruns.db)",
            )

    def runs(self) -> list[dict[str, Any]]:
        rows = self.db.execute(
            "SELECT run_uuid, name, experiment_id FROM runs "
            "WHERE lifecycle_stage IS NULL OR lifecycle_stage != 'deleted' ORDER BY start_time"
        ).fetchall()
        return [{"id": r[0], "name": r[1], "file": self.where} for r in rows]

    def metrics(self, run: dict[str, Any]) -> pl.DataFrame:
        rows = self.db.execute(
            "SELECT key, CASE WHEN is_nan THEN NULL ELSE value END, step, timestamp "
            "FROM metrics WHERE run_uuid = ?",
            (run["id"],),
        ).fetchall()
        frame = pl.DataFrame(rows, schema=SCHEMA, orient="row")
        return frame.with_columns(pl.col("value").fill_null(math.nan))

    def params(self, run: dict[str, Any]) -> dict[str, str]:
        rows = self.db.execute(
            "SELECT key, value FROM params WHERE run_uuid = ?", (run["id"],)
        ).fetchall()
        return {str(k): str(v) for k, v in rows}

    def close(self) -> None:
        self.db.close()


class _Files(_Store):
    """A file store (mlflow/store/tracking/file_store.py): `<experiment>/<run>/meta.yaml`,
    `metrics/<key>` (lines `timestamp value step`, keys with `/` as folders), `params/<key>`,
    `tags/mlflow.runName`."""

    def __init__(self, path: Path) -> None:
        self.where = path
        if (path / "metrics").is_dir() and (path / "meta.yaml").is_file():
            self.folders = [path]
        else:
            metas = [*path.glob("*/metrics"), *path.glob("*/*/metrics")]
            self.folders = sorted(
                {m.parent for m in metas if (m.parent / "meta.yaml").is_file()},
                key=lambda p: p.as_posix(),
            )
            self.folders = [f for f in self.folders if ".trash" not in f.parts]
        if not self.folders:
            raise RlscopeError(
                f"{path}: not an MLflow store (no sqlite file, no mlruns/<experiment>/<run>/"
                "metrics folder)",
                hint="pass the sqlite file (e.g. /tmp/mlruns.db) or the mlruns/ folder",
            )

    def runs(self) -> list[dict[str, Any]]:
        out = []
        for folder in self.folders:
            name_file = folder / "tags" / "mlflow.runName"
            name = name_file.read_text(encoding="utf-8").strip() if name_file.is_file() else None
            out.append(
                {"id": folder.name, "name": name, "path": folder, "file": folder / "meta.yaml"}
            )
        return out

    def metrics(self, run: dict[str, Any]) -> pl.DataFrame:
        root = Path(run["path"]) / "metrics"
        frames = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = path.relative_to(root).as_posix()
            try:
                frame = pl.read_csv(
                    path,
                    separator=" ",
                    has_header=False,
                    new_columns=["timestamp", "value", "step"],
                    schema_overrides={"timestamp": pl.Int64, "value": pl.Float64},
                    truncate_ragged_lines=True,
                )
            except (pl.exceptions.PolarsError, OSError) as exc:
                raise RlscopeError(f"{path}: not an MLflow metric file ({exc})") from None
            if "step" not in frame.columns:  # MLflow < 1.? wrote `timestamp value`
                frame = frame.with_columns(pl.lit(0).alias("step"))
            frames.append(
                frame.select(
                    pl.lit(key).alias("key"),
                    pl.col("value").cast(pl.Float64),
                    pl.col("step").cast(pl.Int64).fill_null(0),
                    pl.col("timestamp").cast(pl.Int64),
                )
            )
        if not frames:
            return pl.DataFrame(schema=SCHEMA)
        return pl.concat(frames)

    def params(self, run: dict[str, Any]) -> dict[str, str]:
        root = Path(run["path"]) / "params"
        if not root.is_dir():
            return {}
        return {
            p.relative_to(root).as_posix(): p.read_text(encoding="utf-8")
            for p in root.rglob("*")
            if p.is_file()
        }


def _open(source: Path) -> _Store:
    if source.is_file():
        with open(source, "rb") as handle:
            magic = handle.read(len(SQLITE_MAGIC))
        if magic != SQLITE_MAGIC:
            raise RlscopeError(
                f"{source}: not an MLflow store (neither a sqlite file nor an mlruns/ folder)",
                hint="pass the sqlite file (e.g. /tmp/mlruns.db) or the mlruns/ folder",
            )
        return _Sqlite(source)
    return _Files(source)


MLFLOW = Importer(
    name="mlflow",
    summary="MLflow tracking store (sqlite file or mlruns/ folder), one run -> steps table",
    options=(
        Option(
            "run",
            "str",
            None,
            "the MLflow run to import: its id or name (default: the store's only run)",
        ),
        OOD_SETS_OPTION,
        *COMMON_OPTIONS,
    ),
    tables=("steps",),
    default_algorithm="GRPO",
    run=import_mlflow,
)
