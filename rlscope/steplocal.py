"""The steps, rollouts and probes tables read per file: each file's results are cached and only
new or changed files are read (the usual live run: a file per flush)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import CodeType
from typing import Any, Protocol, runtime_checkable

import polars as pl

from rlscope._version import __version__
from rlscope.reader import (
    FILE_INDEX,
    IDS_OF,
    INDEX_COLUMNS,
    PROBED,
    ROLLOUTS_FILE,
    STEPS_OF,
    Run,
    files_of_ids,
    index_names,
    read_index,
    scan_error,
)
from rlscope.tokenscan import FILE_ID


class FrameStore(Protocol):
    """Frames kept per key between analyses (rlscope.cache.Parts): `open` says which keys it
    holds, `scans` reads their frames (FILE_ID: the key's index in `open`'s), `add` and
    `commit` store new ones."""

    def open(self, keys: Sequence[str]) -> list[bool]: ...

    def scans(self, name: str) -> list[pl.LazyFrame]: ...

    def add(self, key: str, frames: Mapping[str, pl.DataFrame]) -> None: ...

    def commit(self) -> None: ...


@runtime_checkable
class TableStore(Protocol):
    """Where a table's per-file results are kept (rlscope.cache.PartialCache)."""

    def file_keys(self, run: Run, table: str) -> list[str]: ...

    def table_frames(
        self, run: Run, table: str, role: str, fingerprint: str, names: Sequence[str]
    ) -> FrameStore: ...


@dataclass(frozen=True)
class TableRead:
    """How much of a table an analysis read: files read now vs results taken from the cache."""

    files: int = 0
    files_read: int = 0


#: A table's results over a run (or some of its files): frames by name, each with a `step`.
FramesOf = Callable[[Run], dict[str, pl.DataFrame]]


@dataclass(frozen=True)
class FileIndex:
    """What is known of each file of a table without reading it again (`reader.read_index`:
    steps; rollout id runs and check counts; probed ids), read once per file and then kept
    in the cache, and each file's cache key."""

    keys: list[str]
    frames: dict[str, pl.DataFrame]

    def files_with_steps(self, first: int, last: int) -> list[int]:
        """The files holding a step in [first, last], in file order."""
        inside = self.frames[STEPS_OF].filter(pl.col("step").is_between(first, last))
        return sorted(int(i) for i in inside[FILE_INDEX].unique())

    def files_of_ids(self, ids: pl.DataFrame) -> pl.DataFrame:
        """`ids` with ROLLOUTS_FILE, the rollouts file holding each (see `reader.files_of_ids`)."""
        return files_of_ids(self.frames[IDS_OF], ids)


def file_index(run: Run, table: str, store: TableStore | None) -> FileIndex:
    """`table`'s `FileIndex`: cached for the files seen before, read for the new ones (without
    a store: read for every file, and no keys)."""
    if store is None:
        return FileIndex([], read_index(run, table, range(len(run.tables[table].files))))
    keys = store.file_keys(run, table)
    names = index_names(table)
    index_store = store.table_frames(run, table, "index", INDEX_REVISION, names)
    known = index_store.open(keys)
    try:
        frames = {
            n: _collect_concat(index_store.scans(n), {FILE_ID: pl.Int64, **INDEX_COLUMNS[n]})
            for n in names
        }
    except CACHE_ERRORS:  # a part gone or damaged since `open`: read those files again
        known = [False] * len(keys)
        frames = {n: pl.DataFrame(schema={FILE_ID: pl.Int64, **INDEX_COLUMNS[n]}) for n in names}
    frames = {n: f.rename({FILE_ID: FILE_INDEX}) for n, f in frames.items()}
    new = [i for i, hit in enumerate(known) if not hit]
    if new:
        found = read_index(run, table, new)
        per_file = {
            name: dict(frame.partition_by(FILE_INDEX, as_dict=True, include_key=False))
            for name, frame in found.items()
        }
        empty = {name: frame.clear().drop(FILE_INDEX) for name, frame in found.items()}
        for i in new:
            index_store.add(keys[i], {n: per_file[n].get((i,), empty[n]) for n in names})
        index_store.commit()
        frames = {n: pl.concat([frames[n], found[n]], how="diagonal_relaxed") for n in names}
    return FileIndex(keys, frames)


