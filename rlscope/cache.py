"""Where rlscope keeps what it derives (imported runs, token-file partials): the user cache dir."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from rlscope._version import __version__
from rlscope.atomic import atomic_write
from rlscope.exactsum import ENGINE
from rlscope.reader import Footer, Run
from rlscope.store import RunPath, StorePath, location
from rlscope.tokenscan import (
    FILE_ID,
    LEVEL_KEYS,
    TokenFile,
    TokenPlan,
    fold,
    merged,
    value_columns,
)


def cache_root(override: str | os.PathLike[str] | None = None) -> Path:
    """`--cache-dir`, else $RLSCOPE_CACHE_DIR, else $XDG_CACHE_HOME/rlscope or ~/.cache/rlscope."""
    if override is not None:
        return Path(override)
    if os.environ.get("RLSCOPE_CACHE_DIR"):
        return Path(os.environ["RLSCOPE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlscope"


#: Bumped whenever an importer writes something different for the same source (a field read
#: with another meaning, a new run.json field): cached imports of older revisions are not reused.
#: 11: a 0/1 accuracy reward read as correct_rate with steps where it left [0, 1] (kept, and
#: named by accuracy-out-of-range);
#: 10: a W&B config's max_grad_norm kept by TRL's meta; 9: TensorBoard and MLflow eval sets as
#: L5 columns; 8: W&B eval sets as L5 columns;
#: 7: correct_rate from a 0/1 accuracy reward's logged mean (steps-only readers); 6: TRL
#: frac_reward_zero_std with float noise kept apart; 5: max_grad_norm (TRL, the Trainer's args
#: in TensorBoard); 4: reward_weights, scale_rewards; eval sets as L5 steps columns (TRL, verl)
IMPORT_REVISION = 11


def import_cache_dir(
    format: str,
    source: str | os.PathLike[str],
    options: dict[str, Any],
    *,
    root: str | os.PathLike[str] | None = None,
) -> Path:
    """The run directory an `analyze --from FORMAT SOURCE` converts into: one per source path,
    format, import options and importer revision, so a different source or option, or an
    rlscope whose importers changed, never reuses a stale import."""
    where = location(source)
    where = where if isinstance(where, StorePath) else where.resolve()
    key = json.dumps(
        {
            "format": format,
            "source": str(where),
            "options": options,
            "revision": IMPORT_REVISION,
        },
        sort_keys=True,
        default=str,
    )
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return cache_root(root) / "imports" / f"{where.name}-{format}-{digest}"


def store_copy_dir(source: StorePath, *, root: str | os.PathLike[str] | None = None) -> Path:
    """Where a `--from` source in a store is copied for its importer (see `store.mirror`)."""
    digest = hashlib.blake2b(str(source).encode(), digest_size=8).hexdigest()
    return cache_root(root) / "store-sources" / f"{source.name}-{digest}"


#: Bumped whenever what a store holds is written differently (the MANIFEST's `format`, with
#: rlscope's version): a store of another format or version is ignored and rebuilt, never read.
STORE_FORMAT = 2  # 2: a frame with no row keeps its columns and types


class Parts:
    """Per-file frames on disk, in parts: a folder holds `MANIFEST` (its format and the parts
    that make the store, JSON) and one folder per part — `files.arrow` (each of its files' key
    and id) and one Arrow IPC file per frame name with those files' rows tagged by id, its
    columns and types those the frames had even where no file had a row — so loading costs a
    read per part and name whatever the number of files.

    Writing is incremental: the files an analysis reads are written as new parts as they come
    (a part per PART_ROWS rows, so they are never all held), then named in a new manifest (an
    atomic rename): readers see the old store or the new one, and a file appended to a run
    costs that file's frames only. Parts whose files are all gone leave the manifest (and the
    disk); past MAX_PARTS parts the small ones (under a quarter of the largest: the appends of
    a live run) are merged into one, and when gone files hold half the rows every live file's
    frames are rewritten into one part. A read-only or full cache dir costs speed, never a
    result."""

    #: Files' frames are concatenated (tagged by id) every TAG_FILES files, and written as a
    #: part once they hold PART_ROWS rows.
    TAG_FILES = 256
    PART_ROWS = 2_000_000
    MAX_PARTS = 16

    def __init__(self, folder: Path, names: Sequence[str]) -> None:
        self.folder, self.names = folder, list(names)
        self._reset()

    def _reset(self) -> None:
        self._broken = False
        self._manifest: list[str] = []
        self._live: dict[str, list[int]] = {}  # part -> ids of its files still in the run
        self._index: dict[str, dict[int, int]] = {}  # part -> id -> index in `open`'s keys
        self._files: dict[str, int] = {}  # part -> files it holds
        self._pending: list[tuple[str, Mapping[str, pl.DataFrame]]] = []
        self._keys: list[str] = []  # of the tagged frames not yet written
        self._tagged: dict[str, list[pl.DataFrame]] = {}
        self._written: list[str] = []
        self._stale: list[str] = []  # the parts of a store of another format, removed on commit

    def open(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` the store holds (nothing when it is absent, unreadable, or of another
        format or rlscope version)."""
        position = {key: i for i, key in enumerate(keys)}
        try:
            manifest = json.loads((self.folder / "MANIFEST").read_text())
            if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT_KEY:
                self._stale = _part_names(manifest)
                return [False] * len(keys)
            self._manifest = _part_names(manifest)
            for part in self._manifest:
                known = _read_ipc(self.folder / part / "files.arrow")
                live = known.filter(pl.col("key").is_in(list(position)))
                self._files[part] = known.height
                self._live[part] = live["id"].to_list()
                self._index[part] = {
                    i: position.pop(k)
                    for i, k in zip(live["id"].to_list(), live["key"].to_list(), strict=True)
                    if k in position
                }
        except (OSError, ValueError, pl.exceptions.PolarsError):
            self._reset()
            return [False] * len(keys)
        return [k not in position for k in keys]

    def scans(self, name: str) -> list[pl.LazyFrame]:
        """Per part with a live file, its rows of `name` of the live files, FILE_ID being the
        file's index in the keys given to `open`."""
        out = []
        for part in self._manifest:
            if not self._index.get(part):
                continue
            index = pl.DataFrame(
                {FILE_ID: list(self._index[part]), "__index__": list(self._index[part].values())},
                schema={FILE_ID: pl.Int64, "__index__": pl.Int64},
            )
            out.append(
                pl.scan_ipc(self.folder / part / f"{name}.arrow", glob=False)
                .join(index.lazy(), on=FILE_ID)
                .with_columns(pl.col("__index__").alias(FILE_ID))
                .drop("__index__")
            )
        return out

    def add(self, key: str, frames: Mapping[str, pl.DataFrame]) -> None:
        """A file read now: its frames go out with the next part written."""
        self._pending.append((key, frames))
        if len(self._pending) >= self.TAG_FILES:
            self._tag()

    def _tag(self) -> None:
        """The pending files' frames as one frame per name, tagged by id; a part written once
        they hold PART_ROWS rows."""
        for i, (key, one) in enumerate(self._pending, start=len(self._keys)):
            for name in self.names:  # a frame with no row too: it carries the columns
                tagged = one[name].with_columns(pl.lit(i, pl.Int64).alias(FILE_ID))
                self._tagged.setdefault(name, []).append(tagged)
            self._keys.append(key)
        self._pending = []
        for name, frames in self._tagged.items():
            self._tagged[name] = [pl.concat(frames, how="diagonal_relaxed")] if frames else []
        if sum(f.height for frames in self._tagged.values() for f in frames) >= self.PART_ROWS:
            self._write_tagged()

    def _write_tagged(self) -> None:
        if self._keys and not self._broken:
            try:
                part = self._write_part(self._keys, self._tagged)
            except OSError:
                self._broken = True
            else:
                self._written.append(part)
                self._files[part] = len(self._keys)
                self._live[part] = list(range(len(self._keys)))
        self._keys, self._tagged = [], {}

    def _write_part(self, keys: list[str], tagged: Mapping[str, list[pl.DataFrame]]) -> str:
        """A new part folder: `keys` (file i has id i) and each name's frames tagged by id."""
        self.folder.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(dir=self.folder, prefix="part-"))
        files = pl.DataFrame(
            {"key": keys, "id": range(len(keys))}, schema={"key": pl.String, "id": pl.Int64}
        )
        files.write_ipc(folder / "files.arrow")
        for name in self.names:
            frames = tagged.get(name, [])
            pack = (
                pl.concat(frames, how="diagonal_relaxed")
                if frames
                else pl.DataFrame(schema={FILE_ID: pl.Int64})
            )
            pack.write_ipc(folder / f"{name}.arrow")
        return folder.name

    def commit(self) -> None:
        """The new manifest: the loaded parts that still have a file in the run, then the new
        ones; compacted when they are many or mostly stale."""
        self._tag()
        self._write_tagged()
        if not self._written or self._broken:
            return
        parts = [part for part in self._manifest if self._live.get(part)] + self._written
        live = sum(len(self._live[part]) for part in parts)
        try:
            if sum(self._files[part] for part in parts) > 2 * live:
                parts = [self._compacted(parts)]
            elif len(parts) > self.MAX_PARTS:
                largest = max(self._files[part] for part in parts)
                small = [part for part in parts if self._files[part] * 4 < largest]
                merged = small if len(small) >= 2 else parts
                parts = [part for part in parts if part not in merged]
                parts.append(self._compacted(merged))
            atomic_write(
                self.folder / "MANIFEST", json.dumps({"format": _FORMAT_KEY, "parts": parts})
            )
        except (OSError, pl.exceptions.PolarsError):
            return
        gone = {*self._manifest, *self._written, *self._stale} - set(parts)
        for old in gone:  # a reader may hold one
            shutil.rmtree(self.folder / old, ignore_errors=True)
        for legacy in self.folder.glob("gen-*"):  # rlscope before parts: one pack per analysis
            shutil.rmtree(legacy, ignore_errors=True)

    def _compacted(self, parts: list[str]) -> str:
        """The live files' frames of `parts` rewritten as one part (ids renumbered)."""
        keys: list[str] = []
        tagged: dict[str, list[pl.DataFrame]] = {name: [] for name in self.names}
        for part in parts:
            known = _read_ipc(self.folder / part / "files.arrow")
            known = known.filter(pl.col("id").is_in(self._live[part])).sort("id")
            first = len(keys)
            renumber = known.select(
                pl.col("id").alias(FILE_ID),
                pl.int_range(first, first + known.height, dtype=pl.Int64).alias("new"),
            )
            keys += known["key"].to_list()
            for name in self.names:
                frame = _read_ipc(self.folder / part / f"{name}.arrow")
                tagged[name].append(
                    frame.join(renumber, on=FILE_ID)
                    .with_columns(pl.col("new").alias(FILE_ID))
                    .drop("new")
                )
        part = self._write_part(keys, tagged)
        self._files[part], self._live[part] = len(keys), list(range(len(keys)))
        return part


