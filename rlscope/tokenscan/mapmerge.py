"""The map over chunks of token files, the merge by summation, the cache, and scan_tokens."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Protocol

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from rlscope.exactsum import ENGINE
from rlscope.reader import INVALID_PREFIX, Run
from rlscope.store import RunPath, arrow_source, polars_options
from rlscope.tokenscan import limits
from rlscope.tokenscan.plan import (
    _KEY_TYPES,
    FILE,
    LEVEL_KEYS,
    ROWS,
    ScanStats,
    TokenFile,
    TokenPlan,
    merged,
    token_files,
)
from rlscope.tokenscan.reduce import (
    _batches,
    _collect,
    _conformed,
    _grouped_levels,
    _reduce_rows,
    collect_all,
)


def pieces(files: list[TokenFile]) -> list[TokenFile]:
    """The files, each larger than PIECE_FILE_BYTES split into pieces of whole row groups of
    about PIECE_ROWS rows (so one large file is reduced by every worker, not one)."""
    out: list[TokenFile] = []
    for file in files:
        if file.row_groups is not None or file.stat[0] <= limits.PIECE_FILE_BYTES:
            out.append(file)
            continue
        source, filesystem = arrow_source(file.path)
        meta = pq.read_metadata(source, filesystem=filesystem)
        groups: list[list[int]] = [[]]
        rows = 0
        for index in range(meta.num_row_groups):
            if groups[-1] and rows >= limits.PIECE_ROWS:
                groups.append([])
                rows = 0
            groups[-1].append(index)
            rows += meta.row_group(index).num_rows
        if len(groups) == 1:
            out.append(file)
        else:
            out += [replace(file, row_groups=tuple(g)) for g in groups]
    return out


def chunks(files: list[TokenFile]) -> list[list[TokenFile]]:
    """Consecutive files (or pieces) grouped up to CHUNK_BYTES each: the unit of work of the
    map stage."""
    out: list[list[TokenFile]] = []
    size = 0
    for file in files:
        if not out or size + file.stat[0] > limits.CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(file)
        size += file.stat[0]
    return out


def chunk_partials(files: list[TokenFile], plan: TokenPlan) -> list[dict[str, pl.DataFrame]]:
    """Each file of a chunk reduced to every level's partials (a frame per level, keyed by
    LEVEL_KEYS): `chunk_tagged` split by file."""
    return by_file(chunk_tagged(files, plan), len(files))


def chunk_tagged(files: list[TokenFile], plan: TokenPlan) -> dict[str, pl.DataFrame]:
    """The map stage: each file of a chunk reduced to every level's partials, a frame per level
    of every file's rows tagged in FILE with its index in the chunk (keyed by FILE and
    LEVEL_KEYS): thousands of small files make a few frames, not a few per file. Batches of
    small files are reduced together, keyed by file too, so many small files cost about what
    one large one does. Pure: depends on the files' contents and the plan only."""
    # Each batch's partials, tagged in FILE.
    parts: dict[str, list[pl.DataFrame]] = {level: [] for level in plan.levels}
    # (file index, its rows as read) or (None, rows of several files tagged in FILE)
    pending: list[tuple[int | None, pl.DataFrame]] = []
    pending_rows = 0

    def reduce_pending() -> None:
        nonlocal pending_rows
        index, frame = pending[0]
        if len(pending) == 1 and index is not None:
            for level, result in _reduce_rows(_conformed(frame, files[index], plan), plan).items():
                parts[level].append(_tagged([(index, result)]))
        else:
            # Conformed once per kind of file (types, hive values), not file by file.
            kinds: dict[tuple, list[pl.DataFrame]] = {}
            for index, frame in pending:
                first = index if index is not None else int(frame[FILE][0])
                tagged = _tagged([(index, frame)]) if index is not None else frame
                kinds.setdefault(_kind(files[first]), []).append(tagged)
            conformed = [
                _conformed(pl.concat(same), files[int(same[0][FILE][0])], plan, keep=(FILE,))
                for same in kinds.values()
            ]
            rows = pl.concat(conformed, how="diagonal_relaxed")  # flags only where NaN/inf
            for level, result in _collect([_grouped_levels(rows, plan, [FILE, "step"])]).items():
                parts[level].append(result)
        pending.clear()
        pending_rows = 0

    for index, batch in _reads(files):
        # A batch large enough for the run-by-run path is reduced alone; small ones (of
        # small files) are pooled up to POOL_ROWS.
        alone = index is not None and batch.height >= limits.MIN_STEP_RUN_ROWS
        if alone and pending:
            reduce_pending()
        pending.append((index, batch))
        pending_rows += batch.height
        if alone or pending_rows >= limits.POOL_ROWS:
            reduce_pending()
    if pending:
        reduce_pending()
    return _summed([parts], plan, tagged=True)


