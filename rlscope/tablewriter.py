"""TableWriter: format-v1 rows buffered per table and written as Parquet files, crash-safely."""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlscope.atomic import atomic_write
from rlscope.schema import RUN_FIELDS, RUN_JSON, SCHEMA_VERSION, TABLES

# Rows buffered per table before a flush writes one file (one row group of this size, or for
# the tokens table a row group per step where steps are large enough).
DEFAULT_FLUSH_ROWS = {"steps": 10_000, "rollouts": 200_000, "tokens": 1_000_000, "probes": 200_000}
#: A step's token rows get a row group of their own when there are at least this many: its
#: statistics then say it holds one step, and the token scan does not decode the step column
#: (rlscope.tokenscan.reduce._step_spans). Smaller ones share a row group with their neighbours
#: (many small row groups cost more to read than the step column saves).
STEP_ROW_GROUP_ROWS = 65_536

TableLike = Any  # dict of columns, list of row dicts, pyarrow.Table, polars.DataFrame, pandas


def _to_polars(data: TableLike) -> pl.DataFrame:
    if isinstance(data, pl.DataFrame):
        return data
    if isinstance(data, pa.Table | pa.RecordBatch):
        return pl.from_arrow(data)  # type: ignore[return-value]
    if isinstance(data, Mapping):
        columns = {}
        for name, col in data.items():
            if hasattr(col, "detach"):  # torch tensor
                col = col.detach().cpu().numpy()
            if isinstance(col, np.ndarray):
                # Copy: polars wraps numpy buffers zero-copy, and a training loop that reuses
                # its arrays would otherwise rewrite rows still waiting in the buffer.
                col = col.copy()
                if col.ndim == 0:
                    col = col.reshape(1)
            columns[name] = col
        return pl.DataFrame(columns)
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        return pl.from_dicts(list(data)) if data else pl.DataFrame()
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas
        return pl.from_pandas(data)
    raise TypeError(
        f"cannot log {type(data).__name__}: pass a dict of columns, a list of row "
        "dicts, a pyarrow Table or a polars DataFrame"
    )


def _conform(table: str, frame: pl.DataFrame) -> pl.DataFrame:
    """Check required columns and cast known columns to their format-v1 types."""
    spec = TABLES[table]
    missing = [c for c in spec.required_columns if c not in frame.columns]
    if missing:
        raise ValueError(f"log_{table}: missing required column(s) {', '.join(missing)}")
    targets: dict[str, pl.DataType] = {}
    for name in frame.columns:
        col = spec.column(name)
        if col is None or frame.schema[name] == col.dtype:
            continue
        targets[name] = pl.String() if isinstance(col.dtype, pl.Categorical) else col.dtype
    if not targets:
        return frame
    try:
        out = frame.with_columns(pl.col(n).cast(t, strict=True) for n, t in targets.items())
    except pl.exceptions.PolarsError as exc:
        raise ValueError(
            f"log_{table}: a column cannot be cast to its format-v1 type: {exc}"
        ) from exc
    # Some casts "succeed" without producing the target type (a struct casts field by field).
    wrong = [n for n, t in targets.items() if out.schema[n] != t]
    if wrong:
        raise ValueError(
            f"log_{table}: column(s) {', '.join(wrong)} cannot be cast to their format-v1 type"
        )
    return out


