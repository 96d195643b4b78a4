"""A committed dataset version exported in the layout a VeRL-Omni recipe's dataset class reads (the
recipe's data_process script's output), on the shared path:

    shared_dir/datasets/{name}/{version}/verl_omni-{layout}/...  + _manifest.json (written last)

Layouts (`RECIPE_LAYOUTS` says which recipe reads which):
- `inline` (gsm8k, mmk12, OCR in the Qwen-Image form, vid_prompt, hpsv3, pickscore_sfw): the store's verl
  Parquet as one `{split}.parquet` per split, the converter having written the script's own rows;
  MMK12's images stay inline as bytes (data_process/mmk12.py keeps them so).
- `sd3_ocr`: OCR prompts in the SD3 form (data_process/sd3_ocr.py): `prompt` = [user], no
  `negative_prompt`, `extra_info.raw_prompt` = the text prompt.
- `bagel_ocr`: OCR prompts in BAGEL's form (data_process/bagel_ocr.py): `prompt` = [user: the stripped
  line], `negative_prompt` = [user: " "], `prompt_token_ids` = `<|im_start|>` + the line's tokens +
  `<|im_end|>` (no chat template), cut at 256: pre-tokenized with the stage model's tokenizer, whose
  digest is part of the export's identity.
- `image_edit` (qwen_image_edit/prepare_data.py): the stored rows, the letterboxed source image inline
  as PNG bytes (`images: [{bytes}]`, as the script writes it), checked: one image per row and one
  `<image>` placeholder in the user message.
- `avqa_media` (data_process/avqa.py): image and audio files written to `media/`, rows holding
  their absolute paths (`images: [{image: PATH}]`, `audios: [PATH]`).
- `dpo_modality` (omni_preference_dpo_multisource.py): `{image,video,audio}/{train,test}.parquet`,
  each modality's media written to `media/` and referenced by absolute path (`images|videos|audios:
  [PATH]`, `extra_info.{modality}_path`).
Content-addressed as omni_core/backends/jobs/export.py is: the manifest records the source version's
manifest digest, the layout and this code's version; a matching export is reused; a new one is
written in a temporary sibling folder and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omni_core.backends.jobs.export import export_files, matching_export, replace_folder
from omni_core.backends.verl_omni.catalog import get_recipe
from omni_core.data.ingest import MANIFEST, load_version
from omni_core.data.schema import MESSAGE
from omni_core.errors import ConfigError
from omni_core.storage import Store, file_digest

EXPORT_VERSION = "1"
MODALITIES = ("image", "video", "audio")
MEDIA_FIELD = {"image": "images", "video": "videos", "audio": "audios"}
# layout -> the converters (our dataset kinds) it can be made from
LAYOUT_CONVERTERS = {"inline": {"gsm8k", "mmk12", "ocr", "vid_prompt", "hpsv3", "pickscore_sfw"},
                     "sd3_ocr": {"ocr"}, "bagel_ocr": {"ocr"}, "image_edit": {"image_edit"},
                     "avqa_media": {"avqa"}, "dpo_modality": {"omni_preference"}}
TOKENIZED = {"bagel_ocr"}  # layouts pre-tokenized with the model's tokenizer (export_for_recipe's `tokenizer`)
BAGEL_MAX_PROMPT_LENGTH = 256  # bagel_ocr.py --max_prompt_length default (the recipe's data.max_prompt_length)
RECIPE_LAYOUTS = {
    "qwen3-omni-thinker-gspo-gsm8k": ("inline", "gsm8k"),
    "qwen3-omni-thinker-gspo-mmk12": ("inline", "mmk12"),
    "qwen3-omni-thinker-gspo-mmk12-npu": ("inline", "mmk12"),
    "qwen3-omni-thinker-gspo-avqa-npu": ("avqa_media", "avqa"),
    "qwen3-omni-dpo-omni-preference": ("dpo_modality", "omni_preference"),
    "qwen-image-flowgrpo-ocr-lora": ("inline", "ocr"),
    "qwen-image-flowgrpo-ocr-full": ("inline", "ocr"),
    "qwen-image-flowdppo-ocr-lora": ("inline", "ocr"),
    "sd35-medium-flowgrpo-ocr-lora-v1": ("sd3_ocr", "ocr"),
    "sd35-medium-flowgrpo-ocr-lora-v1-separate-async": ("sd3_ocr", "ocr"),
    "bagel-flowgrpo-ocr-lora": ("bagel_ocr", "ocr"),
    "ltx2.3-flowgrpo-t2av-lora": ("inline", "vid_prompt"),
    "qwen-image-edit-flowgrpo-pickscore-lora": ("image_edit", "image_edit"),
    "sd35-medium-flowgrpo-drm-lora": ("inline", "pickscore_sfw"),
    "wan2.2-dancegrpo-t2v-hpsv3": ("inline", "hpsv3"),
}
BAGEL_SCHEMA = pa.schema([  # bagel_ocr.py's columns, in its order
    ("data_source", pa.string()), ("prompt", pa.list_(MESSAGE)), ("negative_prompt", pa.list_(MESSAGE)),
    ("prompt_token_ids", pa.list_(pa.int64())), ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
])
_MAGIC = [(b"\x89PNG", ".png"), (b"\xff\xd8\xff", ".jpg"), (b"RIFF", ".wav"), (b"GIF8", ".gif"),
          (b"fLaC", ".flac"), (b"OggS", ".ogg"), (b"ID3", ".mp3")]


@dataclass(frozen=True)
class RecipeExport:
    folder: Path
    layout: str
    train_files: list[str]
    val_files: list[str]
    manifest: dict[str, Any]
    reused: bool


def recipe_layout(recipe: str, converter: str) -> str:
    """The layout `recipe` reads, checked against the dataset's converter; ConfigError otherwise."""
    get_recipe(recipe)
    if recipe not in RECIPE_LAYOUTS:
        raise ConfigError(f"backend.recipe {recipe!r}: its data ({get_recipe(recipe).data_layout}) is not exported "
                          "by omni yet; prepare it with the recipe's data_process script and pass the files in "
                          "backend.overrides (data.train_files=..., data.val_files=...)")
    layout, wanted = RECIPE_LAYOUTS[recipe]
    if converter != wanted:
        raise ConfigError(f"data: recipe {recipe!r} reads {wanted} data ({get_recipe(recipe).data_layout}); the "
                          f"stage's dataset was ingested with converter {converter!r}: ingest the recipe's data "
                          f"with `converter: {wanted}`")
    return layout


