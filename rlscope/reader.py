"""Find, validate and lazily scan a format-v1 run directory; never writes into it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlscope.errors import RlscopeError
from rlscope.schema import RUN_FIELDS, RUN_JSON, SCHEMA_VERSION, TABLES, Column, type_name

_INT_TYPES = (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32)
_FLOAT_TYPES = (pl.Float32, pl.Float64)
_STRING_TYPES = (pl.String, pl.Categorical, pl.Enum)
_JSON_CHECKS = {"integer": int, "number": (int, float), "string": str}


@dataclass(frozen=True)
class TableFiles:
    """A table's Parquet files and the unified schema rlscope reads them with."""

    name: str
    files: tuple[Path, ...]
    file_schemas: tuple[dict[str, pl.DataType], ...]
    schema: dict[str, pl.DataType]
    n_rows: int

    @property
    def columns(self) -> set[str]:
        return set(self.schema)


@dataclass(frozen=True)
class Run:
    """A validated run directory: run.json and its tables, scanned lazily on demand."""

    path: Path
    meta: dict[str, Any]
    tables: dict[str, TableFiles]
    warnings: tuple[str, ...] = ()
    step_range: tuple[int | None, int | None] = (None, None)
    notes: list[str] = field(default_factory=list, compare=False)

    def has(self, table: str, *columns: str) -> bool:
        """Whether `table` exists and has every column (derived columns count)."""
        if table not in self.tables:
            return False
        available = self.tables[table].columns | set(self.derived_columns(table))
        return all(c in available for c in columns)

    def derived_columns(self, table: str) -> dict[str, str]:
        """Columns rlscope fills in when a table lacks them, with how."""
        if table not in self.tables:
            return {}
        present = self.tables[table].columns
        derived: dict[str, str] = {}
        if table == "rollouts":
            if "split" not in present:
                derived["split"] = "every rollout is `train` (no `split` column)"
            if "correct" not in present:
                threshold = self.meta.get("correct_threshold")
                derived["correct"] = (
                    f"correct = reward >= {threshold} (run.json correct_threshold)"
                    if threshold is not None
                    else "correct = reward > 0 (no `correct` column, no correct_threshold)"
                )
            if "truncated" not in present and self.meta.get("max_response_len") is not None:
                derived["truncated"] = (
                    f"truncated = response_len >= {self.meta['max_response_len']} "
                    "(run.json max_response_len)"
                )
            if "n_tool_calls" not in present and "tool_calls" in present:
                derived["n_tool_calls"] = "n_tool_calls = number of entries in `tool_calls`"
        return derived

    def scan(self, table: str) -> pl.LazyFrame:
        """The table as one LazyFrame with format-v1 types, derived columns and the step range."""
        files = self.tables[table]
        frames = []
        for signature, paths in _group_by_signature(files).items():
            file_schema = dict(signature)
            lf = pl.scan_parquet(list(paths), hive_partitioning=False, glob=False)
            frames.append(lf.select(_conform(files.schema, file_schema)))
        lf = frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")
        lo, hi = self.step_range
        if lo is not None:
            lf = lf.filter(pl.col("step") >= lo)
        if hi is not None:
            lf = lf.filter(pl.col("step") <= hi)
        return lf.with_columns(self._derivations(table))

    def _derivations(self, table: str) -> list[pl.Expr]:
        derived = self.derived_columns(table)
        exprs: list[pl.Expr] = []
        if "split" in derived:
            exprs.append(pl.lit("train").alias("split"))
        if "correct" in derived:
            threshold = self.meta.get("correct_threshold")
            reward = pl.col("reward")
            exprs.append(
                (reward >= threshold if threshold is not None else reward > 0).alias("correct")
            )
        if "truncated" in derived:
            cap = int(self.meta["max_response_len"])
            exprs.append((pl.col("response_len") >= cap).alias("truncated"))
        if "n_tool_calls" in derived:
            exprs.append(pl.col("tool_calls").list.len().cast(pl.Int32).alias("n_tool_calls"))
        return exprs

    def row_count(self, table: str) -> int:
        """Rows in the table within the step range (file metadata when no range is set)."""
        if table not in self.tables:
            return 0
        if self.step_range == (None, None):
            return self.tables[table].n_rows
        return int(self.scan(table).select(pl.len()).collect().item())


def _group_by_signature(files: TableFiles) -> dict[tuple, list[Path]]:
    groups: dict[tuple, list[Path]] = {}
    for path, schema in zip(files.files, files.file_schemas, strict=True):
        groups.setdefault(tuple(schema.items()), []).append(path)
    return groups