def read_step_local(
    run: Run,
    table: str,
    names: Sequence[str],
    frames_of: FramesOf,
    *,
    store: TableStore | None = None,
    fingerprint: str = "",
    index: FileIndex | None = None,
) -> tuple[dict[str, pl.DataFrame], TableRead]:
    """`frames_of(run)` (frames named `names`), from the cache where it holds the results and
    read for the rest (`index`: the table's `file_index`, when already read).

    Every result of `frames_of` is keyed by step and computed from that step's rows alone. So
    the table's files fall into groups that share no step with another group (files linked by
    a common step are one group: a step written by several ranks, or flushed in two files),
    a group's results are the rows of its steps, and the run's are the groups' concatenated.
    Each file's steps are cached (read once), each group's results under the keys of its
    files: a file appended to a live run is its own group and is the only one read; a file
    holding a step of an earlier group makes a new group of both, read again. The run's step
    range is applied after the merge."""
    n_files = len(run.tables[table].files)
    if store is None:
        return frames_of(run), TableRead(n_files, n_files)
    index = index or file_index(run, table, store)
    keys, file_steps = index.keys, index.frames[STEPS_OF]
    groups = _groups(n_files, file_steps)
    group_keys = [_group_key([keys[i] for i in group]) for group in groups]
    results = store.table_frames(run, table, "results", fingerprint, names)
    hits = results.open(group_keys)
    cached = {}
    if any(hits):
        try:
            cached = {name: _collect_concat(results.scans(name), None) for name in names}
        except CACHE_ERRORS:
            hits = [False] * len(groups)
    missed = [i for i, hit in enumerate(hits) if not hit]
    read = sorted(i for g in missed for i in groups[g])
    computed = frames_of(run.only(table, read)) if read else {}
    if missed:
        group_of = {i: g for g in missed for i in groups[g]}
        steps = (
            file_steps.filter(pl.col(FILE_INDEX).is_in(read))
            .with_columns(pl.col(FILE_INDEX).replace_strict(group_of).alias(GROUP))
            .select(GROUP, "step")
            .unique()
        )
        by_group = {
            name: frame.join(steps, on="step", how="inner", nulls_equal=True).partition_by(
                GROUP, as_dict=True, include_key=False
            )
            for name, frame in computed.items()
        }
        for g in missed:
            results.add(
                group_keys[g],
                {name: by_group[name].get((g,), computed[name].clear()) for name in computed},
            )
        results.commit()
    merged = {}
    for name in names:  # a cached frame with no row still has the columns a read one has
        parts = [cached[name].drop(FILE_ID)] if name in cached else []
        parts += [computed[name]] if name in computed else []
        if parts:
            merged[name] = pl.concat(parts, how="diagonal_relaxed").filter(run.in_step_range())
    return merged, TableRead(n_files, len(read))


def read_probes(
    run: Run,
    rows_of: Callable[[Run], pl.LazyFrame],
    *,
    store: TableStore | None = None,
    fingerprint: str = "",
    probes: FileIndex | None = None,
    rollouts: FileIndex | None = None,
) -> tuple[pl.DataFrame, TableRead]:
    """`rows_of(run)` (a row per probe joined with its rollout, with the probe's FILE_INDEX),
    from the cache where it holds a probes file's rows and read for the rest; the run's step
    range (of the probed rollouts) applied after.

    A probes file's rows depend on the file and on the rollouts its ids name. The `probes`
    and `rollouts` tables' `file_index`es say which rollouts files hold a probes file's ids; a
    probes file's rows are cached under its key and theirs. So rollouts appended to a live run
    leave the probes read before untouched, and a probes file is read again only when a
    rollouts file holding one of its ids is new or changed; then it is joined with those
    rollouts files only."""
    n_files = len(run.tables["probes"].files)
    unranged = replace(run, step_range=(None, None))
    if store is None or probes is None or rollouts is None:
        rows = _collect_rows(run, rows_of(unranged)).drop(FILE_INDEX)
        return rows.filter(run.in_step_range()), TableRead(n_files, n_files)
    pairs = rollouts.files_of_ids(probes.frames[PROBED]).select(FILE_INDEX, ROLLOUTS_FILE).unique()
    basis: dict[int, list[int]] = {i: [] for i in range(n_files)}
    for (i,), frame in pairs.partition_by(FILE_INDEX, as_dict=True).items():
        basis[int(i)] = sorted(frame[ROLLOUTS_FILE].to_list())
    entry_keys = [
        _group_key([probes.keys[i], *(f"rollouts:{rollouts.keys[r]}" for r in basis[i])])
        for i in range(n_files)
    ]
    results = store.table_frames(run, "probes", "results", fingerprint, [PROBE_ROWS])
    hits = results.open(entry_keys)
    parts = []
    if any(hits):
        try:
            parts.append(_collect_concat(results.scans(PROBE_ROWS), None).drop(FILE_ID))
        except CACHE_ERRORS:
            hits = [False] * n_files
    missed = [i for i, hit in enumerate(hits) if not hit]
    if missed:
        needed = sorted({r for i in missed for r in basis[i]})
        query = rows_of(unranged.only("probes", missed).only("rollouts", needed or [0]))
        # No rollouts file may hold their ids: no row, and nothing to read.
        computed = _collect_rows(run, query if needed else query.clear()).with_columns(
            pl.col(FILE_INDEX).replace_strict(dict(enumerate(missed)))
        )
        per_file = dict(computed.partition_by(FILE_INDEX, as_dict=True, include_key=False))
        empty = computed.clear().drop(FILE_INDEX)
        for i in missed:
            results.add(entry_keys[i], {PROBE_ROWS: per_file.get((i,), empty)})
        results.commit()
        parts.append(computed.drop(FILE_INDEX))
    rows = pl.concat(parts, how="diagonal_relaxed")
    return rows.filter(run.in_step_range()), TableRead(n_files, len(missed))


