"""The `rollouts --filter` language: parsed by rlscope, compiled to Polars, never run as code."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from rlscope.errors import RlscopeError, did_you_mean

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
