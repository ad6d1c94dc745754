"""One read per token file: every token-level partial, cached per file, merged by summation
(or, for a maximum, by taking the largest).

The token table is most of a run's bytes (a row per generated token), so it is read by this
module alone, one file at a time and once per `analyze`: each file (in batches of row groups)
is reduced to small per-step partial aggregates — the per-step sums, the per-(step, entropy
bin) and per-(step, advantage tier) histograms, the per-(step, segment) sums and the
per-(step, rollout_id) token counts (and per-rollout sums) that find tokens without a rollout —
which are all sums (or maxima), so merging files (or batches, or machines) is a group-by-sum.
A batch sorted by step is reduced step by step without hashing rows, the histograms by
bincounts, and the segment and rollout levels from the runs of rows of one (rollout, segment),
a row per run. That makes three things cheap:

* memory: a batch of at most `BATCH_ROWS` rows is in memory at a time (per worker), whatever the
  run's size; what is kept is per step, never per token;
* re-analysis: each file's partials are cached in the user cache dir (one pack per run and
  plan), keyed by the file's path, size, mtime and inode, so re-analysing a growing run reads
  only the files that are new since the last time;
* scaling out: `chunk_tagged` is a pure function of (files, plan), so any map over chunks of
  files (a process pool, Ray, Dask) can run it, with `merge` on the driver
  (docs/guides/scaling-out.md).
"""

from __future__ import annotations

from rlscope.tokenscan.mapmerge import (
    Mapper,
    PartialStore,
    by_file,
    chunk_partials,
    chunk_tagged,
    chunks,
    file_partials,
    fold,
    merge,
    pieces,
    scan_tokens,
    value_columns,
)
from rlscope.tokenscan.plan import (
    ADVANTAGE_TIERS,
    BIN_COUNT,
    ENTROPY_BIN_OFFSET,
    ENTROPY_BINS_PER_EFOLD,
    FILE_ID,
    HISTOGRAMS,
    LEVEL_KEYS,
    MAX_PREFIX,
    ROWS,
    ScanStats,
    TokenFile,
    TokenPlan,
    entropy_bin_midpoint,
    is_additive,
    merged,
    token_files,
)
from rlscope.tokenscan.reduce import collect_all

__all__ = [
    "ADVANTAGE_TIERS",
    "BIN_COUNT",
    "ENTROPY_BINS_PER_EFOLD",
    "ENTROPY_BIN_OFFSET",
    "FILE_ID",
    "HISTOGRAMS",
    "LEVEL_KEYS",
    "MAX_PREFIX",
    "ROWS",
    "Mapper",
    "PartialStore",
    "ScanStats",
    "TokenFile",
    "TokenPlan",
    "by_file",
    "chunk_partials",
    "chunk_tagged",
    "chunks",
    "collect_all",
    "entropy_bin_midpoint",
    "file_partials",
    "fold",
    "is_additive",
    "merge",
    "merged",
    "pieces",
    "scan_tokens",
    "token_files",
    "value_columns",
]
