"""Find, validate and lazily scan a format-v1 run directory; never writes into it.

Snapshot semantics: `open_run` lists a run's files once and reads their footers; every later
scan reads exactly those files, so analysing a run that is still being written (RunWriter adds
complete files under new names, never rewrites one) sees a consistent snapshot as of the open —
files added afterwards are not read. A listed file that is removed or rewritten (size, mtime or
inode changed) before the scans finish is an RlscopeError naming the file, never a silently
different number; re-running takes a new snapshot.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlscope.errors import RlscopeError
from rlscope.report import run_provenance
from rlscope.schema import RUN_FIELDS, RUN_JSON, SCHEMA_VERSION, TABLES, Column, Table, type_name
from rlscope.store import (
    CONCURRENCY,
    RunPath,
    StoreObject,
    StorePath,
    arrow_source,
    concurrently,
    list_folder,
    list_folders,
    location,
    open_object,
    polars_options,
    read_object,
    relative,
    store_error,
)

_INT_TYPES = (pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt16, pl.UInt32)
_FLOAT_TYPES = (pl.Float32, pl.Float64)
_STRING_TYPES = (pl.String, pl.Categorical, pl.Enum)
_JSON_CHECKS: dict[str, type | tuple[type, ...]] = {
    "integer": int,
    "number": (int, float),
    "string": str,
    "array": list,
    "object": dict,
}

#: A row's file's index among its table's files (`Run.scan(..., file_index=True)`).
FILE_INDEX = "__file_index__"
#: `Run.scan(table, invalid_flags=True)` adds, per float column `c`, a boolean
#: `__invalid__c`: the file held a non-null value that is not finite (NaN/±inf, read as null).
INVALID_PREFIX = "__invalid__"
#: A response longer than this (or negative) is a logging bug, not a length.
MAX_RESPONSE_LEN = 10_000_000


def valid_rollout() -> pl.Expr:
    """Rows the rollout metrics use: a step, a finite reward and a plausible (or missing)
    length."""
    length = pl.col("response_len")
    absurd = ((length < 0) | (length > MAX_RESPONSE_LEN)).fill_null(False)
    return pl.col("step").is_not_null() & pl.col("reward").is_not_null() & ~absurd


@dataclass(frozen=True)
class TableFiles:
    """A table's Parquet files and the unified schema rlscope reads them with."""

    name: str
    files: tuple[RunPath, ...]
    file_schemas: tuple[dict[str, pl.DataType], ...]
    schema: dict[str, pl.DataType]
    n_rows: int
    # Per file, values from hive-style folders (`step=000100/`) for columns the file lacks.
    file_hive: tuple[dict[str, str], ...] = ()
    # Per file, (size, mtime_ns, inode) when the run was opened: the snapshot that is read. An
    # object in a store: (size, mtime_ns, a digest of its ETag or generation).
    file_stats: tuple[tuple[int, int, int], ...] = ()
    # Per file, its rows (from the footer).
    file_rows: tuple[int, ...] = ()

    @property
    def columns(self) -> set[str]:
        return set(self.schema)


