"""GSM8K: fixture generator, converter, and versioned ingestion into the store (local and S3)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from omni_core.config import DatasetConfig
from omni_core.data import ingest, load_version, resolve_source, write_fixture
from omni_core.data.gsm8k import INSTRUCTION, SCHEMA
from omni_core.errors import DataError
from omni_core.storage import Store


@pytest.fixture(autouse=True)
def _cache(omni_cache):
    return omni_cache


def test_fixture_writes_the_hub_layout_deterministically(tmp_path) -> None:
    a = write_fixture("gsm8k", tmp_path / "a", rows=20, seed=3)
    b = write_fixture("gsm8k", tmp_path / "b", rows=20, seed=3)
    c = write_fixture("gsm8k", tmp_path / "c", rows=20, seed=4)
    assert [p.relative_to(tmp_path / "a").as_posix() for p in a] == [
        "main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != c[0].read_bytes()
    train = pq.read_table(a[0])
    assert train.column_names == ["question", "answer"] and train.num_rows == 20
    assert all("\n#### " in answer for answer in train.column("answer").to_pylist())


def test_ingest_produces_verl_rows(store: Store) -> None:
    dv = ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=12&seed=1", converter="gsm8k"),
                progress=lambda _: None)
    assert dv.manifest["splits"]["train"]["rows"] == 12 and dv.manifest["splits"]["test"]["rows"] == 3
    with store.open_read(dv.shard_keys("train")[0]) as f:
        table = pq.read_table(f)
    assert table.schema.equals(SCHEMA)
    raw = pq.read_table(resolve_source("fixtures://gsm8k?rows=12&seed=1").path(
        "main/train-00000-of-00001.parquet")).to_pylist()
    for index, (row, source) in enumerate(zip(table.to_pylist(), raw, strict=True)):
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": source["question"] + " " + INSTRUCTION}]
        truth = source["answer"].rsplit("#### ", 1)[1].replace(",", "")
        assert row["reward_model"] == {"style": "rule", "ground_truth": truth}
        assert row["extra_info"] == {"split": "train", "index": index, "answer": source["answer"],
                                     "question": source["question"]}
    assert "," not in "".join(table.column("reward_model").combine_chunks().field("ground_truth").to_pylist())


def test_reingest_is_a_no_op_and_latest_names_the_version(store: Store) -> None:
    config = DatasetConfig(source="fixtures://gsm8k?rows=8&seed=0", converter="gsm8k")
    first = ingest(store, "gsm8k", config, progress=lambda _: None)
    shard = first.shard_keys("train")[0]
    before = store.read_bytes(shard)
    second = ingest(store, "gsm8k", config, progress=lambda _: None)
    assert second.version == first.version and second.reused and not first.reused
    assert store.read_bytes(shard) == before
    assert load_version(store, "gsm8k").version == first.version
    other = ingest(store, "gsm8k", config.model_copy(update={"shard_rows": 3}), progress=lambda _: None)
    assert other.version != first.version and len(other.shard_keys("train")) == 3  # 8 rows -> 3+3+2
    assert load_version(store, "gsm8k").version == other.version
    assert first.manifest["options"] == {"shard_rows": 10_000}  # an unset byte limit leaves the ids as they were
    limited = ingest(store, "gsm8k", DatasetConfig.model_validate({**config.model_dump(), "shard_bytes": "4KiB"}),
                     progress=lambda _: None)
    assert limited.version not in (first.version, other.version)
    assert limited.manifest["options"] == {"shard_rows": 10_000, "shard_bytes": 4096}
    assert 1 < len(limited.shard_keys("train")) < 8  # a few rows per 4 KiB shard
    assert limited.manifest["counts"]["rows"] == first.manifest["counts"]["rows"]


def test_bad_rows_are_quarantined_and_counts_add_up(store: Store) -> None:
    dv = ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=10&seed=0&bad_rows=4",
                                              converter="gsm8k", max_quarantine_fraction=0.5), progress=lambda _: None)
    counts = dv.manifest["counts"]
    assert counts == {"read": 10 + 4 + 2, "rows": 12, "quarantined": 4, "skipped": 0}
    with store.open_read(dv.manifest["quarantine"]) as f:
        quarantine = pq.read_table(f).to_pylist()
    assert sorted(r["reason"] for r in quarantine) == ["answer has no '#### N' final answer"] * 2 + ["empty question"] * 2
    assert all(r["split"] == "train" and r["raw"] for r in quarantine)


def test_a_half_written_version_is_not_visible(store: Store) -> None:
    config = DatasetConfig(source="fixtures://gsm8k?rows=8&seed=0", converter="gsm8k")
    dv = ingest(store, "gsm8k", config, progress=lambda _: None)
    store.delete(f"datasets/gsm8k/{dv.version}/_manifest.json")  # as if the process died before the commit
    with pytest.raises(DataError, match="not committed"):
        load_version(store, "gsm8k", dv.version)
    again = ingest(store, "gsm8k", config, progress=lambda _: None)
    assert again.version == dv.version and not again.reused


def test_unknown_sources_fail_clearly(tmp_path) -> None:
    with pytest.raises(DataError, match="no fixture 'nope'"):
        resolve_source("fixtures://nope?rows=3")
    with pytest.raises(DataError, match="no such directory"):
        resolve_source(str(tmp_path / "missing"))
    with pytest.raises(DataError, match="unknown parameters"):
        resolve_source("fixtures://gsm8k?rows=3&colour=red")


def test_too_many_bad_rows_fail_the_ingest_and_leave_nothing(store: Store) -> None:
    good = ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=8&seed=0", converter="gsm8k"),
                  progress=lambda _: None)
    bad = DatasetConfig(source="fixtures://gsm8k?rows=10&seed=0&bad_rows=4", converter="gsm8k")
    with pytest.raises(DataError, match=r"4 of 16 rows \(25.0%\) were quarantined, over max_quarantine_fraction=0.05"):
        ingest(store, "gsm8k", bad, progress=lambda _: None)
    assert store.list("datasets/gsm8k") == sorted([*store.list(good.uri.removeprefix(store.root + "/")),
                                                   "datasets/gsm8k/LATEST"])
    assert load_version(store, "gsm8k").version == good.version


def test_a_corrupt_raw_file_fails_naming_it(tmp_path, store: Store) -> None:
    write_fixture("gsm8k", tmp_path / "raw", rows=6)
    (tmp_path / "raw/main/test-00000-of-00001.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match="main/test-00000-of-00001.parquet is not a readable Parquet file"):
        ingest(store, "gsm8k", DatasetConfig(source=str(tmp_path / "raw"), converter="gsm8k"), progress=lambda _: None)
    assert store.list("datasets") == []


def test_workers_give_the_same_bytes(tmp_path) -> None:
    config = DatasetConfig(source="fixtures://gsm8k?rows=600&seed=2&bad_rows=3", converter="gsm8k", shard_rows=250)
    serial = ingest(Store(str(tmp_path / "a")), "gsm8k", config, progress=lambda _: None)
    parallel = ingest(Store(str(tmp_path / "b")), "gsm8k", config, progress=lambda _: None, workers=2)
    assert serial.version == parallel.version
    assert serial.manifest["splits"] == parallel.manifest["splits"]  # same keys, row counts and shard digests
    assert [s["rows"] for s in serial.manifest["splits"]["train"]["shards"]] == [250, 250, 100]


def test_an_s3_source_is_ingested_like_a_local_one(tmp_path, s3_bucket) -> None:
    raw = tmp_path / "raw"
    write_fixture("gsm8k", raw, rows=9, seed=5)
    source = Store(f"s3://{s3_bucket}/raw/gsm8k")
    for path in sorted(p for p in raw.rglob("*") if p.is_file()):
        source.write_bytes(path.relative_to(raw).as_posix(), path.read_bytes())
    local = ingest(Store(str(tmp_path / "a")), "gsm8k", DatasetConfig(source=str(raw), converter="gsm8k"),
                   progress=lambda _: None)
    remote = ingest(Store(str(tmp_path / "b")), "gsm8k",
                    DatasetConfig(source=f"s3://{s3_bucket}/raw/gsm8k", converter="gsm8k"), progress=lambda _: None)
    assert remote.version == local.version  # same bytes, same version, wherever they came from
    assert remote.manifest["source_uri"] == f"s3://{s3_bucket}/raw/gsm8k"
    source.write_bytes("main/test-00000-of-00001.parquet", (raw / "main/train-00000-of-00001.parquet").read_bytes())
    changed = ingest(Store(str(tmp_path / "b")), "gsm8k",
                     DatasetConfig(source=f"s3://{s3_bucket}/raw/gsm8k", converter="gsm8k"), progress=lambda _: None)
    assert changed.version != remote.version  # a changed source is re-read, never served stale
