"""Where rlscope keeps what it derives (imported runs): the user cache dir, never a run dir."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


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
