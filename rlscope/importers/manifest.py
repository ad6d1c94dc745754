"""The OUT/import.json manifest's inputs: source fingerprints and rollout-id namespaces."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from rlscope.schema import TABLES

MANIFEST = "import.json"
MANIFEST_VERSION = 1


def file_hash(path: Path, limit: int | None = None) -> str:
    """blake2b of the file's first `limit` bytes (all of it by default)."""
    digest = hashlib.blake2b(digest_size=16)
    remaining = limit
    with open(path, "rb") as handle:
        while remaining is None or remaining > 0:
            chunk = handle.read(1 << 20 if remaining is None else min(1 << 20, remaining))
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest.hexdigest()


def fingerprint(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "blake2b": file_hash(path)}


def split_namespace(split: str) -> int:
    """rollout_id namespace of a split, so train and eval imports into one OUT never clash."""
    fixed = {"train": 0, "eval_id": 1, "eval_ood": 2}
    if split in fixed:
        return fixed[split]
    return 3 + int(hashlib.blake2b(split.encode(), digest_size=4).hexdigest(), 16) % 9000


def parquet_files(out: Path) -> set[str]:
    found = set()
    for table in TABLES:
        folder = out / table
        if folder.is_dir():
            found |= {
                p.relative_to(out).as_posix()
                for p in folder.rglob("*.parquet")
                if not p.name.startswith((".", "_"))
            }
        if (out / f"{table}.parquet").is_file():
            found.add(f"{table}.parquet")
    return found
