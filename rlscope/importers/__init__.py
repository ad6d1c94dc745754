"""Importers: what trainers write (verl, TRL, W&B, MLflow, JSONL...) -> format-v1 run dirs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlscope.cache import store_copy_dir
from rlscope.errors import RlscopeError
from rlscope.importers.jsonl import JSONL
from rlscope.importers.manifest import MANIFEST
from rlscope.importers.mlflow_store import MLFLOW
from rlscope.importers.options import Option
from rlscope.importers.session import Importer, ImportResult, Progress, Session, check_paths
from rlscope.importers.tensorboard import TENSORBOARD
from rlscope.importers.trl import TRL
from rlscope.importers.verl import VERL, VERL_METRICS
from rlscope.importers.wandb_run import WANDB
from rlscope.store import StorePath, is_url, location, mirror

IMPORTERS: dict[str, Importer] = {
    i.name: i for i in (VERL, VERL_METRICS, TRL, JSONL, TENSORBOARD, WANDB, MLFLOW)
}

__all__ = ["IMPORTERS", "MANIFEST", "ImportResult", "Importer", "Option", "import_run"]


def import_run(
    format: str,
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    progress: Progress | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> ImportResult:
    """Import `source` (never written to) in `format` into the run directory `out`.

    Re-running appends only steps not imported yet (OUT/import.json records what was); the
    options must be the same as the first time. `progress(files_done, files_total)` is called
    after each source file. See `IMPORTERS[format].doc` for the mapping and the options.

    A `source` in a store (s3://...) is copied first into the user cache dir (`cache_dir`),
    only its new or changed objects fetched; `out` is always a local directory."""
    importer = IMPORTERS.get(format)
    if importer is None:
        raise RlscopeError(
            f"unknown import format {format!r}", hint=f"formats: {', '.join(IMPORTERS)}"
        )
    if is_url(out):
        raise RlscopeError(
            f"{out}: OUT must be a local directory (rlscope never writes into a store)"
        )
    where = location(source)
    if isinstance(where, StorePath):
        where = mirror(where, store_copy_dir(where, root=cache_dir))
    source_path = where.expanduser().resolve()
    out_path = Path(out).expanduser().resolve()
    check_paths(source_path, out_path)
    session = Session(importer, source_path, out_path, importer.parse_options(options), progress)
    session.open()
    importer.run(session)
    session.close()
    return session.result()
