"""W&B importer: a run's `run-<id>.wandb` log -> steps, and TRL's completions tables -> rollouts."""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.importers import trl as trl_importer
from rlscope.importers._tags import (
    TAGS,
    binary_accuracy_key,
    config_fields,
    mapped_once,
    step_columns,
    with_mapping,
)
from rlscope.importers.manifest import fingerprint
from rlscope.importers.options import COMMON_OPTIONS, ROLLOUT_OPTIONS
from rlscope.importers.session import MAX_STEP, Importer, Session
from rlscope.importers.wandb_log import RunLog, read_run_log

EXTRA = "wandb"
#: `run-<id>.wandb` (wandb/sdk/wandb_settings.py `sync_file`), in `wandb/run-<time>-<id>/`
#: or `wandb/offline-run-<time>-<id>/`.
RUN_FILE = re.compile(r"^run-(.+)\.wandb$")
#: The x-axis OpenRLHF and transformers declare with define_metric for their `train/` keys.
GLOBAL_STEP = "train/global_step"
#: OpenRLHF's log_eval adds `global_step` under `eval/` (and declares eval/epoch its axis).
EVAL_STEP = "eval/global_step"
SCALES = ("group", "batch", "none")


def run_files(source: Path) -> list[Path]:
    """The `.wandb` files of one run under `source` (or `source` itself), oldest first: a
    resumed run writes one folder per process, all named after the run id."""
    if source.is_file():
        return [source]
    found: dict[Path, Path] = {}
    for path in sorted(source.rglob("*.wandb")):
        if path.is_file() and "latest-run" not in path.parts:
            found.setdefault(path.resolve(), path)
    files = sorted(found.values(), key=lambda p: (p.parent.name.split("-")[-2:-1], p.as_posix()))
    if not files:
        raise RlscopeError(
            f"{source}: no W&B run file (run-<id>.wandb)",
            hint="pass a run's folder (wandb/run-<time>-<id>, or offline-run-...) or its "
            "run-<id>.wandb file",
        )
    ids = sorted({m.group(1) if (m := RUN_FILE.match(p.name)) else p.stem for p in files})
    if len(ids) > 1:
        raise RlscopeError(
            f"{source}: holds {len(ids)} W&B runs ({', '.join(ids[:5])}"
            f"{' ...' if len(ids) > 5 else ''})",
            hint="pass one run's folder (wandb/run-<time>-<id>); wandb/latest-run is the last",
        )
    return files


