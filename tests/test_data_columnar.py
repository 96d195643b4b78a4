"""Columnar ingest: MMK12's `convert_batch` against its row-by-row `convert`, the shard writer's
Parquet options, and digests of a file hashed while it is written."""

from __future__ import annotations

import importlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.data import shards as shards_module
from omni_core.data.converter import BatchConverted, RowRejected, table_records
from omni_core.data.media import encode_image
from omni_core.data.mmk12 import SCHEMA, MMK12Converter, write_mmk12_raw
from omni_core.data.sources import RawSource
from omni_core.storage.digest import AppendDigest, file_digest

ingest_module = importlib.import_module("omni_core.data.ingest")  # the package exports the function `ingest`
RAW = RawSource(uri="memory://", root=Path("."), files={})


def _row_by_row(table: pa.Table, first_index: int) -> BatchConverted:
    converter, rows, rejected = MMK12Converter(), [], []
    for offset, record in enumerate(table_records(table)):
        try:
            rows.append(converter.convert(record, "train", first_index + offset, RAW))
        except RowRejected as exc:
            rejected.append((offset, exc.reason))
    return BatchConverted(pa.Table.from_pylist(ingest_module._owned(rows), schema=SCHEMA), rejected)


def _raw_table(tmp_path: Path) -> pa.Table:
    """The fixture's raw rows (bad ones included) in several chunks, plus rows the fixture never
    makes: a null image struct whose child still holds a valid PNG, an empty image, a corrupt PNG,
    a non-PNG image and a None id/subject."""
    paths = write_mmk12_raw(tmp_path / "raw", rows=40, seed=2, bad_rows=8, image_size=32, shard_rows=1000)
    table = pq.read_table(paths[0])
    png = table.column("image")[0].as_py()["bytes"]
    broken = bytearray(png)
    broken[40] ^= 0xFF
    from PIL import Image
    jpeg = encode_image(Image.new("RGB", (8, 8), "red"), "JPEG")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    extra = pa.table({
        "id": ["x1", "x2", "x3", "x4", None],
        "question": ["Q?"] * 5,
        "answer": ["A"] * 5,
        "subject": ["math", "math", "math", "math", None],
        "image": pa.StructArray.from_arrays(
            [pa.array([png, b"", bytes(broken), jpeg, png]), pa.array(["a", "b", "c", "d", "e"])],
            fields=list(image), mask=pa.array([True, False, False, False, False])),
    }, schema=table.schema)
    return pa.concat_tables([table.slice(0, 17), extra, table.slice(17)])


def test_convert_batch_equals_row_by_row(tmp_path: Path) -> None:
    table = _raw_table(tmp_path)
    assert table.column("image").num_chunks > 1
    batch = MMK12Converter().convert_batch(table, "train", 100, RAW)
    expected = _row_by_row(table, 100)
    assert batch.rejected == expected.rejected
    assert {reason.split(":")[0] for _, reason in batch.rejected} >= {
        "missing image", "undecodable image", "missing answer", "empty question"}
    assert batch.table.schema.equals(SCHEMA)
    assert batch.table.equals(expected.table)
    assert batch.table.num_rows + len(batch.rejected) == table.num_rows


def test_convert_batch_with_a_plain_binary_image_column(tmp_path: Path) -> None:
    table = _raw_table(tmp_path)
    images = pa.chunked_array([c.field("bytes") for c in table.column("image").chunks])
    for kind in (pa.binary(), pa.large_binary()):
        plain = table.set_column(4, "image", images.cast(kind))
        batch = MMK12Converter().convert_batch(plain, "train", 0, RAW)
        expected = _row_by_row(plain, 0)
        assert batch.rejected == expected.rejected and batch.table.equals(expected.table)


def test_convert_batch_declines_an_unusual_image_column() -> None:
    table = pa.table({"id": ["a"], "question": ["q"], "answer": ["a"], "subject": ["s"], "image": ["not bytes"]})
    assert MMK12Converter().convert_batch(table, "train", 0, RAW) is None


def test_shards_do_not_dictionary_encode_media(tmp_path: Path) -> None:
    options = shards_module.parquet_write_options(SCHEMA)
    assert "images.list.element.bytes" not in options["use_dictionary"]
    assert {"data_source", "extra_info.subject", "prompt.list.element.content"} <= set(options["use_dictionary"])
    table = pa.Table.from_pylist([{
        "data_source": "mmk12", "prompt": [{"role": "user", "content": "q"}], "images": [{"bytes": b"x" * 1000}],
        "ability": "math_vl", "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"split": "train", "index": i, "id": str(i), "dataset": "MMK12", "subject": "math",
                       "raw_question": "q", "raw_answer": "1", "options": "{}"}} for i in range(3)], schema=SCHEMA)
    path = tmp_path / "shard.parquet"
    with pq.ParquetWriter(path, SCHEMA, **options) as writer:
        writer.write_table(table)
    metadata = pq.ParquetFile(path).metadata.row_group(0)
    columns = {metadata.column(i).path_in_schema: metadata.column(i) for i in range(metadata.num_columns)}
    assert not columns["images.list.element.bytes"].has_dictionary_page
    assert columns["data_source"].has_dictionary_page
    assert columns["images.list.element.bytes"].compression == "UNCOMPRESSED"  # PNG bytes: compressed already
    assert {c.compression for name, c in columns.items() if name != "images.list.element.bytes"} == {"SNAPPY"}
    assert pq.read_table(path).equals(table)


def test_append_digest_matches_the_finished_file(tmp_path: Path) -> None:
    path = tmp_path / "growing.bin"
    with open(path, "wb", buffering=0) as f:
        digest = AppendDigest(path)
        for n in (0, 5, 3 << 20, 17):
            f.write(bytes(range(256)) * (n // 256) + b"z" * (n % 256))
            digest.update()
        f.write(b"tail")
    assert digest.finish() == file_digest(path)


def test_release_freed_memory_keeps_live_buffers() -> None:
    from omni_core.data.memory import release_freed_memory

    live = pa.array([b"x" * 1000] * 1000)
    freed = pa.array([b"y" * 1000] * 1000)
    del freed
    release_freed_memory()
    assert live[999].as_py() == b"x" * 1000 and pa.total_allocated_bytes() >= live.nbytes
