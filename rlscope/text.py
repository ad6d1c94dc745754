"""Rollout text: tag sets, segment parsing and per-rollout text features as Polars expressions.

Every feature is an elementwise expression over one rollout's row (regexes, list operations and
hashes run in Polars' Rust kernels), so the text metrics stream with the rollouts table: no
Python loop per rollout, and no text is kept once its features are computed.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import polars as pl

#: The canonical segments (the tokens table's `segment` uses the same names).
SEGMENTS = ("think", "answer", "tool_call", "tool_response")
#: Word n-grams for repetition and text similarity (open-r1's repetition penalty uses 3).
SHINGLE_WORDS = 3
#: MinHash signature length: the Jaccard estimate of one pair has standard error
#: sqrt(J(1 - J)/K) <= 1/(2 sqrt(K)) = 0.088; a group mean over P pairs is tighter.
MINHASH_K = 32
#: Default pattern for a biased-context probe's text mentioning the biasing cue.
DEFAULT_CUE_PATTERN = (
    r"(?i)\b(hint|hinted|suggest(s|ed|ion)?|the user (thinks|said|believes|suggested)|"
    r"you (think|said|believe|suggested)|i think the answer|according to|professor|expert)\b"
)
_TAG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]*$")


@dataclass(frozen=True)
class TagSet:
    """Which tags open each segment (Qwen/Hermes and Search-R1 by default) and which tool-call
    tags hold JSON (`{"name": ..., "arguments": ...}`); overridable under `[tags]` in config."""

    think: tuple[str, ...] = ("think",)
    answer: tuple[str, ...] = ("answer",)
    tool_call: tuple[str, ...] = ("tool_call", "search")
    tool_response: tuple[str, ...] = ("tool_response", "information")
    json_calls: tuple[str, ...] = ("tool_call",)

    def __post_init__(self) -> None:
        for name in self.all_tags + self.json_calls:
            if not _TAG_NAME.match(name):
                raise ValueError(f"tag name {name!r}: use letters, digits, _ . : -")

    def of(self, segment: str) -> tuple[str, ...]:
        return getattr(self, segment)

    @property
    def all_tags(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for s in SEGMENTS for t in self.of(s)))

    def tag_regex(self, tags: tuple[str, ...] | None = None) -> str:
        """An opening or closing tag of `tags` (default: every tag)."""
        return r"</?(?:" + "|".join(map(re.escape, tags or self.all_tags)) + r")>"

    def segment_regex(self, segment: str) -> str:
        """One whole segment of `segment`, tags included (shortest match, across lines)."""
        names = "|".join(map(re.escape, self.of(segment)))
        return rf"(?s)<(?:{names})>.*?</(?:{names})>"

    def grammar(self) -> str:
        """The allowed order of segments over the sequence of tags of a response: an optional
        think, then any number of (tool call, optional tool response, optional think), then
        exactly one answer, each tag closed before the next opens."""

        def pair(segment: str) -> str:
            return (
                "(?:"
                + "|".join(f"<{re.escape(t)}></{re.escape(t)}>" for t in self.of(segment))
                + ")"
            )

        think, call, response, answer = (
            pair(s) for s in ("think", "tool_call", "tool_response", "answer")
        )
        return rf"^{think}?(?:{call}{response}?{think}?)*{answer}$"

    def grammar_untagged_answer(self) -> str:
        """`grammar` for responses whose final answer is an untagged line after the last tag
        (DAPO / R1 `Answer: X`, GSM8K `#### N`): the same order, without the answer tag."""
        return self.grammar().removesuffix("$").rsplit("(?:", 1)[0] + "$"


@dataclass(frozen=True)
class TextSettings:
    """How rollout text is parsed: the tag set and the cue pattern of biased-context probes."""

    tags: TagSet = field(default_factory=TagSet)
    cue_pattern: str = DEFAULT_CUE_PATTERN


def normalized(expr: pl.Expr) -> pl.Expr:
    r"""Lower-cased, whitespace collapsed and trimmed: what counts as 'the same text'. (Runs of
    whitespace and single non-space whitespace become one space: the same as replacing `\s+`,
    4x faster, since single spaces, most of them, are left alone.)"""
    return expr.str.to_lowercase().str.replace_all(r"\s\s+|[^\S ]", " ").str.strip_chars()


def answer_key(column: str = "answer") -> pl.Expr:
    """A hash of the normalised answer; null when there is no (non-blank) answer."""
    norm = normalized(pl.col(column))
    return pl.when(norm.str.len_bytes() > 0).then(norm.hash())


def tagged(tags: TagSet, column: str = "response") -> pl.Expr:
    """Whether the response uses any tag of the set."""
    return pl.col(column).str.contains(tags.tag_regex())


def segments(tags: TagSet, segment: str, column: str = "response") -> pl.Expr:
    """The list of the response's `segment` segments, tags included."""
    return pl.col(column).str.extract_all(tags.segment_regex(segment))


