"""verl importers: rollout dumps (`<step>.jsonl`, verl-agent too) and the file logger's metrics."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.importers._base import (
    COMMON_OPTIONS,
    ROLLOUT_OPTIONS,
    SPLIT_OPTION,
    Importer,
    Option,
    Session,
    numbered,
)
from rlscope.importers._common import (
    StepRows,
    correct_from_reward,
    correct_rule,
    index_within_step,
    keep_new_steps,
    rename_reserved,
)
from rlscope.importers._jsonl import CHUNK_LINES, LINE, Field, chunks, read_jsonl
from rlscope.importers.text import ASSISTANT, WORDS_NOTE, answer_expr, prompt_ids, word_count_expr

TRAJECTORY_KEYS = ("traj_uid", "trajectory_id")
LENGTH_KEYS = ("response_length", "response_len")
_CONSUMED = ("input", "output", "score", "step", "acc", "pred", *LENGTH_KEYS)


def _files(source: Path, pattern: str = "*.jsonl") -> list[tuple[int | None, Path]]:
    if source.is_file():
        return numbered([source], lambda p: p.stem)
    files = [p for p in source.glob(pattern) if p.is_file() and not p.name.startswith(".")]
    return numbered(files, lambda p: p.stem)


def import_verl(session: Session) -> None:
    """verl rollout dumps: a folder of `<step>.jsonl` files, one JSON object a line, as written
    by `trainer.rollout_data_dir` (train) or `trainer.validation_data_dir` (validation; import
    it with `split=eval_id` or `eval_ood`). A single `.jsonl` file works too.

    Fields read (verl's names) -> format v1:
      step      `step`, else the file name `<step>.jsonl`
      prompt_id blake2b-8 hex of `input`: rollouts of one step with identical `input` are one
                group (verl writes no prompt uid); the text is kept as column `prompt`
      response  `output`;  reward = `score`
      correct   `acc` when present (a bool, or a number: acc > 0.5), else score > 0
                (score >= correct_threshold with that option)
      answer    `pred` when present, else extracted from `output`: the last
                <answer>...</answer>, else the last \\boxed{...}, else null
      response_len  `response_length` / `response_len` when present, else the number of
                whitespace-separated words of `output` (exact for word-level tokenizers, an
                underestimate for BPE ones)
      every other key (`gts`, `reward`, any reward-extra key): an extra column, numbers as
      float64, strings as they are, nested values as JSON text; a key named like a format-v1
      column (e.g. validation's `reward`) is kept as `raw_<key>`.
    rollout_id = split namespace * 10^15 + step * 10^6 + line order within the step.

    verl-agent dumps (one row per environment step) are folded into trajectories when a
    trajectory key is present (option `trajectory_key`, else `traj_uid` or `trajectory_id`):
    one rollout per (step, trajectory) in order of first appearance; actions = the outputs in
    line order, response = the outputs joined with "\\n", reward = sum of `score`,
    response_len = sum of the rows' lengths, prompt = the first row's `input`, correct and
    answer from the last row's `acc` / `pred` (else the rules above on the summed reward and
    the last output), other keys: the last non-null value; `n_env_steps` = rows folded.

    Malformed lines (bad JSON, not an object, `input`/`output`/`score` missing, a field of the
    wrong type, no step) are skipped and counted with file:line examples; `strict=true` stops
    at the first with an error naming file and line. Files are read one at a time.
    Incremental: re-running on a grown folder imports only new step files; a step already
    imported is never re-imported (a changed file is a warning)."""
    opts = session.options
    files = _files(session.source)
    if not files:
        raise RlscopeError(
            f"{session.source}: no *.jsonl files",
            hint="pass verl's trainer.rollout_data_dir (files named <step>.jsonl)",
        )
    state = session.state()
    fields = [
        Field("input", "text", True),
        Field("output", "text", True, ASSISTANT),
        Field("score", "num", True),
        Field("step", "int"),
        Field("acc", "flag"),
        Field("pred", "id"),
        *(Field(k, "num") for k in LENGTH_KEYS),
    ]
    candidates = [opts["trajectory_key"]] if opts["trajectory_key"] else list(TRAJECTORY_KEYS)
    fields += [Field(k, "id") for k in candidates]
    for done, (file_step, path) in enumerate(files, 1):
        status = session.read_status(path, done, len(files))
        if status is None:
            continue
        chunks = list(read_jsonl(path, fields, session.skips, session.warnings))
        frame = pl.concat(chunks, how="diagonal_relaxed") if chunks else pl.DataFrame()
        n_steps = 0
        if frame.height:
            frame = _with_step(frame, file_step, path, session)
            n_steps = frame["step"].n_unique()
            frame = keep_new_steps(frame, path, session, status)
        if frame.height:
            key = state.get("trajectory_key")
            if key is None:
                key = next((k for k in candidates if frame[k].null_count() < frame.height), "")
                state["trajectory_key"] = key
                if key:
                    session.notes.append(f"verl-agent rows folded into trajectories by `{key}`")
            session.add_rollouts(_rollouts(frame, key or None, candidates, session))
        session.file_done(path, n_steps)
        session.checkpoint()
        session.tick(done, len(files))


def _with_step(
    frame: pl.DataFrame, file_step: int | None, path: Path, session: Session
) -> pl.DataFrame:
    if file_step is not None:
        return frame.with_columns(pl.col("step").fill_null(file_step))
    missing = frame.filter(pl.col("step").is_null())
    for line in missing[LINE].to_list():
        session.skips.add(path, line, "missing `step`", "and the file name is not <step>.jsonl")
    return frame.filter(pl.col("step").is_not_null())


def _rollouts(
    frame: pl.DataFrame, key: str | None, candidates: list[str], session: Session
) -> pl.DataFrame:
    opts = session.options
    threshold = opts["correct_threshold"]
    has_length = any(frame[k].null_count() < frame.height for k in LENGTH_KEYS)
    length = pl.coalesce(*(pl.col(k) for k in LENGTH_KEYS)).round().cast(pl.Int32)
    frame = frame.with_columns(pl.coalesce(length, word_count_expr(pl.col("output"))).alias("_len"))
    session.notes.append(
        "response_len from `response_length`/`response_len`"
        + (", words where a row has neither" if frame["_len"].null_count() else "")
        if has_length
        else WORDS_NOTE
    )
    if frame["acc"].null_count() < frame.height:
        session.notes.append("correct from `acc` (bool, or acc > 0.5)")
    if frame["acc"].null_count():
        session.notes.append(f"correct = {correct_rule(threshold, 'score')} (no `acc`)")
    if frame["pred"].null_count() < frame.height:
        session.notes.append("answer from `pred`")
    if frame["pred"].null_count():
        session.notes.append("answer extracted from `output` (<answer>, else \\boxed{})")
    extras = [c for c in frame.columns if c not in (*_CONSUMED, LINE, "_len", *candidates)]
    frame, extras = rename_reserved(frame, extras, session, "verl")
    if key is None:
        frame = index_within_step(frame)
        out = frame.select(
            "step",
            prompt_ids(frame["input"]),
            pl.col("input").alias("prompt"),
            pl.col("score").alias("reward"),
            pl.coalesce("acc", correct_from_reward(pl.col("score"), threshold)).alias("correct"),
            pl.col("_len").alias("response_len"),
            pl.coalesce("pred", answer_expr(pl.col("output"))).alias("answer"),
            pl.col("output").alias("response"),
            "_index",
            *extras,
        )
    else:
        out = _fold(frame, key, extras, threshold)
    out = out.with_columns(pl.lit(opts["split"]).alias("split"))
    return out.with_columns(session.rollout_ids(out, "_index")).drop("_index")


def _fold(
    frame: pl.DataFrame, key: str, extras: list[str], threshold: float | None
) -> pl.DataFrame:
    frame = frame.sort(LINE).with_columns(
        pl.coalesce(pl.col(key), pl.lit("_line") + pl.col(LINE).cast(pl.String)).alias("_traj")
    )
    folded = frame.group_by("step", "_traj", maintain_order=True).agg(
        pl.col("input").first().alias("prompt"),
        pl.col("output").alias("actions"),
        pl.col("output").str.join("\n").alias("response"),
        pl.col("output").last().alias("_last_output"),
        pl.col("score").sum().alias("reward"),
        pl.col("_len").sum().cast(pl.Int32).alias("response_len"),
        pl.col("acc").drop_nulls().last().alias("_acc"),
        pl.col("pred").drop_nulls().last().alias("_pred"),
        pl.col(LINE).first().alias(LINE),
        pl.len().cast(pl.Int32).alias("n_env_steps"),
        pl.col(key).first().alias(key),
        *(pl.col(c).drop_nulls().last().alias(c) for c in extras),
    )
    folded = index_within_step(folded)
    return folded.select(
        "step",
        prompt_ids(folded["prompt"]),
        "prompt",
        "reward",
        pl.coalesce("_acc", correct_from_reward(pl.col("reward"), threshold)).alias("correct"),
        "response_len",
        pl.coalesce("_pred", answer_expr(pl.col("_last_output"))).alias("answer"),
        "response",
        "actions",
        "n_env_steps",
        key,
        "_index",
        *extras,
    )


# --- verl-metrics -------------------------------------------------------------------------

METRIC_NAMES = {
    "actor/grad_norm": "grad_norm",
    "actor/entropy": "entropy",
    "actor/pg_clipfrac": "clip_frac",
    "actor/kl_loss": "kl",
    "actor/pg_loss": "loss",
    "actor/lr": "lr",
}


def import_verl_metrics(session: Session) -> None:
    """verl's file logger (`trainer.logger=[file]`): JSON lines `{"step": N, "data": {...}}`,
    one file (or a folder of *.jsonl) -> the steps table only.

    Mapping: actor/grad_norm -> grad_norm, actor/entropy -> entropy, actor/pg_clipfrac ->
    clip_frac, actor/kl_loss -> kl, actor/pg_loss -> loss, actor/lr -> lr. Every other
    numeric key is an extra column under its own name (`actor/ppo_kl`, `critic/score/mean`,
    `response_length/mean`, `response_length/clip_ratio`, ...; rlscope compares the ones it
    recomputes with them). Non-numeric values (strings, lists, booleans) are dropped and
    counted in the notes. Several lines of one step (a resumed run) merge, later keys winning.

    Combine it with the `verl` importer into one OUT: run.json is kept (the later import only
    adds fields it lacks, e.g. group_size) and import.json keeps one entry per format.
    Malformed lines (bad JSON, no integer `step`, `data` not an object) are skipped and
    counted; `strict=true` stops at the first. A log that grew is read again and only steps
    after the last imported one are added."""
    files = _files(session.source)
    if not files:
        raise RlscopeError(f"{session.source}: no *.jsonl metrics file")
    for done, (_, path) in enumerate(files, 1):
        status = session.read_status(path, done, len(files))
        if status is None:
            continue
        rows = StepRows(METRIC_NAMES)
        steps: set[int] = set()
        for step, data in _metric_records(path, session):
            steps.add(step)
            if session.already("steps", step, this_call=False):
                session.skip_step("steps", step)
                continue
            rows.add(step, data)
        rows.note(session, str(path))
        session.add_steps(rows.sorted_rows())
        session.file_done(path, len(steps))
        session.checkpoint()
        session.tick(done, len(files))


def _metric_records(path: Path, session: Session):
    """(step, data) per valid line: Polars per chunk when every value is numeric, else
    line by line (which also finds the malformed lines)."""
    for numbers, lines, partial in chunks(path, CHUNK_LINES):
        fast = _metric_fast(lines)
        if fast is not None:
            yield from fast
            continue
        for i, (number, line) in enumerate(zip(numbers, lines, strict=True)):
            try:
                obj = json.loads(line)
            except ValueError as exc:
                if partial and i == len(lines) - 1:
                    session.warnings.append(f"{path}:{number}: incomplete last line, not read")
                    continue
                session.skips.add(path, number, "bad JSON", str(exc).split(":")[0])
                continue
            if not isinstance(obj, dict):
                session.skips.add(path, number, "not a JSON object")
                continue
            step, data = obj.get("step"), obj.get("data")
            if isinstance(step, float) and step.is_integer():
                step = int(step)
            if step is None:
                session.skips.add(path, number, "missing `step`")
            elif isinstance(step, bool) or not isinstance(step, int):
                session.skips.add(path, number, "wrong type for `step`", type(step).__name__)
            elif data is None:
                session.skips.add(path, number, "missing `data`")
            elif not isinstance(data, dict):
                session.skips.add(path, number, "wrong type for `data`", type(data).__name__)
            else:
                yield step, data


def _metric_fast(lines: list[bytes]) -> list[tuple[int, dict[str, Any]]] | None:
    try:
        raw = pl.read_ndjson(io.BytesIO(b"\n".join(lines)), infer_schema_length=None)
    except Exception:
        return None
    if raw.height != len(lines) or "step" not in raw.columns or "data" not in raw.columns:
        return None
    if not raw.schema["step"].is_integer() or not isinstance(raw.schema["data"], pl.Struct):
        return None
    if raw["step"].null_count() or raw["data"].null_count():
        return None
    data = raw["data"].struct.unnest()
    if not all(d.is_numeric() or isinstance(d, pl.Null) for d in data.schema.values()):
        return None
    records = []
    for step, row in zip(raw["step"].to_list(), data.iter_rows(named=True), strict=True):
        records.append((step, {k: v for k, v in row.items() if v is not None}))
    return records


VERL = Importer(
    name="verl",
    summary="verl rollout dumps: <step>.jsonl files (trainer.rollout_data_dir), verl-agent too",
    options=(
        SPLIT_OPTION,
        Option(
            "trajectory_key",
            "str",
            None,
            "key of verl-agent rows naming their trajectory (default: traj_uid or "
            "trajectory_id when present)",
        ),
        *ROLLOUT_OPTIONS,
        *COMMON_OPTIONS,
    ),
    tables=("rollouts",),
    default_algorithm="GRPO",
    run=import_verl,
)

VERL_METRICS = Importer(
    name="verl-metrics",
    summary="verl file-logger metrics JSONL ({step, data}) -> steps table",
    options=COMMON_OPTIONS,
    tables=("steps",),
    default_algorithm="GRPO",
    run=import_verl_metrics,
)
