"""The same run's token table in the file layouts trainers write: one big file, 10M-row files,
~1.2M-row files (rlscope synth's), thousands of small files. Only the tokens are rewritten; the
other tables are hard links to the base run's."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq


@dataclass(frozen=True)
class Layout:
    name: str
    what: str
    rows_per_file: int | None  # None: keep the base run's files
    row_group_rows: int | None = None


LAYOUTS = (
    Layout(
        "one-file",
        "one file, 64Mi-row row groups (what pyarrow < 15 writes for a whole table)",
        10**12,
        64 * 2**20,
    ),
    Layout("10M-files", "files of 10M rows, 1M-row row groups", 10_000_000, 1_000_000),
    Layout("synth-files", "rlscope synth's files: a file per step, ~1.2M rows", None),
    Layout("10k-files", "files of 10k rows (a file per rollout batch)", 10_000, 10_000),
)


def ensure_layout(base: Path, layout: Layout) -> Path:
    """`base` with its token table rewritten in `layout` (cached next to it)."""
    if layout.rows_per_file is None:
        return base
    path = base.parent / f"{base.name}-{layout.name}"
    if (path / "run.json").exists():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, copy_function=os.link, ignore=shutil.ignore_patterns("tokens"))
    (tmp / "run.json").unlink()  # written last: the layout is complete when it exists
    (tmp / "tokens").mkdir()
    files = sorted((base / "tokens").glob("*.parquet"))
    source = ds.dataset([str(f) for f in files], format="parquet")
    group_rows = layout.row_group_rows or layout.rows_per_file
    writer: pq.ParquetWriter | None = None
    in_file = file_index = 0
    pending: list[pa.RecordBatch] = []
    pending_rows = 0

    def flush() -> None:
        nonlocal pending_rows
        if pending and writer is not None:
            writer.write_table(pa.Table.from_batches(pending), row_group_size=group_rows)
        pending.clear()
        pending_rows = 0

    for batch in source.to_batches(batch_size=min(group_rows, 1_000_000), use_threads=False):
        offset = 0
        while offset < batch.num_rows:
            if writer is None or in_file >= layout.rows_per_file:
                flush()
                if writer is not None:
                    writer.close()
                name = tmp / "tokens" / f"part-{file_index:06d}.parquet"
                writer = pq.ParquetWriter(name, batch.schema, compression="zstd")
                file_index += 1
                in_file = 0
            take = min(batch.num_rows - offset, layout.rows_per_file - in_file)
            take = min(take, group_rows - pending_rows)
            pending.append(batch.slice(offset, take))
            pending_rows += take
            in_file += take
            offset += take
            if pending_rows >= group_rows:
                flush()
    flush()
    if writer is not None:
        writer.close()
    shutil.copy(base / "run.json", tmp / "run.json")
    tmp.rename(path)
    print(f"wrote {path.name}: {file_index} token files", file=sys.stderr)
    return path


if __name__ == "__main__":
    for chosen in LAYOUTS:
        print(ensure_layout(Path(sys.argv[1]), chosen))
