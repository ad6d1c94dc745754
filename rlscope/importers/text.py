"""Text rules shared by every importer: prompt ids, answer extraction, lengths, chat messages."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import polars as pl

from rlscope.text import answer_line

#: How `response_len` is estimated when the source has no length field.
WORDS_NOTE = (
    "response_len estimated as whitespace-separated words (no length field in the source): "
    "exact for word-level tokenizers, an underestimate for BPE tokenizers (~0.75 words a token)"
)

#: The chat-message roles whose contents make a completion's text.
ASSISTANT = ("assistant",)


#: Joins a prompt's id and the number of its group when one batch holds the prompt twice
#: (`<hash>#2` is its second group in the step): every importer and integration uses it.
REPEAT_SEPARATOR = "#"


def prompt_id(text: str, repeat: int = 0) -> str:
    """Stable prompt id: blake2b (8 bytes) of the prompt's UTF-8 text, in hex; the `repeat`-th
    further group of the same prompt in one step (0 = the first) gets `#<repeat + 1>`."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()
    return digest if repeat == 0 else f"{digest}{REPEAT_SEPARATOR}{repeat + 1}"


def prompt_ids(texts: pl.Series) -> pl.Series:
    """`prompt_id` of every value, hashing each distinct prompt once (null stays null)."""
    unique = texts.drop_nulls().unique()
    mapping = {t: prompt_id(t) for t in unique.to_list()}
    return texts.replace_strict(mapping, default=None, return_dtype=pl.String).alias("prompt_id")


def _nested(depth: int) -> str:
    """Regex for text with balanced braces nested at most `depth` deep."""
    inner = r"[^{}]*"
    for _ in range(depth):
        inner = r"(?:[^{}]|\{" + inner + r"\})*"
    return inner


#: Deepest brace nesting inside `\boxed{...}` recognised (`\frac{\sqrt{a^{2}}}{2}` is 3).
BOXED_MAX_DEPTH = 6
_BOXED = r"\\boxed\s*\{(" + _nested(BOXED_MAX_DEPTH) + r")\}"
_ANSWER = r"(?s)<answer>(.*?)</answer>"


def answer_expr(text: pl.Expr, pattern: str | None = None) -> pl.Expr:
    """The final answer: the last `<answer>…</answer>` content if present, else the content of
    the last `\\boxed{…}` (braces nested up to BOXED_MAX_DEPTH deep), else the last untagged
    final-answer line (`Answer: X` as DAPO / R1 and verl's math_dapo, `#### N` as GSM8K),
    else null; with `pattern` (a regex whose group 1 is the answer), its last match only.
    Stripped; an empty answer is null."""
    if pattern is not None:
        answer = text.str.extract_all(pattern).list.last().str.extract(pattern, 1)
    else:
        tagged = text.str.extract_all(_ANSWER).list.last().str.extract(_ANSWER, 1)
        boxed = text.str.extract_all(_BOXED).list.last().str.extract(_BOXED, 1)
        answer = pl.coalesce(tagged, boxed, answer_line(text))
    answer = answer.str.strip_chars()
    return pl.when(answer.str.len_chars() > 0).then(answer).otherwise(None)


def extract_answer(text: str | None) -> str | None:
    """`answer_expr` for one string."""
    return pl.select(answer_expr(pl.lit(text, dtype=pl.String))).item()


def word_count_expr(text: pl.Expr) -> pl.Expr:
    """Tokenizer-free length estimate: the number of whitespace-separated words (Int32)."""
    return text.str.count_matches(r"\S+").cast(pl.Int32)


def _content_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: [{"type": "text", "text": ...}, ...]
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return str(content)


def messages_to_text(value: Any, roles: Iterable[str] | None = None) -> str | None:
    """A prompt or completion as text: strings as they are; a list of chat messages (dicts with
    `role` and `content`) as the contents joined with "\\n", only messages of `roles` if given."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return str(value)
    wanted = set(roles) if roles is not None else None
    texts = [
        _content_text(m.get("content"))
        for m in value
        if isinstance(m, dict) and (wanted is None or m.get("role") in wanted)
    ]
    return "\n".join(t for t in texts if t is not None)


def is_messages(dtype: pl.DataType) -> bool:
    """Whether a column holds chat messages: list<struct<role, content, ...>>."""
    return (
        isinstance(dtype, pl.List)
        and isinstance(dtype.inner, pl.Struct)
        and "content" in {f.name for f in dtype.inner.fields}
    )


def messages_expr(column: str, dtype: pl.DataType, roles: Iterable[str] | None = None) -> pl.Expr:
    """`messages_to_text` as a Polars expression over a string or chat-message column."""
    col = pl.col(column)
    if not is_messages(dtype):
        return col.cast(pl.String)
    inner: pl.Struct = dtype.inner  # type: ignore[attr-defined]
    fields = {f.name: f.dtype for f in inner.fields}
    element = pl.element()
    if roles is not None and "role" in fields:
        element = element.filter(element.struct.field("role").is_in(list(roles)))
    content = element.struct.field("content")
    content_type = fields["content"]
    if isinstance(content_type, pl.List) and isinstance(content_type.inner, pl.Struct):
        if "text" in {f.name for f in content_type.inner.fields}:
            content = content.list.eval(pl.element().struct.field("text")).list.join("\n")
        else:
            content = pl.lit(None, dtype=pl.String)
    else:
        content = content.cast(pl.String)
    return col.list.eval(content.drop_nulls()).list.join("\n")