def _conform(target: dict[str, pl.DataType], file_schema: dict[str, pl.DataType]) -> list[pl.Expr]:
    """Select every unified column: cast what the file has, null for what it lacks, and NaN/inf
    in float columns become null (metrics are computed over valid values)."""
    exprs = []
    for name, dtype in target.items():
        if name not in file_schema:
            exprs.append(pl.lit(None, dtype=dtype).alias(name))
            continue
        col = pl.col(name)
        if file_schema[name] != dtype:
            col = col.cast(dtype)
        if isinstance(dtype, pl.Float32 | pl.Float64):
            col = pl.when(col.is_finite()).then(col).otherwise(None)
        exprs.append(col.alias(name))
    return exprs


def open_run(
    path: str | os.PathLike[str], *, steps: tuple[int | None, int | None] = (None, None)
) -> Run:
    """Validate a run directory's layout, run.json and every file's schema (footers only)."""
    root = Path(path)
    if not root.exists():
        raise RlscopeError(f"{root}: no such run directory")
    if not root.is_dir():
        raise RlscopeError(f"{root}: not a directory", hint="pass the run directory, not a file")
    meta = _read_run_json(root)
    warnings: list[str] = []
    tables: dict[str, TableFiles] = {}
    for name, spec in TABLES.items():
        files = _find_files(root, name, warnings)
        if files is None:
            if spec.required:
                raise RlscopeError(
                    f"{root}: no `{name}` table (expected {name}.parquet or {name}/*.parquet)",
                    hint="the rollouts table is required; see schemas/run-format-v1.json",
                )
            continue
        tables[name] = _validate_table(root, name, files, warnings)
    run = Run(root, meta, tables, tuple(warnings), steps)
    _check_unique_rollout_ids(run)
    return run


