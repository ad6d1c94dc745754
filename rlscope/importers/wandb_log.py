"""W&B run files (`run-<id>.wandb`): the record log's framing, and history rows as columns."""

from __future__ import annotations

import json
import struct
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from rlscope.errors import RlscopeError

# The record log, as written by wandb from 0.10 (wandb/sdk/internal/datastore.py, the Python
# writer up to 0.29) to 0.31 (the Go core: core/internal/transactionlog, core/pkg/leveldb/
# record.go, LevelDB's log format with the IEEE CRC-32):
#
#   file   := header block*            header := ":W&B" magic:u16le=0xBEE1 version:u8=0
#   block  := chunk* trailer?          32 KiB; the first block starts with the header; a chunk
#                                      never crosses a block; fewer than 7 bytes left: zeros
#   chunk  := crc:u32le length:u16le type:u8 payload[length]
#             crc = CRC-32 (IEEE, zlib.crc32) of the type byte and the payload
#             type 1 FULL: a whole record; 2 FIRST, 3 MIDDLE..., 4 LAST: one record in pieces
#   record := a `wandb.proto.wandb_internal_pb2.Record` message
IDENT = b":W&B"
MAGIC = 0xBEE1
VERSIONS = (0,)
HEADER = 7
BLOCK = 32 * 1024
CHUNK = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
_CHUNK = struct.Struct("<IHB")
_HEADER = struct.Struct("<4sHB")
#: History bytes decoded at once (a few thousand rows): bounds the decoder's scratch memory.
BATCH_BYTES = 8 * 2**20
#: Record fields (wandb_internal.proto `Record`) read by field number, never parsed whole.
HISTORY_FIELD, SUMMARY_FIELD = 2, 3
#: `HistoryRecord.item`, and `HistoryItem.key` / `nested_key` / `value_json`.
ITEM, KEY, NESTED_KEY, VALUE_JSON = 1, 1, 2, 16
#: Zeros after a batch's bytes, so that reading a few bytes past any item stays in the buffer.
_PAD = 256


def proto() -> Any:
    """wandb's own protobuf classes (`wandb.proto.wandb_internal_pb2`), or an error naming
    the extra."""
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError:
        raise RlscopeError(
            "reading W&B run files needs the `wandb` package (its protobuf classes)",
            hint="pip install wandb  (from a clone of rlscope: pip install '.[wandb]')",
        ) from None
    return wandb_internal_pb2


@dataclass
class History:
    """Decoded history rows: one frame per batch (a `_row` column numbers the rows across the
    file, in log order), the nested items (tables, dict values) by row, and the numbers of
    values that were not numbers, per key."""

    frames: list[pl.DataFrame] = field(default_factory=list)
    nested: list[tuple[int, list[str], str]] = field(default_factory=list)
    non_numeric: dict[str, int] = field(default_factory=dict)
    rows: int = 0

    def add(self, batch: _Batch) -> None:
        self.frames.append(batch.frame)
        self.nested += batch.nested
        for key, count in batch.non_numeric.items():
            self.non_numeric[key] = self.non_numeric.get(key, 0) + count

    def frame(self) -> pl.DataFrame:
        if not self.frames:
            return pl.DataFrame({"_row": pl.Series([], dtype=pl.Int64)})
        return pl.concat(self.frames, how="diagonal_relaxed")


@dataclass
class RunLog:
    """What one `.wandb` file holds: history, and the few other records rlscope reads."""

    path: Path
    history: History
    config: dict[str, Any]
    run: dict[str, Any]
    metrics: list[dict[str, Any]]
    version: str | None
    cut: str | None  # why the last record(s) were not read (a file cut mid-write)
    records: int


