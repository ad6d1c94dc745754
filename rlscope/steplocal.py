"""The steps and rollouts tables read per file: a file's step-keyed results are cached, and only
new files are read, when no step spans two files (the usual live run: a file per flush)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any, Protocol, runtime_checkable

import polars as pl

from rlscope._version import __version__
from rlscope.reader import FILE_INDEX, Run, scan_error
from rlscope.tokenscan import FILE_ID

#: The (file, step) pairs of a file, stored with its results: what says whether a step spans
#: two files.
STEPS_OF = "steps_of"


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


def read_step_local(
    run: Run,
    table: str,
    names: Sequence[str],
    frames_of: FramesOf,
    *,
    store: TableStore | None = None,
    fingerprint: str = "",
) -> tuple[dict[str, pl.DataFrame], TableRead]:
    """`frames_of(run)` (frames named `names`), from the cache where it holds the results and
    read for the rest.

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
    keys = store.file_keys(run, table)
    steps_store = store.table_frames(run, table, "steps", STEPS_REVISION, [STEPS_OF])
    known = steps_store.open(keys)
    try:
        file_steps = _collect_concat(steps_store.scans(STEPS_OF), FILE_STEPS)
    except CACHE_ERRORS:  # a part gone or damaged since `open`: read those files again
        known, file_steps = [False] * n_files, pl.DataFrame(schema=FILE_STEPS)
    file_steps = file_steps.rename({FILE_ID: FILE_INDEX})
    new = [i for i, hit in enumerate(known) if not hit]
    if new:
        local = run.only(table, new).scan(table, file_index=True)
        try:
            steps_new = (
                local.select(FILE_INDEX, "step")
                .unique()
                .with_columns(pl.col(FILE_INDEX).replace_strict(dict(enumerate(new))))
                .collect()
            )
        except CACHE_ERRORS as exc:
            raise scan_error(run, [table], f"reading {table}", exc) from None
        for (index,), steps in steps_new.partition_by(FILE_INDEX, as_dict=True).items():
            steps_store.add(keys[int(index)], {STEPS_OF: steps.drop(FILE_INDEX)})
        for index in set(new) - set(steps_new[FILE_INDEX].to_list()):  # a file with no row
            steps_store.add(keys[index], {STEPS_OF: steps_new.clear().drop(FILE_INDEX)})
        steps_store.commit()
        file_steps = pl.concat([file_steps, steps_new], how="diagonal_relaxed")
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
    for name in names:
        parts = [cached[name].drop(FILE_ID)] if name in cached and cached[name].height else []
        parts += [computed[name]] if name in computed else []
        if parts:
            merged[name] = pl.concat(parts, how="diagonal_relaxed").filter(run.in_step_range())
    return merged, TableRead(n_files, len(read))


#: What reading a cache part that was damaged or removed meanwhile raises.
CACHE_ERRORS = (OSError, pl.exceptions.PolarsError)
#: Bumped when what is stored of a file's steps changes.
STEPS_REVISION = "1"
FILE_STEPS = {FILE_ID: pl.Int64, "step": pl.Int64}
GROUP = "__group__"


def _collect_concat(scans: list[pl.LazyFrame], schema: dict[str, Any] | None) -> pl.DataFrame:
    """The scans' rows as one frame (a part whose files had no row stores no column: with
    `schema`, those columns are there all the same)."""
    frames = [f for f in pl.collect_all(scans) if f.height] if scans else []
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