#: What reading a cache part that was damaged or removed meanwhile raises.
CACHE_ERRORS = (OSError, pl.exceptions.PolarsError)
#: Bumped when what a file's index holds (`reader.read_index`) changes.
INDEX_REVISION = "2"
#: A probes file's rows (cached per file).
PROBE_ROWS = "rows"
GROUP = "__group__"


def _collect_rows(run: Run, query: pl.LazyFrame) -> pl.DataFrame:
    try:
        return query.collect()
    except CACHE_ERRORS as exc:
        raise scan_error(run, ["probes", "rollouts"], "reading probes", exc) from None


def _collect_concat(scans: list[pl.LazyFrame], schema: dict[str, Any] | None) -> pl.DataFrame:
    """The scans' rows as one frame, with the columns and types the stored frames had (rows
    or none; with `schema`, its columns are there even when there is no part)."""
    frames = pl.collect_all(scans) if scans else []
    base = [pl.DataFrame(schema=schema)] if schema is not None else []
    return pl.concat(base + frames, how="diagonal_relaxed") if base + frames else pl.DataFrame()


def _groups(n_files: int, file_steps: pl.DataFrame) -> list[list[int]]:
    """The files in groups linked by a common step (connected components), in file order."""
    parent = list(range(n_files))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for files in file_steps.group_by("step").agg(FILE_INDEX)[FILE_INDEX].to_list():
        first = root(files[0])
        for other in files[1:]:
            parent[root(other)] = first
    groups: dict[int, list[int]] = {}
    for i in range(n_files):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def _group_key(file_keys: list[str]) -> str:
    if len(file_keys) == 1:
        return file_keys[0]
    return hashlib.blake2b("\n".join(sorted(file_keys)).encode(), digest_size=16).hexdigest()


def fingerprint(run: Run, table: str, parts: Sequence[Any]) -> str:
    """Changes whenever a cached result of `table` could differ: rlscope's version, run.json,
    the table's types and `parts` (the expressions, and the code of the functions, that make
    the results)."""
    pieces = [__version__, table, json.dumps(run.meta, sort_keys=True, default=str)]
    pieces += [f"{c}:{t}" for c, t in run.tables[table].schema.items()]
    pieces += [_describe(part) for part in parts]
    return hashlib.blake2b("\n".join(pieces).encode(), digest_size=16).hexdigest()


def _describe(part: Any, depth: int = 0) -> str:
    """A stable text of what makes a result: an expression's text; a function's code (nested
    code too), constants and closed-over values; containers item by item. Never an address."""
    if isinstance(part, pl.Expr):
        return str(part)
    if depth > 4:
        return type(part).__name__
    if isinstance(part, CodeType):
        consts = [_describe(c, depth + 1) for c in part.co_consts]
        return f"{part.co_code.hex()}{consts}{part.co_names}"
    code = getattr(part, "__code__", None)
    if code is not None:
        cells = [_describe(c.cell_contents, depth + 1) for c in part.__closure__ or ()]
        return f"{_describe(code, depth + 1)}{cells}"
    if isinstance(part, Mapping):
        return repr({str(k): _describe(v, depth + 1) for k, v in part.items()})
    if isinstance(part, list | tuple):
        return repr([_describe(v, depth + 1) for v in part])
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(part))