def export_for_recipe(store: Store, name: str, version: str | None, shared_dir: str | Path,
                      recipe: str, tokenizer: str | Path | None = None) -> RecipeExport:
    """Export `name@version` (None: LATEST) in the layout `recipe` reads; reused when present.

    `tokenizer` (a model folder or hub id) is what a pre-tokenized layout (`TOKENIZED`) encodes the
    prompts with: the stage's model, whose tokenizer the recipe trains with."""
    dv = load_version(store, name, version)
    converter = (dv.manifest.get("converter") or {}).get("name", "")
    layout = recipe_layout(recipe, converter)
    source_digest = hashlib.sha256(store.read_bytes(f"datasets/{name}/{dv.version}/{MANIFEST}")).hexdigest()
    identity = {"dataset": name, "version": dv.version, "layout": f"verl_omni-{layout}",
                "export_version": EXPORT_VERSION, "source_manifest_sha256": source_digest, "source_uri": dv.uri}
    tok = None
    if layout in TOKENIZED:
        if tokenizer is None:
            raise ConfigError(f"backend.recipe {recipe!r}: its data ({layout}) is pre-tokenized with the model's "
                              "tokenizer; pass the stage's model folder as the export's tokenizer")
        tok = _load_tokenizer(tokenizer)
        identity.update(tokenizer_sha256=_tokenizer_digest(tok), max_prompt_length=BAGEL_MAX_PROMPT_LENGTH)
    folder = (Path(shared_dir) / "datasets" / name / dv.version / f"verl_omni-{layout}").absolute()
    manifest = matching_export(folder, identity)
    reused = manifest is not None
    if manifest is None:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".verl_omni-{layout}.tmp-", dir=folder.parent))
        try:
            tables = {split: pa.concat_tables([_read(store, key) for key in dv.shard_keys(split)])
                      for split in sorted(dv.manifest["splits"])}
            entries, media = _write(layout, tables, tmp, folder, tok)
            manifest = {**identity, "files": entries, "media": media}
            (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")  # last
            tmp.chmod(0o755)
            replace_folder(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    files = export_files(folder, manifest)
    train = files.get("train", [])
    val = files.get("test") or files.get("validation") or []
    return RecipeExport(folder, layout, train, val, manifest, reused)


def _read(store: Store, key: str) -> pa.Table:
    with store.open_read(key) as f:
        return pq.read_table(f)


def _write(layout: str, tables: dict[str, pa.Table], tmp: Path, folder: Path, tok: Any = None
           ) -> tuple[list[dict], int]:
    entries: list[dict] = []
    media = _Media(tmp, folder)
    for split, table in tables.items():
        if layout == "inline":
            out = {split: table}
        elif layout == "sd3_ocr":
            out = {split: _sd3(table)}
        elif layout == "bagel_ocr":
            out = {split: _bagel(table, tok)}
        elif layout == "image_edit":
            out = {split: _image_edit(table, split)}
        elif layout == "avqa_media":
            out = {split: _avqa(table, split, media)}
        else:
            out = _dpo(table, split, media)
        for rel, written in out.items():
            path = tmp / f"{rel}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(written, path)
            size, digest = file_digest(path)
            entries.append({"path": f"{rel}.parquet", "split": split, "bytes": size, "sha256": digest,
                            "rows": written.num_rows})
    entries.extend(media.entries)
    return entries, len(media.entries)


class _Media:
    """Media files written once by content (`media/{sha256[:16]}{ext}`), referenced by absolute path."""

    def __init__(self, tmp: Path, folder: Path) -> None:
        self.tmp, self.folder, self.entries, self.seen = tmp, folder, [], set()

    def write(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        ext = next((e for magic, e in _MAGIC if data.startswith(magic)), ".mp4" if data[4:8] == b"ftyp" else ".bin")
        rel = f"media/{digest[:16]}{ext}"
        if rel not in self.seen:
            (self.tmp / "media").mkdir(exist_ok=True)
            (self.tmp / rel).write_bytes(data)
            self.seen.add(rel)
            self.entries.append({"path": rel, "split": "media", "bytes": len(data), "sha256": digest, "rows": 0})
        return str(self.folder / rel)


def _sd3(table: pa.Table) -> pa.Table:
    rows = []
    for row in table.to_pylist():
        user = [m for m in row["prompt"] if m["role"] == "user"]
        if len(user) != 1:
            raise ConfigError(f"data: an OCR row ({row.get('extra_info')}) has {len(user)} user messages; the SD3 "
                              "form takes one")
        rows.append({"data_source": row["data_source"], "prompt": user, "ability": row["ability"],
                     "reward_model": row["reward_model"],
                     "extra_info": {**(row.get("extra_info") or {}), "raw_prompt": user[0]["content"]}})
    return pa.Table.from_pylist(rows)


def _user_message(row: dict, what: str) -> str:
    user = [m for m in row["prompt"] if m["role"] == "user"]
    if len(user) != 1:
        raise ConfigError(f"data: {what} ({row.get('extra_info')}) has {len(user)} user messages; the recipe's "
                          "form takes one")
    return user[0]["content"]


def _load_tokenizer(source: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {source}: no tokenizer loads from it ({exc.__class__.__name__}); BAGEL's data is "
                          "pre-tokenized with the model's own (Qwen2) tokenizer") from exc
    for token in ("<|im_start|>", "<|im_end|>"):
        if token not in tok.get_vocab():
            raise ConfigError(f"model {source}: its tokenizer has no {token} token; bagel_ocr.py wraps each prompt "
                              "in <|im_start|> ... <|im_end|> (BAGEL's Qwen2 tokenizer)")
    return tok


def _tokenizer_digest(tok: Any) -> str:
    """sha256 of the tokenizer's full definition (a fast tokenizer's JSON; else its vocabulary)."""
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _bagel(table: pa.Table, tok: Any) -> pa.Table:
    """data_process/bagel_ocr.py's rows: the stripped OCR line as the one user message, `prompt_token_ids`
    = [<|im_start|>] + encode(line, add_special_tokens=False) + [<|im_end|>], cut at 256 tokens."""
    bos, eos = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for row in table.to_pylist():
        text = _user_message(row, "an OCR row").strip()
        ids = [bos, *tok.encode(text, add_special_tokens=False), eos][:BAGEL_MAX_PROMPT_LENGTH]
        rows.append({"data_source": row["data_source"], "prompt": [{"role": "user", "content": text}],
                     "negative_prompt": [{"role": "user", "content": " "}], "prompt_token_ids": ids,
                     "ability": row["ability"], "reward_model": row["reward_model"],
                     "extra_info": {"split": row["extra_info"]["split"], "index": row["extra_info"]["index"]}})
    return pa.Table.from_pylist(rows, schema=BAGEL_SCHEMA)


def _image_edit(table: pa.Table, split: str) -> pa.Table:
    """The stored rows as they are, once each is checked to be what Qwen-Image-Edit takes: exactly one
    source image (bytes) and one `<image>` placeholder in the user message (qwen_image_edit/README.md)."""
    images = _image_counts(table)
    for index, row in enumerate(table.select(["prompt", "extra_info"]).to_pylist()):  # the text only
        placeholders = _user_message(row, f"an image-edit {split} row").count("<image>")
        if images[index] != 1 or placeholders != 1:
            raise ConfigError(f"data: image-edit {split} row {index} has {images[index]} source image(s) and "
                              f"{placeholders} <image> placeholder(s); Qwen-Image-Edit takes exactly one of each "
                              "(text+image -> image): ingest the pairs with `converter: image_edit`")
    return table


def _image_counts(table: pa.Table) -> list[int]:
    """Per row, the images with non-empty bytes in its `images` list (0 without the column), counted on
    Arrow's arrays (the bytes never become Python objects)."""
    if "images" not in table.column_names:
        return [0] * table.num_rows
    counts = np.zeros(table.num_rows, dtype=np.int64)
    offset = 0
    for chunk in table.column("images").chunks:
        items = pc.struct_field(pc.list_flatten(chunk), "bytes")
        usable = pc.fill_null(pc.greater(pc.binary_length(items), 0), False).to_numpy(zero_copy_only=False)
        parents = pc.list_parent_indices(chunk).to_numpy(zero_copy_only=False)
        counts[offset:offset + len(chunk)] += np.bincount(parents[usable], minlength=len(chunk))
        offset += len(chunk)
    return counts.tolist()


def _media_list(row: dict, field: str) -> list[bytes]:
    return [item["bytes"] for item in (row.get(field) or [])]


def _avqa(table: pa.Table, split: str, media: _Media) -> pa.Table:
    rows = []
    for index, row in enumerate(table.to_pylist()):
        images, audios = _media_list(row, "images"), _media_list(row, "audios")
        if not images or not audios:
            raise ConfigError(f"data: AVQA {split} row {index} has {len(images)} image(s) and {len(audios)} "
                              "audio clip(s); the recipe needs both (text+image+audio -> text)")
        rows.append({**row, "images": [{"image": media.write(b)} for b in images],
                     "audios": [media.write(b) for b in audios]})
    return pa.Table.from_pylist(rows)


def _dpo(table: pa.Table, split: str, media: _Media) -> dict[str, pa.Table]:
    grouped: dict[str, list[dict]] = {m: [] for m in MODALITIES}
    for row in table.to_pylist():
        modality = (row.get("extra_info") or {}).get("modality")
        if modality not in grouped:
            raise ConfigError(f"data: an Omni-Preference {split} row has modality {modality!r}; the DPO recipe "
                              f"groups {', '.join(MODALITIES)}")
        field = MEDIA_FIELD[modality]
        files = _media_list(row, field)
        if not files:
            raise ConfigError(f"data: an Omni-Preference {split} {modality} row has no {field}")
        paths = [media.write(b) for b in files]
        out = {k: v for k, v in row.items() if k not in MEDIA_FIELD.values()}
        out[field] = paths
        out["extra_info"] = {**row["extra_info"], f"{modality}_path": paths[0]}
        grouped[modality].append(out)
    name = "test" if split in ("test", "validation") else split
    missing = [m for m, rows in grouped.items() if not rows]
    if missing:
        raise ConfigError(f"data: the Omni-Preference {split} split has no {', '.join(missing)} rows; the DPO recipe "
                          f"reads {{image,video,audio}}/{name}.parquet (its script refuses a missing one)")
    return {f"{m}/{name}": pa.Table.from_pylist(rows) for m, rows in grouped.items()}