def read_run_log(path: Path) -> RunLog:
    """Every record of `path`: history decoded in batches, run/config/metric/telemetry records
    with wandb's protobuf classes, summaries and the rest skipped by their field number."""
    pb = proto()
    reader = _Records(path)
    history = History()
    # Batches are decoded by a worker thread while the next ones are read (numpy and polars
    # release the GIL): at most two are in flight, which bounds their memory. (A second worker
    # saves little with the file hash on the other core, and costs ~50 MB.)
    workers = ThreadPoolExecutor(max_workers=1)
    waiting: deque[Future[_Batch]] = deque()
    config: dict[str, Any] = {}
    run: dict[str, Any] = {}
    metrics: list[dict[str, Any]] = []
    version: str | None = None
    batch: list[bytes] = []
    size = 0
    count = 0
    for payload in reader:
        count += 1
        number, start, end = _record_type(payload)
        if number == HISTORY_FIELD:
            # a copy: a view would keep its whole 32 KiB block (summaries too) alive
            batch.append(bytes(payload[start:end]))
            size += end - start
            if size >= BATCH_BYTES:
                if len(waiting) >= 2:
                    history.add(waiting.popleft().result())
                waiting.append(workers.submit(_decode, batch, history.rows, path))
                history.rows += len(batch)
                batch, size = [], 0
            continue
        if number not in _WANTED:
            continue
        try:
            record = pb.Record.FromString(bytes(payload))
        except Exception as exc:
            raise RlscopeError(f"{path}: a record is not a W&B protobuf message ({exc})") from None
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {"run_id": record.run.run_id, "project": record.run.project}
            run["name"] = record.run.display_name
            _config_update(config, record.run.config.update)
            if record.run.telemetry.cli_version:
                version = record.run.telemetry.cli_version
        elif kind == "config":
            _config_update(config, record.config.update)
        elif kind == "metric":
            m = record.metric
            metrics.append({"name": m.name, "glob": m.glob_name, "step_metric": m.step_metric})
        elif kind == "telemetry" and record.telemetry.cli_version:
            version = record.telemetry.cli_version
    if batch:
        waiting.append(workers.submit(_decode, batch, history.rows, path))
        history.rows += len(batch)
    try:
        while waiting:
            history.add(waiting.popleft().result())
    finally:
        workers.shutdown(cancel_futures=True)
    return RunLog(path, history, config, run, metrics, version, reader.cut, count + reader.skipped)


_WANTED = {5, 12, 11, 17}  # config, metric, telemetry, run (wandb_internal.proto Record)


def _config_update(config: dict[str, Any], items: Any) -> None:
    for item in items:
        path = list(item.nested_key) or [item.key]
        try:
            value = json.loads(item.value_json)
        except ValueError:
            continue
        node = config
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = value


