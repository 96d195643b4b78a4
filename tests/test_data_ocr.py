"""OCR prompts: text-file fixture, converter (Qwen-Image and SD3 templates), and ingestion to local and S3."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from omni_core.config import DatasetConfig
from omni_core.data import ingest, resolve_source, write_fixture
from omni_core.data.ocr import SCHEMA, SYSTEM_PROMPT, OCRConverter
from omni_core.errors import ConfigError, DataError
from omni_core.storage import Store

pytestmark = pytest.mark.usefixtures("omni_cache")


def test_fixture_writes_prompt_files_deterministically(tmp_path) -> None:
    a = write_fixture("ocr", tmp_path / "a", rows=12, seed=3, bad_rows=2)
    b = write_fixture("ocr", tmp_path / "b", rows=12, seed=3, bad_rows=2)
    assert [p.name for p in a] == ["train.txt", "test.txt"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != write_fixture("ocr", tmp_path / "c", rows=12, seed=4)[0].read_bytes()
    train = a[0].read_text().splitlines()
    assert len(train) == 14 and sum(line.count('"') >= 2 and line.split('"')[1] != "" for line in train) == 12
    assert len(a[1].read_text().splitlines()) == 3


def test_ingest_produces_qwen_image_rows(store: Store) -> None:
    source = "fixtures://ocr?rows=8&seed=1"
    dv = ingest(store, "ocr", DatasetConfig(source=source, converter="ocr"), progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 10, "rows": 10, "quarantined": 0, "skipped": 0}
    raw = resolve_source(source)
    for split in ("train", "test"):
        with store.open_read(dv.shard_keys(split)[0]) as f:
            table = pq.read_table(f)
        assert table.schema.equals(SCHEMA)
        lines = raw.path(f"{split}.txt").read_text().splitlines()
        for index, (row, text) in enumerate(zip(table.to_pylist(), lines, strict=True)):
            assert row == {
                "data_source": "flow_grpo/ocr",
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}],
                "negative_prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": " "}],
                "ability": "ocr",
                "reward_model": {"style": "model", "ground_truth": text.split('"')[1]},
                "extra_info": {"split": split, "index": index},
            }


def test_prompts_without_quoted_text_are_quarantined(store: Store) -> None:
    config = DatasetConfig(source="fixtures://ocr?rows=8&seed=0&bad_rows=2", converter="ocr",
                           max_quarantine_fraction=0.5)
    dv = ingest(store, "ocr", config, progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 12, "rows": 10, "quarantined": 2, "skipped": 0}
    with store.open_read(dv.manifest["quarantine"]) as f:
        quarantine = pq.read_table(f).to_pylist()
    assert sorted(r["reason"] for r in quarantine) == ["prompt has no double-quoted text", "quoted text is empty"]
    assert all(r["source_file"] == "train.txt" and r["split"] == "train" for r in quarantine)


def test_sd3_template_has_no_system_message(tmp_path) -> None:
    write_fixture("ocr", tmp_path, rows=2, seed=0)
    raw = resolve_source(str(tmp_path))
    converter = OCRConverter(model_family="sd3")
    _, _, record = next(converter.records(raw, "train"))
    row = converter.convert(record, "train", 0, raw)
    assert row["prompt"] == [{"role": "user", "content": record["text"]}]
    assert row["negative_prompt"] == [{"role": "user", "content": " "}]
    with pytest.raises(ConfigError, match="model_family 'flux' is unknown"):
        OCRConverter(model_family="flux")


def test_blank_lines_are_not_prompts_and_bad_encoding_fails(tmp_path) -> None:
    (tmp_path / "train.txt").write_text('A sign that reads "Hi"\n\n   \nA mug printed with "Yo"\n')
    raw = resolve_source(str(tmp_path))
    converter = OCRConverter()
    assert [(row, rec["text"]) for _, row, rec in converter.records(raw, "train")] == [
        (0, 'A sign that reads "Hi"'), (3, 'A mug printed with "Yo"')]
    (tmp_path / "train.txt").write_bytes(b'A sign that reads "\xff\xfe"\n')
    with pytest.raises(DataError, match="train.txt is not UTF-8 text"):
        list(converter.records(resolve_source(str(tmp_path)), "train"))