def by_file(tagged: Mapping[str, pl.DataFrame], count: int) -> list[dict[str, pl.DataFrame]]:
    """`chunk_tagged`'s frames split into each of its `count` files' partials."""
    split: list[dict[str, pl.DataFrame]] = [{} for _ in range(count)]
    for level, frame in tagged.items():
        files = frame.partition_by(FILE, as_dict=True, include_key=False, maintain_order=True)
        empty = frame.clear().drop(FILE)
        for index, one in enumerate(split):
            one[level] = files.get((index,), empty)
    return split


def _untagged(tagged: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    return {level: frame.drop(FILE) for level, frame in tagged.items()}


def _reads(files: list[TokenFile]) -> Iterator[tuple[int | None, pl.DataFrame]]:
    """The chunk's rows: a file's batches, with its index; consecutive small files of one kind
    read together, up to POOL_BYTES of Parquet, by one Polars scan (a live run's thousands of
    small files cost about what their rows do), their rows tagged with their index in FILE."""
    i = 0
    while i < len(files):
        j, size = i, 0
        while (
            j < len(files)
            and _small(files[j])
            and _kind(files[j]) == _kind(files[i])
            and (j == i or size + files[j].stat[0] <= limits.POOL_BYTES)
        ):
            size += files[j].stat[0]
            j += 1
        if j - i <= 1:
            yield from ((i, batch) for batch in _batches(files[i]))
            i += 1
            continue
        pool = files[i:j]
        paths = {str(f.path): i + k for k, f in enumerate(pool)}
        options = polars_options(pool[0].path)  # a run's files are in one store
        present = [c for c in pool[0].target if c in pool[0].schema]
        counts = [f.rows for f in pool if f.rows is not None]
        if len(counts) < len(pool):
            scan = pl.scan_parquet(
                list(paths),
                include_file_paths=FILE,
                hive_partitioning=False,
                glob=False,
                storage_options=options,
            )
            files_of = pl.col(FILE).replace_strict(paths, return_dtype=pl.Int32)
            yield None, scan.select(*present, files_of).collect()
        else:
            # Each row's file from the files' row counts (their footers, read at open): no
            # path per row to write and map (half the cost of reading 10k-row files).
            scan = pl.scan_parquet(
                list(paths), hive_partitioning=False, glob=False, storage_options=options
            )
            rows = scan.select(present).collect()
            index = np.repeat(np.arange(i, j, dtype=np.int32), counts)
            if index.size != rows.height:
                raise OSError(f"{pool[0].path} and the files after it changed since the open")
            yield None, rows.with_columns(pl.Series(FILE, index))
        i = j


def _small(file: TokenFile) -> bool:
    return file.row_groups is None and file.stat[0] <= limits.SMALL_FILE_BYTES


def file_partials(file: TokenFile, plan: TokenPlan) -> dict[str, pl.DataFrame]:
    """The map stage for one file (see `chunk_partials`)."""
    return chunk_partials([file], plan)[0]


def merge(
    partials: Iterable[Mapping[str, pl.DataFrame]], plan: TokenPlan
) -> dict[str, pl.DataFrame]:
    """The reduce stage: files' (or workers') partials summed per key (maxima maximised),
    float sums in an order of their values (`merged`): the same files' partials in any order
    give the same bits."""
    parts: dict[str, list[pl.DataFrame]] = {level: [] for level in plan.levels}
    for one in partials:
        for level in plan.levels:
            parts[level].append(one[level])
    return _summed([parts], plan)


def fold(
    partials: Iterable[Mapping[str, pl.DataFrame]], plan: TokenPlan
) -> dict[str, pl.DataFrame]:
    """Files' partials held as one: a level of counts and maxima summed per key (exact in any
    grouping), a level with a float sum concatenated, each file's rows kept for the one
    `merge` of the run: a sum of blocks' sums would depend on which files made a block (the
    order they came in, a warm or cold cache)."""
    parts: dict[str, list[pl.DataFrame]] = {level: [] for level in plan.levels}
    for one in partials:
        for level in plan.levels:
            parts[level].append(one[level])
    kept: dict[str, pl.DataFrame] = {}
    for level in plan.levels:
        frames = [f for f in parts[level] if f.height]
        schema = frames[0].schema if frames else {}
        if any(schema[v].is_float() for v in value_columns(level, plan) if v in schema):
            keys = LEVEL_KEYS[level]
            kept[level] = pl.concat([_key_typed(f, keys) for f in frames], how="diagonal_relaxed")
    folded = _summed([parts], plan, [level for level in plan.levels if level not in kept])
    return folded | kept


def value_columns(level: str, plan: TokenPlan) -> list[str]:
    if level == "ids":
        return ["len", *plan.partials.get("ids", {})]
    names = list(plan.partials.get(level, {}))
    if level == "":
        names = [ROWS, *(INVALID_PREFIX + c for c in plan.count_invalid), *names]
    return names


def _summed(
    parts: Sequence[Mapping[str, list[pl.DataFrame]]],
    plan: TokenPlan,
    levels: Sequence[str] | None = None,
    *,
    tagged: bool = False,
) -> dict[str, pl.DataFrame]:
    """Every element's frames (a file's, or every file's) summed per key of their level (of
    `levels`, by default every one), sorted by key; `tagged` frames per file too (FILE). One
    query per level whatever the number of elements: a chunk of thousands of small files
    costs a few group-bys, not a query per file."""
    levels = plan.levels if levels is None else levels
    queries = []
    for level in levels:
        keys = [FILE, *LEVEL_KEYS[level]] if tagged else list(LEVEL_KEYS[level])
        values = value_columns(level, plan)
        frames = [f for one in parts for f in one[level] if f.height]
        if not frames:
            schema = {k: pl.Int32 if k == FILE else _KEY_TYPES[k] for k in keys}
            queries.append(pl.LazyFrame(schema=schema | {v: pl.Float64 for v in values}))
            continue
        # Concatenated eagerly (cheap for small frames), then widened in one select: a lazy
        # select per frame would cost more to plan than to run. Keys are unified first (a
        # categorical segment in one file, an enum in another have no common type).
        typed = [_key_typed(f, LEVEL_KEYS[level]) for f in frames]
        rows = pl.concat(typed, how="diagonal_relaxed")
        query = rows.lazy().select(*keys, *(_widen(v, rows.schema[v]) for v in values))
        # Rows already one per key (a chunk of small files, each read in one batch) are only
        # widened and sorted: the sum of one value is that value.
        if not tagged or rows.select(keys).is_duplicated().any():
            query = query.group_by(keys).agg(merged(v, rows.schema[v]) for v in values)
        queries.append(query.sort(keys, nulls_last=True))
    return dict(zip(levels, collect_all(queries, ENGINE), strict=True))


def _kind(file: TokenFile) -> tuple:
    """What conforming a file's rows depends on: its types, the unified ones, hive values."""
    return tuple(file.schema.items()), tuple(file.target.items()), tuple(file.hive.items())


def _tagged(frames: list[tuple[int, pl.DataFrame]]) -> pl.DataFrame:
    """(index, frame) pairs as one frame (a column missing from a frame is null there), each
    row tagged in FILE with its frame's index."""
    rows = pl.concat([f for _, f in frames], how="diagonal_relaxed")
    index = np.repeat([i for i, _ in frames], [f.height for _, f in frames])
    return rows.with_columns(pl.Series(FILE, index, pl.Int32))


def _key_typed(frame: pl.DataFrame, keys: tuple[str, ...]) -> pl.DataFrame:
    odd = [k for k in keys if frame.schema[k] != _KEY_TYPES[k]]
    return frame.with_columns(pl.col(k).cast(_KEY_TYPES[k]) for k in odd) if odd else frame


def _widen(name: str, dtype: pl.DataType) -> pl.Expr:
    """Partials are summed as Int64 (counts) or Float64 (sums): no overflow, no float32 drift."""
    if dtype.is_integer() or dtype == pl.Boolean:
        return pl.col(name).cast(pl.Int64)
    return pl.col(name).cast(pl.Float64)


class PartialStore(Protocol):
    """Where file partials are kept between analyses (rlscope.cache.PartialCache): `load` says
    which files it holds and leaves their merged partials in `loaded`; `add` takes a file's
    partials as soon as it is read (written out in parts as they come, not held); `commit`
    makes what was added the cache's content."""

    loaded: dict[str, pl.DataFrame]

    def load(
        self, run: Run, files: list[TokenFile], plan: TokenPlan, fingerprint: str
    ) -> list[bool]: ...

    def add(self, file: TokenFile, partials: Mapping[str, pl.DataFrame]) -> None: ...

    def commit(self) -> None: ...


#: Any `map`: the builtin, `Executor.map`, or a distributed engine's map over the chunks of
#: files (Ray, Dask; docs/guides/scaling-out.md). It must return one result per chunk, in order.
Mapper = Callable[[Callable[[list[TokenFile]], dict[str, pl.DataFrame]], list], Iterable]


@contextmanager
def _arrow_pool() -> Iterator[None]:
    """Arrow's jemalloc pool, where pyarrow has it, for the scan's decoding: mimalloc (its
    default) hands freed pages back to the OS within milliseconds, and the next batch faults
    them in again, zeroed (measured at 100M tokens: 4% of the scan, 80 MB more peak RSS).
    Then the pool's freed buffers handed back, so that what `analyze` reads next (with Polars'
    allocator) does not stack on top of them."""
    previous = pa.default_memory_pool()
    try:
        pool = pa.jemalloc_memory_pool()
    except NotImplementedError:
        pool = previous
    pa.set_memory_pool(pool)
    try:
        yield
    finally:
        pa.set_memory_pool(previous)
        pool.release_unused()


def scan_tokens(
    run: Run,
    plan: TokenPlan,
    *,
    cache: PartialStore | None = None,
    progress: Callable[[int, int], None] | None = None,
    mapper: Mapper | None = None,
) -> tuple[dict[str, pl.DataFrame], ScanStats]:
    """Every level of the plan over the run's token files: cached partials where a file is
    unchanged, `chunk_tagged` of the others (mapped by `mapper`, by default over WORKERS
    threads), merged; then the run's step range applied."""
    files = token_files(run, plan)
    fingerprint = plan.fingerprint(run.tables["tokens"].schema)
    cached = (
        cache.load(run, files, plan, fingerprint) if cache is not None else [False] * len(files)
    )
    split = pieces([f for f, hit in zip(files, cached, strict=True) if not hit])
    todo = chunks(split)
    # Blocks of files' partials folded (`folded`), and the files read since (what is kept
    # grows with the steps and rollouts, never with the number of files).
    folded: list[Mapping[str, pl.DataFrame]] = [cache.loaded] if cache and cache.loaded else []
    results: list[Mapping[str, pl.DataFrame]] = []
    in_results = 0  # files
    # A large file's pieces until its last one is in: a file's partials are the sum of its
    # pieces', its rows in the run's merge (cached or not) are the file's.
    read: dict[RunPath, list[Mapping[str, pl.DataFrame]]] = {}
    left = Counter(piece.path for piece in split)
    done, rows_read = sum(cached), 0
    if progress is not None:
        progress(done, len(files))
    reduce_chunk = partial(chunk_tagged, plan=plan)
    with _arrow_pool(), ThreadPoolExecutor(max_workers=limits.WORKERS) as pool:
        for chunk, tagged in zip(todo, (mapper or pool.map)(reduce_chunk, todo), strict=True):
            rows_read += int(tagged[""][ROWS].sum())
            if cache is None and all(piece.row_groups is None for piece in chunk):
                results.append(_untagged(tagged))  # whole files, each its own rows
                in_results += len(chunk)
                done += len(chunk)
            else:
                for piece, one in zip(chunk, by_file(tagged, len(chunk)), strict=True):
                    left[piece.path] -= 1
                    read.setdefault(piece.path, []).append(one)
                    if left[piece.path]:
                        continue
                    parts = read.pop(piece.path)
                    whole = parts[0] if len(parts) == 1 else merge(parts, plan)
                    if cache is not None:
                        cache.add(replace(piece, row_groups=None), whole)
                    results.append(whole)
                    in_results += 1
                    done += 1
            if in_results >= limits.FOLD_FILES or len(results) >= limits.FOLD_FILES:
                # The new files' partials held as one apart from what was folded before (a
                # block's rows, never the whole run's, are hashed while the workers hold their
                # batches).
                folded.append(fold(results, plan))
                results, in_results = [], 0
                if len(folded) >= limits.FOLD_FILES:
                    folded = [fold(folded, plan)]
            if progress is not None:
                progress(done, len(files))
    if cache is not None:
        cache.commit()
    # One file's partials are already summed per key: not summed again.
    single = not folded and in_results == 1
    merged = dict(results[0]) if single else merge(folded + results, plan)
    if run.step_range != (None, None):
        merged = {level: frame.filter(run.in_step_range()) for level, frame in merged.items()}
    stats = ScanStats(
        files=len(files),
        files_read=len(files) - sum(cached),
        rows=int(merged[""][ROWS].sum()),
        rows_read=rows_read,
    )
    return merged, stats