def segment_words(
    tags: TagSet, segment: str, column: str = "response", found: pl.Expr | None = None
) -> pl.Expr:
    """Words in all of a response's `segment` segments (`found`: their list, if computed);
    null when it has none."""
    found = segments(tags, segment, column) if found is None else found
    text = found.list.join(" ").str.replace_all(tags.tag_regex(), " ")
    return pl.when(found.list.len() > 0).then(text.str.count_matches(r"\S+"))


#: A final-answer line outside any tag: DAPO / R1 (`Answer: 42`, what verl's math_dapo
#: parses) and GSM8K (`#### 42`, verl's gsm8k reward). Group 1 is the answer.
ANSWER_LINE = r"(?m)(?:^|[ \t])(?:Answer[ \t]*:|####)[ \t]*(\S[^\n]*?)[ \t]*$"


def answer_line(text: pl.Expr) -> pl.Expr:
    """The last untagged final-answer line's answer (`Answer: X`, `#### N`), else null."""
    return text.str.extract_all(ANSWER_LINE).list.last().str.extract(ANSWER_LINE, 1)


def format_ok(tags: TagSet, column: str = "response") -> pl.Expr:
    """Balanced tags in the allowed order (`TagSet.grammar`), a non-blank answer, and every JSON
    tool call parsing with `name` and `arguments`. The answer is the answer tag's content, or,
    in a response with no answer tag, an untagged final-answer line after the last tag
    (`Answer: X` as DAPO / R1 and verl's math_dapo reward expect, `#### N` as GSM8K). Null
    where the response is null."""
    response = pl.col(column)
    sequence = response.str.extract_all(tags.tag_regex()).list.join("")
    answers = "|".join(map(re.escape, tags.answer))
    tagged = response.str.extract(rf"(?s)<(?:{answers})>(.*?)</(?:{answers})>", 1)
    after_tags = response.str.replace(r"(?s)^.*</[^>]+>", "")
    untagged = pl.when(sequence.str.contains(tags.grammar_untagged_answer())).then(
        answer_line(after_tags)
    )
    answer = pl.coalesce(tagged, untagged)
    calls_ok = pl.lit(True)
    if tags.json_calls:
        names = "|".join(map(re.escape, tags.json_calls))
        calls = response.str.extract_all(rf"(?s)<(?:{names})>.*?</(?:{names})>")
        body = pl.element().str.replace_all(tags.tag_regex(tags.json_calls), "")
        parses = body.str.json_path_match("$.name").is_not_null() & (
            body.str.json_path_match("$.arguments").is_not_null()
        )
        calls_ok = calls.list.eval(parses).list.all()
    ordered = sequence.str.contains(tags.grammar()) | untagged.is_not_null()
    ok = ordered & (answer.str.strip_chars().str.len_bytes() > 0).fill_null(False) & calls_ok
    return pl.when(response.is_not_null()).then(ok)