def file_key(
    path: RunPath, stat: tuple[int, int, int], schema: Mapping[str, Any], hive: Mapping[str, str]
) -> str:
    """A file's cache key: its resolved path, size, mtime, inode and the types and hive values
    it is read with, so a rewritten or replaced file is never served stale."""
    size, mtime_ns, inode = stat
    parts = [
        str(path.resolve()),
        str(size),
        str(mtime_ns),
        str(inode),
        repr(sorted((c, str(t)) for c, t in schema.items())),
        repr(sorted(hive.items())),
    ]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


def _run_digest(run: Run) -> str:
    return hashlib.blake2b(str(run.path.resolve()).encode(), digest_size=16).hexdigest()


class FooterCache:
    """Each file's footer (its rows and schema) as last read, by run, keyed by the file's size,
    modification time and version (inode, or the store's ETag or generation): `footers/<run>.arrow`
    in the user cache dir. Re-opening a run of 20k files reads no footer that did not change
    (from a store: one request per object, a HEAD, instead of two). Implements
    `rlscope.reader.FooterMemo`; an unreadable or unwritable file costs speed, never a result."""

    FORMAT = b"rlscope-footers/1"

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = cache_root(root) / "footers"

    def _path(self, run: RunPath) -> Path:
        digest = hashlib.blake2b(str(run.resolve()).encode(), digest_size=16).hexdigest()
        return self.root / f"{digest}.arrow"

    def recall(self, run: RunPath) -> dict[str, Footer]:
        try:
            with pa.OSFile(str(self._path(run))) as source:
                table = pa.ipc.open_file(source).read_all()
        except (OSError, pa.ArrowException):
            return {}
        if (table.schema.metadata or {}).get(b"format") != self.FORMAT:
            return {}
        if table.num_rows == 0:
            return {}
        encoded = table["schema"].combine_chunks()
        schemas = [pa.ipc.read_schema(pa.py_buffer(b)) for b in encoded.dictionary.to_pylist()]
        columns = [table[c].to_pylist() for c in ("path", "size", "mtime_ns", "version", "rows")]
        return {
            path: ((size, mtime_ns, version), rows, schemas[i])
            for (path, size, mtime_ns, version, rows), i in zip(
                zip(*columns, strict=True), encoded.indices.to_pylist(), strict=True
            )
        }

    def keep(self, run: RunPath, footers: Mapping[str, Footer]) -> None:
        order: dict[pa.Schema, int] = {}
        indices = [order.setdefault(schema, len(order)) for _, _, schema in footers.values()]
        table = pa.table(
            {
                "path": pa.array(list(footers), pa.string()),
                "size": pa.array([stat[0] for stat, _, _ in footers.values()], pa.int64()),
                "mtime_ns": pa.array([stat[1] for stat, _, _ in footers.values()], pa.int64()),
                "version": pa.array([stat[2] for stat, _, _ in footers.values()], pa.uint64()),
                "rows": pa.array([rows for _, rows, _ in footers.values()], pa.int64()),
                "schema": pa.DictionaryArray.from_arrays(
                    pa.array(indices, pa.int32()),
                    pa.array([s.serialize().to_pybytes() for s in order], pa.binary()),
                ),
            }
        ).replace_schema_metadata({"format": self.FORMAT})
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write(self._path(run), sink.getvalue().to_pybytes())
        except OSError:
            pass