def _read_run_json(root: Path) -> dict[str, Any]:
    path = root / RUN_JSON
    if not path.is_file():
        raise RlscopeError(
            f"{path}: missing",
            hint='a run directory needs run.json, e.g. {"schema_version": 1, "run_id": "r1", '
            '"algorithm": "GRPO"}',
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RlscopeError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise RlscopeError(f"{path}: must hold a JSON object, not {type(meta).__name__}")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RlscopeError(
            f"{path}: unknown schema_version {version!r}; this rlscope reads version "
            f"{SCHEMA_VERSION}",
            hint="upgrade rlscope, or set schema_version to 1 if the run follows format v1",
        )
    for spec in RUN_FIELDS:
        value = meta.get(spec.name)
        if value is None:
            if spec.required:
                raise RlscopeError(f"{path}: required field `{spec.name}` is missing")
            continue
        expected = _JSON_CHECKS[spec.json_type]
        if isinstance(value, bool) or not isinstance(value, expected):
            raise RlscopeError(
                f"{path}: field `{spec.name}` must be a {spec.json_type}, got {value!r}"
            )
        if spec.json_type in ("integer", "number") and spec.name != "schema_version" and value < 0:
            raise RlscopeError(f"{path}: field `{spec.name}` must not be negative, got {value!r}")
    return meta


def _find_files(root: Path, name: str, warnings: list[str]) -> list[Path] | None:
    single, folder = root / f"{name}.parquet", root / name
    if single.is_file() and folder.is_dir():
        raise RlscopeError(
            f"{root}: both {name}.parquet and {name}/ exist", hint="keep one layout per table"
        )
    if single.is_file():
        return [single] if _inside(root, single, warnings) else None
    if not folder.is_dir():
        return None
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
        for fname in sorted(filenames):
            if fname.startswith((".", "_")) or not fname.endswith(".parquet"):
                continue
            path = Path(dirpath) / fname
            if _inside(root, path, warnings):
                found.append(path)
    return found or None


def _inside(root: Path, path: Path, warnings: list[str]) -> bool:
    """Symlinks that leave the run directory are not followed."""
    if path.is_symlink() and not path.resolve().is_relative_to(root.resolve()):
        warnings.append(f"{path}: symlink pointing outside the run directory, not read")
        return False
    return True


def _arrow_schema(path: Path) -> pa.Schema:
    try:
        if path.stat().st_size == 0:
            raise RlscopeError(f"{path}: empty file (0 bytes)", hint="delete it or re-write it")
        return pq.read_schema(path)
    except RlscopeError:
        raise
    except (pa.ArrowInvalid, OSError) as exc:
        raise RlscopeError(
            f"{path}: not a readable Parquet file ({exc})",
            hint="a file truncated mid-write has no footer; delete it or re-write it",
        ) from None


def _validate_table(root: Path, name: str, files: list[Path], warnings: list[str]) -> TableFiles:
    spec = TABLES[name]
    file_schemas: list[dict[str, pl.DataType]] = []
    n_rows = 0
    for path in files:
        arrow = _arrow_schema(path)
        try:
            schema = dict(pl.from_arrow(arrow.empty_table()).schema)  # type: ignore[union-attr]
        except Exception as exc:  # an Arrow type Polars cannot hold
            raise RlscopeError(f"{path}: unsupported column type ({exc})") from None
        missing = [c for c in spec.required_columns if c not in schema]
        if missing:
            raise RlscopeError(
                f"{path}: required column(s) {', '.join(f'`{c}`' for c in missing)} missing "
                f"from the {name} table",
                hint=f"the {name} table needs {', '.join(spec.required_columns)}",
            )
        for col_name, dtype in schema.items():
            column = spec.column(col_name)
            if column is not None:
                _check_type(path, column, dtype)
        file_schemas.append(schema)
        n_rows += pq.read_metadata(path).num_rows
    unified: dict[str, pl.DataType] = {}
    for column in spec.columns:
        if any(column.name in s for s in file_schemas):
            unified[column.name] = _canonical(column, [s[column.name] for s in file_schemas
                                                        if column.name in s])
    for schema, path in zip(file_schemas, files, strict=True):
        for col_name, dtype in schema.items():
            if col_name in unified or spec.column(col_name) is not None:
                continue
            first = next(s[col_name] for s in file_schemas if col_name in s)
            if dtype != first:
                warnings.append(
                    f"{path}: extra column `{col_name}` is {dtype} here but {first} elsewhere; "
                    "read as string"
                )
                unified[col_name] = pl.String()
            else:
                unified.setdefault(col_name, dtype)
    return TableFiles(name, tuple(files), tuple(file_schemas), unified, n_rows)


def _check_type(path: Path, column: Column, dtype: pl.DataType) -> None:
    want = column.dtype
    ok: bool
    if isinstance(want, pl.Int64 | pl.Int32):
        ok = isinstance(dtype, _INT_TYPES)
    elif isinstance(want, pl.Float32 | pl.Float64):
        ok = isinstance(dtype, _FLOAT_TYPES + _INT_TYPES)
    elif isinstance(want, pl.Boolean):
        ok = isinstance(dtype, pl.Boolean)
    elif isinstance(want, pl.String | pl.Categorical):
        ok = isinstance(dtype, _STRING_TYPES + _INT_TYPES)
    elif isinstance(want, pl.List):
        ok = isinstance(dtype, pl.List) and isinstance(dtype.inner, _STRING_TYPES)
    else:
        ok = dtype == want
    if not ok:
        raise RlscopeError(
            f"{path}: column `{column.name}` has type {dtype}, expected {type_name(want)}",
            hint="integers widen and ints are read as floats or ids as needed; other types "
            "must be converted by the writer",
        )


def _canonical(column: Column, seen: Iterable[pl.DataType]) -> pl.DataType:
    """The type a column is read as: format-v1's, widened when a file holds a wider one."""
    seen = list(seen)
    want = column.dtype
    if isinstance(want, pl.Int32) and any(isinstance(d, pl.Int64 | pl.UInt32) for d in seen):
        return pl.Int64()
    if isinstance(want, pl.Float32) and any(isinstance(d, pl.Float64) for d in seen):
        return pl.Float64()
    if isinstance(want, pl.Categorical):
        return pl.String()
    return want


def _check_unique_rollout_ids(run: Run) -> None:
    files = run.tables["rollouts"]
    lf = pl.concat(
        [
            pl.scan_parquet(list(paths), hive_partitioning=False, glob=False).select(
                pl.col("rollout_id").cast(pl.Int64)
            )
            for paths in _group_by_signature(files).values()
        ]
    )
    dupes = (
        lf.group_by("rollout_id")
        .len()
        .filter(pl.col("len") > 1)
        .sort("rollout_id")
        .head(5)
        .collect()
    )
    if dupes.height:
        ids = ", ".join(str(i) for i in dupes["rollout_id"].to_list())
        raise RlscopeError(
            f"{run.path}: rollouts table has duplicate rollout_id values (e.g. {ids})",
            hint="rollout_id must be unique in the run; with several ranks, offset ids by rank",
        )
