"""Dataset versions exported in the layout each VeRL-Omni recipe reads: our fixtures (mmk12, avqa,
omni_preference, ocr) ingested into a local store, exported, checked against the version's manifest;
the OCR exports (Qwen-Image and SD3 forms) read by verl 0.9.1's RLHFDataset."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from verl_env import verl_python

from omni_core.backends.verl_omni.export import _avqa, _dpo, _Media, export_for_recipe
from omni_core.backends.verl_omni.render import RecipePaths, render_recipe
from omni_core.config import DatasetConfig
from omni_core.data import ingest
from omni_core.errors import ConfigError
from omni_core.storage import Store

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    root = tmp_path_factory.mktemp("omni_store")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(root / "cache"))
        s = Store(str(root / "store"))
        for name in ("mmk12", "avqa", "omni_preference", "ocr"):
            ingest(s, name, DatasetConfig(source=f"fixtures://{name}?rows=6&seed=0", converter=name),
                   progress=lambda _: None)
    return s


def _source(store: Store, name: str) -> dict[str, list[dict]]:
    from omni_core.data.ingest import load_version

    dv = load_version(store, name, None)
    out = {}
    for split in dv.manifest["splits"]:
        rows = []
        for key in dv.shard_keys(split):
            with store.open_read(key) as f:
                rows += pq.read_table(f).to_pylist()
        assert len(rows) == dv.manifest["splits"][split]["rows"]
        out[split] = rows
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _paths(export) -> RecipePaths:
    return RecipePaths(train_files=export.train_files, val_files=export.val_files, model="/m",
                       default_local_dir="/shared/runs/x/checkpoints")


def test_mmk12_inline_and_render(store: Store, tmp_path: Path) -> None:
    src = _source(store, "mmk12")
    export = export_for_recipe(store, "mmk12", None, tmp_path, "qwen3-omni-thinker-gspo-mmk12")
    assert export.layout == "inline" and [Path(p).name for p in export.train_files] == ["train.parquet"]
    rows = pq.read_table(export.train_files[0]).to_pylist()
    assert rows == src["train"]  # images inline, every column as ingested
    assert pq.read_table(export.val_files[0]).num_rows == len(src["test"])
    again = export_for_recipe(store, "mmk12", None, tmp_path, "qwen3-omni-thinker-gspo-mmk12")
    assert again.reused and again.train_files == export.train_files
    cmd = render_recipe("qwen3-omni-thinker-gspo-mmk12", {}, _paths(export))
    assert f"data.train_files={export.train_files[0]}" in cmd.overrides


def test_avqa_media_written_out_with_absolute_paths(store: Store, tmp_path: Path) -> None:
    src = _source(store, "avqa")
    export = export_for_recipe(store, "avqa", None, tmp_path, "qwen3-omni-thinker-gspo-avqa-npu")
    assert export.layout == "avqa_media" and Path(export.val_files[0]).name == "validation.parquet"
    blobs = set()
    for split, path in (("train", export.train_files[0]), ("validation", export.val_files[0])):
        rows = pq.read_table(path).to_pylist()
        assert len(rows) == len(src[split])
        for row, source in zip(rows, src[split], strict=True):
            assert row["prompt"] == source["prompt"] and row["reward_model"] == source["reward_model"]
            images = [Path(i["image"]) for i in row["images"]]
            audios = [Path(a) for a in row["audios"]]
            assert all(p.is_absolute() and p.is_file() for p in images + audios)
            assert [_sha(p.read_bytes()) for p in images] == [_sha(i["bytes"]) for i in source["images"]]
            assert [_sha(p.read_bytes()) for p in audios] == [_sha(a["bytes"]) for a in source["audios"]]
            blobs |= {_sha(i["bytes"]) for i in source["images"]} | {_sha(a["bytes"]) for a in source["audios"]}
    assert export.manifest["media"] == len(blobs)  # each distinct file written once
    manifest = json.loads((export.folder / "_manifest.json").read_text())
    assert sum(e["rows"] for e in manifest["files"]) == sum(len(r) for r in src.values())


def test_omni_preference_dpo_layout(store: Store, tmp_path: Path) -> None:
    src = _source(store, "omni_preference")
    export = export_for_recipe(store, "omni_preference", None, tmp_path, "qwen3-omni-dpo-omni-preference")
    rel = [str(Path(p).relative_to(export.folder)) for p in export.train_files + export.val_files]
    assert rel == ["image/train.parquet", "video/train.parquet", "audio/train.parquet",
                   "image/test.parquet", "video/test.parquet", "audio/test.parquet"]
    for split, files in (("train", export.train_files), ("test", export.val_files)):
        total = 0
        for path in files:
            modality = Path(path).parent.name
            field = {"image": "images", "video": "videos", "audio": "audios"}[modality]
            rows = pq.read_table(path).to_pylist()
            total += len(rows)
            for row in rows:
                assert row["extra_info"]["modality"] == modality
                media = Path(row[field][0])
                assert media.is_absolute() and media.is_file()
                assert row["extra_info"][f"{modality}_path"] == str(media)
        assert total == len(src[split])
    cmd = render_recipe("qwen3-omni-dpo-omni-preference", {}, _paths(export))
    assert "data.train_files=[" + ",".join(f"'{p}'" for p in export.train_files) + "]" in cmd.overrides


def test_ocr_forms_and_verl_reads_them(store: Store, tmp_path: Path, model_cache: Path) -> None:
    src = _source(store, "ocr")
    qi = export_for_recipe(store, "ocr", None, tmp_path, "qwen-image-flowgrpo-ocr-lora")
    sd3 = export_for_recipe(store, "ocr", None, tmp_path, "sd35-medium-flowgrpo-ocr-lora-v1")
    qi_rows = pq.read_table(qi.train_files[0]).to_pylist()
    assert qi_rows == src["train"]
    assert [m["role"] for m in qi_rows[0]["prompt"]] == ["system", "user"] and qi_rows[0]["negative_prompt"]
    sd3_rows = pq.read_table(sd3.train_files[0]).to_pylist()
    assert len(sd3_rows) == len(src["train"]) and "negative_prompt" not in sd3_rows[0]
    for row, source in zip(sd3_rows, src["train"], strict=True):
        user = [m for m in source["prompt"] if m["role"] == "user"]
        assert row["prompt"] == user and row["extra_info"]["raw_prompt"] == user[0]["content"]
        assert row["reward_model"] == source["reward_model"]
    from omni_core.models.tiny import tiny_model_dir

    model = str(tiny_model_dir("lm", cache_dir=model_cache))
    sets = [["qwen_image", qi.train_files, False], ["sd3", sd3.train_files, False]]
    proc = subprocess.run([verl_python(), str(HERE / "verl_cpu" / "load_verl_omni_export.py"), model, json.dumps(sets)],
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    for label in ("qwen_image", "sd3"):
        assert seen[label]["rows"] == len(src["train"])
        assert seen[label]["ground_truth"] == src["train"][0]["reward_model"]["ground_truth"]
    assert seen["sd3"]["raw_prompt"] == sd3_rows[0]["prompt"]


def test_a_dataset_the_recipe_cannot_take_is_refused(store: Store, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reads avqa data"):
        export_for_recipe(store, "mmk12", None, tmp_path, "qwen3-omni-thinker-gspo-avqa-npu")
    with pytest.raises(ConfigError, match="reads ocr data"):
        export_for_recipe(store, "mmk12", None, tmp_path, "sd35-medium-flowgrpo-ocr-lora-v1")
    with pytest.raises(ConfigError, match="not exported by omni yet"):
        export_for_recipe(store, "ocr", None, tmp_path, "bagel-flowgrpo-ocr-lora")
    assert not (tmp_path / "datasets").exists() or not any((tmp_path / "datasets").rglob("*.parquet"))
    media = _Media(tmp_path, tmp_path)
    pref = _source(store, "omni_preference")["train"]
    only_images = pa.Table.from_pylist([r for r in pref if r["extra_info"]["modality"] == "image"])
    with pytest.raises(ConfigError, match="no video, audio rows"):
        _dpo(only_images, "train", media)
    avqa = _source(store, "avqa")["train"]
    no_audio = pa.Table.from_pylist([{**avqa[0], "audios": []}])
    with pytest.raises(ConfigError, match="needs both"):
        _avqa(no_audio, "train", media)