class PartialCache:
    """What rlscope keeps between analyses of a run, in the user cache dir (see `Parts`):
    `token-partials/<plan>/<run>/`, each token file's partials (loaded folded), and
    `table-partials/<table>/<plan>/<run>/`, each steps or rollouts file's step-local
    aggregates (loaded as rows tagged by file)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.base = cache_root(root)
        self.root = self.base / "token-partials"
        # By `load`: every hit's partials, folded (see `tokenscan.fold`).
        self.loaded: dict[str, pl.DataFrame] = {}
        self._tokens: Parts | None = None

    @staticmethod
    def key(file: TokenFile) -> str:
        schema = {c: t for c, t in file.schema.items() if c in file.target}
        return file_key(file.path, file.stat, schema, file.hive)

    def folder(self, run: Run, fingerprint: str) -> Path:
        return self.root / fingerprint / _run_digest(run)

    def load(
        self, run: Run, files: list[TokenFile], plan: TokenPlan, fingerprint: str
    ) -> list[bool]:
        """Which token files have cached partials; theirs, folded, are left in `self.loaded`."""
        self.loaded = {}
        self._tokens = Parts(self.folder(run, fingerprint), [_pack_name(lv) for lv in plan.levels])
        hits = self._tokens.open([self.key(f) for f in files])
        if not any(hits):
            return hits
        # A part at a time, folded into what came before: the parts' rows (20k files' entropy
        # bins: 10M) are never all held at once (0.77 GiB at 20k files, all collected at once).
        scans = {level: self._tokens.scans(_pack_name(level)) for level in plan.levels}
        loaded: list[dict[str, pl.DataFrame]] = []
        try:
            for j in range(len(scans[plan.levels[0]])):
                queries = []
                for level in plan.levels:
                    scan = scans[level][j]
                    keys, values = LEVEL_KEYS[level], value_columns(level, plan)
                    schema = scan.collect_schema()
                    if any(schema[v].is_float() for v in values if v in schema):
                        queries.append(scan.drop(FILE_ID))  # each file's rows, for `merge`
                    else:
                        queries.append(scan.group_by(keys).agg(merged(v) for v in values))
                frames = pl.collect_all(queries, engine=ENGINE)
                loaded = [fold([*loaded, dict(zip(plan.levels, frames, strict=True))], plan)]
        except (OSError, pl.exceptions.PolarsError):
            self._tokens = Parts(self._tokens.folder, self._tokens.names)
            return [False] * len(files)
        self.loaded = loaded[0] if loaded else {}
        return hits

    def add(self, file: TokenFile, partials: Mapping[str, pl.DataFrame]) -> None:
        """A token file read now: its partials go out with the next part written."""
        if self._tokens is not None:
            self._tokens.add(self.key(file), {_pack_name(lv): f for lv, f in partials.items()})

    def commit(self) -> None:
        if self._tokens is not None:
            self._tokens.commit()

    def file_keys(self, run: Run, table: str) -> list[str]:
        """Each file of `table`'s cache key (see `file_key`)."""
        files = run.tables[table]
        hive = files.file_hive or tuple({} for _ in files.files)
        return [
            file_key(path, stat, schema, values)
            for path, stat, schema, values in zip(
                files.files, files.file_stats, files.file_schemas, hive, strict=True
            )
        ]

    def table_frames(
        self, run: Run, table: str, role: str, fingerprint: str, names: Sequence[str]
    ) -> Parts:
        """The store of `table`'s per-file (or per-group-of-files) frames of one kind."""
        folder = self.base / "table-partials" / table / role / fingerprint / _run_digest(run)
        return Parts(folder, names)


_FORMAT_KEY = f"{STORE_FORMAT}/{__version__}"


def _part_names(manifest: Any) -> list[str]:
    """The part folders a MANIFEST names (of this format, or of an older one: a JSON list),
    only names of parts (never a path out of the store)."""
    parts = manifest.get("parts") if isinstance(manifest, dict) else manifest
    if not isinstance(parts, list):
        return []
    return [p for p in parts if isinstance(p, str) and p.startswith("part-") and "/" not in p]


def _read_ipc(path: Path) -> pl.DataFrame:
    """An Arrow IPC file by its literal path (`pl.read_ipc` expands `[`, `*` as a pattern)."""
    return pl.scan_ipc(path, glob=False).collect()


def _pack_name(level: str) -> str:
    return level or "steps"
