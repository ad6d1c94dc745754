"""Open single rollouts (`rlscope show`) and list rollouts by finding or filter (`rollouts`)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from rlscope.config import Config, load_config
from rlscope.errors import RlscopeError, did_you_mean
from rlscope.reader import Run, open_run, scan_error
from rlscope.report import json_safe
from rlscope.text import TagSet, parse_segments

#: Token columns a rollout view carries (those the tokens table has), sorted by `pos`.
TOKEN_COLUMNS = ("pos", "entropy", "segment", "logprob", "advantage")
#: Columns of a rollout list, in order (those the rollouts table has).
LIST_COLUMNS = (
    "rollout_id",
    "step",
    "prompt_id",
    "split",
    "reward",
    "correct",
    "response_len",
    "answer",
)
#: A word of the response, for the entropy heat strip.
WORD = re.compile(r"\S+")


@dataclass(frozen=True)
class Segment:
    """One part of a response: `think`, `answer`, `tool_call`, `tool_response` or `text`."""

    name: str
    text: str


@dataclass(frozen=True)
class ToolCall:
    """One tool call as logged (or as written in the response's tags), with its name and
    arguments when the call is JSON `{"name": ..., "arguments": ...}`."""

    text: str
    name: str | None = None
    arguments: Any = None


@dataclass(frozen=True)
class Probe:
    """One probe of the rollout (all its columns) and whether its answer equals the rollout's
    (lower-cased, whitespace collapsed; a probe without an answer counts as changed; None when
    the rollout has no answer)."""

    row: dict[str, Any]
    unchanged: bool | None


@dataclass(frozen=True)
class WordHeat:
    """A word of the response (character span) and the mean entropy of the tokens aligned to
    it (None when they have none)."""

    start: int
    end: int
    entropy: float | None
    n_tokens: int


@dataclass(frozen=True)
class RolloutView:
    """Everything the run holds about one rollout."""

    run_path: str
    run_id: str
    rollout_id: int
    row: dict[str, Any]
    segments: tuple[Segment, ...]
    tool_calls: tuple[ToolCall, ...]
    #: Where the tool calls come from: `tool_calls` (the column), `response` (its tags) or None.
    tool_calls_source: str | None
    #: Token columns (pos, entropy, segment, logprob, advantage as present), sorted by pos.
    tokens: dict[str, list[Any]]
    #: Why there are no tokens (no tokens table, no rows for this rollout), else None.
    tokens_note: str | None
    probes: tuple[Probe, ...]
    #: Why there are no probes (no probes table), else None.
    probes_note: str | None = None

    @property
    def response(self) -> str | None:
        value = self.row.get("response")
        return value if isinstance(value, str) else None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens.get("pos", []))

    def word_entropy(self) -> tuple[WordHeat, ...]:
        """The response's words coloured by token entropy (see `word_entropy`); () without a
        response, tokens or an entropy column."""
        if self.response is None or "entropy" not in self.tokens:
            return ()
        return word_entropy(self.response, self.tokens["entropy"])

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "run": {"path": self.run_path, "run_id": self.run_id},
                "rollout_id": self.rollout_id,
                "rollout": self.row,
                "segments": [{"segment": s.name, "text": s.text} for s in self.segments],
                "tool_calls": [
                    {"text": c.text, "name": c.name, "arguments": c.arguments}
                    for c in self.tool_calls
                ],
                "tool_calls_source": self.tool_calls_source,
                "tokens": self.tokens,
                "tokens_note": self.tokens_note,
                "probes": [{**p.row, "unchanged": p.unchanged} for p in self.probes],
                "probes_note": self.probes_note,
            }
        )


@dataclass(frozen=True)
class RolloutList:
    """Rollouts matching a finding and/or a filter, sorted by step and rollout_id."""

    run_path: str
    columns: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]
    #: How many rollouts matched in total (`rows` holds at most `limit`).
    total: int
    limit: int
    finding: str | None = None
    where: str | None = None
    #: Why the list is empty for a reason other than the filter (a finding that did not fire).
    message: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "run": {"path": self.run_path},
                "finding": self.finding,
                "filter": self.where,
                "total": self.total,
                "shown": len(self.rows),
                "limit": self.limit,
                "message": self.message,
                "notes": list(self.notes),
                "rollouts": list(self.rows),
            }
        )


# --- one rollout ------------------------------------------------------------------------------


def rollout(
    path: str | os.PathLike[str], rollout_id: int, *, tags: TagSet | None = None
) -> RolloutView:
    """The rollout `rollout_id` of the run at `path`: its row, segments, tool calls, tokens
    (filtered by rollout_id and step, lazily) and probes. Read-only."""
    run = open_run(path)
    run_id = str(run.meta.get("run_id", run.path.name))
    rid = int(rollout_id)
    try:
        found = run.scan("rollouts").filter(pl.col("rollout_id") == rid).collect()
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["rollouts"], f"reading rollout {rid}", exc) from None
    if found.height == 0:
        raise RlscopeError(
            f"{run.path}: run `{run_id}` has no rollout with rollout_id {rid}",
            hint=f"`rlscope rollouts {run.path}` lists rollout ids",
        )
    row = found.row(0, named=True)
    response = row.get("response")
    segments = (
        tuple(Segment(name, text) for name, text in parse_segments(response, tags))
        if isinstance(response, str)
        else ()
    )
    calls, source = _tool_calls(row, segments)
    tokens, tokens_note = _tokens(run, rid, row.get("step"))
    probes, probes_note = _probes(run, rid, row.get("answer"))
    run.check_unchanged()
    return RolloutView(
        run_path=str(run.path),
        run_id=run_id,
        rollout_id=rid,
        row=row,
        segments=segments,
        tool_calls=calls,
        tool_calls_source=source,
        tokens=tokens,
        tokens_note=tokens_note,
        probes=probes,
        probes_note=probes_note,
    )


def parse_tool_call(text: str) -> ToolCall:
    """A serialized call; `name` and `arguments` filled when it is JSON with them."""
    body = text.strip()
    try:
        value = json.loads(body)
    except ValueError:
        return ToolCall(body)
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return ToolCall(body, value["name"], value.get("arguments"))
    return ToolCall(body, None, value)


def _tool_calls(
    row: Mapping[str, Any], segments: Sequence[Segment]
) -> tuple[tuple[ToolCall, ...], str | None]:
    logged = row.get("tool_calls")
    if logged is not None:
        return tuple(parse_tool_call(c) for c in logged if c is not None), "tool_calls"
    parsed = tuple(parse_tool_call(s.text) for s in segments if s.name == "tool_call")
    return parsed, "response" if parsed else None


def _tokens(run: Run, rid: int, step: int | None) -> tuple[dict[str, list[Any]], str | None]:
    if "tokens" not in run.tables:
        return {}, "the run has no tokens table"
    columns = [c for c in TOKEN_COLUMNS if c in run.tables["tokens"].schema]
    # The step first: Parquet statistics let whole files and row groups of other steps be skipped.
    where = pl.col("rollout_id") == rid
    if step is not None:
        where = (pl.col("step") == step) & where
    try:
        frame = (
            run.scan("tokens")
            .filter(where)
            .select(columns)
            .sort("pos", nulls_last=True, maintain_order=True)
            .collect(engine="streaming")
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["tokens"], f"reading the tokens of rollout {rid}", exc) from None
    if frame.height == 0:
        at = f" at step {step}" if step is not None else ""
        return {}, f"the tokens table has no rows for rollout {rid}{at}"
    return {c: frame[c].to_list() for c in columns}, None


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def _probes(run: Run, rid: int, answer: object) -> tuple[tuple[Probe, ...], str | None]:
    if "probes" not in run.tables:
        return (), "the run has no probes table"
    schema = run.tables["probes"].schema
    order = [c for c in ("intervention", "fraction") if c in schema]
    try:
        frame = (
            run.scan("probes")
            .filter(pl.col("rollout_id") == rid)
            .sort(order, nulls_last=True, maintain_order=True)
            .collect()
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["probes"], f"reading the probes of rollout {rid}", exc) from None
    original = _normalized(answer) if isinstance(answer, str) and answer.strip() else None
    probes = []
    for row in frame.iter_rows(named=True):
        probe_answer = row.get("answer")
        if original is None:
            unchanged = None
        else:
            unchanged = isinstance(probe_answer, str) and _normalized(probe_answer) == original
        probes.append(Probe(row, unchanged))
    return tuple(probes), None


def word_entropy(text: str, entropy: Sequence[float | None]) -> tuple[WordHeat, ...]:
    """Tokens aligned to the text's words by position (the tokens table has no token strings):
    with T tokens and W words, word i covers the tokens j with i·T/W <= j < (i+1)·T/W, i.e.
    j = ceil(i·T/W) … ceil((i+1)·T/W) - 1; a word that covers none (T < W) takes the token
    floor(i·T/W). Each word gets the mean of its tokens' finite entropies."""
    words = list(WORD.finditer(text))
    n_words, n_tokens = len(words), len(entropy)
    if not n_words or not n_tokens:
        return ()
    out = []
    for i, match in enumerate(words):
        lo = -(-i * n_tokens // n_words)
        hi = -(-(i + 1) * n_tokens // n_words)
        if hi <= lo:
            lo = i * n_tokens // n_words
            hi = lo + 1
        values = [float(v) for v in entropy[lo:hi] if v is not None and math.isfinite(float(v))]
        mean = sum(values) / len(values) if values else None
        out.append(WordHeat(match.start(), match.end(), mean, hi - lo))
    return tuple(out)


# --- lists of rollouts ------------------------------------------------------------------------


def rollouts(
    path: str | os.PathLike[str],
    *,
    finding: str | None = None,
    where: str | None = None,
    limit: int = 20,
    config: Config | None = None,
) -> RolloutList:
    """The run's rollouts named by a finding's evidence (`finding`, analysing the run) and/or
    matching a filter expression (`where`, see `parse_filter`), sorted by step and rollout_id;
    at most `limit` rows, with the total count. Read-only."""
    if limit < 0:
        raise RlscopeError(f"--limit {limit}: must be 0 or more")
    node = parse_filter(where) if where is not None else None
    run = open_run(path)
    scan = run.scan("rollouts")
    schema = scan.collect_schema()
    predicate = compile_filter(node, schema, where or "") if node is not None else None
    columns = tuple(c for c in LIST_COLUMNS if c in schema)

    def empty(message: str) -> RolloutList:
        return RolloutList(str(run.path), columns, (), 0, limit, finding, where, message)

    notes: list[str] = []
    if finding is not None:
        ids, message = finding_rollouts(path, finding, config)
        if ids is None:
            return empty(message or "")
        if message:
            notes.append(message)
        scan = scan.filter(pl.col("rollout_id").is_in(ids))
    if predicate is not None:
        scan = scan.filter(predicate)
    scan = scan.select(columns)
    try:
        counted, rows = pl.collect_all(
            [
                scan.select(pl.len()),
                scan.sort(["step", "rollout_id"], nulls_last=True).head(limit),
            ],
            engine="streaming",
        )
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise scan_error(run, ["rollouts"], "listing rollouts", exc) from None
    run.check_unchanged()
    return RolloutList(
        str(run.path),
        columns,
        tuple(rows.iter_rows(named=True)),
        int(counted.item()),
        limit,
        finding,
        where,
        None,
        tuple(notes),
    )


def evidence_rollout_ids(evidence: Mapping[str, Any]) -> list[int]:
    """The rollout ids a finding's evidence names: `rollout_ids`, and the `rollout_id`s inside
    `rollouts` (grad-spike: step -> list of {rollout_id, ...}); sorted, unique."""
    ids: set[int] = set()
    for value in evidence.get("rollout_ids") or ():
        if value is not None:
            ids.add(int(value))
    nested = evidence.get("rollouts")
    groups: Iterable[Any] = ()
    if isinstance(nested, Mapping):
        groups = nested.values()
    elif isinstance(nested, list | tuple):
        groups = [nested]
    for group in groups:
        for item in group if isinstance(group, list | tuple) else ():
            if isinstance(item, Mapping) and item.get("rollout_id") is not None:
                ids.add(int(item["rollout_id"]))
    return sorted(ids)


def finding_rollouts(
    path: str | os.PathLike[str], finding: str, config: Config | None = None
) -> tuple[list[int] | None, str | None]:
    """Analyse the run for one finding: (the rollout ids its evidence names, a note) when it
    fired and names some; (None, why) when it is disabled, could not be checked, did not fire or
    names no rollouts. An unknown finding id is an RlscopeError."""
    from rlscope.analysis import analyze
    from rlscope.catalog import load_all
    from rlscope.registry import METRICS, RULES

    load_all()
    rule = RULES.get(finding)
    if rule is None:
        what = "a metric id, not a finding id" if finding in METRICS else "unknown finding id"
        hint = did_you_mean(finding, RULES, "`rlscope metrics` lists finding ids")
        raise RlscopeError(f"--finding {finding!r}: {what}", hint=hint)
    config = config if config is not None else load_config()
    if config.findings.get(finding, {}).get("enabled", True) is False:
        return None, f"finding `{finding}` is disabled in {config.source}"
    # Only the metrics the rule reads: the same finding as a full analysis, computed faster.
    report = analyze(path, metrics=rule.metrics, config=config)
    fired = [f for f in report.findings if f.id == finding]
    if not fired:
        skipped = [s.reason for s in report.skipped if s.metric == finding]
        if skipped:
            return None, f"finding `{finding}` could not be checked on this run: {skipped[0]}"
        return None, f"finding `{finding}` did not fire on this run"
    ids = sorted({i for f in fired for i in evidence_rollout_ids(f.evidence)})
    if not ids:
        steps = sorted({int(s) for f in fired for s in f.evidence.get("steps") or ()})
        at = f" (its evidence points at steps {', '.join(map(str, steps))})" if steps else ""
        return None, f"finding `{finding}` fired but names no rollouts{at}"
    return ids, f"finding `{finding}` names {len(ids)} rollout(s)"


# --- the filter language ----------------------------------------------------------------------

#: Comparison operators of the filter language.
OPERATORS = ("==", "!=", "<", "<=", ">", ">=")
KEYWORDS = ("and", "or", "not", "contains", "true", "false", "null")
#: Deepest nesting of parentheses and `not`s accepted (keeps the parser's recursion bounded).
MAX_DEPTH = 64
MAX_LENGTH = 10_000

_LEX = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?(?![A-Za-z0-9_.]))
    |(?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<op>==|!=|<=|>=|<|>)
    |(?P<lparen>\()
    |(?P<rparen>\))
    |(?P<name>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<quoted>`[^`]+`)
    """,
    re.X | re.S,
)

Value = int | float | bool | str | None


@dataclass(frozen=True)
class Compare:
    """`column OP value`."""

    column: str
    op: str
    value: Value


@dataclass(frozen=True)
class Contains:
    """`column contains "text"`: a substring (of a string column, or of any list element)."""

    column: str
    text: str


@dataclass(frozen=True)
class BoolOp:
    """`left and right`, `left or right`."""

    op: str
    left: Node
    right: Node


@dataclass(frozen=True)
class Not:
    """`not operand`."""

    operand: Node


Node = Compare | Contains | BoolOp | Not


@dataclass(frozen=True)
class _Token:
    kind: str  # number, string, op, lparen, rparen, name, keyword, end
    text: str
    value: Any
    pos: int


def _describe(token: _Token) -> str:
    if token.kind == "end":
        return "the end of the filter"
    return f"`{token.text}` at column {token.pos + 1}"


def _filter_error(text: str, problem: str, hint: str | None = None) -> RlscopeError:
    return RlscopeError(
        f"--filter {text!r}: {problem}",
        hint=hint
        or 'write comparisons like reward > 0.5, correct == false, answer == "42", '
        'response contains "<tool_call>", combined with and, or and parentheses',
    )


def _unquote(literal: str) -> str:
    body = literal[1:-1]
    return re.sub(r"\\(.)", lambda m: m.group(1) if m.group(1) in "\\\"'" else m.group(0), body)


def _lex(text: str) -> list[_Token]:
    tokens = []
    pos = 0
    while pos < len(text):
        match = _LEX.match(text, pos)
        if match is None:
            char = text[pos]
            if char in "\"'":
                raise _filter_error(text, f"unterminated string starting at column {pos + 1}")
            if char == "=":
                raise _filter_error(text, f"`=` at column {pos + 1}: compare with `==`")
            raise _filter_error(text, f"unexpected character {char!r} at column {pos + 1}")
        kind, raw = match.lastgroup or "", match.group()
        if kind == "number":
            value: Any = float(raw) if re.search(r"[.eE]", raw) else int(raw)
            if isinstance(value, float) and not math.isfinite(value):
                raise _filter_error(text, f"number {raw} at column {pos + 1} is out of range")
        elif kind == "string":
            value = _unquote(raw)
        elif kind == "quoted":
            kind, value = "name", raw[1:-1]
        elif kind == "name" and raw.lower() in KEYWORDS:
            kind, value = "keyword", raw.lower()
        else:
            value = raw
        if kind != "space":
            tokens.append(_Token(kind, raw, value, pos))
        pos = match.end()
    tokens.append(_Token("end", "", None, len(text)))
    return tokens


class _Parser:
    """Recursive descent: or_expr := and_expr (or and_expr)*; and_expr := unary (and unary)*;
    unary := not unary | ( or_expr ) | column OP value | column contains string."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _lex(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> _Token:
        return self.tokens[self.i]

    def take(self) -> _Token:
        token = self.tokens[self.i]
        self.i += 1
        return token

    def keyword(self, word: str) -> bool:
        token = self.peek()
        if token.kind == "keyword" and token.value == word:
            self.i += 1
            return True
        return False

    def error(self, problem: str, hint: str | None = None) -> RlscopeError:
        return _filter_error(self.text, problem, hint)

    def parse(self) -> Node:
        if self.peek().kind == "end":
            raise self.error("empty filter")
        node = self.or_expr()
        if self.peek().kind != "end":
            raise self.error(f"unexpected {_describe(self.peek())}: expected and, or or the end")
        return node

    def or_expr(self) -> Node:
        node = self.and_expr()
        while self.keyword("or"):
            node = BoolOp("or", node, self.and_expr())
        return node

    def and_expr(self) -> Node:
        node = self.unary()
        while self.keyword("and"):
            node = BoolOp("and", node, self.unary())
        return node

    def unary(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(f"nested deeper than {MAX_DEPTH} levels")
        try:
            if self.keyword("not"):
                return Not(self.unary())
            if self.peek().kind == "lparen":
                self.take()
                node = self.or_expr()
                if self.peek().kind != "rparen":
                    raise self.error(f"expected `)`, got {_describe(self.peek())}")
                self.take()
                return node
            return self.comparison()
        finally:
            self.depth -= 1

    def comparison(self) -> Node:
        token = self.take()
        if token.kind != "name":
            raise self.error(
                f"expected a column name, got {_describe(token)}",
                hint=None
                if token.kind != "keyword"
                else "quote a column named like a keyword with backticks: `null`",
            )
        column = str(token.value)
        if self.keyword("contains"):
            text = self.take()
            if text.kind != "string":
                raise self.error(f"`contains` needs a quoted string, got {_describe(text)}")
            return Contains(column, str(text.value))
        op = self.take()
        if op.kind != "op":
            raise self.error(
                f"expected a comparison (== != < <= > >= or contains) after `{column}`, got "
                f"{_describe(op)}"
            )
        value = self.take()
        if value.kind in ("number", "string"):
            return Compare(column, op.value, value.value)
        if value.kind == "keyword" and value.value in ("true", "false", "null"):
            literal = {"true": True, "false": False, "null": None}[value.value]
            return Compare(column, op.value, literal)
        raise self.error(
            f"expected a value (a number, true, false, null or a quoted string) after "
            f"`{column} {op.value}`, got {_describe(value)}"
        )


def parse_filter(text: str) -> Node:
    """Parse a filter expression into a tree (never `eval`): comparisons `column OP value`
    (OP one of == != < <= > >=; value a number, true, false, null or a quoted string),
    `column contains "text"`, combined with `and`, `or`, `not` and parentheses. Column names
    are bare identifiers or `backticked`. Errors are RlscopeErrors naming the position."""
    if len(text) > MAX_LENGTH:
        raise _filter_error(text[:40] + "…", f"longer than {MAX_LENGTH:,} characters")
    return _Parser(text).parse()


def _kind(dtype: pl.DataType) -> str:
    if isinstance(dtype, pl.Boolean):
        return "boolean"
    if dtype.is_numeric():
        return "number"
    if isinstance(dtype, pl.String | pl.Categorical | pl.Enum):
        return "string"
    if isinstance(dtype, pl.List) and isinstance(dtype.inner, pl.String | pl.Categorical):
        return "list"
    return "other"


def _value_kind(value: Value) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "string"


def compile_filter(node: Node, schema: Mapping[str, pl.DataType], text: str = "") -> pl.Expr:
    """The Polars expression of a parsed filter over a table with `schema`. An unknown column,
    or a value of the wrong type for its column, is an RlscopeError listing what is valid.
    Rows where the compared column is null match only `== null` (SQL semantics)."""

    def column(name: str) -> str:
        if name not in schema:
            columns = "columns of the rollouts table: " + ", ".join(schema)
            hint = did_you_mean(name, schema, columns)
            hint = columns if hint == columns else f"{hint} {columns}"
            raise _filter_error(text, f"unknown column `{name}`", hint=hint)
        return _kind(schema[name])

    def build(node: Node) -> pl.Expr:
        if isinstance(node, BoolOp):
            left, right = build(node.left), build(node.right)
            return left & right if node.op == "and" else left | right
        if isinstance(node, Not):
            return ~build(node.operand)
        if isinstance(node, Contains):
            kind = column(node.column)
            col = pl.col(node.column)
            if kind == "string":
                return col.cast(pl.String).str.contains(node.text, literal=True)
            if kind == "list":
                element = pl.element().cast(pl.String).str.contains(node.text, literal=True)
                return col.list.eval(element).list.any()
            raise _filter_error(
                text, f"`contains` needs a text column; `{node.column}` holds {kind} values"
            )
        kind = column(node.column)
        col = pl.col(node.column)
        if node.value is None:
            if node.op == "==":
                return col.is_null()
            if node.op == "!=":
                return col.is_not_null()
            raise _filter_error(text, f"`{node.column} {node.op} null`: use == null or != null")
        want = _value_kind(node.value)
        if kind in ("list", "other"):
            raise _filter_error(
                text,
                f"`{node.column}` cannot be compared with {node.op}"
                + (" (use contains)" if kind == "list" else "")
                + "; only == null and != null apply",
            )
        if want != kind:
            example = {"number": "0.5", "boolean": "true", "string": '"42"'}[kind]
            raise _filter_error(
                text,
                f"`{node.column}` holds {kind} values; compare it with a {kind}, e.g. "
                f"{node.column} {node.op} {example}",
            )
        if kind == "boolean" and node.op not in ("==", "!="):
            raise _filter_error(text, f"`{node.column}` is true/false: use == or !=")
        if kind == "string":
            col = col.cast(pl.String)
        lit = pl.lit(node.value)
        return {
            "==": col == lit,
            "!=": col != lit,
            "<": col < lit,
            "<=": col <= lit,
            ">": col > lit,
            ">=": col >= lit,
        }[node.op]

    return build(node)


def filter_expr(text: str, schema: Mapping[str, pl.DataType]) -> pl.Expr:
    """`compile_filter(parse_filter(text), schema)`."""
    return compile_filter(parse_filter(text), schema, text)
