"""Image-edit pairs (instruction + source image): fixture, converter (the rows of VeRL-Omni's
examples/flowgrpo_trainer/qwen_image_edit/prepare_data.py) and quarantine, ingested into a local store."""

from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
import pytest
from PIL import Image

from omni_core.config import DatasetConfig
from omni_core.data import ingest, resolve_source, write_fixture
from omni_core.data.image_edit import SCHEMA, SYSTEM_PROMPT, letterbox_png
from omni_core.storage import Store

pytestmark = pytest.mark.usefixtures("omni_cache")


def test_fixture_writes_jsonl_and_encoded_images_deterministically(tmp_path) -> None:
    a = write_fixture("image_edit", tmp_path / "a", rows=4, seed=2, bad_rows=4)
    b = write_fixture("image_edit", tmp_path / "b", rows=4, seed=2, bad_rows=4)
    assert [p.relative_to(tmp_path / "a") for p in a] == [p.relative_to(tmp_path / "b") for p in b]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    lines = (tmp_path / "a" / "train.jsonl").read_text().splitlines()
    assert len(lines) == 8 and len((tmp_path / "a" / "test.jsonl").read_text().splitlines()) == 1
    good = [json.loads(line) for line in lines if line.endswith("}") and '"image"' in line]
    for record in good:
        path = tmp_path / "a" / "images" / record["image"]
        if path.is_file() and not record["image"].startswith("broken"):
            with Image.open(path) as image:  # real encoded files, as the README's images/ folder holds
                assert image.format == {"png": "PNG", "jpg": "JPEG"}[record["image"].rsplit(".", 1)[1]]
                assert image.width != image.height  # not square: the converter letterboxes


def test_ingest_writes_the_scripts_rows(tmp_path) -> None:
    store = Store(str(tmp_path / "store"))
    source = "fixtures://image_edit?rows=4&seed=1"
    dv = ingest(store, "image_edit", DatasetConfig(source=source, converter="image_edit"), progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 5, "rows": 5, "quarantined": 0, "skipped": 0}
    raw = resolve_source(source)
    for split in ("train", "test"):
        with store.open_read(dv.shard_keys(split)[0]) as f:
            table = pq.read_table(f)
        assert table.schema.equals(SCHEMA)
        records = [json.loads(line) for line in raw.path(f"{split}.jsonl").read_text().splitlines()]
        for index, (row, record) in enumerate(zip(table.to_pylist(), records, strict=True)):
            # examples/flowgrpo_trainer/qwen_image_edit/prepare_data.py _convert_split (a1139baf)
            instruction = record["prompt"]
            png = row.pop("images")[0]["bytes"]
            assert row == {
                "data_source": "image_edit",
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                           {"role": "user", "content": f"Picture 1: <image>{instruction}"}],
                "negative_prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": "Picture 1: <image> "}],
                "ability": "image_edit",
                "reward_model": {"style": "model", "ground_truth": instruction},
                "extra_info": {"split": split, "index": index, "instruction": instruction, "image": record["image"]},
            }
            assert png == letterbox_png(raw.path(f"images/{record['image']}").read_bytes())
            with Image.open(io.BytesIO(png)) as image:  # _load_image: a 512x512 PNG, letterboxed on white
                assert (image.format, image.size, image.mode) == ("PNG", (512, 512), "RGB")
                assert image.getpixel((0, 0)) == (255, 255, 255) or image.getpixel((511, 511)) == (255, 255, 255)


def test_rows_without_a_usable_source_image_are_quarantined(tmp_path) -> None:
    store = Store(str(tmp_path / "store"))
    config = DatasetConfig(source="fixtures://image_edit?rows=4&seed=0&bad_rows=4", converter="image_edit",
                           max_quarantine_fraction=0.6)
    dv = ingest(store, "image_edit", config, progress=lambda _: None)
    assert dv.manifest["counts"] == {"read": 9, "rows": 5, "quarantined": 4, "skipped": 0}
    with store.open_read(dv.manifest["quarantine"]) as f:
        quarantine = pq.read_table(f).to_pylist()
    assert all(q["split"] == "train" and q["source_file"] == "train.jsonl" for q in quarantine)
    assert sorted(q["reason"] for q in quarantine) == [
        "condition image images/broken_1.png does not decode (UnidentifiedImageError)",
        "condition image not found: images/missing_0.png",
        "line is not a JSON object",
        "record has no 'image'",
    ]


def test_an_image_name_cannot_leave_the_images_folder(tmp_path) -> None:
    from omni_core.data.converter import RowRejected
    from omni_core.data.image_edit import ImageEditConverter

    (tmp_path / "images").mkdir()
    (tmp_path / "secret.png").write_bytes(b"x")
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "p", "image": "../secret.png"}) + "\n")
    raw = resolve_source(str(tmp_path))
    converter = ImageEditConverter()
    _, _, record = next(converter.records(raw, "train"))
    with pytest.raises(RowRejected, match="condition image not found: images/../secret.png"):
        converter.convert(record, "train", 0, raw)