class _Records:
    """The records of one file, in order. A file that ends inside a chunk or inside a record
    (a run killed mid-write, or one still running) stops there: `cut` says where. Any other
    damage (a checksum mismatch with data after it, a chunk running past its block, a piece of
    a record out of order) is an error naming the byte offset."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cut: str | None = None
        self.skipped = 0  # summary records: never assembled, their chunks only checked

    def _corrupt(self, offset: int, why: str) -> RlscopeError:
        return RlscopeError(
            f"{self.path}: corrupt W&B run file at byte {offset:,}: {why}",
            hint="only the end of a file may be incomplete (a run killed mid-write); a damaged "
            "chunk before the end means the file was altered or the disk failed",
        )

    def __iter__(self) -> Iterator[memoryview]:
        """Each record's bytes: a view into the block read (no copy) for a whole chunk, the
        pieces joined for a record in several."""
        with open(self.path, "rb") as handle:
            head = handle.read(HEADER)
            if len(head) < HEADER:
                raise RlscopeError(f"{self.path}: not a W&B run file (shorter than its header)")
            ident, magic, version = _HEADER.unpack(head)
            if ident != IDENT or magic != MAGIC:
                raise RlscopeError(
                    f"{self.path}: not a W&B run file (no `:W&B` header)",
                    hint="pass the run's `run-<id>.wandb` file or its folder (wandb/run-...)",
                )
            if version not in VERSIONS:
                raise RlscopeError(
                    f"{self.path}: W&B run file version {version}, rlscope reads version 0 "
                    "(wandb 0.10 - 0.31)"
                )
            pending: list[memoryview] | None = None
            pending_at = 0
            skipping = False
            block_at = 0
            block = head + handle.read(BLOCK - HEADER)
            view = memoryview(block)
            pos = HEADER
            while True:
                n = len(block)
                last = n < BLOCK or not handle.peek(1)
                while n - pos >= CHUNK:
                    crc, length, kind = _CHUNK.unpack_from(block, pos)
                    if crc == 0 and length == 0 and kind == 0:
                        break  # zeros to the end of the block
                    at = block_at + pos
                    end = pos + CHUNK + length
                    if end > n:
                        if last and n < BLOCK:
                            self.cut = f"the file ends inside a chunk at byte {at:,}"
                            return
                        raise self._corrupt(at, "a chunk runs past the end of its 32 KiB block")
                    if zlib.crc32(view[pos + 6 : end]) != crc:
                        if last and end == n:
                            self.cut = f"the last chunk (byte {at:,}) fails its checksum"
                            return
                        raise self._corrupt(at, "chunk checksum mismatch")
                    start, pos = pos + CHUNK, end
                    if kind in (FULL, FIRST) and pending is None:
                        summary = _is_summary(block, start, end)
                        if kind == FULL:
                            if summary:
                                self.skipped += 1
                            else:
                                yield view[start:end]
                        else:
                            pending, pending_at = ([] if summary else [view[start:end]]), at
                            skipping = summary
                    elif kind == MIDDLE and pending is not None:
                        if not skipping:
                            pending.append(view[start:end])
                    elif kind == LAST and pending is not None:
                        if skipping:
                            self.skipped += 1
                        else:
                            pending.append(view[start:end])
                            yield memoryview(b"".join(pending))
                        pending = None
                    else:
                        raise self._corrupt(at, f"chunk type {kind} out of sequence")
                if last:
                    tail = block[pos:n]
                    if tail.strip(b"\0"):
                        self.cut = f"the file ends inside a chunk header at byte {block_at + pos:,}"
                    elif pending is not None:
                        self.cut = f"the record starting at byte {pending_at:,} is incomplete"
                    return
                block_at += n
                block = handle.read(BLOCK)
                view = memoryview(block)
                pos = 0
                if not block:
                    if pending is not None:
                        self.cut = f"the record starting at byte {pending_at:,} is incomplete"
                    return


def _is_summary(block: bytes, start: int, end: int) -> bool:
    """Whether the record starting at block[start] is a summary (field 3, after `num`)."""
    i = start
    if i < end and block[i] == 0x08:
        i += 1
        while i < end and block[i] & 0x80:
            i += 1
        i += 1
    return i < end and block[i] == (SUMMARY_FIELD << 3 | 2)


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _record_type(payload: memoryview) -> tuple[int, int, int]:
    """The field number of the record's `record_type` and the span of its message. Fields are
    walked by their wire type (Go's marshaller writes `num` first, then the record)."""
    pos, n = 0, len(payload)
    try:
        while pos < n:
            tag, pos = _varint(payload, pos)
            number, wire = tag >> 3, tag & 7
            if wire == 0:
                _, pos = _varint(payload, pos)
            elif wire == 2:
                length, pos = _varint(payload, pos)
                if 1 < number < 100 and number != 16:  # the oneof, not control/uuid/_info
                    return number, pos, pos + length
                pos += length
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                break
    except IndexError:
        pass
    return 0, 0, 0


def _varints(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The varints at `pos` (at most 5 bytes: lengths and tags): values and byte counts. Most
    are one or two bytes (a value_json tag is 0x82 0x01): those take the short way."""
    b0 = buf[pos].astype(np.int64)
    b1 = buf[pos + 1].astype(np.int64)
    value = np.where(b0 < 0x80, b0, (b0 & 0x7F) | (b1 << 7))
    count = np.where(b0 < 0x80, 1, 2)
    longer = np.nonzero((b0 >= 0x80) & (b1 >= 0x80))[0]
    if longer.size:
        value[longer], count[longer] = _long_varints(buf, pos[longer])
    return value, count


def _long_varints(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    raw = buf[pos[:, None] + np.arange(5)].astype(np.int64)
    ends = raw < 0x80
    count = np.argmax(ends, axis=1) + 1
    if not ends.any(axis=1).all():
        raise ValueError("a varint longer than 5 bytes")
    used = np.arange(5)[None, :] < count[:, None]
    value = (((raw & 0x7F) << (7 * np.arange(5))[None, :]) * used).sum(axis=1)
    return value, count


def _fields(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every length-delimited field of the messages buf[starts[i]:ends[i]], all messages read in
    step (one field of each per pass): (message index, field number, body start, body end).
    A field with a one-byte tag and length (a history item shorter than 128 bytes) takes the
    short way."""
    quick = _short_fields(buf, starts, ends)
    if quick is not None:
        return quick
    pos = starts.copy()
    owners, numbers, bodies, stops = [], [], [], []
    active = np.nonzero(pos < ends)[0]
    while active.size:
        at = pos[active]
        tag = buf[at]
        length = buf[at + 1]
        if ((tag < 0x80) & (length < 0x80) & ((tag & 7) == 2)).all():
            number = (tag >> 3).astype(np.int64)
            body = at + 2
            stop = body + length
        else:
            wide, n1 = _varints(buf, at)
            if ((wide & 7) != 2).any():
                raise ValueError("a field that is not length-delimited")
            size, n2 = _varints(buf, at + n1)
            number = wide >> 3
            body = at + n1 + n2
            stop = body + size
        limit = ends[active]
        if (stop > limit).any():
            raise ValueError("a field runs past its message")
        owners.append(active)
        numbers.append(number)
        bodies.append(body)
        stops.append(stop)
        pos[active] = stop
        active = active[stop < limit]
    if not owners:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    return (
        np.concatenate(owners),
        np.concatenate(numbers),
        np.concatenate(bodies),
        np.concatenate(stops),
    )


def _short_fields(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """`_fields` when every field has a one-byte tag and length (history rows whose items are
    shorter than 128 bytes): the fewest operations a pass, all checked at the end; None when
    some field is not like that."""
    pos = starts.copy()
    owners, tags, lengths, stops = [], [], [], []
    active = np.nonzero(pos < ends)[0]
    while active.size:
        at = pos[active]
        length = buf[at + 1]
        stop = at + 2 + length
        owners.append(active)
        tags.append(buf[at])
        lengths.append(length)
        stops.append(stop)
        pos[active] = stop
        active = active[stop < ends[active]]
    if not owners:
        return None
    tag, length = np.concatenate(tags), np.concatenate(lengths)
    if ((tag | length) >= 0x80).any() or ((tag & 7) != 2).any() or (pos != ends).any():
        return None
    stop = np.concatenate(stops)
    return np.concatenate(owners), (tag >> 3).astype(np.int64), stop - length, stop


def _unaligned(joined: bytes, dtype: str) -> np.ndarray:
    """Little-endian words starting at every byte of `joined` (an unaligned, strided view)."""
    size = np.dtype(dtype).itemsize
    return np.ndarray((len(joined) - size + 1,), dtype=dtype, buffer=joined, strides=(1,))


def _string_views(
    words: tuple[np.ndarray, np.ndarray], data: pa.Buffer, starts: np.ndarray, lengths: np.ndarray
) -> pa.Array:
    """joined[start:start + length] of each item as an Arrow string-view array, without copying
    the bytes (length, then up to 12 bytes inline, or a 4-byte prefix, buffer 0 and the
    offset)."""
    u32, u64 = words
    n = len(starts)
    head = u32[starts].astype(np.uint64)
    if (lengths < 4).any():
        head = _masked(head, lengths)
    views = np.empty((n, 2), dtype=np.uint64)
    views[:, 0] = lengths.astype(np.uint64) | (head << np.uint64(32))
    views[:, 1] = starts.astype(np.uint64) << np.uint64(32)
    short = np.nonzero(lengths <= 12)[0]
    if short.size:
        views[short, 1] = _masked(u64[starts[short] + 4], lengths[short] - 4)
    # Protobuf strings are UTF-8 (the writer checks): string views, not validated again.
    return pa.Array.from_buffers(pa.string_view(), n, [None, pa.py_buffer(views), data])


@dataclass
class _Batch:
    frame: pl.DataFrame
    nested: list[tuple[int, list[str], str]]
    non_numeric: dict[str, int]


def _decode(bodies: list[bytes], first: int, path: Path) -> _Batch:
    """HistoryRecord messages -> one frame: a column per flat key (numbers as Float64, null
    where a row lacks the key), `_row` = the row's number in the file (`first` for the first
    one). Items with a nested key (a dict value, a table reference) are returned apart."""
    joined = b"".join([*bodies, b"\0" * _PAD])
    n = len(bodies)
    buf = np.frombuffer(joined, dtype=np.uint8)
    words = (_unaligned(joined, "<u4"), _unaligned(joined, "<u8"))
    sizes = np.fromiter((len(b) for b in bodies), dtype=np.int64, count=n)
    del bodies
    ends = np.cumsum(sizes)
    try:
        owner, number, body, stop = _fields(buf, ends - sizes, ends)
        items = number == ITEM
        item_row, item_start, item_end = owner[items], body[items], stop[items]
        del owner, number, body, stop, items
        key_at, key_len, value_at, value_len, nested_items = _items(buf, item_start, item_end)
        nested = [
            (first + int(item_row[i]), *_nested_item(joined[item_start[i] : item_end[i]]))
            for i in nested_items
        ]
        del item_start, item_end
        flat = key_at >= 0
        if not flat.all():
            item_row, key_at, key_len = item_row[flat], key_at[flat], key_len[flat]
            value_at, value_len = value_at[flat], value_len[flat]
        data = pa.py_buffer(joined)
        local, names = _key_ids(_string_views(words, data, key_at, key_len))
    except (ValueError, IndexError, UnicodeDecodeError, pa.ArrowInvalid) as exc:
        raise RlscopeError(f"{path}: a history record does not decode ({exc})") from None
    texts = pl.Series(pl.from_arrow(_string_views(words, data, value_at, value_len)))
    values = texts.cast(pl.Float64, strict=False)
    non_numeric: dict[str, int] = {}
    failed = values.is_null().to_numpy().copy()
    numbers = values.to_numpy()
    if failed.any():
        # wandb < 0.17 logs a dict value (a table reference) as one item of JSON text
        for index in np.nonzero(failed & (texts.str.starts_with("{").to_numpy()))[0]:
            try:
                value = json.loads(texts[int(index)])
            except ValueError:
                continue
            if isinstance(value, dict):
                key, row = names[local[index]], first + int(item_row[index])
                nested += [(row, [key, k], json.dumps(v)) for k, v in value.items()]
                failed[index] = False  # not a dropped number
        bad = np.bincount(local[failed], minlength=len(names))
        non_numeric = {names[k]: int(bad[k]) for k in np.nonzero(bad)[0]}
        keep = ~values.is_null().to_numpy()
        item_row, local, numbers = item_row[keep], local[keep], numbers[keep]
    # Fortran order: each key's column is contiguous for Arrow.
    matrix = np.full((n, len(names)), np.nan, order="F")
    present = np.zeros((n, len(names)), dtype=bool, order="F")
    matrix[item_row, local] = numbers
    present[item_row, local] = True
    columns: dict[str, pa.Array] = {"_row": pa.array(np.arange(first, first + n, dtype=np.int64))}
    for j, name in enumerate(names):
        seen = present[:, j]
        if seen.all():
            columns[name] = pa.array(matrix[:, j])
        elif seen.any():
            columns[name] = pa.array(matrix[:, j], mask=~seen)
    return _Batch(pl.DataFrame(pl.from_arrow(pa.table(columns))), nested, non_numeric)


def _masked(word: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The first `count` (0-8) bytes of little-endian 8-byte words, the rest zeroed."""
    bits = np.clip(count, 0, 8).astype(np.uint64) * np.uint64(8)
    full = bits == 64
    mask = np.where(full, ~np.uint64(0), (np.uint64(1) << (bits % np.uint64(64))) - 1)
    return word & mask


def _key_ids(keys: pa.Array) -> tuple[np.ndarray, list[str]]:
    """A number per key (0, 1, ... in order of first appearance) and the keys: Arrow's
    dictionary encoding, which compares whole keys, so two keys share a number only when
    they are equal (TRL logs `train/completions/min_terminated_length` and
    `.../max_terminated_length`: same length, same first and last 8 bytes)."""
    encoded = pc.dictionary_encode(keys)
    return encoded.indices.to_numpy().astype(np.int64), encoded.dictionary.to_pylist()


def _items(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Key and value spans of HistoryItem messages (-1: not a flat item), and the indices of
    items with a nested key. Nearly every item is `0x12 len key 0x82 0x01 len value` (one
    nested_key, then value_json, each shorter than 128 bytes): read at once; the others field
    by field."""
    key_len = buf[starts + 1].astype(np.int64)
    value_tag = starts + 2 + key_len
    value_len = buf[value_tag + 2].astype(np.int64)
    fast = (
        (buf[starts] == 0x12)
        & (key_len < 0x80)
        & (buf[value_tag] == 0x82)
        & (buf[value_tag + 1] == 0x01)
        & (value_len < 0x80)
        & (value_tag + 3 + value_len == ends)
    )
    key_at = np.where(fast, starts + 2, -1)
    value_at = np.where(fast, value_tag + 3, -1)
    key_len = np.where(fast, key_len, 0)
    value_len = np.where(fast, value_len, 0)
    slow = np.nonzero(~fast)[0]
    nested = np.zeros(0, dtype=np.int64)
    if slow.size:
        owner, number, body, stop = _fields(buf, starts[slow], ends[slow])
        parts = np.bincount(owner[number != VALUE_JSON], minlength=slow.size)
        has_value = np.bincount(owner[number == VALUE_JSON], minlength=slow.size) > 0
        is_key = (number == KEY) | (number == NESTED_KEY)
        is_value = number == VALUE_JSON
        one = (parts == 1) & has_value
        at, ln = np.full(slow.size, -1), np.zeros(slow.size, dtype=np.int64)
        at[owner[is_key]], ln[owner[is_key]] = body[is_key], (stop - body)[is_key]
        key_at[slow] = np.where(one, at, -1)
        key_len[slow] = np.where(one, ln, 0)
        at, ln = np.full(slow.size, -1), np.zeros(slow.size, dtype=np.int64)
        at[owner[is_value]], ln[owner[is_value]] = body[is_value], (stop - body)[is_value]
        value_at[slow] = np.where(one, at, -1)
        value_len[slow] = np.where(one, ln, 0)
        nested = slow[(parts > 1) & has_value]
    return key_at, key_len, value_at, value_len, nested


def _nested_item(item: bytes) -> tuple[list[str], str]:
    pb = proto()
    parsed = pb.HistoryItem.FromString(item)
    return (list(parsed.nested_key) or [parsed.key]), parsed.value_json
