"""Writing one split's output shards: `{split}-{n:05d}.parquet`, `shard_rows` rows each (and, with
`shard_bytes`, about that many bytes of Arrow data at most), one row group per batch, each shard
hashed while it is written and committed atomically by the store.

`ShardWriters` writes up to `threads` shards at once, each on its own thread. Encoding a row group,
writing it into the page cache, hashing it and fsyncing the shard all run without the GIL, and for
media-heavy data they are most of an ingest's work, so on two cores one writer thread was the
bottleneck while the conversion waited. Shard boundaries are fixed by row counts as they arrive
(every shard but a split's last holds exactly `shard_rows` rows), so the output is the same bytes
whatever `threads` is. A `shard_bytes` limit is also decided from the data alone: each batch's rows
are counted at that batch's mean size (its Arrow `nbytes` over its rows), and a shard takes rows
while they fit, at least one.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, suppress
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.data.memory import release_freed_memory
from omni_core.errors import DataError
from omni_core.storage import Store
from omni_core.storage.digest import AppendDigest

WRITE_THREADS = 2  # shards written at once; more bought nothing on the 2-core machines we measure on
DATA_PAGE_BYTES = 1 << 20  # pyarrow's default data page size, stated because the batch size follows it
DEFAULT_WRITE_BATCH_ROWS = 1024  # pyarrow's default
ENCODED_MEDIA = {"images", "videos"}  # columns whose bytes are compressed formats already
IN_FLIGHT_EXTRA = 0  # batches queued beyond one per writer thread (more raised the peak, not the speed)


@functools.cache
def parquet_write_options(schema: pa.Schema) -> dict[str, Any]:
    """`pq.ParquetWriter` options for output shards: pyarrow's defaults, except that raw binary
    columns (images, audio, video) are not dictionary-encoded, and images and videos are stored
    without Snappy compression.

    By default the writer first puts every value of a column chunk into a dictionary and falls
    back to plain encoding only after the batch: for a row group of images that copied and hashed
    the whole group again (with reallocations) and wrote it as one huge dictionary page. That was
    two thirds of the time spent writing MMK12 shards. Media never repeat within a row group, so
    the dictionary bought nothing; the values read back are the same.

    PNG, JPEG and MP4 bytes are compressed already: Snappy gained nothing on them (the MMK12 shards
    came out the same size) but cost a pass over every byte and an output buffer as large as the
    row group, which the kernel had to fault in for every batch. WAV audio is raw PCM and keeps it.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(schema.empty_table(), sink)
    columns = pq.ParquetFile(pa.BufferReader(sink.getvalue())).schema
    leaves = [columns.column(i) for i in range(len(columns))]
    binary = {c.path for c in leaves if c.physical_type == "BYTE_ARRAY" and c.logical_type.type == "NONE"}
    # a per-column codec dict leaves unnamed columns uncompressed, so every column is named
    compression = {c.path: "NONE" if c.path in binary and c.path.split(".")[0] in ENCODED_MEDIA else "SNAPPY"
                   for c in leaves}
    return {"use_dictionary": [c.path for c in leaves if c.path not in binary], "compression": compression}