@dataclass(frozen=True)
class Run:
    """A validated run directory: run.json and its tables, scanned lazily on demand."""

    path: RunPath
    meta: dict[str, Any]
    tables: dict[str, TableFiles]
    warnings: tuple[str, ...] = ()
    step_range: tuple[int | None, int | None] = (None, None)
    #: Whether `warnings` hold the rollouts check (`check_rollouts`), done at open by default.
    rollouts_checked: bool = True

    @property
    def provenance(self) -> dict[str, str]:
        """run.json `provenance`: how the importer derived fields, {topic: one sentence}."""
        return run_provenance(self.meta)

    @property
    def lengths_in_words(self) -> bool:
        """rollouts.response_len counts whitespace words, not tokens (run.json
        response_len_unit): never compared with token caps or token-based logs."""
        return self.meta.get("response_len_unit") == "words"

    def has(self, table: str, *columns: str) -> bool:
        """Whether `table` exists and has every column (derived columns count)."""
        if table not in self.tables:
            return False
        available = self.tables[table].columns | set(self._derivable(table))
        return all(c in available for c in columns)

    def derived_columns(self, table: str) -> dict[str, str]:
        """Columns rlscope fills in where a table (or some of its files) lacks them, with how."""
        if table not in self.tables:
            return {}
        files = self.tables[table]
        notes = {}
        for column, (how, _) in self._derivable(table).items():
            missing = sum(column not in schema for schema in files.file_schemas)
            if missing == len(files.file_schemas):
                notes[column] = how
            elif missing:
                notes[column] = f"{how}, in the {missing} file(s) without `{column}`"
        return notes

    def _derivable(self, table: str) -> dict[str, tuple[str, pl.Expr]]:
        """Per column, how it is derived and the expression (applied where it is null)."""
        if table != "rollouts":
            return {}
        present = self.tables[table].columns
        out: dict[str, tuple[str, pl.Expr]] = {
            "split": ("split = `train`", pl.lit("train")),
        }
        threshold = self.meta.get("correct_threshold")
        reward = pl.col("reward")
        if self.meta.get("correct_source") or self.meta.get("correct_unknown"):
            pass  # the writer said how correct was derived, or that it is unknown: no guess
        elif threshold is not None:
            out["correct"] = (
                f"correct = reward >= {threshold} (run.json correct_threshold)",
                reward >= threshold,
            )
        else:
            out["correct"] = ("correct = reward > 0 (no correct_threshold in run.json)", reward > 0)
        cap = self.meta.get("max_response_len")
        # A cap counts tokens: word counts (run.json response_len_unit "words") are never
        # compared with it.
        if cap is not None and not self.lengths_in_words:
            out["truncated"] = (
                f"truncated = response_len >= {cap} (run.json max_response_len)",
                pl.col("response_len") >= int(cap),
            )
        if "tool_calls" in present:
            out["n_tool_calls"] = (
                "n_tool_calls = number of entries in `tool_calls`",
                pl.col("tool_calls").list.len().cast(pl.Int32),
            )
        return out

    def scan(
        self, table: str, *, invalid_flags: bool = False, file_index: bool = False
    ) -> pl.LazyFrame:
        """The table as one LazyFrame with format-v1 types, derived columns and the step range.

        With `invalid_flags`, also a boolean `__invalid__<c>` per float column `c` (NaN/±inf in
        the file); projection pushdown drops the ones a query does not use. With `file_index`,
        a FILE_INDEX column: the row's file's index in the table's files."""
        if table == "rollouts" and self.steps_only:
            # No rollout to read: an empty table (e.g. for a rule naming a step's rollouts).
            spec = TABLES[table]
            return pl.LazyFrame(schema={c.name: _canonical(c, ()) for c in spec.columns})
        self.require(table)
        files = self.tables[table]
        frames = []
        index = {str(path): i for i, path in enumerate(files.files)}
        for (signature, hive), paths in _group_by_signature(files).items():
            named = FILE_INDEX if file_index else None
            lf = pl.scan_parquet(
                [str(p) for p in paths],
                hive_partitioning=False,
                glob=False,
                include_file_paths=named,
                storage_options=polars_options(self.path),
            )
            exprs = conform(files.schema, dict(signature), dict(hive), invalid_flags=invalid_flags)
            if file_index:
                exprs.append(
                    pl.col(FILE_INDEX)
                    .replace_strict(index, return_dtype=pl.Int64)
                    .alias(FILE_INDEX)
                )
            frames.append(lf.select(exprs))
        lf = frames[0] if len(frames) == 1 else pl.concat(frames, how="vertical")
        if self.step_range != (None, None):
            lf = lf.filter(self.in_step_range())
        present = files.columns
        fills = [
            (pl.col(column).fill_null(expr) if column in present else expr).alias(column)
            for column, (_, expr) in self._derivable(table).items()
        ]
        return lf.with_columns(fills) if fills else lf

    def in_step_range(self) -> pl.Expr:
        """Rows of the run's step range (a null step is in no range; true without one)."""
        lo, hi = self.step_range
        inside = pl.lit(True)
        if lo is not None:
            inside &= pl.col("step") >= lo
        if hi is not None:
            inside &= pl.col("step") <= hi
        return inside

    def only(self, table: str, indices: Iterable[int]) -> Run:
        """The run with `table` cut to the files at `indices` (same types, derived columns and
        run.json), and no step range: for reading some of its files alone."""
        files = self.tables[table]
        keep = list(indices)
        subset = replace(
            files,
            files=tuple(files.files[i] for i in keep),
            file_schemas=tuple(files.file_schemas[i] for i in keep),
            file_hive=tuple(files.file_hive[i] for i in keep) if files.file_hive else (),
            file_stats=tuple(files.file_stats[i] for i in keep) if files.file_stats else (),
            file_rows=tuple(files.file_rows[i] for i in keep) if files.file_rows else (),
        )
        return replace(self, tables={**self.tables, table: subset}, step_range=(None, None))

    @property
    def steps_only(self) -> bool:
        """A run whose trainer logged step metrics only: a steps table, no rollouts table."""
        return "rollouts" not in self.tables and "steps" in self.tables

    def require(self, table: str) -> None:
        """Raise a clear error when the run has no `table` (for commands that need it)."""
        if table in self.tables:
            return
        raise RlscopeError(
            f"{self.path}: no {table} table"
            + (": the trainer logged step metrics only" if self.steps_only else ""),
            hint=f"this command needs the {table} table ({table}.parquet or {table}/*.parquet); "
            "`rlscope analyze` reads what the run has",
        )

    def row_count(self, table: str) -> int:
        """Rows in the table within the step range (file metadata when no range is set)."""
        if table not in self.tables:
            return 0
        if self.step_range == (None, None):
            return self.tables[table].n_rows
        try:
            return int(self.scan(table).select(pl.len()).collect().item())
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise scan_error(self, [table], f"counting {table} rows", exc) from None

    def check_unchanged(self) -> None:
        """Raise if a file of the snapshot taken at open was removed or rewritten since."""
        # A store's listing (one per folder) says each object's size and time, not its ETag.
        listed = _listed_stats(self) if isinstance(self.path, StorePath) else {}
        for files in self.tables.values():
            for path, stat in zip(files.files, files.file_stats, strict=False):
                try:
                    now: tuple[int, ...] = (
                        listed[str(path)] if isinstance(path, StorePath) else _stat(path)
                    )
                except (OSError, KeyError):
                    raise RlscopeError(
                        f"{path}: removed while the run was being read (the run's files are "
                        "listed once, when it is opened)",
                        hint="re-run to analyse the files present now; RunWriter never removes "
                        "a finished file",
                    ) from None
                if now != stat[: len(now)]:
                    raise RlscopeError(
                        f"{path}: rewritten while the run was being read (size or mtime changed)",
                        hint="re-run; a writer should write a new file under a temporary name "
                        "and rename it, never rewrite a finished one (RunWriter does so)",
                    )

    def locate_bad_data(self, tables: Iterable[str]) -> str | None:
        """After a failed scan: the file, column and row range that cannot be read, if any.
        Reads every listed column row group by row group (only ever on the error path)."""
        for table in tables:
            if table not in self.tables:
                continue
            files = self.tables[table]
            for path, schema in zip(files.files, files.file_schemas, strict=True):
                found = _locate_in_file(path, [c for c in schema if c in files.schema])
                if found:
                    return found
        return None


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _listed_stats(run: Run) -> dict[str, tuple[int, int]]:
    """Each listed object's (size, mtime_ns) in the run's table folders, as listed now."""
    root = run.path
    assert isinstance(root, StorePath)
    folders = [root / name for name in run.tables]
    listed: list[StoreObject] = list_folder(root, recursive=False) or []
    for found in list_folders(folders):
        listed += found or []
    return {str(o.path): (o.size, o.mtime_ns) for o in listed}


