"""Generic JSON-lines importer: a column mapping from source keys to format-v1 names."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from rlscope.errors import RlscopeError
from rlscope.importers._common import (
    correct_from_reward,
    correct_rule,
    keep_new_steps,
    rename_reserved,
)
from rlscope.importers._jsonl import LINE, Field, read_jsonl
from rlscope.importers.options import COMMON_OPTIONS, ROLLOUT_OPTIONS, SPLIT_OPTION, Option
from rlscope.importers.session import Importer, Session
from rlscope.importers.text import ASSISTANT, WORDS_NOTE, answer_expr, prompt_ids, word_count_expr

#: Format-v1 rollouts columns (and `prompt`, hashed into prompt_id) a mapping may name.
KINDS = {
    "rollout_id": "int",
    "step": "int",
    "prompt_id": "id",
    "prompt": "text",
    "split": "str",
    "reward": "num",
    "correct": "flag",
    "response_len": "num",
    "truncated": "bool",
    "answer": "id",
    "response": "text",
    "n_tool_calls": "int",
    "tool_calls": "strlist",
    "actions": "strlist",
    "advantage": "num",
}
_PASSTHROUGH = ("truncated", "n_tool_calls", "tool_calls", "actions", "advantage")


def _check_mapping(mapping: dict[str, str]) -> str | None:
    unknown = sorted(set(mapping) - set(KINDS))
    if unknown:
        return f"unknown format-v1 name(s) {', '.join(unknown)}; known: {', '.join(KINDS)}"
    keys = list(mapping.values())
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        return f"source key(s) {', '.join(twice)} mapped twice"
    return None


def _fields(mapping: dict[str, str]) -> dict[str, Field]:
    """format-v1 name -> the source field read for it: the mapped key, else a key of the same
    name (unless that key is mapped to another name; rollout_id only when mapped)."""
    used = set(mapping.values())
    out = {}
    for name, kind in KINDS.items():
        identity = name if name not in used and name != "rollout_id" else None
        key = mapping.get(name) or identity
        if key is None:
            continue
        required = name in ("step", "reward") or (name == "rollout_id" and name in mapping)
        out[name] = Field(key, kind, required, ASSISTANT if name == "response" else None)
    return out


def import_jsonl(session: Session) -> None:
    """Generic JSON lines: one file, or a folder of *.jsonl (read in name order, one chunk of
    lines at a time), one rollout per line.

    `mapping` names the source key of each format-v1 rollouts column, e.g.
    mapping={"prompt_id": "uid", "reward": "score", "step": "iteration"}
    (on the command line `prompt_id=uid,reward=score,step=iteration`). A format-v1 name that
    is not mapped is read from a key of the same name when there is one. Required:
      step          (integer) groups rows into steps
      reward        (number)
      prompt_id     (string or number), or `prompt` (text or chat messages): prompt_id =
                    blake2b-8 hex of the prompt text, which is kept as column `prompt`
      response_len  (number, rounded), or `response`: whitespace-separated words of the
                    response (exact for word-level tokenizers, an underestimate for BPE)
    Optional: rollout_id (integer, used only when mapped, even as `rollout_id=rollout_id`;
    default split namespace * 10^15 + step * 10^6 + order of the row within its step),
    split (per row; default the `split` option), correct (bool, or a number > 0.5; default
    reward > 0, or reward >= correct_threshold), answer (default: extracted from `response`:
    the last <answer>...</answer>, else the last \\boxed{...}), truncated, n_tool_calls,
    tool_calls, actions, advantage. Every other key is an extra
    column (numbers float64, strings as they are, nested values JSON text; a key named like a
    format-v1 column is kept as `raw_<key>`).

    Malformed lines (bad JSON, not an object, step or reward missing, a mapped field of the
    wrong type) are skipped and counted with file:line examples; `strict=true` stops at the
    first. Incremental: a re-run reads new and grown files and adds rows of steps after the
    last imported step; a step is imported once, so import a live log after its step ends."""
    opts = session.options
    source = session.source
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*.jsonl"))
    files = [p for p in files if p.is_file() and not p.name.startswith(".")]
    if not files:
        raise RlscopeError(f"{source}: no *.jsonl files")
    fields = _fields(opts["mapping"])
    if "prompt_id" not in fields and "prompt" not in fields:
        raise RlscopeError("jsonl: map `prompt_id` (or `prompt`, hashed into prompt_id)")
    describe = ", ".join(f"{n} <- `{f.key}`" for n, f in fields.items() if f.key != n)
    if describe:
        session.notes.append(f"mapping: {describe}")
    counters: dict[int, int] = {}
    for done, path in enumerate(files, 1):
        status = session.read_status(path, done, len(files))
        if status is None:
            continue
        steps: set[int] = set()
        valid = 0
        skipped_before = dict(session.skips.counts)
        for chunk in read_jsonl(path, list(fields.values()), session.skips, session.warnings):
            frame = _rename(chunk, fields, session)
            steps |= set(frame["step"].to_list())
            # A grown file holds steps imported before: expected, no warning.
            seen = status if status == "new" else ""
            frame = keep_new_steps(frame, path, session, seen, this_call=False)
            frame = _rollouts(frame, path, fields, counters, session)
            valid += frame.height
            session.add_rollouts(frame)
            session.checkpoint()
        if not valid and not steps:
            reasons = sorted(
                r for r, n in session.skips.counts.items() if n > skipped_before.get(r, 0)
            )
            if reasons and all(r.startswith("missing") for r in reasons):
                raise RlscopeError(
                    f"{path}: no line has the fields the mapping names ({'; '.join(reasons)})",
                    hint=f"mapping: {describe or 'none (format-v1 names)'}; map each required "
                    "field: mapping=step=<key>,reward=<key>,prompt_id=<key>",
                )
            session.warnings.append(f"{path}: no valid line")
        session.file_done(path, len(steps))
        session.checkpoint()
        session.tick(done, len(files))


def _rename(frame: pl.DataFrame, fields: dict[str, Field], session: Session) -> pl.DataFrame:
    keys = {f.key for f in fields.values()}
    extras = [c for c in frame.columns if c not in keys and c != LINE]
    frame, _ = rename_reserved(frame, extras, session, "source")
    return frame.rename({f.key: name for name, f in fields.items() if f.key != name})


def _require_one(
    frame: pl.DataFrame, names: tuple[str, str], path: Path, session: Session
) -> pl.DataFrame:
    present = [n for n in names if n in frame.columns]
    missing = pl.all_horizontal(pl.col(present).is_null()) if present else pl.lit(True)
    bad = frame.filter(missing)
    for line in bad[LINE].to_list():
        session.skips.add(path, line, f"missing `{names[0]}` (or `{names[1]}`)")
    return frame.filter(~missing)


def _rollouts(
    frame: pl.DataFrame,
    path: Path,
    fields: dict[str, Field],
    counters: dict[int, int],
    session: Session,
) -> pl.DataFrame:
    opts = session.options
    frame = _require_one(frame, ("prompt_id", "prompt"), path, session)
    frame = _require_one(frame, ("response_len", "response"), path, session)
    if "split" in frame.columns:
        split = pl.col("split").fill_null(opts["split"])
        bad = frame.filter(~(split == "train") & ~split.str.starts_with("eval_"))
        for line, value in bad.select(LINE, "split").iter_rows():
            session.skips.add(path, line, "bad split", f"{value!r}, expected train or eval_*")
        frame = frame.filter((split == "train") | split.str.starts_with("eval_"))
        frame = frame.with_columns(split.alias("split"))
    else:
        frame = frame.with_columns(pl.lit(opts["split"]).alias("split"))
    if not frame.height:
        return frame
    has = set(frame.columns)
    hashed = prompt_ids(frame["prompt"]) if "prompt" in has else None
    if "prompt_id" in has:
        prompt_id = pl.col("prompt_id") if hashed is None else pl.coalesce("prompt_id", hashed)
    else:
        prompt_id = pl.lit(hashed)
    words = word_count_expr(pl.col("response")) if "response" in has else None
    if "response_len" in has:
        length = pl.col("response_len").round().cast(pl.Int32)
        length = length if words is None else pl.coalesce(length, words)
    else:
        assert words is not None  # _require_one kept only rows with a length or a response
        length = words
        session.notes.append(WORDS_NOTE)
    reward_rule = correct_from_reward(pl.col("reward"), opts["correct_threshold"])
    correct = pl.coalesce("correct", reward_rule) if "correct" in has else reward_rule
    if "correct" not in has or frame["correct"].null_count():
        session.notes.append(f"correct = {correct_rule(opts['correct_threshold'])} (no `correct`)")
    answer = pl.col("answer") if "answer" in has else pl.lit(None, pl.String)
    if "response" in has:
        answer = pl.coalesce(answer, answer_expr(pl.col("response")))
    frame = frame.sort(LINE).with_columns(
        prompt_id.alias("prompt_id"),
        length.alias("response_len"),
        correct.alias("correct"),
        answer.alias("answer"),
    )
    if "rollout_id" not in fields:
        frame = _generate_ids(frame, counters, session)
    own = {*KINDS, LINE}
    extras = [c for c in frame.columns if c not in own]
    keep = [c for c in ("prompt", "response", *_PASSTHROUGH) if c in has]
    keep = [c for c in keep if frame[c].null_count() < frame.height]
    return frame.select(
        "rollout_id",
        "step",
        "prompt_id",
        "split",
        pl.col("reward").cast(pl.Float64),
        "correct",
        "response_len",
        "answer",
        *keep,
        *extras,
    )


def _generate_ids(frame: pl.DataFrame, counters: dict[int, int], session: Session) -> pl.DataFrame:
    """Index within the step continuing across chunks and files of this import."""
    frame = frame.with_columns(pl.int_range(pl.len(), dtype=pl.Int64).over("step").alias("_index"))
    offsets = {s: counters.get(s, 0) for s in frame["step"].unique().to_list()}
    frame = frame.with_columns(
        pl.col("_index") + pl.col("step").replace_strict(offsets, return_dtype=pl.Int64)
    )
    for step, n in frame.group_by("step").len().iter_rows():
        counters[step] = counters.get(step, 0) + n
    return frame.with_columns(session.rollout_ids(frame, "_index")).drop("_index")


JSONL = Importer(
    name="jsonl",
    summary="generic JSON lines with a mapping of source keys to format-v1 names",
    options=(
        Option(
            "mapping",
            "dict[str,str]",
            {},
            "format-v1 name -> source key, e.g. prompt_id=uid,reward=score,step=iteration",
            choices=_check_mapping,
        ),
        SPLIT_OPTION,
        *ROLLOUT_OPTIONS,
        *COMMON_OPTIONS,
    ),
    tables=("rollouts",),
    default_algorithm="unknown",
    run=import_jsonl,
)
