"""Dataset versions exported in the layout each VeRL-Omni recipe reads: our fixtures (mmk12, avqa,
omni_preference, ocr, vid_prompt, hpsv3, pickscore_sfw, image_edit) ingested into a local store,
exported, checked against the version's manifest and the rows of the recipe's data script (VeRL-Omni
a1139bafffb5b9711f0a6b6edff8ecaa60bfff30); the prompt exports (OCR in the Qwen-Image, SD3 and BAGEL
forms, LTX-2.3, Wan2.2, SD3.5 PickScore-SFW) read by verl 0.9.1's RLHFDataset."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from verl_env import verl_python

from omni_core.backends.verl_omni.catalog import get_recipe
from omni_core.backends.verl_omni.export import (
    RECIPE_LAYOUTS,
    _avqa,
    _bagel,
    _dpo,
    _image_edit,
    _Media,
    export_for_recipe,
)
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
        for name in ("mmk12", "avqa", "omni_preference", "ocr", "vid_prompt", "hpsv3", "pickscore_sfw", "image_edit"):
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
    bagel = export_for_recipe(store, "ocr", None, tmp_path, "bagel-flowgrpo-ocr-lora", tokenizer=model)
    prompts = {name: export_for_recipe(store, name, None, tmp_path, recipe) for name, recipe in PROMPT_RECIPES}
    sets = [["qwen_image", qi.train_files, False], ["sd3", sd3.train_files, False], ["bagel", bagel.train_files, False]]
    sets += [[name, export.train_files, False] for name, export in prompts.items()]
    proc = subprocess.run([verl_python(), str(HERE / "verl_cpu" / "load_verl_omni_export.py"), model, json.dumps(sets)],
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    for label in ("qwen_image", "sd3", "bagel"):
        assert seen[label]["rows"] == len(src["train"])
        assert seen[label]["ground_truth"] == src["train"][0]["reward_model"]["ground_truth"]
    assert seen["sd3"]["raw_prompt"] == sd3_rows[0]["prompt"]
    bagel_first = pq.read_table(bagel.train_files[0]).to_pylist()[0]
    assert seen["bagel"]["prompt_token_ids"] == bagel_first["prompt_token_ids"]  # the column reaches the batch
    for name, _ in PROMPT_RECIPES:
        first = _source(store, name)["train"][0]
        assert seen[name]["rows"] == len(_source(store, name)["train"]) and seen[name]["data_source"] == first["data_source"]
        assert seen[name]["raw_prompt"] == first["prompt"]


# (dataset, recipe) of the recipes whose converter writes its data script's rows (layout `inline`)
PROMPT_RECIPES = [("vid_prompt", "ltx2.3-flowgrpo-t2av-lora"), ("hpsv3", "wan2.2-dancegrpo-t2v-hpsv3"),
                  ("pickscore_sfw", "sd35-medium-flowgrpo-drm-lora")]


def _adds_up(export, src: dict[str, list[dict]]) -> dict:
    """The export's files are absolute and there, its manifest counts every row of the version once."""
    for path in export.train_files + export.val_files:
        assert Path(path).is_absolute() and Path(path).is_file()
    manifest = json.loads((export.folder / "_manifest.json").read_text())
    tables = [e for e in manifest["files"] if e["split"] != "media"]
    assert sum(e["rows"] for e in tables) == sum(len(rows) for rows in src.values())
    assert [Path(p).name for p in export.train_files + export.val_files] == ["train.parquet", "test.parquet"]
    return manifest


@pytest.mark.parametrize(("name", "recipe"), PROMPT_RECIPES)
def test_prompt_recipes_read_their_scripts_rows(store: Store, tmp_path: Path, name: str, recipe: str) -> None:
    from test_data_prompts import expected_row  # each script's row, fact by fact

    src = _source(store, name)
    export = export_for_recipe(store, name, None, tmp_path, recipe)
    assert export.layout == "inline" and export.manifest["media"] == 0
    _adds_up(export, src)
    for split, path in (("train", export.train_files[0]), ("test", export.val_files[0])):
        rows = pq.read_table(path).to_pylist()
        assert rows == src[split]
        assert rows == [expected_row(name, r["reward_model"]["ground_truth"], split, i) for i, r in enumerate(rows)]
    recipe_ = get_recipe(recipe)
    cmd = render_recipe(recipe, recipe_.example, _paths(export))
    assert f"data.train_files={export.train_files[0]}" in cmd.overrides
    assert f"data.val_files={export.val_files[0]}" in cmd.overrides


def test_image_edit_keeps_the_source_image_inline(store: Store, tmp_path: Path) -> None:
    src = _source(store, "image_edit")
    export = export_for_recipe(store, "image_edit", None, tmp_path, "qwen-image-edit-flowgrpo-pickscore-lora")
    assert export.layout == "image_edit" and export.manifest["media"] == 0  # no media files: bytes in the rows
    _adds_up(export, src)
    for split, path in (("train", export.train_files[0]), ("test", export.val_files[0])):
        rows = pq.read_table(path).to_pylist()
        assert rows == src[split]
        for row in rows:
            # qwen_image_edit/prepare_data.py (a1139baf): images = [{"bytes": PNG}], one <image> placeholder
            assert len(row["images"]) == 1 and row["images"][0]["bytes"].startswith(b"\x89PNG")
            assert row["prompt"][1]["content"] == f"Picture 1: <image>{row['extra_info']['instruction']}"
            assert row["negative_prompt"][1]["content"] == "Picture 1: <image> "
    cmd = render_recipe("qwen-image-edit-flowgrpo-pickscore-lora", {}, _paths(export))
    assert f"data.train_files={export.train_files[0]}" in cmd.overrides