def _locate_in_file(path: RunPath, columns: list[str]) -> str | None:
    try:
        source, filesystem = arrow_source(path)
        parquet = pq.ParquetFile(source, filesystem=filesystem)
    except (pa.ArrowException, OSError) as exc:
        return f"{path}: not a readable Parquet file ({exc})"
    start = 0
    with parquet:
        for group in range(parquet.metadata.num_row_groups):
            n = parquet.metadata.row_group(group).num_rows
            for column in columns:
                try:
                    data = parquet.read_row_group(group, columns=[column])
                    data.validate(full=True)  # includes UTF-8 validity of string columns
                except (pa.ArrowException, OSError) as exc:
                    return (
                        f"{path}: column `{column}`, rows {start:,}-{start + n - 1:,} "
                        f"(row group {group}): {exc}"
                    )
            start += n
    return None


def _group_by_signature(files: TableFiles) -> dict[tuple, list[RunPath]]:
    """Files that can share one scan: same column types and same hive-filled values."""
    groups: dict[tuple, list[RunPath]] = {}
    hive = files.file_hive or tuple({} for _ in files.files)
    for path, schema, values in zip(files.files, files.file_schemas, hive, strict=True):
        groups.setdefault((tuple(schema.items()), tuple(values.items())), []).append(path)
    return groups


def conform(
    target: dict[str, pl.DataType],
    file_schema: dict[str, pl.DataType],
    hive: dict[str, str],
    *,
    invalid_flags: bool = False,
    all_finite: Iterable[str] = (),
) -> list[pl.Expr]:
    """Select every unified column: cast what the file has, take hive folder values or null for
    what it lacks; NaN/inf in float columns become null (metrics use valid values only), and
    with `invalid_flags` a boolean `__invalid__<column>` marks where they were. Float columns in
    `all_finite` are known to hold no NaN/inf (no per-row check); with `invalid_flags` their
    flag column is left out."""
    finite = set(all_finite)
    exprs = []
    flags = []
    for name, dtype in target.items():
        is_float = isinstance(dtype, pl.Float32 | pl.Float64)
        if name not in file_schema:
            value = hive.get(name)
            lit = pl.lit(value).cast(dtype) if value is not None else pl.lit(None, dtype=dtype)
            exprs.append(lit.alias(name))
            if is_float and invalid_flags:
                flags.append(pl.lit(False).alias(INVALID_PREFIX + name))
            continue
        col = pl.col(name)
        if file_schema[name] != dtype:
            col = col.cast(dtype)
        if is_float and name not in finite:
            if invalid_flags:
                flags.append((~col.is_finite()).fill_null(False).alias(INVALID_PREFIX + name))
            col = pl.when(col.is_finite()).then(col).otherwise(None)
        exprs.append(col.alias(name))
    return exprs + flags


