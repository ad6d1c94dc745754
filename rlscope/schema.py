"""Run-directory format v1: tables, columns, types and run.json fields, in one place."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

SCHEMA_VERSION = 1
RUN_JSON = "run.json"


@dataclass(frozen=True)
class Column:
    """One column of a format-v1 table."""

    name: str
    dtype: pl.DataType
    required: bool
    doc: str


@dataclass(frozen=True)
class Table:
    """One format-v1 table: `<name>.parquet` or a folder `<name>/` of Parquet files."""

    name: str
    required: bool
    doc: str
    columns: tuple[Column, ...]

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)

    @property
    def required_columns(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.required)


def _c(name: str, dtype: pl.DataType, required: bool, doc: str) -> Column:
    return Column(name, dtype, required, doc)


_F64, _F32, _I64, _I32 = pl.Float64(), pl.Float32(), pl.Int64(), pl.Int32()
_STR, _BOOL = pl.String(), pl.Boolean()

TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        Table(
            "steps",
            False,
            "One row per optimizer step, as logged by the trainer.",
            (
                _c("step", _I64, True, "optimizer step"),
                _c("loss", _F64, False, "policy loss"),
                _c("grad_norm", _F64, False, "gradient norm before clipping"),
                _c("lr", _F64, False, "learning rate"),
                _c("kl", _F64, False, "KL to the reference policy, as logged"),
                _c("clip_frac", _F64, False, "PPO clip fraction, as logged"),
                _c("entropy", _F64, False, "mean token entropy, as logged"),
                _c("value_loss", _F64, False, "the critic's value loss, as logged"),
                _c("value_clip_frac", _F64, False, "share of value predictions clipped, as logged"),
                _c(
                    "explained_variance",
                    _F64,
                    False,
                    "critic explained variance 1 - Var(return - value)/Var(return), as logged",
                ),
                _c("kl_coef", _F64, False, "the KL penalty coefficient in use (β), as logged"),
                _c(
                    "response_len",
                    _F64,
                    False,
                    "mean response length in tokens, as logged (e.g. verl response_length/mean)",
                ),
                _c(
                    "truncation_rate",
                    _F64,
                    False,
                    "share of responses that hit the length cap, as logged (e.g. verl "
                    "response_length/clip_ratio)",
                ),
                _c("reward", _F64, False, "mean sequence reward, as logged"),
                _c(
                    "correct_rate",
                    _F64,
                    False,
                    "share of the step's train responses that are correct, as logged (e.g. "
                    "TRL's rewards/<accuracy>/mean of a 0/1 accuracy reward): pass@1 without "
                    "a rollouts table",
                ),
                _c(
                    "correct_rate_std",
                    _F64,
                    False,
                    "the standard deviation (n − 1) of the 0/1 correctness behind correct_rate, "
                    "as logged: it gives the responses counted, n = r / (r − 1) with "
                    "r = std² / (p(1 − p))",
                ),
            ),
        ),
        Table(
            "rollouts",
            True,
            "One row per generated response (sequence). Required, except in a run whose "
            "trainer logged step metrics only: a steps table and no rollouts table (rlscope "
            "then computes what the steps table holds and skips the rest, saying why).",
            (
                _c("rollout_id", _I64, True, "unique in the run"),
                _c("step", _I64, True, "policy step that generated it (eval: checkpoint step)"),
                _c("prompt_id", _STR, True, "same (step, prompt_id) = one group"),
                _c("split", _STR, False, "`train` (default), `eval_id`, `eval_ood`, any `eval_*`"),
                _c("reward", _F64, True, "sequence reward"),
                _c("correct", _BOOL, False, "task success; absent: reward >= correct_threshold"),
                _c("response_len", _I32, True, "generated tokens"),
                _c("truncated", _BOOL, False, "hit the length cap"),
                _c("answer", _STR, False, "extracted final answer"),
                _c("response", _STR, False, "full generated text with its tags"),
                _c(
                    "prompt",
                    _STR,
                    False,
                    "the prompt exactly as the policy saw it (chat template applied): what "
                    "`rlscope probe` continues",
                ),
                _c(
                    "messages",
                    _STR,
                    False,
                    "the chat messages (JSON list of {role, content}) before the response, "
                    "when the prompt is kept as messages",
                ),
                _c("n_tool_calls", _I32, False, "tool calls made"),
                _c("tool_calls", pl.List(_STR), False, "each call's serialized arguments"),
                _c("actions", pl.List(_STR), False, "agent action sequence"),
                _c("advantage", _F64, False, "sequence advantage used in the update"),
                _c("steps_checked", _I32, False, "intermediate steps checked by a verifier"),
                _c("steps_verified", _I32, False, "of those, steps found correct"),
            ),
        ),
        Table(
            "tokens",
            False,
            "One row per generated token of a train rollout.",
            (
                _c("rollout_id", _I64, True, "the rollout this token belongs to"),
                _c("step", _I64, True, "policy step"),
                _c("pos", _I32, True, "0-based position in the response"),
                _c("logprob", _F32, False, "log-probability under the current policy"),
                _c("old_logprob", _F32, False, "log-probability under the behaviour policy"),
                _c(
                    "rollout_logprob",
                    _F32,
                    False,
                    "log-probability the sampling engine (vLLM, SGLang) gave the token",
                ),
                _c("ref_logprob", _F32, False, "log-probability under the reference policy"),
                _c("entropy", _F32, False, "full-vocabulary entropy, nats"),
                _c("value", _F32, False, "the critic's value estimate at this position (PPO)"),
                _c("return", _F32, False, "the critic's regression target at this position"),
                _c("advantage", _F32, False, "token advantage"),
                _c("clipped", _BOOL, False, "PPO clip active"),
                _c(
                    "segment",
                    pl.Categorical(),
                    False,
                    "think/answer/tool_call/tool_response/text; a tag's tokens belong to the "
                    "segment the tag opens or closes",
                ),
            ),
        ),
        Table(
            "probes",
            False,
            "Faithfulness probes: a rollout re-answered after an intervention on its CoT.",
            (
                _c("rollout_id", _I64, True, "the probed rollout"),
                _c("intervention", _STR, True, "truncate, mistake, paraphrase, filler or custom"),
                _c("fraction", _F64, False, "share of the CoT kept, or where the change was made"),
                _c("answer", _STR, True, "final answer after the intervention"),
                _c("hint", _STR, False, "bias probes: the answer the biasing cue pointed to"),
                _c("response", _STR, False, "the probe's generated text"),
                _c("model", _STR, False, "the model that answered the probe (as served)"),
                _c("checkpoint_step", _I64, False, "the training step of that model's weights"),
                _c("prompt_tokens", _I64, False, "tokens sent for the probe (server's count)"),
                _c("completion_tokens", _I64, False, "tokens generated for it"),
            ),
        ),
    )
}


@dataclass(frozen=True)
class MetaField:
    """One field of run.json."""

    name: str
    json_type: str
    required: bool
    doc: str


RUN_FIELDS: tuple[MetaField, ...] = (
    MetaField("schema_version", "integer", True, "format version, 1"),
    MetaField("run_id", "string", True, "name of the run"),
    MetaField("algorithm", "string", True, "free text, e.g. GRPO, PPO, GiGPO"),
    MetaField("group_size", "integer", False, "rollouts per prompt (N)"),
    MetaField("max_tool_calls", "integer", False, "tool-call cap per rollout"),
    MetaField("clip_ratio_low", "number", False, "PPO epsilon_low (default 0.2)"),
    MetaField("clip_ratio_high", "number", False, "PPO epsilon_high (default clip_ratio_low)"),
    MetaField("max_response_len", "integer", False, "generation length cap in tokens"),
    MetaField(
        "reward_weights",
        "object",
        False,
        "weight of each reward column in `reward` (reward = Σ weight · column; TRL "
        "`reward_weights`); absent: 1 each",
    ),
    MetaField(
        "scale_rewards",
        "string",
        False,
        "how the trainer scaled each group's centred rewards into advantages: `group` (by the "
        "group's std, GRPO), `batch` (the batch's std) or `none` (Dr. GRPO); TRL `scale_rewards`",
    ),
    MetaField(
        "max_grad_norm",
        "number",
        False,
        "the trainer's gradient-norm clip (TRL `max_grad_norm`, verl `grad_clip`)",
    ),
    MetaField("correct_threshold", "number", False, "reward >= this counts as correct"),
    MetaField(
        "correct_source",
        "string",
        False,
        "how rollouts.correct was derived, set by the writer (e.g. `accuracy_reward > 0`); when "
        "set, rlscope never fills a missing or null `correct` from reward",
    ),
    MetaField(
        "correct_unknown",
        "string",
        False,
        "why correctness is unknown (e.g. several reward functions, none accuracy-like); when "
        "set, `correct` is not derived from reward and metrics needing it are skipped",
    ),
    MetaField(
        "reward_components",
        "array",
        False,
        "rollouts columns each holding one reward function's per-rollout value (unweighted)",
    ),
    MetaField(
        "response_len_unit",
        "string",
        False,
        "unit of rollouts.response_len: `tokens` or `words` (whitespace-separated)",
    ),
    MetaField(
        "provenance",
        "object",
        False,
        "how the importer derived fields: {topic: one sentence}, e.g. correct, reward",
    ),
)

_JSON_TYPES: dict[object, str] = {
    pl.Int64: "int64",
    pl.Int32: "int32",
    pl.Float64: "float64",
    pl.Float32: "float32",
    pl.String: "string",
    pl.Boolean: "bool",
    pl.Categorical: "string (dictionary)",
}


def type_name(dtype: object) -> str:
    """The format's name for a column type (`int64`, `list<string>`, ...)."""
    if isinstance(dtype, pl.List):
        return f"list<{type_name(dtype.inner)}>"
    return _JSON_TYPES.get(type(dtype), str(dtype))


def to_json_schema() -> dict[str, Any]:
    """The machine-readable description of format v1 stored in `schemas/run-format-v1.json`."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "rlscope run directory, format v1",
        "schema_version": SCHEMA_VERSION,
        "run_json": {
            "type": "object",
            "required": [f.name for f in RUN_FIELDS if f.required],
            "properties": {
                f.name: {"type": f.json_type, "description": f.doc}
                | ({"const": SCHEMA_VERSION} if f.name == "schema_version" else {})
                for f in RUN_FIELDS
            },
            "additionalProperties": True,
        },
        "tables": {
            t.name: {
                "required": t.required,
                "description": t.doc,
                "layout": [f"{t.name}.parquet", f"{t.name}/**/*.parquet"],
                "columns": {
                    c.name: {
                        "type": type_name(c.dtype),
                        "required": c.required,
                        "description": c.doc,
                    }
                    for c in t.columns
                },
                "extra_columns": "carried through",
            }
            for t in TABLES.values()
        },
    }


def schema_file() -> Path:
    return Path(__file__).resolve().parent.parent / "schemas" / "run-format-v1.json"


def render_json_schema() -> str:
    return json.dumps(to_json_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    schema_file().write_text(render_json_schema())