def reasoning_text(tags: TagSet, column: str = "response") -> pl.Expr:
    """The think segments' text; the whole response without tags when it has no think tag."""
    found = segments(tags, "think", column)
    strip = tags.tag_regex()
    return (
        pl.when(found.list.len() > 0)
        .then(found.list.join(" "))
        .otherwise(pl.col(column))
        .str.replace_all(strip, " ")
    )


def plain_text(tags: TagSet, column: str = "response") -> pl.Expr:
    """The whole response without its tags."""
    return pl.col(column).str.replace_all(tags.tag_regex(), " ")


def word_hashes(norm: pl.Expr) -> pl.Expr:
    """One string hash per word of already normalised text."""
    return norm.str.split(" ").list.eval(pl.element().hash(0x5EED))


def word_grams(hashes: pl.Expr) -> pl.Expr:
    """Hashes of the word 3-grams from a list of word hashes (empty under 3 words), combined
    arithmetically (wrapping uint64): no string is built per 3-gram."""
    h = pl.element()
    gram = h
    for offset, mult in ((1, 0x9E3779B97F4A7C15), (2, 0xC2B2AE3D27D4EB4F)):
        gram = (gram * pl.lit(mult, dtype=pl.UInt64)).xor(h.shift(-offset))
    return hashes.list.eval(gram.drop_nulls())  # the last 2 words start no 3-gram


def shingles(norm: pl.Expr, grams: pl.Expr | None = None) -> pl.Expr:
    """The shingle set of normalised text: its word 3-grams (`grams`, from `word_grams`), or
    the whole text as one shingle under 3 words; null for blank text."""
    grams = word_grams(word_hashes(norm)) if grams is None else grams
    return (
        pl.when(norm.str.len_bytes() == 0)
        .then(None)
        .when(grams.list.len() == 0)
        .then(pl.concat_list(norm.hash()))
        .otherwise(grams)
    )


def repetition(grams: pl.Expr) -> pl.Expr:
    """1 - distinct/total of a text's word 3-grams (from `word_grams`); null under 3 words."""
    return pl.when(grams.list.len() > 0).then(1.0 - grams.list.n_unique() / grams.list.len())


#: The MinHash values' column names: `minhash_0` … `minhash_{K-1}`.
MINHASH_PREFIX = "minhash_"


