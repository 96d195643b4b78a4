"""AVQA-R1-6K: JSON + JPEG + WAV fixture, converter, and ingestion to local and S3 stores."""

from __future__ import annotations

import io
import json
import wave

import pyarrow.parquet as pq
import pytest
from PIL import Image

from omni_core.config import DatasetConfig
from omni_core.data import ingest, load_version, resolve_source, write_fixture
from omni_core.data.avqa import SCHEMA, SYSTEM_PROMPT, iter_json_array
from omni_core.errors import DataError
from omni_core.storage import Store

pytestmark = pytest.mark.usefixtures("omni_cache")


def test_fixture_writes_the_dataset_layout_deterministically(tmp_path) -> None:
    a = write_fixture("avqa", tmp_path / "a", rows=4, seed=3, bad_rows=1)
    b = write_fixture("avqa", tmp_path / "b", rows=4, seed=3, bad_rows=1)
    rel = [p.relative_to(tmp_path / "a").as_posix() for p in a]
    assert rel == [p.relative_to(tmp_path / "b").as_posix() for p in b]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert {"train/omni_rl_format_train.json", "valid/omni_rl_format_valid.json", "train/images/sample_0.jpg",
            "train/audios/sample_0.wav", "valid/images/sample_0.jpg", "valid/audios/sample_0.wav"} <= set(rel)
    records = json.loads((tmp_path / "a/train/omni_rl_format_train.json").read_text())
    assert len(records) == 5 and set(records[0]) == {"problem_id", "problem", "data_type", "problem_type", "options",
                                                     "solution", "path", "data_source"}
    assert records[0]["path"] == {"image": "images/sample_0.jpg", "audio": "audios/sample_0.wav"}
    other = write_fixture("avqa", tmp_path / "c", rows=4, seed=4)
    assert other[-1].read_bytes() != a[-1].read_bytes()


def test_ingest_produces_verl_rows_with_media_embedded(store: Store) -> None:
    source = "fixtures://avqa?rows=6&seed=1"
    dv = ingest(store, "avqa", DatasetConfig(source=source, converter="avqa"), progress=lambda _: None)
    assert list(dv.manifest["splits"]) == ["train", "validation"]
    raw = resolve_source(source)
    for split, folder in (("train", "train"), ("validation", "valid")):
        with store.open_read(dv.shard_keys(split)[0]) as f:
            table = pq.read_table(f)
        assert table.schema.equals(SCHEMA)
        records = json.loads(raw.path(f"{folder}/omni_rl_format_{folder}.json").read_text())
        assert table.num_rows == len(records) == (6 if split == "train" else 1)
        for index, (row, rec) in enumerate(zip(table.to_pylist(), records, strict=True)):
            options = "\n".join(rec["options"])
            assert row["prompt"] == [{"role": "system", "content": SYSTEM_PROMPT},
                                     {"role": "user", "content": f"<image><audio>{rec['problem']}\nOptions:\n{options}"}]
            assert row["data_source"] == "avqa_r1_6k" and row["ability"] == "audio_visual_qa"
            assert row["reward_model"] == {"style": "rule", "ground_truth": rec["solution"]}
            assert row["images"] == [{"bytes": raw.path(f"{folder}/{rec['path']['image']}").read_bytes()}]
            assert row["audios"] == [{"bytes": raw.path(f"{folder}/{rec['path']['audio']}").read_bytes()}]
            Image.open(io.BytesIO(row["images"][0]["bytes"])).load()
            with wave.open(io.BytesIO(row["audios"][0]["bytes"])) as wav:
                assert wav.getnframes() > 0 and wav.getframerate() == 16_000
            info = row["extra_info"]
            assert json.loads(info.pop("options")) == {o[0]: o[3:] for o in rec["options"]}
            assert info == {"split": split, "index": index, "problem_id": str(rec["problem_id"]),
                            "dataset": "AVQA-R1-6K", "problem_type": "multiple choice", "raw_problem": rec["problem"],
                            "raw_solution": rec["solution"]}


def test_bad_records_are_quarantined_with_reasons(store: Store) -> None:
    config = DatasetConfig(source="fixtures://avqa?rows=6&seed=0&bad_rows=6", converter="avqa",
                           max_quarantine_fraction=0.6)
    dv = ingest(store, "avqa", config, progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 13, "rows": 7, "quarantined": 6, "skipped": 0}
    with store.open_read(dv.manifest["quarantine"]) as f:
        quarantine = pq.read_table(f).to_pylist()
    assert sorted(r["reason"].split(":")[0] for r in quarantine) == [
        "empty question", "missing answer", "missing audio file", "missing image file", "undecodable audio",
        "undecodable image"]
    assert all(r["source_file"] == "train/omni_rl_format_train.json" and json.loads(r["raw"])["problem_id"] == r["row"]
               for r in quarantine)


@pytest.mark.parametrize("text, message", [
    ('{"problem": "x"}', "is not a JSON list of records"),
    ('[{"problem": "x"}, {"problem": ', "invalid JSON"),
])
def test_an_unusable_json_file_fails_the_ingest_and_leaves_nothing(tmp_path, text: str, message: str) -> None:
    store = Store(str(tmp_path / "store"))
    good = ingest(store, "avqa", DatasetConfig(source="fixtures://avqa?rows=2", converter="avqa"),
                  progress=lambda _: None)
    write_fixture("avqa", tmp_path / "raw", rows=2, seed=9)
    (tmp_path / "raw/valid/omni_rl_format_valid.json").write_text(text)
    with pytest.raises(DataError, match=f"valid/omni_rl_format_valid.json.*{message}"):
        ingest(store, "avqa", DatasetConfig(source=str(tmp_path / "raw"), converter="avqa"), progress=lambda _: None)
    assert [k for k in store.list("datasets/avqa") if not k.startswith(f"datasets/avqa/{good.version}/")] == [
        "datasets/avqa/LATEST"]
    assert load_version(store, "avqa").version == good.version


def test_json_list_is_streamed_across_chunk_boundaries(tmp_path) -> None:
    items = [{"n": i, "text": "é" * (i % 7), "v": [1.5, None, True]} for i in range(40)] + [12345, "tail"]
    path = tmp_path / "list.json"
    path.write_text(json.dumps(items, indent=2, ensure_ascii=False), encoding="utf-8")
    for chunk in (1, 3, 17, 1 << 16):
        assert list(iter_json_array(path, "list.json", chunk=chunk)) == items
    path.write_text("[]")
    assert list(iter_json_array(path, "list.json")) == []
    path.write_text("[1, 2] 3")
    with pytest.raises(DataError, match="unexpected data after the JSON list"):
        list(iter_json_array(path, "list.json"))