def import_wandb(session: Session) -> None:
    """A W&B run, online or offline: every run writes its whole history locally to
    `wandb/run-<time>-<id>/run-<id>.wandb` (`offline-run-...` offline), a log of protobuf
    records. Pass that folder, the file, or a `wandb/` folder holding one run (a resumed run's
    folders are read oldest first). Needs the `wandb` package for its protobuf classes
    (`wandb.proto.wandb_internal_pb2`); W&B has no public reader of these files, so the record
    framing (LevelDB's log format: 32 KiB blocks of CRC-32-checked chunks, a 7-byte `:W&B`
    header; wandb/sdk/internal/datastore.py up to wandb 0.29, core/pkg/leveldb/record.go and
    core/internal/transactionlog in the Go core) is rlscope's, checked on files written by
    wandb 0.16.6, 0.22.3 and 0.31.0. The source is never written to.

    Read: history rows (`wandb.log`) -> the steps table; the run's config -> run.json; tables
    (`wandb.Table`) -> rollouts where the columns allow. Summary, system metrics, console
    output and files are not read.

    Step: `train/global_step` where the run declared it the x-axis (`define_metric`: OpenRLHF,
    openrlhf/utils/logging_utils.py `WandbLogger.__init__`; transformers, integration_utils.py
    `WandbCallback.setup`) or logged it, else W&B's own `_step` (verl logs with
    `step=global_steps`: verl/utils/tracking.py `Tracking.log`). With train/global_step,
    `_step` runs ahead of the step (OpenRLHF logs its samples table in a call of its own,
    transformers its eval logs), and W&B copies the last global step into such rows
    (step_sync): rows sharing a step merge, later keys winning; OpenRLHF's eval rows take
    their `eval/global_step`. The provenance says which axis was read. W&B's own keys
    (`_step`, `_runtime`, `_timestamp`) and the axes are not columns; values that are not
    numbers (strings, booleans, media) are counted in the notes.

    {MAPPING}

    run.json from the run's config, where the key is there (the first found; the notes and the
    provenance name the keys used): group_size = actor_rollout_ref.rollout.n (verl),
    num_generations (TRL), rollout.n_samples_per_prompt (OpenRLHF); clip_ratio_low/high =
    actor_rollout_ref.actor.clip_ratio_low/high (or clip_ratio), epsilon / epsilon_high,
    actor.eps_clip_low_high (or eps_clip); max_response_len = data.max_response_length,
    max_completion_length, rollout.max_new_tokens; max_grad_norm =
    actor_rollout_ref.actor.grad_clip, max_grad_norm, actor.max_norm; algorithm from
    algorithm.adv_estimator / algo.advantage.estimator (gae -> PPO, grpo and group_norm ->
    GRPO, rloo -> RLOO, ...). Options win over the config.

    Tables: TRL's completions table (grpo_trainer.py `log`: `wandb.log({"completions":
    wandb.Table(dataframe=df)})`, the columns of its completions parquet: step, prompt,
    completion, one per reward function, advantage) -> rollouts exactly as the `trl` importer
    reads its parquet files (`rlscope formats trl`: groups, reward, correct, words), the reward
    functions from the `train/rewards/<name>/mean` keys, num_generations and scale_rewards
    from the config (GRPOConfig) when it has them, else inferred as `trl` does; then
    train/completions/mean_length is kept as `completions/mean_length_logged` (tokens;
    response_len counts words). OpenRLHF's
    samples table (global_step, text, reward: one decoded prompt+response a step) and verl's
    validation table (val/generations: step, input_1, output_1, score_1, ... side by side) are
    skipped, with the reason in the notes: neither is a batch of rollouts. A table's file is
    read from the run folder's `files/` (W&B writes it there).

    Eval sets: a dict of eval datasets (transformers' Trainer.evaluate, one log call a set with
    its own `eval/<name>_runtime` beside TRL's unnamed `eval/...` metrics) -> TRL's keys renamed
    `eval/<name>_<key>` in each set's rows, and each set's accuracy (the 0/1 accuracy reward's
    mean, as `correct_rate` is read) and size (samples_per_second x runtime x
    num_generations_eval, else num_generations) -> the L5 columns `eval_id_accuracy`,
    `eval_id_completions`, `eval_ood_*`, as the `trl` importer reads trainer_state.json
    (`ood_sets`, else `ood` in a set's name).

    A file cut mid-write (a run killed, or still running) is read up to its last whole record,
    with a warning saying where it stops; damage before the end, a file that is not a W&B run
    file, or a run with no history is an error, and nothing is written. Re-running on a grown
    file adds only the steps after the last imported one."""
    files = run_files(session.source)
    state = session.state()
    logs: list[RunLog] = []
    # The manifest's hash of each file, on the other core while the file is read.
    hasher = ThreadPoolExecutor(max_workers=1)
    prints: dict[Path, Future[dict[str, Any]]] = {}
    try:
        for done, path in enumerate(files, 1):
            if session.read_status(path, done, len(files)) is None:
                continue
            prints[path] = hasher.submit(fingerprint, path)
            logs.append(read_run_log(path))
            session.tick(done, len(files))
        known = {path: future.result() for path, future in prints.items()}
    finally:
        hasher.shutdown(cancel_futures=True)
    if not logs:
        return
    for log in logs:
        if log.cut:
            session.warnings.append(
                f"{log.path}: {log.cut}; read up to the last whole record (a run killed "
                "mid-write, or still running)"
            )
    history = _history(logs)
    axis, why = state.get("axis"), state.get("axis_why")
    if axis is None:
        axis, why = _axis(logs, history)
        state["axis"], state["axis_why"] = axis, why
    history, evals = _eval_sets(history, axis, session, _run_config(logs))
    frame = _steps(history, axis, logs, session)
    if evals:
        l5 = pl.DataFrame([{"step": step, **row} for step, row in sorted(evals.items())]).cast(
            {"step": pl.Int64}
        )
        frame = frame.join(l5, on="step", how="full", coalesce=True).sort("step")
    if frame.height == 0 and not session.entry["last_step"]:
        raise RlscopeError(
            f"{logs[0].path}: the W&B run has no history (no numeric value logged with wandb.log)",
            hint="rlscope reads the metrics a trainer logs each step",
        )
    # Everything run.json says is known before the first rows are written.
    provenance: dict[str, str] = {"step": str(why), **_config(logs, session)}
    completions = _tables(logs, history, axis, session)
    names = dict(TAGS)
    if completions:
        names["train/completions/mean_length"] = "completions/mean_length_logged"
    session.notes += mapped_once(state, frame, names, _run_config(logs))
    provenance.update(state.get("provenance", {}))
    session.meta["provenance"] = {**session.meta.get("provenance", {}), **provenance}
    if completions:
        _trl_rollouts(completions, frame, session, provenance, _run_config(logs))
    frame = session.add_step_frame(step_columns(frame, state["mapping"]))
    for log in logs:
        session.file_done(log.path, frame.height, known=known[log.path], records=log.records)
    versions = sorted({v for log in logs if (v := log.version)})
    if versions:
        session.notes.append(f"written by wandb {', '.join(versions)}")
    session.checkpoint()