def test_bagel_prompts_are_tokenized_with_the_models_tokenizer(store: Store, tmp_path: Path,
                                                                model_cache: Path) -> None:
    from transformers import AutoTokenizer

    from omni_core.models.tiny import tiny_model_dir

    model = tiny_model_dir("lm", cache_dir=model_cache)
    src = _source(store, "ocr")
    with pytest.raises(ConfigError, match="pre-tokenized with the model's tokenizer"):
        export_for_recipe(store, "ocr", None, tmp_path, "bagel-flowgrpo-ocr-lora")
    export = export_for_recipe(store, "ocr", None, tmp_path, "bagel-flowgrpo-ocr-lora", tokenizer=model)
    assert export.layout == "bagel_ocr" and len(export.manifest["tokenizer_sha256"]) == 64
    _adds_up(export, src)
    tok = AutoTokenizer.from_pretrained(str(model))
    bos, eos = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    for split, path in (("train", export.train_files[0]), ("test", export.val_files[0])):
        rows = pq.read_table(path).to_pylist()
        assert len(rows) == len(src[split])
        for row, source in zip(rows, src[split], strict=True):
            # examples/flowgrpo_trainer/data_process/bagel_ocr.py (a1139baf): the stripped line as the one user
            # message, negative [user " "], prompt_token_ids = [<|im_start|>] + encode(line) + [<|im_end|>]
            text = source["prompt"][-1]["content"].strip()
            assert row == {"data_source": "flow_grpo/ocr", "prompt": [{"role": "user", "content": text}],
                           "negative_prompt": [{"role": "user", "content": " "}],
                           "prompt_token_ids": [bos, *tok.encode(text, add_special_tokens=False), eos],
                           "ability": "ocr", "reward_model": source["reward_model"],
                           "extra_info": {"split": split, "index": source["extra_info"]["index"]}}
    assert pq.read_table(export.train_files[0]).column_names == [
        "data_source", "prompt", "negative_prompt", "prompt_token_ids", "ability", "reward_model", "extra_info"]
    again = export_for_recipe(store, "ocr", None, tmp_path, "bagel-flowgrpo-ocr-lora", tokenizer=model)
    assert again.reused
    long = {**src["train"][0], "prompt": [{"role": "user", "content": "word " * 400}]}
    assert len(_bagel(pa.Table.from_pylist([long]), tok).to_pylist()[0]["prompt_token_ids"]) == 256  # --max_prompt_length
    cmd = render_recipe("bagel-flowgrpo-ocr-lora", {}, RecipePaths(
        train_files=export.train_files, val_files=export.val_files, model=str(model),
        default_local_dir="/shared/runs/x/checkpoints"))
    assert f"data.train_files={export.train_files[0]}" in cmd.overrides
    assert f"actor_rollout_ref.model.tokenizer_path={model}" in cmd.overrides  # the tokenizer the ids came from


def test_a_dataset_the_recipe_cannot_take_is_refused(store: Store, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reads avqa data"):
        export_for_recipe(store, "mmk12", None, tmp_path, "qwen3-omni-thinker-gspo-avqa-npu")
    with pytest.raises(ConfigError, match="reads ocr data"):
        export_for_recipe(store, "mmk12", None, tmp_path, "sd35-medium-flowgrpo-ocr-lora-v1")
    for recipe, (_, wanted) in RECIPE_LAYOUTS.items():
        wrong = "mmk12" if wanted != "mmk12" else "ocr"
        with pytest.raises(ConfigError, match=f"reads {wanted} data .*converter: {wanted}"):
            export_for_recipe(store, wrong, None, tmp_path, recipe)
    with pytest.MonkeyPatch.context() as mp:  # a recipe whose data omni does not export
        mp.delitem(RECIPE_LAYOUTS, "bagel-flowgrpo-ocr-lora")
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
    edit = _source(store, "image_edit")["train"]
    with pytest.raises(ConfigError, match="row 1 has 0 source image.*converter: image_edit"):
        _image_edit(pa.Table.from_pylist([edit[0], {**edit[1], "images": []}]), "train")
    with pytest.raises(ConfigError, match="row 0 has 2 source image"):
        _image_edit(pa.Table.from_pylist([{**edit[0], "images": edit[0]["images"] * 2}]), "train")
    no_placeholder = {**edit[0], "prompt": [edit[0]["prompt"][0], {"role": "user", "content": "Make it blue"}]}
    with pytest.raises(ConfigError, match="1 source image.* and 0 <image> placeholder"):
        _image_edit(pa.Table.from_pylist([no_placeholder]), "train")