def open_run(
    path: str | os.PathLike[str],
    *,
    steps: tuple[int | None, int | None] = (None, None),
    check_rollouts: bool = True,
    memo: FooterMemo | None = None,
) -> Run:
    """Validate a run directory's layout, run.json and every file's schema (footers only) and,
    unless told not to (`analyze` checks them from each file's index), the rollouts' ids and
    values (`check_rollouts`). With a `memo`, a file whose size, modification time and version
    are those it had when its footer was last read is not read again."""
    root = location(path)
    warnings: list[str] = []
    tables: dict[str, TableFiles] = {}
    footers: Mapping[str, Iterable[Footer]] = {}
    found: Mapping[str, Sequence[RunPath] | None]
    if isinstance(root, StorePath):
        meta, objects = _list_store_run(root)
        found = {
            name: [o.path for o in listed] if listed else None for name, listed in objects.items()
        }
        known = memo.recall(root) if memo is not None else {}
        footers = _store_footers(objects, known)
    else:
        if not root.exists():
            raise RlscopeError(f"{root}: no such run directory")
        if not root.is_dir():
            raise RlscopeError(
                f"{root}: not a directory", hint="pass the run directory, not a file"
            )
        meta = _read_run_json(root)
        local = {name: _find_files(root, name, warnings) for name in TABLES}
        found = local
        known = memo.recall(root) if memo is not None else {}
        footers = {name: _local_footers(files, known) for name, files in local.items() if files}
    for name, spec in TABLES.items():
        files = found[name]
        if files is None:
            if name == "rollouts" and found["steps"] is not None:
                continue  # a run whose trainer logged step metrics only
            if spec.required:
                raise RlscopeError(
                    f"{root}: no `{name}` table (expected {name}.parquet or {name}/*.parquet)",
                    hint="the rollouts table is required (or, for a run with step metrics "
                    "only, a steps table); see schemas/run-format-v1.json",
                )
            continue
        tables[name] = _validate_table(root, name, files, footers[name], warnings)
    if memo is not None:
        now = {
            str(path): footer
            for name, files in found.items()
            if files
            for path, footer in zip(files, footers[name], strict=True)
        }
        if now != known:
            memo.keep(root, now)
    run = Run(root, meta, tables, (), steps, rollouts_checked=check_rollouts)
    if "rollouts" in tables and check_rollouts:
        warnings += check_rollouts_scan(run)
    return replace(run, warnings=tuple(warnings))


def _read_run_json(root: Path) -> dict[str, Any]:
    path = root / RUN_JSON
    if not path.is_file():
        raise _no_run_json(path)
    return _parse_run_json(path, path.read_bytes())


def _no_run_json(path: RunPath) -> RlscopeError:
    return RlscopeError(
        f"{path}: missing",
        hint='a run directory needs run.json, e.g. {"schema_version": 1, "run_id": "r1", '
        '"algorithm": "GRPO"}',
    )