import_wandb.__doc__ = with_mapping(import_wandb.__doc__)


def _history(logs: list[RunLog]) -> pl.DataFrame:
    """Every file's history rows in order (`_row` numbered across files). A dict logged as a
    value (`wandb.log({"a": {"b": 1}})`) is the column `a.b`, as W&B shows it; media and
    tables (a dict with `_type`) are not columns."""
    frames, offset = [], 0
    for log in logs:
        frame = log.history.frame().with_columns(pl.col("_row") + offset)
        media = {(row, path[0]) for row, path, _ in log.history.nested if path[-1] == "_type"}
        cells = []
        for row, path, text in log.history.nested:
            if (row, path[0]) in media:
                continue
            try:
                value = json.loads(text)
            except ValueError:
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                cells.append((row + offset, ".".join(path), float(value)))
        if cells:
            nested = pl.DataFrame(cells, schema=["_row", "key", "value"], orient="row").pivot(
                on="key", index="_row", values="value", aggregate_function="last"
            )
            frame = frame.join(nested, on="_row", how="left")
        frames.append(frame)
        offset += log.history.rows
    return pl.concat(frames, how="diagonal_relaxed")


def _axis(logs: list[RunLog], history: pl.DataFrame) -> tuple[str, str]:
    declared = [
        m["step_metric"]
        for log in logs
        for m in log.metrics
        if m["step_metric"] and (m["glob"] in ("*", "train/*") or m["name"].startswith("train/"))
    ]
    if declared and declared[-1] in history.columns:
        return declared[-1], (
            f"{declared[-1]}: declared the x-axis of the train keys with define_metric "
            "(OpenRLHF logging_utils.py WandbLogger, transformers integration_utils.py "
            "WandbCallback); W&B's _step counts log calls"
        )
    if GLOBAL_STEP in history.columns:
        return GLOBAL_STEP, f"{GLOBAL_STEP}: logged with every train row (W&B's _step counts calls)"
    return "_step", (
        "W&B's _step (verl logs with step=global_steps: verl/utils/tracking.py Tracking.log)"
    )


def _axes(logs: list[RunLog]) -> set[str]:
    return {m["step_metric"] for log in logs for m in log.metrics if m["step_metric"]} | {
        m["name"] for log in logs for m in log.metrics if m["name"] and not m["step_metric"]
    }


def _steps(history: pl.DataFrame, axis: str, logs: list[RunLog], session: Session) -> pl.DataFrame:
    """One row per step: the axis as `step`, the numeric keys as columns."""
    skip = {axis, "_row", EVAL_STEP, *_axes(logs)}
    values = [c for c in history.columns if c not in skip and not c.startswith("_")]
    if axis not in history.columns:
        return pl.DataFrame({"step": pl.Series([], dtype=pl.Int64)})
    step = pl.col(axis)
    if axis == GLOBAL_STEP and EVAL_STEP in history.columns:
        step = pl.coalesce(axis, EVAL_STEP)
    frame = history.select(step.alias("step"), *values)
    if not values:
        return frame.clear().select(pl.col("step").cast(pl.Int64))
    # Filters copy every column (a 100k x 200 history is 160 MB): only when a row goes.
    logged = pl.any_horizontal(pl.col(values).is_not_null())
    if not frame.select(logged.all()).item():
        frame = frame.filter(logged)  # rows holding only a table, or only the axes
    good = (
        pl.col("step").is_not_null()
        & (pl.col("step") == pl.col("step").round())
        & pl.col("step").is_between(0, MAX_STEP)
    )
    bad = frame.filter(~good).select("step")
    if bad.height:
        session.notes.append(
            f"{bad.height:,} history row(s) without a usable `{axis}` skipped"
            + (f" (e.g. {bad['step'][0]})" if bad["step"][0] is not None else "")
        )
        frame = frame.filter(good)
    frame = frame.with_columns(pl.col("step").cast(pl.Int64))
    if frame["step"].n_unique() < frame.height:
        frame = frame.group_by("step", maintain_order=True).agg(
            pl.col(c).drop_nulls().last() for c in values
        )
    non_numeric: Counter[str] = Counter()
    for log in logs:
        non_numeric.update(log.history.non_numeric)
    for key in [k for k in non_numeric if k in skip or k.startswith("_")]:
        del non_numeric[key]
    if non_numeric:
        keys = ", ".join(f"`{k}`" for k, _ in non_numeric.most_common(5))
        session.notes.append(
            f"{sum(non_numeric.values()):,} history value(s) that are not numbers dropped "
            f"(keys {keys}{' ...' if len(non_numeric) > 5 else ''})"
        )
    return frame if frame["step"].is_sorted() else frame.sort("step")


