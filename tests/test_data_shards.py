"""Writing a split's shards on several threads: same bytes as one thread, exact boundaries, and
nothing half-written left after an error or an abort."""

from __future__ import annotations

import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omni_core.data.shards import ShardWriters
from omni_core.storage import Store
from omni_core.storage.digest import file_digest

SCHEMA = pa.schema([("index", pa.int64()), ("blob", pa.binary())])


def _batch(first: int, rows: int) -> pa.Table:
    return pa.table({"index": list(range(first, first + rows)),
                     "blob": [(b"%08d" % i) * 512 for i in range(first, first + rows)]}, schema=SCHEMA)


def _write(store: Store, threads: int, batch_rows: list[int], shard_rows: int) -> tuple[list[dict], list[int]]:
    writers = ShardWriters(store, "v1", "train", SCHEMA, shard_rows, threads=threads)
    done: list[int] = []
    lock = threading.Lock()
    first = 0
    for n, rows in enumerate(batch_rows):
        def finished(n: int = n) -> None:
            with lock:
                done.append(n)
        writers.write(_batch(first, rows), finished)
        first += rows
    return writers.close(), sorted(done)


def test_threads_write_the_same_shards_as_one_thread(tmp_path: Path) -> None:
    batches = [7, 13, 1, 20, 9, 30, 4]  # batches that straddle shard boundaries, one that fills two shards
    one, done_one = _write(Store(str(tmp_path / "one")), 1, batches, shard_rows=10)
    four, done_four = _write(Store(str(tmp_path / "four")), 4, batches, shard_rows=10)
    assert [s["rows"] for s in one] == [10] * 8 + [4]
    assert [s["key"] for s in one] == [f"v1/train-{i:05d}.parquet" for i in range(9)]
    assert [(s["key"], s["rows"], s["sha256"], s["bytes"]) for s in four] == \
        [(s["key"], s["rows"], s["sha256"], s["bytes"]) for s in one]
    assert done_one == done_four == list(range(len(batches)))  # each batch's callback ran exactly once
    for shard in four:
        path = tmp_path / "four" / shard["key"]
        assert file_digest(path)[1] == shard["sha256"]
    rows = pa.concat_tables(pq.read_table(tmp_path / "four" / s["key"]) for s in four)
    assert rows.column("index").to_pylist() == list(range(sum(batches)))
    assert [p.name for p in (tmp_path / "four" / "v1").iterdir() if p.name.startswith(".")] == []


def test_an_error_on_a_writer_thread_is_raised_and_leaves_no_partial_shard(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    writers = ShardWriters(store, "v1", "train", SCHEMA, shard_rows=10, threads=2)
    writers.write(_batch(0, 25))
    wrong = pa.table({"index": ["not an int"] * 3, "blob": [b"x"] * 3})  # the shard's writer refuses it
    with pytest.raises(Exception, match="schema"):
        writers.write(wrong)
        for i in range(50):  # the error reaches the producer at a later write or at close
            writers.write(_batch(100 + i, 3))
        writers.close()
    writers.abort()
    left = sorted(p.name for p in (tmp_path / "v1").iterdir())
    assert [name for name in left if not name.endswith(".parquet") or name.startswith(".")] == []
    for name in left:  # whatever was committed before the error is whole
        assert pq.read_table(tmp_path / "v1" / name).num_rows == 10


def test_abort_discards_shards_in_progress(tmp_path: Path) -> None:
    writers = ShardWriters(Store(str(tmp_path)), "v1", "train", SCHEMA, shard_rows=100, threads=2)
    writers.write(_batch(0, 150))
    writers.abort()
    folder = tmp_path / "v1"
    left = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    assert left in ([], ["train-00000.parquet"])  # the full shard may have been committed before the abort
    for name in left:
        assert pq.read_table(folder / name).num_rows == 100


def _write_bytes_limited(store: Store, threads: int, batch_rows: list[int], shard_bytes: int) -> list[dict]:
    writers = ShardWriters(store, "v1", "train", SCHEMA, shard_rows=1000, threads=threads, shard_bytes=shard_bytes)
    first = 0
    for rows in batch_rows:
        writers.write(_batch(first, rows))
        first += rows
    return writers.close()


def test_a_byte_limit_ends_shards_early_and_the_same_way_on_every_thread_count(tmp_path: Path) -> None:
    row_bytes = _batch(0, 10).nbytes / 10  # ~4.1 KB a row
    batches = [7, 13, 1, 20, 9, 30, 4]
    one = _write_bytes_limited(Store(str(tmp_path / "one")), 1, batches, shard_bytes=int(10.5 * row_bytes))
    four = _write_bytes_limited(Store(str(tmp_path / "four")), 4, batches, shard_bytes=int(10.5 * row_bytes))
    assert [s["rows"] for s in one] == [10] * 8 + [4]  # 10 rows fit in 10.5 rows' bytes, 11 do not
    assert [(s["key"], s["sha256"]) for s in four] == [(s["key"], s["sha256"]) for s in one]
    rows = pa.concat_tables(pq.read_table(tmp_path / "four" / s["key"]) for s in four)
    assert rows.column("index").to_pylist() == list(range(sum(batches)))  # nothing lost or reordered


def test_a_row_larger_than_the_byte_limit_gets_a_shard_of_its_own(tmp_path: Path) -> None:
    shards = _write_bytes_limited(Store(str(tmp_path)), 2, [3, 2], shard_bytes=100)
    assert [s["rows"] for s in shards] == [1] * 5