def minhash(grams: pl.Expr, k: int = MINHASH_K) -> list[pl.Expr]:
    """K MinHash values (the top 32 bits of K seeded hashes' minima) of a shingle-hash list;
    P[two signatures agree at one position] = the Jaccard similarity of the shingle sets."""
    return [
        (grams.list.eval(pl.element().hash(seed)).list.min() // (1 << 32))
        .cast(pl.UInt32)
        .alias(f"{MINHASH_PREFIX}{seed}")
        for seed in range(k)
    ]


#: Intermediate per-rollout columns shared by the text features (a metric Variant's `prelude`):
#: computed once per rollout, in this order, then dropped.
PLAIN, PLAIN_WORDS = "_plain", "_plain_words"
PLAIN_GRAMS, PLAIN_SHINGLES = "_plain_grams", "_plain_shingles"
REASONING, REASONING_WORDS, REASONING_GRAMS = "_reasoning", "_reasoning_words", "_reasoning_grams"


def plain_prelude(tags: TagSet) -> dict[str, pl.Expr]:
    """The response without tags, normalised, its word 3-grams and its shingle set."""
    return {
        PLAIN: normalized(plain_text(tags)),
        PLAIN_WORDS: word_hashes(pl.col(PLAIN)),
        PLAIN_GRAMS: word_grams(pl.col(PLAIN_WORDS)),
        PLAIN_SHINGLES: shingles(pl.col(PLAIN), pl.col(PLAIN_GRAMS)),
    }


def reasoning_prelude(tags: TagSet) -> dict[str, pl.Expr]:
    """The think segments (else the whole response), normalised, and their word 3-grams."""
    return {
        REASONING: normalized(reasoning_text(tags)),
        REASONING_WORDS: word_hashes(pl.col(REASONING)),
        REASONING_GRAMS: word_grams(pl.col(REASONING_WORDS)),
    }


def call_arguments(tags: TagSet, column: str = "response") -> pl.Expr:
    """Each tool call's contents (whitespace-normalised) from the response's tags."""
    calls = segments(tags, "tool_call", column)
    return calls.list.eval(
        pl.element()
        .str.replace_all(tags.tag_regex(), "")
        .str.replace_all(r"\s+", " ")
        .str.strip_chars()
    )


def redundant_calls(calls: pl.Expr) -> pl.Expr:
    """Calls that repeat an earlier call's arguments in the same rollout: len - distinct."""
    return (calls.list.len() - calls.list.n_unique()).cast(pl.Int64)


def sequence_key(actions: pl.Expr) -> pl.Expr:
    """A hash of a whole action sequence (identical trajectories share it)."""
    return actions.list.eval(pl.element().str.strip_chars()).list.join("\x1f").hash()


def segment_spans(text: str, tags: TagSet | None = None) -> list[tuple[str, int, int]]:
    """A response's tagged segments as (segment, start, end) character spans, in order, each
    span from its opening tag to its closing tag inclusive (the tags belong to the segment
    they open or close); characters in no span are `text`.

    A segment is an opening tag and the nearest closing tag of the same name (`<think>` …
    `</think>`: the first such pair from the left, then the next after it). An opening tag
    that is never closed opens a segment that runs to the next opening tag, or to the end of
    the text: a completion cut at the length cap inside its reasoning is reasoning. (The L2
    word counts and format checks, Polars expressions above, read closed segments only.)
    The one parser of segments in Python: `parse_segments` (display) and the token writers'
    `segment` column (rlscope.integrations.token_segments) use it."""
    return [(name, start, end) for name, start, end, _, _ in _segment_parts(text, tags)]


def parse_segments(text: str, tags: TagSet | None = None) -> list[tuple[str, str]]:
    """A response split into (segment, text) parts in order, the segments' text without their
    tags (`segment_spans`); text outside tags is `text` (blank stretches left out). For display
    (`rlscope show`); the metrics use the expressions above."""
    parts: list[tuple[str, str]] = []
    last = 0
    for name, start, end, inner_start, inner_end in _segment_parts(text, tags):
        if text[last:start].strip():
            parts.append(("text", text[last:start]))
        parts.append((name, text[inner_start:inner_end]))
        last = end
    if text[last:].strip():
        parts.append(("text", text[last:]))
    return parts


@functools.cache
def _segment_patterns(tags: TagSet) -> tuple[dict[str, str], re.Pattern[str], re.Pattern[str]]:
    """Segment by tag name, a closed segment (group 1 its tag, 2 its inner text), an opening
    tag (group 1 its name)."""
    by_tag = {t: s for s in SEGMENTS for t in tags.of(s)}
    names = "|".join(map(re.escape, by_tag))
    return by_tag, re.compile(rf"<({names})>(.*?)</\1>", re.S), re.compile(rf"<({names})>")


def _segment_parts(text: str, tags: TagSet | None) -> list[tuple[str, int, int, int, int]]:
    """(segment, start, end, inner start, inner end) of each segment of `segment_spans`."""
    by_tag, closed, opening = _segment_patterns(tags or TagSet())
    parts: list[tuple[str, int, int, int, int]] = []

    def unclosed(begin: int, stop: int) -> None:
        # Opening tags between closed segments never closed: each runs to the next or to `stop`.
        found = list(opening.finditer(text, begin, stop))
        for j, match in enumerate(found):
            end = found[j + 1].start() if j + 1 < len(found) else stop
            parts.append((by_tag[match.group(1)], match.start(), end, match.end(), end))

    last = 0
    for match in closed.finditer(text):
        unclosed(last, match.start())
        parts.append(
            (by_tag[match.group(1)], match.start(), match.end(), match.start(2), match.end(2))
        )
        last = match.end()
    unclosed(last, len(text))
    return parts
