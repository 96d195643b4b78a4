"""`table_records`: raw Parquet rows as dicts whose media bytes borrow Arrow's memory."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from omni_core.data.converter import table_records

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _plain(value):
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _table() -> pa.Table:
    first = pa.table({
        "id": ["a", "b", "c"],
        "image": pa.array([{"bytes": b"\x89PNG-a", "path": "a.png"}, None, {"bytes": None, "path": "c.png"}], IMAGE),
        "blob": pa.array([b"x" * 10, None, b""], pa.large_binary()),
    })
    second = pa.table({
        "id": ["d", "e"],
        "image": pa.array([{"bytes": b"dd", "path": None}, {"bytes": b"eee", "path": "e.png"}], IMAGE),
        "blob": pa.array([b"y", b"zz"], pa.large_binary()),
    })
    return pa.concat_tables([first, second])  # two chunks per column


def test_records_equal_to_pylist_with_media_as_memoryviews():
    table = _table()
    records = table_records(table)
    assert [_plain(r) for r in records] == table.to_pylist()
    assert isinstance(records[0]["image"]["bytes"], memoryview) and isinstance(records[3]["blob"], memoryview)
    assert records[1]["image"] is None and records[2]["image"]["bytes"] is None and records[1]["blob"] is None
    assert bytes(records[2]["blob"]) == b""


def test_sliced_tables_keep_their_offsets():
    table = _table().slice(1, 3)  # starts inside the first chunk, ends inside the second
    assert [_plain(r) for r in table_records(table)] == table.to_pylist()


def test_media_values_share_arrow_memory():
    table = _table()
    data = table.column("image").chunks[1].field("bytes").buffers()[2]
    view = table_records(table)[4]["image"]["bytes"]
    assert bytes(view) == b"eee"
    # a slice of Arrow's data buffer (after b"dd"), not a copy
    assert np.frombuffer(view, dtype=np.uint8).ctypes.data == data.address + 2
