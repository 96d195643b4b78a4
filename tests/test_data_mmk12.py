"""MMK12: raw-shard fixture, converter, and ingestion to local and S3 stores."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from omni_core.config import DatasetConfig
from omni_core.data import ingest, load_version, resolve_source, write_fixture
from omni_core.data.mmk12 import INSTRUCTION, SCHEMA, write_mmk12_raw
from omni_core.errors import DataError
from omni_core.storage import Store

pytestmark = pytest.mark.usefixtures("omni_cache")


def _read(store: Store, keys: list[str]) -> pa.Table:
    tables = []
    for key in keys:
        with store.open_read(key) as f:
            tables.append(pq.read_table(f))
    return pa.concat_tables(tables)


def test_fixture_writes_the_hub_layout_deterministically(tmp_path) -> None:
    a = write_fixture("mmk12", tmp_path / "a", rows=8, seed=3, bad_rows=2)
    b = write_fixture("mmk12", tmp_path / "b", rows=8, seed=3, bad_rows=2)
    assert [p.name for p in a] == ["train-00000-of-00001.parquet", "test-00000-of-00001.parquet"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != write_fixture("mmk12", tmp_path / "c", rows=8, seed=4)[0].read_bytes()
    train, test = pq.read_table(a[0]), pq.read_table(a[1])
    assert train.column_names == ["id", "question", "answer", "subject", "image"] and train.num_rows == 10
    assert train.schema.field("image").type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    good = [r for r in train.to_pylist() if r["image"] and r["answer"] and r["question"].strip()]
    assert {r["answer"] in "ABCDE" for r in good} == {True, False}  # multiple-choice and free-form
    assert all(Image.open(io.BytesIO(r["image"]["bytes"])).format == "PNG" for r in good)
    rows = test.to_pylist()
    assert [r["subject"] for r in rows] == ["math", "physics"] and all(r["answer"] in "ABCDE" for r in rows)
    assert all("\nA. " in r["question"] and "\nD. " in r["question"] for r in rows)


def test_ingest_produces_verl_rows(store: Store) -> None:
    source = "fixtures://mmk12?rows=8&seed=1"
    dv = ingest(store, "mmk12", DatasetConfig(source=source, converter="mmk12"), progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 10, "rows": 10, "quarantined": 0, "skipped": 0}
    raw = resolve_source(source)
    for split, n in (("train", 8), ("test", 2)):
        table = _read(store, dv.shard_keys(split))
        assert table.schema.equals(SCHEMA) and table.num_rows == n
        expected = pq.read_table(raw.path(f"{split}-00000-of-00001.parquet")).to_pylist()
        for index, (row, src) in enumerate(zip(table.to_pylist(), expected, strict=True)):
            assert row["data_source"] == "mmk12" and row["ability"] == "math_vl"
            assert row["prompt"] == [{"role": "user", "content": "<image>\n" + INSTRUCTION + "\n\n" + src["question"]}]
            assert row["images"] == [{"bytes": src["image"]["bytes"]}]
            Image.open(io.BytesIO(row["images"][0]["bytes"])).load()
            assert row["reward_model"] == {"style": "rule", "ground_truth": src["answer"]}
            info = row["extra_info"]
            options = json.loads(info.pop("options"))
            assert info == {"split": split, "index": index, "id": src["id"], "dataset": "MMK12",
                            "subject": src["subject"], "raw_question": src["question"], "raw_answer": src["answer"]}
            if src["answer"] in "ABCDE":
                assert src["answer"] in options and f"\n{src['answer']}. {options[src['answer']]}" in src["question"]
            else:
                assert options == {}


def test_instruction_asks_for_think_answer_and_boxed() -> None:
    for tag in ("<think></think>", "<answer></answer>", "\\boxed{}"):
        assert tag in INSTRUCTION


def test_bad_rows_are_quarantined_with_reasons(store: Store) -> None:
    config = DatasetConfig(source="fixtures://mmk12?rows=8&seed=0&bad_rows=4", converter="mmk12",
                           max_quarantine_fraction=0.5)
    dv = ingest(store, "mmk12", config, progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 14, "rows": 10, "quarantined": 4, "skipped": 0}
    with store.open_read(dv.manifest["quarantine"]) as f:
        quarantine = pq.read_table(f).to_pylist()
    assert sorted(r["reason"].split(":")[0] for r in quarantine) == [
        "empty question", "missing answer", "missing image", "undecodable image"]
    assert all(r["split"] == "train" and r["source_file"] == "train-00000-of-00001.parquet" for r in quarantine)


def test_shards_are_read_in_order(tmp_path, store: Store) -> None:
    write_mmk12_raw(tmp_path / "raw", rows=7, seed=5, shard_rows=3)
    assert sorted(p.name for p in (tmp_path / "raw").iterdir())[-3:] == [
        "train-00000-of-00003.parquet", "train-00001-of-00003.parquet", "train-00002-of-00003.parquet"]
    dv = ingest(store, "mmk12", DatasetConfig(source=str(tmp_path / "raw"), converter="mmk12"), progress=lambda _: None)
    ids = _read(store, dv.shard_keys("train")).column("extra_info").combine_chunks().field("id").to_pylist()
    assert ids == [f"train_{i:06d}" for i in range(7)]


@pytest.mark.parametrize("damage, message", [
    ("corrupt", "train-00000-of-00001.parquet is not a readable Parquet file"),
    ("columns", r"train-00000-of-00001.parquet lacks column\(s\) \['image'\]"),
])
def test_an_unusable_shard_fails_the_ingest_and_leaves_nothing(tmp_path, damage: str, message: str) -> None:
    store = Store(str(tmp_path / "store"))
    good = ingest(store, "mmk12", DatasetConfig(source="fixtures://mmk12?rows=4", converter="mmk12"),
                  progress=lambda _: None)
    paths = write_fixture("mmk12", tmp_path / "raw", rows=4, seed=9)
    if damage == "corrupt":
        paths[0].write_bytes(b"PAR1 not a parquet file")
    else:
        pq.write_table(pq.read_table(paths[0]).drop_columns(["image"]), paths[0])
    with pytest.raises(DataError, match=message):
        ingest(store, "mmk12", DatasetConfig(source=str(tmp_path / "raw"), converter="mmk12"), progress=lambda _: None)
    assert [k for k in store.list("datasets/mmk12") if not k.startswith(f"datasets/mmk12/{good.version}/")] == [
        "datasets/mmk12/LATEST"]
    assert load_version(store, "mmk12").version == good.version