def _table_refs(logs: list[RunLog], history: pl.DataFrame, axis: str) -> list[tuple]:
    """(row, key, table file, step at that row) of every table logged, in log order."""
    refs: dict[tuple[int, int, str], dict[str, Any]] = {}
    offset = 0
    for index, log in enumerate(logs):
        for row, path, value in log.history.nested:
            if len(path) != 2:
                continue
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            refs.setdefault((index, row + offset, path[0]), {})[path[1]] = parsed
        offset += log.history.rows
    if not refs:
        return []
    steps = dict(history.select("_row", pl.col(axis)).iter_rows()) if axis in history else {}
    out = []
    for (index, row, key), fields in sorted(refs.items(), key=lambda kv: kv[0][1]):
        if str(fields.get("_type", "")).endswith("table-file") and fields.get("path"):
            folder = logs[index].path.parent / "files"
            out.append((row, key, folder / str(fields["path"]), steps.get(row)))
    return out


def _read_table(path: Path) -> pl.DataFrame:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        columns, data = doc["columns"], doc["data"]
        return pl.DataFrame(data, schema=[str(c) for c in columns], orient="row")
    except (OSError, ValueError, KeyError, TypeError, pl.exceptions.PolarsError) as exc:
        raise RlscopeError(f"{path}: not a readable W&B table file ({exc})") from None


def _tables(
    logs: list[RunLog], history: pl.DataFrame, axis: str, session: Session
) -> list[tuple[Path, pl.DataFrame, int | None]]:
    """TRL's completions tables (read, in log order), and a note per other table saying why it
    is not imported."""
    skipped: dict[str, str] = {}
    completions: list[tuple[Path, pl.DataFrame, int | None]] = []
    seen: set[Path] = set()
    for _, key, path, step in _table_refs(logs, history, axis):
        if path in seen:
            continue
        seen.add(path)
        if not path.is_file():
            skipped.setdefault(key, f"its file {path} is not there")
            continue
        frame = _read_table(path)
        columns = frame.columns
        if {"prompt", "completion"} <= set(columns):
            completions.append((path, frame, int(step) if step is not None else None))
        elif columns == ["global_step", "text", "reward"]:
            skipped[key] = (
                "OpenRLHF's samples table (global_step, text, reward): one decoded "
                "prompt+response a step, no group; one sample would stand in for the batch"
            )
        elif columns[:2] == ["step", "input_1"]:
            skipped[key] = (
                "verl's validation generations (one row per step, input_i/output_i/score_i "
                "side by side)"
            )
        else:
            skipped.setdefault(key, f"columns {', '.join(columns[:6])} are not rollouts")
    for key, why in skipped.items():
        session.notes.append(f"W&B table `{key}` not imported: {why}")
    return completions


