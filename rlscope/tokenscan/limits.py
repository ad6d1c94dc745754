"""The token scan's working-set knobs (read at call time, so a test or a benchmark can set them)."""

from __future__ import annotations

#: Rows read and reduced at a time (slices of row groups), and at most this many decoded bytes
#: of the columns read: the working set is rows in flight, whatever the file's layout (a
#: 64Mi-row row group is read a slice at a time, never whole). The per-batch sums run on the
#: in-memory engine (rlscope.exactsum), whose temporaries are a batch's: 12 MiB batches (~300k
#: rows of the 9 token columns) peaked 0.04-0.06 GiB lower than 24 MiB ones (400k rows) at 200M
#: and 1B tokens, at the same speed at 1B (55.0 against 55.4 s cold); the scan alone of the 200M
#: synth files took 6% longer.
BATCH_ROWS = 400_000
BATCH_BYTES = 12 * 2**20
#: Rows of consecutive small files reduced together (200k rows: 0.09 GiB lower than 400k over
#: 20k files of 10k rows, at the same speed).
POOL_ROWS = 200_000
#: Parquet is read through a buffer of this size per column, without pre-buffering whole
#: column chunks (pyarrow's default would hold a row group's compressed columns in memory).
#: Larger costs more than it saves: each column's buffer is fresh memory to fault in (8 MiB:
#: the scan 4% slower at 100M tokens).
READ_BUFFER_BYTES = 2**20
#: From a store, a file (or piece) of at most this many Parquet bytes in the columns read is
#: fetched whole, its ranges coalesced into few requests; a larger one streams through the
#: buffers above (three workers: at most ~100 MB in flight).
PREFETCH_BYTES = 32 * 2**20
#: A row group of at most this many decoded bytes (of the columns read) may be decoded whole, by
#: Polars, where it decodes faster than pyarrow (no byte-stream-split column): three workers
#: then hold up to three such row groups. 21 files of 10M rows in 1M-row groups (41 MB
#: decoded), 4 runs each: at 48 MiB (Polars) 11.0 s and 0.46-0.53 GiB, at 32 MiB (pyarrow's
#: 12 MiB batches) 12.2 s and 0.43 GiB: the memory goal (0.5 GiB) is kept over the speed.
WHOLE_GROUP_BYTES = 32 * 2**20
#: A file of at most this many bytes (decoded: a few times more) is read whole, at once, and
#: consecutive ones together, up to POOL_BYTES of Parquet.
SMALL_FILE_BYTES = 2**20
POOL_BYTES = 4 * 2**20
#: A file larger than this is split into pieces of whole row groups, about PIECE_ROWS rows
#: each, reduced in parallel like files.
PIECE_FILE_BYTES = 64 * 2**20
PIECE_ROWS = 10_000_000
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
#: Files' partials are summed into a block every this many files (and blocks into one every
#: this many blocks): thousands of small files' frames would otherwise be kept to the end (20k
#: files: 0.8 GiB of frames).
FOLD_FILES = 256