def _parse_run_json(path: RunPath, data: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(data.decode("utf-8"))
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
        negative = isinstance(value, int | float) and value < 0
        if spec.json_type in ("integer", "number") and spec.name != "schema_version" and negative:
            raise RlscopeError(f"{path}: field `{spec.name}` must not be negative, got {value!r}")
    return meta


def _list_store_run(root: StorePath) -> tuple[dict[str, Any], dict[str, list[StoreObject]]]:
    """A run in a store: its run.json and each table's objects (the run's folder and each
    table's folder listed at once), with the layout rules of a local run."""
    folders = [root, *(root / name for name in TABLES)]
    top, *below = concurrently(lambda f: list_folder(f, recursive=f != root), folders)
    here = {o.path.name: o for o in top or []}
    if RUN_JSON not in here:
        if not top and not any(below):
            raise RlscopeError(
                f"{root}: no such run (no object under this prefix)",
                hint="check the URL: the run's folder holds run.json and the tables",
            )
        raise _no_run_json(root / RUN_JSON)
    meta = _parse_run_json(root / RUN_JSON, read_object(here[RUN_JSON].path))
    objects: dict[str, list[StoreObject]] = {}
    for name, listed in zip(TABLES, below, strict=True):
        single = here.get(f"{name}.parquet")
        inside = [
            o
            for o in listed or []
            if o.path.name.endswith(".parquet")
            and not any(
                part.startswith((".", "_")) for part in o.path.relative_to(root / name).parts
            )
        ]
        if single is not None and inside:
            raise RlscopeError(
                f"{root}: both {name}.parquet and {name}/ exist", hint="keep one layout per table"
            )
        objects[name] = [single] if single is not None else inside
    return meta, objects


#: What a file's footer says that the open keeps: (size, mtime_ns, inode or ETag digest), its
#: rows and its schema.
Footer = tuple[tuple[int, int, int], int, pa.Schema]


class FooterMemo(Protocol):
    """Footers read before, by file (`rlscope.cache.FooterCache`): a file whose stat is the one
    recalled is not read again (from a store: a HEAD for its version, no GET of its footer)."""

    def recall(self, root: RunPath) -> Mapping[str, Footer]: ...

    def keep(self, root: RunPath, footers: Mapping[str, Footer]) -> None: ...


def _store_footers(
    objects: dict[str, list[StoreObject]], known: Mapping[str, Footer]
) -> dict[str, list[Footer]]:
    """Every object's footer and version, CONCURRENCY requests in flight at once."""
    every = [o for listed in objects.values() for o in listed]
    read = dict(
        zip(
            (o.path for o in every),
            _footers(lambda found: _store_footer(found, known), every),
            strict=True,
        )
    )
    return {name: [read[o.path] for o in listed] for name, listed in objects.items()}


T = TypeVar("T")


def _footers(
    read: Callable[[T], Footer], items: Sequence[T], threads: int = CONCURRENCY
) -> list[Footer]:
    """`read` of each item's footer, `threads` at a time, in order (the first error in order
    raised); equal schemas kept once (a run's thousands of files mostly share one)."""
    schemas: dict[pa.Schema, pa.Schema] = {}
    lock = threading.Lock()

    def footer(item: T) -> Footer:
        stat, rows, schema = read(item)
        with lock:
            return stat, rows, schemas.setdefault(schema, schema)

    return concurrently(footer, items, threads)


def _store_footer(found: StoreObject, known: Mapping[str, Footer]) -> Footer:
    if found.size == 0:
        raise RlscopeError(f"{found.path}: empty object (0 bytes)", hint="delete it or re-write it")
    handle, tag = open_object(found.path)
    stat = (found.size, found.mtime_ns, tag)
    recalled = known.get(str(found.path))
    if recalled is not None and recalled[0] == stat:
        handle.close()
        return recalled
    try:
        with handle:
            footer = pq.read_metadata(handle)
    except pa.ArrowInvalid as exc:
        raise RlscopeError(
            f"{found.path}: not a readable Parquet file ({exc})",
            hint="an object cut mid-write has no footer; delete it or re-write it",
        ) from None
    except OSError as exc:
        raise store_error(found.path, exc) from None
    return stat, footer.num_rows, footer.schema.to_arrow_schema()


def _local_footers(files: list[Path], known: Mapping[str, Footer]) -> list[Footer]:
    """Every file's footer, one by one: threads read 2,067 footers faster (0.20-0.25 s against
    0.37-0.40 s) but 20,478 slower (3.1 against 2.7 s) at 2.4x the peak memory (616 against
    260 MB: each thread's allocations held apart), on 2 cores."""
    return _footers(lambda path: _local_footer(path, known), files, threads=1)


def _local_footer(path: Path, known: Mapping[str, Footer]) -> Footer:
    try:
        stat = _stat(path)
    except FileNotFoundError:
        raise RlscopeError(
            f"{path}: removed while the run was being opened", hint="re-run"
        ) from None
    recalled = known.get(str(path))
    if recalled is not None and recalled[0] == stat:
        return recalled
    footer = _footer(path, stat[0])
    return stat, footer.num_rows, footer.schema.to_arrow_schema()


def _find_files(root: Path, name: str, warnings: list[str]) -> list[Path] | None:
    single, folder = root / f"{name}.parquet", root / name
    if single.is_file() and folder.is_dir():
        raise RlscopeError(
            f"{root}: both {name}.parquet and {name}/ exist", hint="keep one layout per table"
        )
    if single.is_file():
        return [single] if _inside(root, single, warnings) else None
    if not folder.is_dir() or not _inside(root, folder, warnings):
        return None
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        here = Path(dirpath)
        # os.walk does not descend into symlinked folders; follow those that stay inside.
        kept = []
        for d in sorted(dirnames):
            if d.startswith((".", "_")):
                continue
            if (here / d).is_symlink():
                if _inside(root, here / d, warnings):
                    found.extend(_find_files_below(root, here / d, warnings))
                continue
            kept.append(d)
        dirnames[:] = kept
        for fname in sorted(filenames):
            if fname.startswith((".", "_")) or not fname.endswith(".parquet"):
                continue
            path = here / fname
            # Only the file itself can leave the run here: symlinked folders are not walked.
            if not path.is_symlink() or _inside(root, path, warnings):
                found.append(path)
    return sorted(found) or None


def _find_files_below(root: Path, folder: Path, warnings: list[str]) -> list[Path]:
    return [
        p
        for p in sorted(folder.rglob("*.parquet"))
        if not any(part.startswith((".", "_")) for part in p.relative_to(folder).parts)
        and _inside(root, p, warnings)
    ]


def _inside(root: Path, path: Path, warnings: list[str]) -> bool:
    """Symlinks (of files or folders) that leave the run directory are not followed."""
    if not path.resolve().is_relative_to(root.resolve()):
        warnings.append(f"{path}: symlink pointing outside the run directory, not read")
        return False
    return True


def _hive_values(folder: RunPath, path: RunPath) -> dict[str, str]:
    """`key=value` folder names between the table folder and the file."""
    try:
        parts = relative(path, folder).parts[:-1]
    except ValueError:
        return {}
    return dict(part.split("=", 1) for part in parts if "=" in part)


def _footer(path: Path, size: int) -> pq.FileMetaData:
    """The file's Parquet footer (its schema and row count), read once."""
    try:
        if size == 0:
            raise RlscopeError(f"{path}: empty file (0 bytes)", hint="delete it or re-write it")
        return pq.read_metadata(path)
    except RlscopeError:
        raise
    except FileNotFoundError:
        raise RlscopeError(
            f"{path}: removed while the run was being opened", hint="re-run"
        ) from None
    except (pa.ArrowException, OSError) as exc:
        raise RlscopeError(
            f"{path}: not a readable Parquet file ({exc})",
            hint="a file truncated mid-write has no footer; delete it or re-write it",
        ) from None


def _polars_schema(path: RunPath, arrow: pa.Schema, spec: Table) -> dict[str, pl.DataType]:
    """The file's columns as Polars types, each of the table's columns checked."""
    try:
        schema = dict(pl.from_arrow(arrow.empty_table()).schema)  # type: ignore[union-attr]
    except Exception as exc:  # an Arrow type Polars cannot hold
        raise RlscopeError(f"{path}: unsupported column type ({exc})") from None
    for col_name, dtype in schema.items():
        column = spec.column(col_name)
        if column is not None:
            _check_type(path, column, dtype)
    return schema


def _validate_table(
    root: RunPath,
    name: str,
    files: Sequence[RunPath],
    footers: Iterable[Footer],
    warnings: list[str],
) -> TableFiles:
    spec = TABLES[name]
    folder = root / name
    file_schemas: list[dict[str, pl.DataType]] = []
    file_hive: list[dict[str, str]] = []
    file_stats: list[tuple[int, int, int]] = []
    file_rows: list[int] = []
    # A run's files mostly share one schema: converted and type-checked once (the first file
    # with a bad type is the one named).
    checked: dict[pa.Schema, dict[str, pl.DataType]] = {}
    n_rows = 0
    for path, (stat, rows, arrow) in zip(files, footers, strict=True):
        file_stats.append(stat)
        n_rows += rows
        file_rows.append(rows)
        schema = checked.get(arrow)
        if schema is None:
            schema = checked[arrow] = _polars_schema(path, arrow, spec)
        hive = {
            k: v
            for k, v in _hive_values(folder, path).items()
            if k not in schema and spec.column(k) is not None
        }
        missing = [c for c in spec.required_columns if c not in schema and c not in hive]
        if missing:
            raise RlscopeError(
                f"{path}: required column(s) {', '.join(f'`{c}`' for c in missing)} missing "
                f"from the {name} table",
                hint=f"the {name} table needs {', '.join(spec.required_columns)}",
            )
        for col_name, value in hive.items():
            _check_hive_value(path, spec.column(col_name), value)  # type: ignore[arg-type]
        file_schemas.append(schema)
        file_hive.append(hive)
    unified: dict[str, pl.DataType] = {}
    for column in spec.columns:
        seen = [s[column.name] for s in file_schemas if column.name in s]
        if seen or any(column.name in h for h in file_hive):
            unified[column.name] = _canonical(column, seen)
    extra_types: dict[str, list[pl.DataType]] = {}
    reserved: set[str] = set()
    for schema in file_schemas:
        for col_name, dtype in schema.items():
            if col_name.startswith(INVALID_PREFIX):
                reserved.add(col_name)
            elif spec.column(col_name) is None:
                extra_types.setdefault(col_name, []).append(dtype)
    warnings.extend(
        f"{name}: extra column `{col_name}` uses rlscope's reserved prefix `{INVALID_PREFIX}`; "
        "not read"
        for col_name in sorted(reserved)
    )
    for col_name, types in extra_types.items():
        distinct = list(dict.fromkeys(types))
        if len(distinct) == 1:
            unified[col_name] = distinct[0]
        elif all(d.is_numeric() for d in distinct):
            unified[col_name] = pl.Float64()
            warnings.append(
                f"{name}: extra column `{col_name}` has types {', '.join(map(str, distinct))} "
                "in different files; read as float64"
            )
        elif all(d.is_numeric() or isinstance(d, pl.String | pl.Boolean) for d in distinct):
            unified[col_name] = pl.String()
            warnings.append(
                f"{name}: extra column `{col_name}` has types {', '.join(map(str, distinct))} "
                "in different files; read as string"
            )
        else:
            warnings.append(
                f"{name}: extra column `{col_name}` has incompatible types "
                f"{', '.join(map(str, distinct))} in different files; not read"
            )
    return TableFiles(
        name,
        tuple(files),
        tuple(file_schemas),
        unified,
        n_rows,
        tuple(file_hive),
        tuple(file_stats),
        tuple(file_rows),
    )


def _check_hive_value(path: RunPath, column: Column, value: str) -> None:
    try:
        pl.Series([value]).cast(column.dtype, strict=True)
    except pl.exceptions.PolarsError:
        raise RlscopeError(
            f"{path}: folder value {column.name}={value!r} is not a valid {type_name(column.dtype)}"
        ) from None


def _check_type(path: RunPath, column: Column, dtype: pl.DataType) -> None:
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


def rollout_counts(run: Run) -> list[pl.Expr]:
    """What the rollouts check counts (summed per file or over the run): rows without a step,
    without a finite reward, with an absurd response_len, and NaN/inf per other float column
    (of rows scanned with invalid flags)."""
    floats = [c for c, t in run.tables["rollouts"].schema.items() if t.is_float()]
    has_step, has_reward = pl.col("step").is_not_null(), pl.col("reward").is_not_null()
    return [
        (~has_step).sum().cast(pl.Int64).alias("no_step"),
        (has_step & ~has_reward).sum().cast(pl.Int64).alias("no_reward"),
        (has_step & has_reward & ~valid_rollout()).sum().cast(pl.Int64).alias("bad_len"),
        *[
            pl.col(INVALID_PREFIX + c).sum().cast(pl.Int64).alias(INVALID_PREFIX + c)
            for c in floats
            if c != "reward"
        ],
    ]


#: The frames of a table's index (`read_index`), each with a FILE_INDEX column: steps and
#: rollouts, each file's steps; rollouts, its ids as runs of consecutive ids (ID_MIN, ID_MAX)
#: and the check's counts (`rollout_counts`); probes, the rows per probed rollout_id.
STEPS_OF, IDS_OF, CHECKS_OF, PROBED = "steps_of", "ids_of", "checks_of", "probed"
ID_MIN, ID_MAX = "id_min", "id_max"
#: Which rollouts file holds an id (`files_of_ids`).
ROLLOUTS_FILE = "__rollouts_file__"
#: The columns every index frame has (with FILE_INDEX), even with no file.
INDEX_COLUMNS: dict[str, dict[str, pl.DataType]] = {
    STEPS_OF: {"step": pl.Int64()},
    IDS_OF: {ID_MIN: pl.Int64(), ID_MAX: pl.Int64()},
    CHECKS_OF: {},
    PROBED: {"rollout_id": pl.Int64(), "len": pl.Int64()},
}
#: Rows read at once for an index: its sorts and hashes are those of this many rows.
INDEX_BATCH_ROWS = 250_000


def index_queries(run: Run, table: str, rows: pl.LazyFrame) -> dict[str, pl.LazyFrame]:
    """What a table's index holds, per FILE_INDEX of `rows` (scanned with invalid flags)."""
    if table == "probes":
        return {PROBED: rows.group_by(FILE_INDEX, "rollout_id").agg(pl.len().cast(pl.Int64))}
    queries = {STEPS_OF: rows.select(FILE_INDEX, "step").unique()}
    if table == "rollouts":
        ids = rows.select(FILE_INDEX, "rollout_id").drop_nulls().sort(FILE_INDEX, "rollout_id")
        starts = (pl.col(FILE_INDEX) != pl.col(FILE_INDEX).shift(1)) | (
            pl.col("rollout_id") != pl.col("rollout_id").shift(1) + 1
        )
        queries[IDS_OF] = (
            ids.with_columns(starts.fill_null(True).cum_sum().alias("__run__"))
            .group_by("__run__")
            .agg(
                pl.col(FILE_INDEX).first(),
                pl.col("rollout_id").min().alias(ID_MIN),
                pl.col("rollout_id").max().alias(ID_MAX),
            )
            .drop("__run__")
        )
        queries[CHECKS_OF] = rows.group_by(FILE_INDEX).agg(rollout_counts(run))
    return queries


def index_names(table: str) -> list[str]:
    """The frames of `table`'s index."""
    if table == "probes":
        return [PROBED]
    return [STEPS_OF, IDS_OF, CHECKS_OF] if table == "rollouts" else [STEPS_OF]


def read_index(run: Run, table: str, files: Sequence[int]) -> dict[str, pl.DataFrame]:
    """The index frames of `table`'s `files` (FILE_INDEX: the index in the table's files),
    read in batches of consecutive files of at most INDEX_BATCH_ROWS rows, a larger file alone
    in slices of that many rows, so the memory is a batch's whatever the files' sizes."""
    rows = run.tables[table].file_rows
    batches: list[tuple[list[int], tuple[int, int] | None]] = []  # files, rows of a large one
    total = 0
    for i in files:
        if rows[i] > INDEX_BATCH_ROWS:
            step = INDEX_BATCH_ROWS
            batches += [([i], (offset, step)) for offset in range(0, rows[i], step)]
            continue
        if not batches or batches[-1][1] is not None or total + rows[i] > INDEX_BATCH_ROWS:
            batches.append(([], None))
            total = 0
        batches[-1][0].append(i)
        total += rows[i]
    parts: dict[str, list[pl.DataFrame]] = {name: [] for name in index_names(table)}
    for batch, rows_of_file in batches:
        local = run.only(table, batch).scan(table, file_index=True, invalid_flags=True)
        if rows_of_file is not None:
            local = local.slice(*rows_of_file)  # Polars reads only the row groups it spans
        original = pl.col(FILE_INDEX).replace_strict(dict(enumerate(batch)), return_dtype=pl.Int64)
        queries = index_queries(run, table, local)
        try:
            found = pl.collect_all([q.with_columns(original) for q in queries.values()])
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise scan_error(run, [table], f"reading {table}", exc) from None
        for name, frame in zip(queries, found, strict=True):
            parts[name].append(frame)
    index = {
        name: pl.concat(
            [pl.DataFrame(schema={FILE_INDEX: pl.Int64, **INDEX_COLUMNS[name]}), *frames],
            how="diagonal_relaxed",
        )
        for name, frames in parts.items()
    }
    if any(sliced is not None for _, sliced in batches):
        index = {name: _slices_merged(name, frame) for name, frame in index.items()}
    return index


def _slices_merged(name: str, frame: pl.DataFrame) -> pl.DataFrame:
    """An index frame with a file's slices as one: its steps once, its counts summed. (Its
    runs of ids stay as found: a run cut at a slice's edge is two runs that do not overlap,
    so no id is taken for a duplicate.)"""
    if name == STEPS_OF:
        return frame.unique(maintain_order=True)
    if name == CHECKS_OF:
        return frame.group_by(FILE_INDEX, maintain_order=True).agg(pl.all().sum())
    if name == PROBED:
        return frame.group_by(FILE_INDEX, "rollout_id", maintain_order=True).agg(
            pl.col("len").sum()
        )
    return frame


def files_of_ids(id_runs: pl.DataFrame, ids: pl.DataFrame) -> pl.DataFrame:
    """`ids` (with a rollout_id column) with ROLLOUTS_FILE, the file holding each, from the
    rollouts' `id_runs` (rows of ids no file holds are left out): the run of ids at or below
    the id, if it reaches it."""
    return (
        ids.drop_nulls("rollout_id")
        .sort("rollout_id")
        .join_asof(
            id_runs.select(pl.col(FILE_INDEX).alias(ROLLOUTS_FILE), ID_MIN, ID_MAX).sort(ID_MIN),
            left_on="rollout_id",
            right_on=ID_MIN,
            strategy="backward",
        )
        .filter(pl.col("rollout_id") <= pl.col(ID_MAX))
        .drop(ID_MIN, ID_MAX)
    )


def duplicate_ids(id_runs: pl.DataFrame, limit: int = 5) -> list[int]:
    """The smallest ids in two runs of `id_runs` (two files, or twice in one file), at most
    `limit`: runs of consecutive ids overlap exactly where an id is repeated."""
    runs = id_runs.sort(ID_MIN, ID_MAX)
    reach = runs[ID_MAX].cum_max().shift(1).alias("reach")
    overlaps = runs.with_columns(reach).filter(pl.col(ID_MIN) <= pl.col("reach"))
    found: list[int] = []
    for lo, hi, before in overlaps.select(ID_MIN, ID_MAX, "reach").iter_rows():
        start = max(lo, found[-1] + 1) if found else lo
        found += range(start, min(hi, before, start + limit - len(found) - 1) + 1)
        if len(found) >= limit:
            break
    return found[:limit]


def check_from_index(
    run: Run, rollouts: Mapping[str, pl.DataFrame], probes: Mapping[str, pl.DataFrame] | None
) -> list[str]:
    """`check_rollouts` from the rollouts' (and probes') index frames (`read_index`)."""
    checks = rollouts[CHECKS_OF].drop(FILE_INDEX)
    counts: dict[str, int | None] = {c: int(checks[c].sum()) for c in checks.columns}
    counts |= {c: counts.get(c, 0) for c in ("no_step", "no_reward", "bad_len")}
    unknown = (0, 0)
    if probes is not None:
        probed = probes[PROBED]
        known = files_of_ids(rollouts[IDS_OF], probed.select("rollout_id").unique())
        missing = probed.join(known, on="rollout_id", how="anti", nulls_equal=False)
        unknown = (int(missing["len"].sum()), missing["rollout_id"].n_unique())
    return check_rollouts(run, duplicate_ids(rollouts[IDS_OF]), counts, unknown)


def check_rollouts_scan(run: Run) -> list[str]:
    """`check_rollouts` from the rollouts (and probes) files read now, batch by batch."""
    unranged = replace(run, step_range=(None, None))
    index = {
        table: read_index(unranged, table, range(len(run.tables[table].files)))
        for table in ("rollouts", "probes")
        if table in run.tables
    }
    return check_from_index(run, index["rollouts"], index.get("probes"))


def check_rollouts(
    run: Run,
    duplicates: list[int],
    counts: Mapping[str, int | None],
    unknown_probed: tuple[int, int],
) -> list[str]:
    """Duplicate rollout ids (the first few, `duplicates`) are an error. Warnings: rows without
    a finite reward or with an absurd response_len (left out of the rollout metrics), NaN/inf
    in other float columns (`counts`, of `rollout_counts`), and probes whose rollout_id is not
    a rollout (`unknown_probed`: rows, ids)."""
    if duplicates:
        ids_text = ", ".join(str(i) for i in duplicates)
        raise RlscopeError(
            f"{run.path}: rollouts table has duplicate rollout_id values (e.g. {ids_text})",
            hint="rollout_id must be unique in the run; with several ranks, offset ids by rank",
        )
    warnings = []
    if counts["no_step"]:
        warnings.append(
            f"rollouts: {counts['no_step']:,} row(s) with a null step are left out of the "
            "rollout metrics"
        )
    if counts["no_reward"]:
        warnings.append(
            f"rollouts: {counts['no_reward']:,} row(s) with a missing, NaN or infinite reward "
            "are left out of the rollout metrics"
        )
    if counts["bad_len"]:
        warnings.append(
            f"rollouts: {counts['bad_len']:,} row(s) with a negative or absurd response_len "
            f"(< 0 or > {MAX_RESPONSE_LEN:,}) are left out of the rollout metrics"
        )
    invalid = {
        c.removeprefix(INVALID_PREFIX): n for c, n in counts.items() if c.startswith(INVALID_PREFIX)
    }
    warnings += invalid_warnings("rollouts", invalid)
    rows, n_ids = unknown_probed
    if rows:
        warnings.append(
            f"probes: {rows:,} row(s) reference {n_ids:,} rollout_id value(s) that are not in "
            "the rollouts table"
        )
    return warnings


def invalid_warnings(table: str, counts: dict[str, int | None]) -> list[str]:
    """`table.column: N NaN/inf values ignored` for every non-zero count."""
    return [
        f"{table}.{column}: {n:,} NaN/inf value(s) ignored (metrics use the valid ones)"
        for column, n in counts.items()
        if n
    ]


def scan_error(run: Run, tables: Iterable[str], what: str, exc: BaseException) -> RlscopeError:
    """The error for a failed scan: a file removed or rewritten since the open, else the file,
    column and rows that cannot be read, else Polars' message."""
    run.check_unchanged()
    located = run.locate_bad_data(tables)
    if located:
        return RlscopeError(
            f"{located}",
            hint="the file is corrupt or holds invalid data (e.g. non-UTF-8 bytes in a string "
            "column); re-write or delete it",
        )
    return RlscopeError(
        f"failed while {what}: {exc}",
        hint="`rlscope validate RUN` checks every file's schema; a file may be corrupt",
    )
