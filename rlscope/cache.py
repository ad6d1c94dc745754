"""Where rlscope keeps what it derives (imported runs, token-file partials): the user cache dir."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.atomic import atomic_write
from rlscope.reader import Run
from rlscope.tokenscan import FILE_ID, LEVEL_KEYS, TokenFile, TokenPlan, value_columns


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
IMPORT_REVISION = 2


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
    key = json.dumps(
        {
            "format": format,
            "source": str(Path(source).resolve()),
            "options": options,
            "revision": IMPORT_REVISION,
        },
        sort_keys=True,
        default=str,
    )
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return cache_root(root) / "imports" / f"{Path(source).resolve().name}-{format}-{digest}"


class PartialCache:
    """File partials on disk, per run and plan: `<root>/token-partials/<plan>/<run>/` holds the
    current generation of a pack — `files.arrow` (each cached file's key and id) and one Arrow
    IPC file per level with the partials of every cached file, tagged by id — so loading costs
    one read per level whatever the number of files. A file's key is its resolved path, size,
    mtime, inode and the types and hive values it is read with: a rewritten or replaced file is
    never served stale. A new generation is written in its own folder and then named in
    `CURRENT` (an atomic rename): readers see a whole pack or the previous one."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = cache_root(root) / "token-partials"
        self.loaded: dict[str, pl.DataFrame] = {}  # by `load`: every hit's partials, merged
        self._ids: dict[str, int] = {}  # key -> id of the files found by `load`
        self._packs: dict[str, pl.DataFrame] = {}

    @staticmethod
    def key(file: TokenFile) -> str:
        size, mtime_ns, inode = file.stat
        parts = [
            str(file.path.resolve()),
            str(size),
            str(mtime_ns),
            str(inode),
            repr(sorted((c, str(t)) for c, t in file.schema.items() if c in file.target)),
            repr(sorted(file.hive.items())),
        ]
        return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()

    def folder(self, run: Run, fingerprint: str) -> Path:
        digest = hashlib.blake2b(str(run.path.resolve()).encode(), digest_size=16).hexdigest()
        return self.root / fingerprint / digest

    def load(
        self, run: Run, files: list[TokenFile], plan: TokenPlan, fingerprint: str
    ) -> list[bool]:
        """Which files have cached partials; theirs, merged, are left in `self.loaded`."""
        self.loaded, self._ids, self._packs = {}, {}, {}
        folder = self.folder(run, fingerprint)
        try:
            generation = folder / (folder / "CURRENT").read_text().strip()
            known = pl.read_ipc(generation / "files.arrow")
            packs = {lv: pl.read_ipc(generation / f"{_pack_name(lv)}.arrow") for lv in plan.levels}
        except (OSError, pl.exceptions.PolarsError):
            return [False] * len(files)  # nothing yet, or unreadable: recompute
        columns = {lv: [*LEVEL_KEYS[lv], *value_columns(lv, plan)] for lv in plan.levels}
        if any(c not in packs[lv].columns for lv, cols in columns.items() for c in cols):
            return [False] * len(files)
        stored = dict(zip(known["key"].to_list(), known["id"].to_list(), strict=True))
        keys = [self.key(f) for f in files]
        self._ids = {k: stored[k] for k in keys if k in stored}
        hits = pl.Series(list(self._ids.values()), dtype=pl.Int64)
        self._packs = {
            lv: pack.filter(pl.col(FILE_ID).is_in(hits.implode())) for lv, pack in packs.items()
        }
        self.loaded = {lv: self._packs[lv].select(columns[lv]) for lv in plan.levels}
        return [k in self._ids for k in keys]

    def store(
        self,
        run: Run,
        fingerprint: str,
        new: list[tuple[TokenFile, Mapping[str, pl.DataFrame]]],
        plan: TokenPlan,
    ) -> None:
        """A new generation: the loaded files' partials plus the new ones (the files of this
        snapshot only). A read-only or full cache dir costs speed, never a result."""
        if not new:
            return
        ids = dict(self._ids)
        next_id = max(ids.values(), default=-1) + 1
        tagged: dict[str, list[pl.DataFrame]] = {lv: [] for lv in plan.levels}
        for file, partials in new:
            ids[self.key(file)] = next_id
            for level in plan.levels:
                tagged[level].append(
                    partials[level].with_columns(pl.lit(next_id, pl.Int64).alias(FILE_ID))
                )
            next_id += 1
        folder = self.folder(run, fingerprint)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            generation = Path(tempfile.mkdtemp(dir=folder, prefix="gen-"))
            files = pl.DataFrame(
                {"key": list(ids), "id": list(ids.values())},
                schema={"key": pl.String, "id": pl.Int64},
            )
            files.write_ipc(generation / "files.arrow")
            for level in plan.levels:
                old = self._packs.get(level)
                frames = ([old] if old is not None and old.height else []) + tagged[level]
                pack = pl.concat(frames, how="diagonal_relaxed")
                pack.write_ipc(generation / f"{_pack_name(level)}.arrow")
            atomic_write(folder / "CURRENT", generation.name)
        except OSError:
            return
        for stale in folder.glob("gen-*"):  # earlier generations (a reader may still hold one)
            if stale != generation:
                shutil.rmtree(stale, ignore_errors=True)


def _pack_name(level: str) -> str:
    return level or "steps"