def write_batch_rows(table: pa.Table) -> int:
    """Rows the Parquet writer encodes at a time, so that one such batch is about a data page.

    The writer checks a page's size only between batches (1,024 rows by default): for a row group
    of 256 images that meant one 40 MB page, its buffer grown by reallocation, every new piece of
    it faulted in by the kernel. With batches of a page's worth of rows the page buffers stay small
    and are reused. Measured on the MMK12 bench input (pyarrow alone, same bytes): the write's
    system time fell from 1.3-2.8 s to 0.25-0.5 s. Derived from the data, so it is deterministic.
    """
    row_bytes = max(1, -(-table.nbytes // max(1, table.num_rows)))
    return max(1, min(DEFAULT_WRITE_BATCH_ROWS, DATA_PAGE_BYTES // row_bytes))


class _Shard:
    """One shard file: opened on creation, hashed after every row group, committed by `close`."""

    def __init__(self, store: Store, key: str, schema: pa.Schema, first: pa.Table):
        self.key, self.rows = key, 0
        self._stack = ExitStack()
        try:
            path = self._stack.enter_context(store.write_path(key))
            # a native file (no copies through Python); media columns without dictionary encoding
            self._writer = pq.ParquetWriter(path, schema, **parquet_write_options(schema),
                                            data_page_size=DATA_PAGE_BYTES, write_batch_size=write_batch_rows(first))
            self._digest = AppendDigest(path)
        except BaseException:
            self._stack.__exit__(DataError, DataError("shard not opened"), None)
            raise

    def write(self, table: pa.Table) -> None:
        self._writer.write_table(table)
        self._digest.update()  # hashed while the row group is still in the page cache
        self.rows += table.num_rows

    def close(self) -> dict[str, Any]:
        self._writer.close()
        size, digest = self._digest.finish()
        self._stack.close()  # fsync + rename (local) or upload (S3): the shard appears whole or not at all
        return {"key": self.key, "rows": self.rows, "sha256": digest, "bytes": size}

    def abort(self) -> None:
        with suppress(Exception):
            self._writer.close()
        self._digest.close()
        self._stack.__exit__(DataError, DataError("ingest aborted"), None)  # discards the partial file


class _Countdown:
    """Runs `done` once all `n` pieces of a batch (it may span two shards) have been written."""

    def __init__(self, n: int, done: Callable[[], None]):
        self._left, self._done, self._lock = n, done, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._done()


_Item = tuple[pa.Table, _Countdown] | None  # None: the shard is complete


class ShardWriters:
    """Writes a split's batches, in order, into shards of `shard_rows` rows (fewer where `shard_bytes`
    is reached first), up to `threads` shards at once. An error on a writer thread is raised at the
    next `write` or at `close`; after `abort` (or an error) no partial shard is left behind, but
    shards already committed stay (the caller deletes the version folder)."""

    def __init__(self, store: Store, prefix: str, split: str, schema: pa.Schema, shard_rows: int,
                 threads: int = WRITE_THREADS, shard_bytes: int | None = None):
        self.store, self.prefix, self.split, self.schema, self.shard_rows = store, prefix, split, schema, shard_rows
        self.shard_bytes = shard_bytes
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="omni-ingest-write")
        self._futures: list[Future[dict[str, Any] | None]] = []
        self._current: queue.Queue[_Item] | None = None
        self._rows = 0  # rows sent to the current shard
        self._bytes = 0.0  # their Arrow bytes, each batch's rows at that batch's mean size
        self._error: BaseException | None = None
        self._aborted = False
        # One budget across all shards (not a queue bound per shard): how many shards are open at
        # a moment varies with timing, and the peak memory must not.
        self._in_flight = threading.Semaphore(max(1, threads) + IN_FLIGHT_EXTRA)

    def write(self, table: pa.Table, done: Callable[[], None] = lambda: None) -> None:
        """Queue `table`'s rows; `done()` runs once they are all written (it frees the batch)."""
        self._raise_error()
        if not table.num_rows:
            done()
            return
        pieces: list[tuple[queue.Queue[_Item], pa.Table | None]] = []
        row_bytes = table.nbytes / table.num_rows if self.shard_bytes else 0.0
        while table.num_rows:
            if self._current is None:
                self._current = queue.Queue()
                key = f"{self.prefix}/{self.split}-{len(self._futures):05d}.parquet"
                self._futures.append(self._pool.submit(self._write_shard, key, self._current))
                self._rows, self._bytes = 0, 0.0
            room = self.shard_rows - self._rows
            if self.shard_bytes and row_bytes:
                room = min(room, max(int((self.shard_bytes - self._bytes) // row_bytes), 0 if self._rows else 1))
            if room:
                take = table.slice(0, room)
                table = table.slice(take.num_rows)
                pieces.append((self._current, take))
                self._rows += take.num_rows
                self._bytes += take.num_rows * row_bytes
            if not room or self._rows >= self.shard_rows or (self.shard_bytes and self._bytes >= self.shard_bytes):
                pieces.append((self._current, None))
                self._current = None
        self._in_flight.acquire()  # blocks while the writers hold the budget; they always drain

        def written() -> None:
            done()
            self._in_flight.release()

        countdown = _Countdown(sum(piece is not None for _, piece in pieces), written)
        for shard_queue, piece in pieces:
            shard_queue.put(None if piece is None else (piece, countdown))

    def close(self) -> list[dict[str, Any]]:
        """Wait for every shard; their manifest entries in order."""
        self._finish()
        self._raise_error()
        return [entry for entry in (f.result() for f in self._futures) if entry is not None]

    def abort(self) -> None:
        self._aborted = True
        self._finish()

    def _finish(self) -> None:
        if self._current is not None:
            self._current.put(None)
            self._current = None
        for future in self._futures:
            with suppress(BaseException):
                future.result()
        self._pool.shutdown()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_shard(self, key: str, items: queue.Queue[_Item]) -> dict[str, Any] | None:
        """A writer thread: consumes the shard's queue to its end whatever happens, so the producer
        never blocks on a queue nobody reads."""
        shard: _Shard | None = None
        while (item := items.get()) is not None:
            table, countdown = item
            del item
            if self._error is None and not self._aborted:
                try:
                    shard = shard or _Shard(self.store, key, self.schema, table)
                    shard.write(table)
                except BaseException as exc:  # handed to the producer thread
                    self._error = self._error or exc
            del table  # the piece's last reference: its memory is free before the release
            countdown()
            release_freed_memory()
        if shard is None:
            return None
        if self._error is not None or self._aborted:
            shard.abort()
            return None
        try:
            return shard.close()
        except BaseException as exc:
            self._error = self._error or exc
            return None
