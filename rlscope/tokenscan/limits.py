"""The token scan's working-set knobs (read at call time, so a test or a benchmark can set them)."""

from __future__ import annotations

#: Rows read and reduced at a time (whole row groups, or slices of a larger one).
BATCH_ROWS = 1_200_000
#: A batch whose rows form at most this many runs of one step, of this many rows on average, is
#: reduced run by run (a plain select per run); otherwise (unsorted or small batches) by a
#: group-by on the step.
MAX_STEP_RUNS = 32
MIN_STEP_RUN_ROWS = 50_000
#: Small files are reduced together, up to this many bytes of Parquet per chunk of work.
CHUNK_BYTES = 16 * 2**20
#: Chunks reduced at once, each worker holding one batch: reads and Polars use every core
#: anyway, but a third worker fills the gaps while the others are between batches (measured on
#: 2 cores: ~10% faster than 2 workers, ~0.07 GiB more).
WORKERS = 3
#: Queries handed to one `pl.collect_all`: its cost grows with the square of their number
#: (polars 2.1: 4000 small queries take 14 s at once, 1 s in slices of 32), and a run of many
#: small files makes thousands.
COLLECT_SLICE = 32