class TableWriter:
    """Buffers rows per table and writes zstd Parquet files under temporary names, then renames.

    One file per flush: `<run_dir>/<table>/r<rank>-<seq>.parquet`. A crash loses at most the
    unflushed buffer; a file under a final name is always complete. Thread-safe; several ranks
    may write into one run directory (pass `rank`).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        run_id: str | None = None,
        algorithm: str = "unknown",
        rank: int = 0,
        flush_rows: Mapping[str, int] | None = None,
        **meta: Any,
    ) -> None:
        known = {f.name for f in RUN_FIELDS} - {"schema_version"}  # set by the writer only
        unknown = sorted(set(meta) - known)
        if unknown:
            raise TypeError(f"unknown run.json field(s): {', '.join(unknown)}")
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.flush_rows = {**DEFAULT_FLUSH_ROWS, **(flush_rows or {})}
        self._buffers: dict[str, list[pl.DataFrame]] = {t: [] for t in TABLES}
        self._buffered: dict[str, int] = dict.fromkeys(TABLES, 0)
        # Zero-row frame with the merged schema of each table's buffer.
        self._shapes: dict[str, pl.DataFrame] = {t: pl.DataFrame() for t in TABLES}
        self._seq = 0
        self._lock = threading.RLock()
        self._closed = False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_json = self.run_dir / RUN_JSON
        if not run_json.exists():
            doc = {
                "schema_version": SCHEMA_VERSION,
                "run_id": run_id or self.run_dir.resolve().name,
                "algorithm": algorithm,
                **{k: v for k, v in meta.items() if v is not None},
            }
            atomic_write(run_json, json.dumps(doc, indent=2) + "\n")
        # Continue numbering after files an earlier process of this rank left behind.
        prefix = f"r{self.rank:03d}-"
        for table in TABLES:
            for path in (self.run_dir / table).glob(f"{prefix}*.parquet"):
                try:
                    self._seq = max(self._seq, int(path.stem[len(prefix) :]))
                except ValueError:
                    continue

    def log_step(self, step: int, **metrics: float) -> None:
        """One optimizer step's trainer metrics (`loss`, `grad_norm`, `kl`, ...)."""
        row = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items()}}
        self._append("steps", pl.DataFrame([row]))

    def log_steps(self, data: TableLike) -> None:
        """Many steps' metrics at once: a `step` column and one column per metric (null where
        a step did not log it)."""
        self._append("steps", _to_polars(data))

    def log_rollouts(self, data: TableLike) -> None:
        """Rollout rows: dict of columns, list of row dicts, Arrow or Polars frame."""
        self._append("rollouts", _to_polars(data))

    def log_tokens(self, data: TableLike) -> None:
        """Token rows (numpy arrays are fine; torch tensors via `.numpy()`)."""
        self._append("tokens", _to_polars(data))

    def log_probes(self, data: TableLike) -> None:
        """Faithfulness-probe rows."""
        self._append("probes", _to_polars(data))

    def _append(self, table: str, frame: pl.DataFrame) -> None:
        if frame.height == 0:
            return
        frame = _conform(table, frame)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            # Reject a batch the buffer could never be concatenated with, instead of buffering
            # it and making every later flush (and close) of this table fail.
            try:
                shape = pl.concat([self._shapes[table], frame.clear()], how="diagonal_relaxed")
            except pl.exceptions.PolarsError as exc:
                raise ValueError(
                    f"log_{table}: columns incompatible with rows already buffered: {exc}"
                ) from exc
            self._shapes[table] = shape
            self._buffers[table].append(frame)
            self._buffered[table] += frame.height
            if self._buffered[table] >= self.flush_rows[table]:
                self._flush_table(table)

    def flush(self) -> None:
        """Write every buffered row to disk now."""
        with self._lock:
            for table in TABLES:
                self._flush_table(table)

    def _flush_table(self, table: str) -> None:
        if not self._buffers[table]:
            return
        frame = pl.concat(self._buffers[table], how="diagonal_relaxed")
        self._seq += 1
        path = self.run_dir / table / f"r{self.rank:03d}-{self._seq:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            table_data = frame.to_arrow()
            # Float columns: byte-stream-split + zstd is ~1/3 smaller than dictionary + zstd.
            floats = [f.name for f in table_data.schema if pa.types.is_floating(f.type)]
            with pq.ParquetWriter(
                tmp,
                table_data.schema,
                compression="zstd",
                use_byte_stream_split=floats or False,
                use_dictionary=[n for n in table_data.column_names if n not in floats],
            ) as parquet:
                bounds = row_group_bounds(frame) if table == "tokens" else [0, frame.height]
                for start, end in itertools.pairwise(bounds):
                    parquet.write_table(table_data.slice(start, end - start), max(1, end - start))
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # Only forget the rows once they are safely on disk: a failed write can be retried.
        self._buffers[table] = []
        self._buffered[table] = 0
        self._shapes[table] = pl.DataFrame()

    def close(self) -> None:
        """Flush and stop accepting rows. Idempotent."""
        with self._lock:
            if not self._closed:
                self.flush()
                self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def row_group_bounds(frame: pl.DataFrame) -> list[int]:
    """Row offsets cutting a token frame into row groups: each run of one step of at least
    STEP_ROW_GROUP_ROWS rows a row group of its own, the rows between such runs one row group
    (unsorted or small steps: one row group, as a single group would be)."""
    bounds = [0]
    if "step" in frame.columns:
        end = 0
        for length in frame["step"].rle().struct.field("len").to_list():
            start, end = end, end + length
            if length >= STEP_ROW_GROUP_ROWS:
                bounds += [start, end] if start != bounds[-1] else [end]
    if len(bounds) == 1 or bounds[-1] != frame.height:
        bounds.append(frame.height)  # the rows after the last large step (or all of them)
    return bounds


def _scalar(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def next_rollout_id(run_dir: Path) -> int:
    """One past the largest rollout_id already in the run directory (from Parquet statistics):
    where a writer that resumes a run numbers its next rollout."""
    largest = -1
    for path in (run_dir / "rollouts").rglob("*.parquet"):
        if path.name.startswith((".", "_")):
            continue
        try:
            meta = pq.ParquetFile(path).metadata
            index = meta.schema.to_arrow_schema().get_field_index("rollout_id")
            for group in range(meta.num_row_groups):
                stats = meta.row_group(group).column(index).statistics
                if stats is not None and stats.has_min_max:
                    largest = max(largest, int(stats.max))
        except Exception:  # an unreadable file is rlscope validate's business, not ours
            continue
    return largest + 1
