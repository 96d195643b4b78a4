"""The verl backend's inputs on the shared path: a gsm8k version ingested into an S3 store (moto)
exported in verl's RL and SFT layouts, read back by verl 0.9.1's own dataset classes; a model on S3
staged once."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from verl_env import verl_python

from omni_core.backends.jobs.export import export_dataset, stage_model
from omni_core.config import DatasetConfig
from omni_core.data import ingest
from omni_core.errors import DataError, ModelError
from omni_core.storage import Store

HERE = Path(__file__).parent


@pytest.fixture
def gsm8k(s3_bucket, omni_cache):
    store = Store(f"s3://{s3_bucket}/omni")
    dv = ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=20&seed=2", converter="gsm8k", shard_rows=8),
                progress=lambda _: None)
    return store, dv


def test_exports_are_verl_layouts_content_addressed_and_read_by_verl(gsm8k, tmp_path, model_cache):
    store, dv = gsm8k
    shared = tmp_path / "shared"
    rl = export_dataset(store, "gsm8k", None, shared, "rl")
    sft = export_dataset(store, "gsm8k", dv.version, shared, "sft")
    assert not rl.reused and not sft.reused
    assert rl.folder == shared / "datasets" / "gsm8k" / dv.version / "rl"
    assert [Path(p).name for p in rl.files["train"]] == ["train-00000.parquet", "train-00001.parquet",
                                                         "train-00002.parquet"]
    # the RL layout is the store's verl Parquet, byte for byte
    shards = {s["key"]: s["sha256"] for s in dv.manifest["splits"]["train"]["shards"]}
    assert [e["sha256"] for e in rl.manifest["files"] if e["split"] == "train"] == list(shards.values())
    assert json.loads((rl.folder / "_manifest.json").read_text())["files"] == rl.manifest["files"]

    # a second export of the same version is reused, untouched; a changed option is a new export
    before = {p: Path(p).stat().st_mtime_ns for p in sft.files["train"]}
    again = export_dataset(store, "gsm8k", dv.version, shared, "sft")
    assert again.reused and again.files == sft.files
    assert {p: Path(p).stat().st_mtime_ns for p in again.files["train"]} == before
    # a damaged file is noticed (its size no longer matches the manifest) and the export is redone
    Path(sft.files["train"][0]).write_bytes(b"truncated")
    redone = export_dataset(store, "gsm8k", dv.version, shared, "sft")
    assert not redone.reused and pq.ParquetFile(redone.files["train"][0]).metadata.num_rows == 8
    with pytest.raises(DataError, match="extra_info.nope"):
        export_dataset(store, "gsm8k", dv.version, tmp_path / "other", "sft", response_field="extra_info.nope")

    from omni_core.models.tiny import tiny_model_dir

    model = str(tiny_model_dir("lm", cache_dir=model_cache))
    proc = subprocess.run([verl_python(), str(HERE / "verl_cpu" / "load_export.py"), model,
                           json.dumps(rl.files["train"]), json.dumps(sft.files["train"])],
                          capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin",
                                                                              "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    train = pq.read_table(rl.files["train"][0]).to_pylist()[0]
    assert seen["rl_rows"] == 20 and seen["sft_rows"] == 20
    assert seen["rl_data_source"] == "openai/gsm8k"
    assert seen["rl_ground_truth"] == train["reward_model"]["ground_truth"]
    assert seen["sft_messages"] == [*train["prompt"], {"role": "assistant", "content": train["extra_info"]["answer"]}]
    # verl trains on the answer only: the loss mask covers the assistant turn, not the prompt
    assert 0 < seen["sft_trained_tokens"] < seen["sft_tokens"]
    assert train["extra_info"]["answer"].split("####")[-1].strip() in seen["sft_trained_text"]


def test_models_are_staged_once_on_the_shared_path(s3_bucket, tmp_path, omni_cache, model_cache):
    from omni_core.models.tiny import tiny_model_dir

    source = tiny_model_dir("lm", cache_dir=model_cache)
    store = Store(f"s3://{s3_bucket}/models/lm")
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        store.write_bytes(path.relative_to(source).as_posix(), path.read_bytes())
    shared = tmp_path / "shared"
    staged = Path(stage_model(f"s3://{s3_bucket}/models/lm", shared))
    assert staged.parent == shared / "models" / "s3"
    assert (staged / "config.json").read_bytes() == (source / "config.json").read_bytes()
    mtime = (staged / "config.json").stat().st_mtime_ns
    assert stage_model(f"s3://{s3_bucket}/models/lm", shared) == str(staged)
    assert (staged / "config.json").stat().st_mtime_ns == mtime  # downloaded once
    tiny = Path(stage_model("tiny://lm", shared))
    assert tiny.parent == shared / "models" / "tiny" and (tiny / "model.safetensors").is_file()
    assert stage_model("Qwen/Qwen2.5-0.5B", shared) == "Qwen/Qwen2.5-0.5B"
    with pytest.raises(ModelError, match="no objects"):
        stage_model(f"s3://{s3_bucket}/models/missing", shared)
    with pytest.raises(ModelError, match="no config.json"):
        stage_model(str(tmp_path), shared)

