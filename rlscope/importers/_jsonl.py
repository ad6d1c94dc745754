"""Chunked JSON-lines reading: Polars' parser per chunk, line-by-line only to locate bad lines."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.importers.session import LineSkips
from rlscope.importers.text import is_messages, messages_expr, messages_to_text

#: Non-blank lines parsed together (one Polars frame per chunk).
CHUNK_LINES = 50_000
LINE = "_line"

_TARGET: dict[str, pl.DataType] = {
    "int": pl.Int64(),
    "num": pl.Float64(),
    "str": pl.String(),
    "id": pl.String(),
    "text": pl.String(),
    "flag": pl.Boolean(),
    "bool": pl.Boolean(),
    "strlist": pl.List(pl.String()),
}
_EXPECTED = {
    "int": "an integer",
    "num": "a number",
    "str": "a string",
    "id": "a string or number",
    "text": "a string or a list of chat messages",
    "flag": "true/false or a number",
    "bool": "true/false",
    "strlist": "a list",
}


@dataclass(frozen=True)
class Field:
    """A source key read with a type: `int`, `num`, `str`, `id` (string or number, read as a
    string), `text` (string or chat messages, read as text), `flag` (bool, or number > 0.5),
    `bool`, `strlist`. Missing or null is allowed unless `required`."""

    key: str
    kind: str
    required: bool = False
    roles: tuple[str, ...] | None = None  # text: the message roles kept

    @property
    def dtype(self) -> pl.DataType:
        return _TARGET[self.kind]


def _type_name(value: Any) -> str:
    return {bool: "bool", int: "integer", float: "number", str: "string", list: "list"}.get(
        type(value), "object" if isinstance(value, dict) else type(value).__name__
    )


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_FLAG_WORDS = {"true": True, "false": False, "1": True, "0": False}


def convert_value(value: Any, spec: Field) -> tuple[bool, Any]:
    """(ok, value converted to the field's type) for one JSON value that is not null."""
    kind = spec.kind
    if kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return True, int(value)
        return False, None
    if kind == "num":
        return (True, float(value)) if _is_num(value) else (False, None)
    if kind == "str":
        return (True, value) if isinstance(value, str) else (False, None)
    if kind == "id":
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return True, str(value)
        return (True, json.dumps(value)) if isinstance(value, float | list) else (False, None)
    if kind == "text":
        if isinstance(value, str):
            return True, value
        if isinstance(value, list | dict):
            return True, messages_to_text(value, spec.roles)
        return False, None
    if kind == "flag":
        if isinstance(value, bool):
            return True, value
        if isinstance(value, str) and value.strip().lower() in _FLAG_WORDS:
            return True, _FLAG_WORDS[value.strip().lower()]  # verl 0.9 json default=str: "True"
        return (True, float(value) > 0.5) if _is_num(value) else (False, None)
    if kind == "bool":
        return (True, value) if isinstance(value, bool) else (False, None)
    if kind == "strlist":
        if isinstance(value, list):
            return True, [v if isinstance(v, str) else json.dumps(v) for v in value]
        return False, None
    raise AssertionError(kind)


def _convert_series(series: pl.Series, spec: Field) -> pl.Series | None:
    """The column in the field's type, or None when only line-by-line reading can tell which
    values are wrong."""
    dtype, kind = series.dtype, spec.kind
    if isinstance(dtype, pl.Null):
        return pl.Series(series.name, [None] * series.len(), dtype=spec.dtype)
    numeric = dtype.is_numeric()
    if kind == "int":
        if dtype.is_integer():
            return series.cast(pl.Int64)
        if dtype.is_float():
            valid = series.drop_nulls()
            if valid.len() and not (valid.is_finite() & (valid == valid.round())).all():
                return None
            return series.cast(pl.Int64)
        return None
    if kind == "num":
        return series.cast(pl.Float64) if numeric else None
    if kind == "str":
        return series if isinstance(dtype, pl.String) else None
    if kind == "id":
        return series.cast(pl.String) if isinstance(dtype, pl.String) or numeric else None
    if kind == "text":
        if isinstance(dtype, pl.String):
            return series
        if is_messages(dtype):
            text = messages_expr(series.name, dtype, spec.roles)
            return series.to_frame().select(text).to_series()
        return None
    if kind == "flag":
        if isinstance(dtype, pl.Boolean):
            return series
        return (series.cast(pl.Float64) > 0.5) if numeric else None
    if kind == "bool":
        return series if isinstance(dtype, pl.Boolean) else None
    if kind == "strlist":
        if isinstance(dtype, pl.List) and isinstance(dtype.inner, pl.String | pl.Null):
            return series.cast(pl.List(pl.String))
        return None
    return None


def normalize_extras(frame: pl.DataFrame) -> pl.DataFrame:
    """Extra columns in stable types: numbers -> float64, booleans and strings as they are,
    nested values -> JSON text, all-null columns dropped."""
    out = []
    for name, dtype in frame.schema.items():
        col = frame[name]
        if isinstance(dtype, pl.Null):
            continue
        if isinstance(dtype, pl.Boolean | pl.String):
            out.append(col)
        elif dtype.is_numeric():
            out.append(col.cast(pl.Float64))
        else:
            values = [None if v is None else json.dumps(v) for v in col.to_list()]
            out.append(pl.Series(name, values, dtype=pl.String))
    return pl.DataFrame(out) if out else pl.DataFrame()  # hstack-able either way


def _python_column(name: str, values: list[Any]) -> pl.Series | None:
    kinds = {_type_name(v) for v in values if v is not None}
    if not kinds:
        return None
    if kinds <= {"integer", "number"}:
        return pl.Series(name, [None if v is None else float(v) for v in values], pl.Float64)
    if kinds == {"bool"}:
        return pl.Series(name, values, dtype=pl.Boolean)
    text = [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
    return pl.Series(name, text, dtype=pl.String)


def chunks(path: Path, chunk_lines: int) -> Iterator[tuple[list[int], list[bytes], bool]]:
    """(line numbers, lines, whether the chunk ends with a line lacking its newline)."""
    numbers: list[int] = []
    lines: list[bytes] = []
    last_partial = False
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            last_partial = not line.endswith(b"\n")
            numbers.append(number)
            lines.append(line.rstrip(b"\r\n"))
            if len(lines) >= chunk_lines:
                yield numbers, lines, last_partial
                numbers, lines = [], []
    if lines:
        yield numbers, lines, last_partial


def read_jsonl(
    path: Path,
    fields: Sequence[Field],
    skips: LineSkips,
    warnings: list[str],
    *,
    chunk_lines: int = CHUNK_LINES,
) -> Iterator[pl.DataFrame]:
    """Frames of the valid lines: `_line` (1-based line number), each field in its type, every
    other key as a normalised extra column. Malformed lines (bad JSON, not an object, a
    required field missing, a field of the wrong type) go to `skips`."""
    for numbers, lines, partial in chunks(path, chunk_lines):
        frame = _fast(path, numbers, lines, fields, skips)
        if frame is None:
            frame = _slow(path, numbers, lines, partial, fields, skips, warnings)
        yield frame


def _fast(
    path: Path, numbers: list[int], lines: list[bytes], fields: Sequence[Field], skips: LineSkips
) -> pl.DataFrame | None:
    try:
        raw = pl.read_ndjson(io.BytesIO(b"\n".join(lines)), infer_schema_length=None)
    except Exception:  # any parse or schema error: find the culprits line by line
        return None
    if raw.height != len(lines):
        return None
    columns = [pl.Series(LINE, numbers, dtype=pl.Int64)]
    for spec in fields:
        if spec.key not in raw.columns:
            columns.append(pl.Series(spec.key, [None] * raw.height, dtype=spec.dtype))
            continue
        converted = _convert_series(raw[spec.key], spec)
        if converted is None:
            return None
        columns.append(converted.alias(spec.key))
    keys = {s.key for s in fields}
    extras = normalize_extras(raw.select(c for c in raw.columns if c not in keys and c != LINE))
    frame = pl.DataFrame(columns).hstack(extras)
    required = [s.key for s in fields if s.required]
    if required:
        bad = frame.filter(pl.any_horizontal(pl.col(required).is_null()))
        for row in bad.select(LINE, *required).iter_rows(named=True):
            missing = next(k for k in required if row[k] is None)
            skips.add(path, row[LINE], f"missing `{missing}`")
        if bad.height:
            frame = frame.filter(~pl.any_horizontal(pl.col(required).is_null()))
    return frame


def _slow(
    path: Path,
    numbers: list[int],
    lines: list[bytes],
    partial: bool,
    fields: Sequence[Field],
    skips: LineSkips,
    warnings: list[str],
) -> pl.DataFrame:
    keys = {s.key for s in fields}
    kept: list[int] = []
    odd: dict[str, list[str]] = {}
    values: dict[str, list[Any]] = {s.key: [] for s in fields}
    extra: dict[str, list[Any]] = {}
    for i, (number, line) in enumerate(zip(numbers, lines, strict=True)):
        try:
            obj = json.loads(line)
        except ValueError as exc:
            if partial and i == len(lines) - 1:
                warnings.append(
                    f"{path}:{number}: incomplete last line (no newline; still being written?), "
                    "not read"
                )
                continue
            skips.add(path, number, "bad JSON", str(exc).split(":")[0])
            continue
        if not isinstance(obj, dict):
            skips.add(path, number, "not a JSON object", _type_name(obj))
            continue
        row: dict[str, Any] = {}
        problem = None
        for spec in fields:
            value = obj.get(spec.key)
            if value is None:
                if spec.required:
                    problem = (f"missing `{spec.key}`", "")
                    break
                row[spec.key] = None
                continue
            ok, converted = convert_value(value, spec)
            if not ok and not spec.required:
                # One odd optional field nulls that field, never the rollout (counted).
                odd.setdefault(spec.key, []).append(f"line {number}: {_type_name(value)}")
                row[spec.key] = None
                continue
            if not ok:
                problem = (
                    f"wrong type for `{spec.key}`",
                    f"{_type_name(value)}, expected {_EXPECTED[spec.kind]}",
                )
                break
            row[spec.key] = converted
        if problem is not None:
            skips.add(path, number, *problem)
            continue
        n = len(kept)
        kept.append(number)
        for key, value in row.items():
            values[key].append(value)
        for key, value in obj.items():
            if key in keys or key == LINE:
                continue
            column = extra.get(key)
            if column is None:
                column = extra[key] = [None] * n
            column.append(value)
        for column in extra.values():
            if len(column) < len(kept):
                column.append(None)
    for key, where in odd.items():
        expected = _EXPECTED[next(s.kind for s in fields if s.key == key)]
        warnings.append(
            f"{path}: `{key}` is not {expected} on {len(where):,} line(s) "
            f"({', '.join(where[:3])}{' ...' if len(where) > 3 else ''}): left null there, "
            "the rollouts kept"
        )
    series = [pl.Series(LINE, kept, dtype=pl.Int64)]
    for spec in fields:
        series.append(pl.Series(spec.key, values[spec.key], dtype=spec.dtype))
    for key, column in extra.items():
        converted = _python_column(key, column)
        if converted is not None:
            series.append(converted)
    return pl.DataFrame(series)