def _trl_rollouts(
    tables: list[tuple[Path, pl.DataFrame, int | None]],
    steps: pl.DataFrame,
    session: Session,
    provenance: dict[str, str],
    config: dict[str, Any],
) -> None:
    """TRL's completions tables through the trl importer's own reading of a batch (its run.json
    provenance merged with this import's)."""
    opts, state = session.options, session.state()
    functions = [
        m.group(1) for c in steps.columns if (m := re.match(r"^train/rewards/(.+)/mean$", c))
    ]
    # At an evaluation, TRL's log() logs a second table for the step (eval mode: the eval
    # batch mixed with the end of the train batch, from the deques both share): the first
    # table of a step is the train batch.
    first: dict[int | None, tuple[Path, pl.DataFrame, int | None]] = {}
    later = 0
    for path, frame, step in tables:
        logged = frame["step"][0] if "step" in frame.columns and frame.height else None
        key = int(logged) if isinstance(logged, int) else step
        if key in first:
            later += 1
        else:
            first[key] = (path, frame, step)
    if later:
        session.notes.append(
            f"{later} later completions table(s) of a step already read left out (TRL logs a "
            "second one at an evaluation: the eval batch mixed with the end of the train batch)"
        )
    tables = list(first.values())
    info = trl_importer._Info(functions, set())
    if not opts["reward_weights"] and "reward_weights" not in state and functions:
        wanted = ["train/reward", *(f"train/rewards/{f}/mean" for f in functions)]
        if all(c in steps.columns for c in wanted):
            entries = [
                {k.removeprefix("train/"): v for k, v in row.items() if v is not None}
                for row in steps.select(wanted).iter_rows(named=True)
            ]
            inferred = trl_importer.infer_weights(entries, functions)
            if inferred is not None:
                state["reward_weights"] = inferred
    generations = opts["num_generations"] or state.get("num_generations")
    if generations is None and config.get("num_generations"):
        generations = int(config["num_generations"])
        session.notes.append(f"num_generations = {generations} (the W&B config)")
    if generations is None:
        sample = [f.select("prompt") for _, f, _ in tables]
        generations = trl_importer.generations_of(sample[: trl_importer.INFER_FILES])
        session.notes.append(
            f"num_generations = {generations} (inferred from runs of identical prompts)"
        )
    # GRPOConfig.scale_rewards (a bool before TRL 0.22), else detected from the advantages
    scale = config.get("scale_rewards")
    scale = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
    if not opts["scale_rewards"] and "scale_rewards" not in state and scale in SCALES:
        state["scale_rewards"], state["scale_source"] = scale, "the W&B config"
    state["num_generations"] = generations
    session.meta["group_size"] = generations

    def set_meta() -> None:
        if str(state.get("reward_source", "")).startswith("TRL's reward functions"):
            state["reward_source"] = "TRL's reward functions, W&B train/rewards/<name>/mean"
        trl_importer._set_meta(session)
        session.meta["provenance"] = {**provenance, **session.meta.get("provenance", {})}

    counts: Counter[str] = Counter()
    for done, (path, frame, step) in enumerate(tables, 1):
        status = session.read_status(path, done, len(tables), appendable=False)
        if status is None:
            continue
        n_steps = trl_importer._import_file(frame, step, path, status, session, info, counts)
        session.file_done(path, n_steps)
        set_meta()
        session.checkpoint()
    trl_importer._count_warnings(counts, session)
    if "reward_columns" in state:
        session.notes.append(
            "rollouts from TRL's completions table(s): reward = sum of "
            + ", ".join(f"`{c}`" for c in state["reward_columns"])
        )
    if "correct" in state:
        session.notes.append(trl_importer._correct_note(state["correct"]))
    set_meta()


def _eval_sets(
    history: pl.DataFrame, axis: str, session: Session, config: dict[str, Any]
) -> tuple[pl.DataFrame, dict[int, dict[str, float]]]:
    """A dict of eval sets logged by transformers' WandbCallback (a history row is a log call:
    trl_importer.eval_set_calls), with the 0/1 accuracy reward's mean as a set's accuracy."""
    evals = trl_importer.EvalSets.of_config(binary_accuracy_key(history), session, config)
    history = trl_importer.eval_set_calls(history, "eval/", axis, evals)
    session.notes += evals.notes()
    return history, evals.points.columns()


def _run_config(logs: list[RunLog]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for log in logs:
        config.update(log.config)
    return config


def _config(logs: list[RunLog], session: Session) -> dict[str, str]:
    """run.json fields from the W&B config (`wandb.init(config=...)`)."""
    return config_fields(_run_config(logs), session, "the W&B config")


WANDB = Importer(
    name="wandb",
    summary="W&B run files (run-<id>.wandb) -> steps; TRL completions tables -> rollouts",
    options=(
        *(
            o
            for o in trl_importer.TRL.options
            if o.name
            in (
                "ood_sets",
                "num_generations_eval",
                "reward_columns",
                "reward_weights",
                "extra_columns",
                "correct_column",
                "scale_rewards",
                "num_generations",
            )
        ),
        *ROLLOUT_OPTIONS,
        *COMMON_OPTIONS,
    ),
    tables=("rollouts", "steps"),
    default_algorithm="GRPO",
    run=import_wandb,
)
