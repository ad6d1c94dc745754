"""One import: the Importer and its result, skipped lines, and the Session that buffers writes."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from copy import deepcopy
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from rlscope.atomic import atomic_write
from rlscope.errors import RlscopeError
from rlscope.importers.manifest import (
    MANIFEST,
    MANIFEST_VERSION,
    file_hash,
    fingerprint,
    parquet_files,
    split_namespace,
)
from rlscope.importers.options import Option
from rlscope.schema import RUN_JSON, TABLES
from rlscope.tablewriter import TableWriter

#: rollout_id = namespace * NAMESPACE + step * STEP + index within the step.
STEP = 1_000_000
NAMESPACE = 10**15
MAX_STEP = NAMESPACE // STEP - 1
#: Rows (or bytes) buffered before a flush writes one Parquet file per table.
FLUSH_ROWS = 200_000
FLUSH_BYTES = 256 * 2**20
#: Examples kept per reason of skipped lines.
EXAMPLES = 3

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ImportResult:
    """What one import did."""

    format: str
    source: Path
    out: Path
    rows: dict[str, int]  # rows written per table
    first_step: int | None  # steps imported by this call
    last_step: int | None
    steps_imported: int
    steps_skipped: int  # already imported by an earlier call
    files_read: int
    files_unchanged: int  # already imported and unchanged: not read
    lines_skipped: dict[str, int]  # reason -> count
    line_examples: tuple[str, ...]  # `file:line: detail`, the first few per reason
    warnings: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def written(self) -> bool:
        return any(self.rows.values())

    def summary(self) -> str:
        """A few lines a person can read."""
        rows = ", ".join(f"{n:,} {t}" for t, n in self.rows.items() if n) or "nothing new"
        lines = [f"{self.format}: {self.source} -> {self.out}: {rows}"]
        if self.steps_imported:
            lines.append(
                f"  steps {self.first_step}..{self.last_step} ({self.steps_imported} imported)"
            )
        if self.steps_skipped:
            lines.append(f"  {self.steps_skipped} step(s) already imported, skipped")
        for reason, count in self.lines_skipped.items():
            lines.append(f"  skipped {count:,} line(s): {reason}")
        lines += [f"    e.g. {e}" for e in self.line_examples]
        lines += [f"  warning: {w}" for w in self.warnings]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass(frozen=True)
class Importer:
    """One source format: its options, the tables it writes, and the function doing it."""

    name: str
    summary: str
    options: tuple[Option, ...]
    tables: tuple[str, ...]
    default_algorithm: str
    run: Callable[[Session], None]

    @property
    def doc(self) -> str:
        """What it reads, the field mapping and the rules (the run function's doc string),
        followed by its options."""
        import inspect

        text = inspect.cleandoc(self.run.__doc__ or self.summary)
        opts = "\n".join(
            f"  {o.name} ({o.kind}, default {o.default!r}): {o.doc}" for o in self.options
        )
        return f"{text}\n\nOptions:\n{opts}"

    def parse_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        known = {o.name: o for o in self.options}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise RlscopeError(
                f"{self.name}: unknown option(s) {', '.join(unknown)}",
                hint=f"{self.name} takes {', '.join(sorted(known))}",
            )
        return {
            name: (
                o.coerce(options[name]) if options.get(name) is not None else deepcopy(o.default)
            )
            for name, o in known.items()
        }


class LineSkips:
    """Malformed source lines: counts per reason and the first few `file:line` examples."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, path: Path, line: int, reason: str, detail: str = "") -> None:
        where = f"{path}:{line}: {reason}" + (f" ({detail})" if detail else "")
        if self.strict:
            raise RlscopeError(where, hint="without strict, malformed lines are skipped")
        self.counts[reason] += 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < EXAMPLES:
            kept.append(where)


@dataclass
class Session:
    """State of one import call: options, manifest entry, buffered output, result counters.

    Importers read `source` and `options`, call `add_rollouts` / `add_steps` with frames,
    `file_done` after each source file and `checkpoint` when a flush would be safe; the
    session writes through TableWriter and keeps OUT/import.json in step with what is on disk."""

    importer: Importer
    source: Path
    out: Path
    options: dict[str, Any]
    progress: Progress | None = None
    key: str = ""
    entry: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    skips: LineSkips = field(default_factory=lambda: LineSkips(False))
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rows: Counter[str] = field(default_factory=Counter)
    steps_written: set[int] = field(default_factory=set)
    files_read: int = 0
    files_unchanged: int = 0
    group_sizes: Counter[int] = field(default_factory=Counter)
    meta: dict[str, Any] = field(default_factory=dict)  # run.json fields the importer knows
    # The algorithm the source shows (e.g. PPO when a critic is logged), when no option names it.
    algorithm: str | None = None
    _buffers: dict[str, list[pl.DataFrame]] = field(default_factory=dict)
    _step_rows: list[dict[str, Any]] = field(default_factory=list)
    _step_frames: list[pl.DataFrame] = field(default_factory=list)
    _steps_logged: set[int] = field(default_factory=set)
    _staged_files: dict[str, dict[str, Any]] = field(default_factory=dict)
    _staged_last: dict[str, int] = field(default_factory=dict)
    _seen: set[tuple[str, int]] = field(default_factory=set)
    _skipped: set[tuple[str, int]] = field(default_factory=set)
    _unchanged_steps: int = 0
    _writer: TableWriter | None = None
    _dirty: bool = False

    # -- setup --

    def open(self) -> None:
        self.skips = LineSkips(bool(self.options.get("strict")))
        split = self.options.get("split") or "train"
        self.key = self.importer.name if split == "train" else f"{self.importer.name}:{split}"
        self.manifest = self._read_manifest()
        imports: dict[str, Any] = self.manifest["imports"]
        compared = {o.name: self.options[o.name] for o in self.importer.options if o.compared}
        source = str(self.source)
        if self.key in imports:
            entry = imports[self.key]
            if entry.get("source") != source:
                raise RlscopeError(
                    f"{self.out / MANIFEST}: this OUT holds a `{self.key}` import of "
                    f"{entry.get('source')}, not {source}",
                    hint="use a new OUT dir for another source",
                )
            old = entry.get("options", {})
            changed = sorted(k for k in set(old) | set(compared) if old.get(k) != compared.get(k))
            if changed:
                diffs = "; ".join(f"{k}: {old.get(k)!r} -> {compared.get(k)!r}" for k in changed)
                raise RlscopeError(
                    f"{self.out / MANIFEST}: options differ from the earlier `{self.key}` import "
                    f"({diffs})",
                    hint="an import is only extended with the same options; use a new OUT dir",
                )
            self.entry = entry
        else:
            self._check_conflicts(imports, split)
            self.entry = {
                "format": self.importer.name,
                "source": source,
                "options": compared,
                "split": split,
                "tables": list(self.importer.tables),
                "last_step": {},
                "files": {},
                "state": {},
                "outputs": [],
            }
        self._check_orphans(imports)

    def _read_manifest(self) -> dict[str, Any]:
        path = self.out / MANIFEST
        if not path.exists():
            return {"manifest_version": MANIFEST_VERSION, "imports": {}}
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
            raise RlscopeError(f"{path}: unreadable import manifest ({exc})") from None
        if (
            not isinstance(doc, dict)
            or doc.get("manifest_version") != MANIFEST_VERSION
            or not isinstance(doc.get("imports"), dict)
        ):
            raise RlscopeError(
                f"{path}: not an rlscope import manifest (version {MANIFEST_VERSION})",
                hint="use a new OUT dir",
            )
        return doc

    def _check_conflicts(self, imports: dict[str, Any], split: str) -> None:
        for key, other in imports.items():
            tables = set(other.get("tables", ())) & set(self.importer.tables)
            if "steps" in tables:
                raise RlscopeError(
                    f"{self.out / MANIFEST}: the steps table was already imported by `{key}` "
                    f"from {other.get('source')}",
                    hint="one import per OUT writes steps; use a new OUT dir",
                )
            if "rollouts" in tables and other.get("split", "train") == split:
                raise RlscopeError(
                    f"{self.out / MANIFEST}: {split} rollouts were already imported by `{key}` "
                    f"from {other.get('source')}",
                    hint="use a new OUT dir, or import this source with another split",
                )

    def _check_orphans(self, imports: dict[str, Any]) -> None:
        known = {f for e in imports.values() for f in e.get("outputs", ())}
        orphans = sorted(parquet_files(self.out) - known)
        if orphans:
            shown = ", ".join(orphans[:3]) + (" ..." if len(orphans) > 3 else "")
            raise RlscopeError(
                f"{self.out}: holds Parquet files no import recorded ({shown})",
                hint="an interrupted import leaves them, or OUT is not an import dir: delete "
                "them or use a new OUT dir",
            )

    # -- what earlier imports did --

    def already(self, table: str, step: int, *, this_call: bool = True) -> bool:
        """Whether `step` of `table` was imported by an earlier call (at or below its last
        step) or, with `this_call`, earlier in this one."""
        last = self.entry["last_step"].get(table)
        return (last is not None and step <= last) or (this_call and (table, step) in self._seen)

    def state(self) -> dict[str, Any]:
        """Importer-specific state kept in the manifest (mutable; saved at checkpoints)."""
        return self.entry.setdefault("state", {})

    def file_status(self, path: Path) -> tuple[str, dict[str, Any] | None]:
        """`new`, `unchanged`, `grown` (the imported bytes are intact, more were appended) or
        `changed`, and the manifest record of the file."""
        rel = self.rel(path)
        record = self.entry["files"].get(rel)
        if record is None:
            return "new", None
        stat = path.stat()
        if stat.st_size == record["size"] and stat.st_mtime_ns == record["mtime_ns"]:
            return "unchanged", record
        if stat.st_size > record["size"] and file_hash(path, record["size"]) == record["blake2b"]:
            return "grown", record
        if stat.st_size == record["size"] and file_hash(path) == record["blake2b"]:
            return "unchanged", record  # touched, same bytes
        return "changed", record

    def read_status(
        self, path: Path, done: int, total: int, *, appendable: bool = True
    ) -> str | None:
        """The file's status, or None when it is unchanged since its import (counted, not read).
        A file changed in place — or grown, for a format that is never appended to — is warned
        about: its steps already imported are not re-imported."""
        status, record = self.file_status(path)
        if status == "unchanged" and record is not None:
            self.skip_unchanged(record)
            self.tick(done, total)
            return None
        if status == "changed" or (status == "grown" and not appendable):
            self.warnings.append(
                f"{path}: changed after it was imported; steps already imported are not re-imported"
            )
        return status

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.source).as_posix()
        except ValueError:
            return path.name

    def skip_unchanged(self, record: dict[str, Any], *, count_steps: bool = True) -> None:
        """A source file imported earlier and unchanged since: not read."""
        self.files_unchanged += 1
        if count_steps:
            self._unchanged_steps += int(record.get("n_steps", 0))

    def skip_step(self, table: str, step: int) -> None:
        """Count a step left out because it was already imported."""
        self._skipped.add((table, step))

    @property
    def steps_skipped(self) -> int:
        rollouts = self.rows["rollouts"] or any(t == "rollouts" for t, _ in self._skipped)
        main = "rollouts" if "rollouts" in self.importer.tables and rollouts else "steps"
        return self._unchanged_steps + sum(t == main for t, _ in self._skipped)

    # -- writing --

    def rollout_ids(self, frame: pl.DataFrame, index: str) -> pl.Series:
        """namespace(split) * 10^15 + step * 10^6 + index within the step: deterministic, and
        unique across re-imports and across train and eval imports into one OUT."""
        if frame.height and int(frame[index].max()) >= STEP:  # type: ignore[arg-type]
            raise RlscopeError(
                f"{self.source}: a step has {STEP:,} rollouts or more; rollout ids "
                f"(step * {STEP:,} + index) would clash"
            )
        splits = frame["split"].unique().to_list()
        ns = frame["split"].replace_strict(
            {s: split_namespace(s) for s in splits}, return_dtype=pl.Int64
        )
        ids = ns * NAMESPACE + frame["step"].cast(pl.Int64) * STEP + frame[index].cast(pl.Int64)
        return ids.alias("rollout_id")

    def add_rollouts(self, frame: pl.DataFrame) -> None:
        if frame.height == 0:
            return
        frame = frame.select("rollout_id", pl.exclude("rollout_id"))
        for step in frame["step"].unique().to_list():
            self._seen.add(("rollouts", int(step)))
            self.steps_written.add(int(step))
        if (self.options.get("split") or "train") == "train":
            sizes = frame.group_by("step", "prompt_id").len()["len"].value_counts()
            for size, count in sizes.iter_rows():
                self.group_sizes[int(size)] += int(count)
        self._buffers.setdefault("rollouts", []).append(frame)
        self.rows["rollouts"] += frame.height
        self._stage_last("rollouts", int(frame["step"].max()))  # type: ignore[arg-type]

    def add_steps(self, rows: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            step = int(row["step"])
            self._seen.add(("steps", step))
            self._steps_logged.add(step)
            if "rollouts" not in self.importer.tables:
                self.steps_written.add(step)
            self._step_rows.append(row)
            self.rows["steps"] += 1
            self._stage_last("steps", step)

    def add_step_frame(self, frame: pl.DataFrame) -> pl.DataFrame:
        """Many steps as one frame (a `step` column, one column per metric): what a log of
        100k steps is imported as, never one dict per step. Steps an earlier import wrote are
        skipped (and counted); returns the rows kept."""
        last = self.entry["last_step"].get("steps")
        if last is not None:
            for step in frame.filter(pl.col("step") <= last)["step"].to_list():
                self.skip_step("steps", int(step))
            frame = frame.filter(pl.col("step") > last)
        if frame.height == 0:
            return frame
        steps = frame["step"].to_list()
        self._seen.update(("steps", int(s)) for s in steps)
        self._steps_logged.update(int(s) for s in steps)
        if "rollouts" not in self.importer.tables:
            self.steps_written.update(int(s) for s in steps)
        self._step_frames.append(frame)
        self.rows["steps"] += frame.height
        self._stage_last("steps", int(frame["step"].max()))  # type: ignore[arg-type]
        return frame

    def _stage_last(self, table: str, step: int) -> None:
        self._staged_last[table] = max(step, self._staged_last.get(table, step))

    def file_done(
        self, path: Path, n_steps: int, *, known: dict[str, Any] | None = None, **extra: Any
    ) -> None:
        """Record a source file as imported (committed with the next flush); `known`: its
        fingerprint, when the importer took it already (hashing a large file once)."""
        prints = known if known is not None else fingerprint(path)
        self._staged_files[self.rel(path)] = {**prints, "n_steps": n_steps, **extra}
        self.files_read += 1

    def checkpoint(self, *, force: bool = False) -> None:
        """Flush buffered rows if there are enough of them (or `force`), then save the
        manifest, so OUT/import.json always describes the Parquet files on disk."""
        frames = [*(f for fs in self._buffers.values() for f in fs), *self._step_frames]
        buffered = sum(f.height for f in frames)
        size = sum(f.estimated_size() for f in frames)
        if not force and buffered < FLUSH_ROWS and size < FLUSH_BYTES:
            return
        before = parquet_files(self.out) if self.out.exists() else set()
        if buffered or self._step_rows:
            writer = self._open_writer()
            for table, frames in self._buffers.items():
                for frame in frames:
                    getattr(writer, f"log_{table}")(frame)
            for row in self._step_rows:
                writer.log_step(**row)
            for frame in self._step_frames:
                writer.log_steps(frame)
            writer.flush()
            self._buffers = {}
            self._step_rows = []
            self._step_frames = []
        if not (self._staged_files or self._staged_last or buffered):
            return
        self.entry["files"].update(self._staged_files)
        for table, step in self._staged_last.items():
            old = self.entry["last_step"].get(table)
            self.entry["last_step"][table] = step if old is None else max(old, step)
        self._staged_files = {}
        self._staged_last = {}
        new = sorted(parquet_files(self.out) - before)
        self.entry["outputs"] = sorted({*self.entry.get("outputs", ()), *new})
        self._dirty = True
        self.save()

    def save(self) -> None:
        if not self._dirty:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self.entry["updated"] = datetime.now(UTC).isoformat(timespec="seconds")
        self.manifest["imports"][self.key] = self.entry
        atomic_write(self.out / MANIFEST, json.dumps(self.manifest, indent=2) + "\n")
        self._dirty = False

    def _run_meta(self) -> dict[str, Any]:
        meta = dict(self.meta)
        if self.group_sizes and "group_size" not in meta:
            meta["group_size"] = max(self.group_sizes.items(), key=lambda kv: (kv[1], kv[0]))[0]
        for name in ("correct_threshold", "max_response_len"):
            if self.options.get(name) is not None:
                meta[name] = self.options[name]
        return meta

    def _open_writer(self) -> TableWriter:
        if self._writer is not None:
            return self._writer
        meta = self._run_meta()
        run_json = self.out / RUN_JSON
        if run_json.exists():
            self._complete_run_json(run_json, meta)
        self._writer = TableWriter(
            self.out,
            run_id=self.options.get("run_id") or default_run_id(self.source),
            algorithm=self.options.get("algorithm")
            or self.algorithm
            or self.importer.default_algorithm,
            flush_rows=dict.fromkeys(TABLES, 2**62),  # the session decides when to flush
            **meta,
        )
        return self._writer

    def _complete_run_json(self, path: Path, meta: dict[str, Any]) -> None:
        """An earlier import of another format wrote run.json: keep it, only add fields it
        lacks (e.g. group_size, known once rollouts are imported)."""
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError):
            return
        missing = {k: v for k, v in meta.items() if v is not None and k not in doc}
        if isinstance(doc, dict) and missing:
            atomic_write(path, json.dumps({**doc, **missing}, indent=2) + "\n")
            self.notes.append(f"run.json kept; added {', '.join(sorted(missing))}")

    def close(self) -> None:
        self.checkpoint(force=True)
        if self._writer is not None:
            self._writer.close()
        # Notes say how the source was mapped (inferred group size, lengths counted in words):
        # kept with the import, so a later call that reads no file still reports them.
        notes = self._notes()
        if notes != self.entry.get("notes", []):
            self.entry["notes"] = notes
            self._dirty = True
        self.save()

    def _notes(self) -> list[str]:
        """The notes of earlier calls of this import, then this call's new ones."""
        return list(dict.fromkeys([*self.entry.get("notes", []), *self.notes]))

    def tick(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)

    def result(self) -> ImportResult:
        # An import that can write rollouts but found none (a W&B run without a table) counts
        # the steps it wrote to the steps table.
        logged = set() if self.rows["rollouts"] else self._steps_logged
        steps = sorted(self.steps_written or logged)
        examples = tuple(e for reason in self.skips.counts for e in self.skips.examples[reason])
        return ImportResult(
            format=self.importer.name,
            source=self.source,
            out=self.out,
            rows={t: self.rows.get(t, 0) for t in self.importer.tables},
            first_step=steps[0] if steps else None,
            last_step=steps[-1] if steps else None,
            steps_imported=len(steps),
            steps_skipped=self.steps_skipped,
            files_read=self.files_read,
            files_unchanged=self.files_unchanged,
            lines_skipped=dict(self.skips.counts),
            line_examples=examples,
            warnings=tuple(dict.fromkeys(self.warnings)),
            notes=tuple(self._notes()),
        )


def default_run_id(source: Path) -> str:
    """The source folder's name (a file's folder for a file source)."""
    return (source if source.is_dir() else source.parent).name or "run"


def check_paths(source: Path, out: Path) -> None:
    """OUT is rlscope's: never the source, never inside a source folder."""
    if not source.exists():
        raise RlscopeError(f"{source}: no such file or directory")
    if out.exists() and not out.is_dir():
        raise RlscopeError(f"{out}: OUT exists and is not a directory")
    if source.is_dir() and (out == source or out.is_relative_to(source)):
        raise RlscopeError(
            f"{out}: OUT is inside the source {source}",
            hint="rlscope never writes into the source; pick an OUT dir outside it",
        )
    if source.is_file() and out == source:
        raise RlscopeError(f"{out}: OUT is the source file")


def numbered(paths: Iterable[Path], stem: Callable[[Path], str]) -> list[tuple[int | None, Path]]:
    """Paths sorted by the integer in their name (non-numeric names last, by name)."""
    items = []
    for path in paths:
        text = stem(path)
        items.append((int(text) if text.isdigit() else None, path))
    return sorted(items, key=lambda item: (item[0] is None, item[0] or 0, item[1].name))
