"""Inputs on the shared path: a committed dataset version exported in the layout verl reads, and a
model folder every node can load.

    shared_dir/datasets/{name}/{version}/{layout}/{split}-{n:05d}.parquet + _manifest.json (last)
    shared_dir/models/{s3|tiny}/{digest}/   (a save_pretrained folder)

Layouts: `rl` is verl's RL Parquet, which our store already holds (the shards are copied byte for
byte); `sft` is what verl's SFT trainer reads (`MultiTurnSFTDataset`, `data.messages_key=messages`):
`messages` = the row's prompt + one assistant message holding the response (for GSM8K the worked
answer, `extra_info.answer`), with `data_source` and `extra_info` kept.

Content-addressed: the manifest records the source version's manifest digest, the layout, its
options and the export code's version; an export whose manifest matches (and whose files are all
there at their recorded sizes) is reused. A new export is written into a temporary sibling folder
and renamed into place, so a reader never sees a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.data.ingest import MANIFEST, load_version
from omni_core.data.schema import MESSAGE
from omni_core.errors import DataError, ModelError
from omni_core.storage import Store, file_digest
from omni_core.storage.local_copy import download_prefix, materialise

EXPORT_VERSION = "1"  # bump when the exported bytes change for the same inputs
Layout = Literal["rl", "sft"]


@dataclass(frozen=True)
class ExportedDataset:
    folder: Path
    files: dict[str, list[str]]  # split -> absolute Parquet paths, in shard order
    manifest: dict[str, Any]
    reused: bool


def export_dataset(store: Store, name: str, version: str | None, shared_dir: str | Path, layout: Layout = "rl",
                   *, response_field: str = "extra_info.answer") -> ExportedDataset:
    """Export committed version `version` (None: LATEST) of dataset `name` for verl; reused when present."""
    if layout not in ("rl", "sft"):
        raise DataError(f"export layout {layout!r}: use rl (verl RL Parquet) or sft (messages)")
    dv = load_version(store, name, version)
    source_digest = hashlib.sha256(store.read_bytes(f"datasets/{name}/{dv.version}/{MANIFEST}")).hexdigest()
    identity = {"dataset": name, "version": dv.version, "layout": layout, "export_version": EXPORT_VERSION,
                "source_manifest_sha256": source_digest, "source_uri": dv.uri,
                "options": {"response_field": response_field} if layout == "sft" else {}}
    folder = Path(shared_dir) / "datasets" / name / dv.version / layout
    existing = matching_export(folder, identity)
    if existing is not None:
        return ExportedDataset(folder, export_files(folder, existing), existing, True)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{layout}.tmp-", dir=folder.parent))
    try:
        entries = []
        for split in sorted(dv.manifest["splits"]):
            for index, key in enumerate(dv.shard_keys(split)):
                rel = f"{split}-{index:05d}.parquet"
                if layout == "rl":
                    _copy(store, key, tmp / rel)
                else:
                    _write_sft(store, key, tmp / rel, response_field)
                size, digest = file_digest(tmp / rel)
                entries.append({"path": rel, "split": split, "bytes": size, "sha256": digest,
                                "rows": pq.ParquetFile(tmp / rel).metadata.num_rows})
        manifest = {**identity, "files": entries}
        (tmp / MANIFEST).write_text(json.dumps(manifest, sort_keys=True, indent=2) + "\n")  # last
        tmp.chmod(0o755)
        replace_folder(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportedDataset(folder, export_files(folder, manifest), manifest, False)


def matching_export(folder: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if {k: manifest.get(k) for k in identity} != identity:
        return None
    for entry in manifest.get("files", []):
        path = folder / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            return None
    return manifest


def export_files(folder: Path, manifest: dict[str, Any]) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for entry in manifest["files"]:
        files.setdefault(entry["split"], []).append(str(folder / entry["path"]))
    return files


def replace_folder(tmp: Path, folder: Path) -> None:
    """Rename `tmp` onto `folder`; an outdated export there is moved aside first and removed."""
    old = None
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
        os.rename(folder, old)
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / MANIFEST).is_file():  # not a concurrent exporter that got there first
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _copy(store: Store, key: str, target: Path) -> None:
    with store.open_read(key) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def _write_sft(store: Store, key: str, target: Path, response_field: str) -> None:
    with store.open_read(key) as f:
        table = pq.read_table(f)
    responses = _column(table, response_field, key)
    prompts = _column(table, "prompt", key)
    messages = []
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        if not isinstance(response, str) or not response:
            raise DataError(f"{store.uri(key)} row {row}: no response in {response_field!r} for the sft layout; "
                            "choose the column that holds the answer (response_field)")
        messages.append([*prompt, {"role": "assistant", "content": response}])
    columns = {"messages": pa.array(messages, type=pa.list_(MESSAGE))}
    for kept in ("data_source", "extra_info"):
        if kept in table.column_names:
            columns[kept] = table.column(kept)
    pq.write_table(pa.table(columns), target)


def _column(table: pa.Table, dotted: str, key: str) -> list[Any]:
    head, *rest = dotted.split(".")
    if head not in table.column_names:
        raise DataError(f"{key}: no column {head!r} (columns: {', '.join(table.column_names)}); "
                        "the sft layout needs the prompt and a response column")
    column: Any = table.column(head).combine_chunks()
    for name in rest:
        if not pa.types.is_struct(column.type) or column.type.get_field_index(name) < 0:
            raise DataError(f"{key}: column {dotted!r} does not exist; name a column or struct field")
        column = column.field(name)
    return column.to_pylist()


# ---- models ------------------------------------------------------------------------------------


def stage_model(uri: str, shared_dir: str | Path, *, seed: int = 0) -> str:
    """What `model.path` gets: `s3://` downloaded once to shared_dir/models/s3/{digest}/, `tiny://`
    copied to shared_dir/models/tiny/{name}/ (the nodes lack our cache); a local folder or a hub id as is."""
    root = Path(shared_dir) / "models"
    if uri.startswith("s3://"):
        store = Store(uri)
        keys = store.list()
        if not keys:
            raise ModelError(f"model {uri!r}: no objects under it; point it at a save_pretrained folder")
        if "config.json" not in keys:
            raise ModelError(f"model {uri!r} holds no config.json at its top; point it at a save_pretrained folder")
        manifest = store.read_text(MANIFEST) if MANIFEST in keys else ""
        digest = hashlib.sha256(json.dumps([uri, keys, manifest]).encode()).hexdigest()[:16]
        final = root / "s3" / digest
        if not (final / "config.json").is_file():
            materialise(final, lambda tmp: download_prefix(store, keys, tmp))
        return str(final)
    if uri.startswith("tiny://"):
        from omni_core.models.tiny import tiny_model_dir

        source = tiny_model_dir(uri.removeprefix("tiny://"), seed=seed)
        final = root / "tiny" / source.name
        if not final.is_dir():
            materialise(final, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))
        return str(final)
    local = Path(uri.removeprefix("file://")).expanduser()
    if uri.startswith(("/", "./", "../", "~", "file://")):
        if not (local / "config.json").is_file():
            raise ModelError(f"model {uri!r}: {local} is not a save_pretrained folder (no config.json)")
        return str(local.resolve())
    return uri  # a hub id: verl's nodes download it


def planned_model_path(uri: str, shared_dir: str, seed: int) -> str:
    """Where `export.stage_model` puts `uri`, worked out without downloading or building anything."""
    root = Path(shared_dir) / "models"
    if uri.startswith("s3://"):
        return f"{root}/s3/<digest of the objects under {uri}>"
    if uri.startswith("tiny://"):
        from omni_core.models.tiny import _recipe_and_builder, digest

        name = uri.removeprefix("tiny://")
        return str(root / "tiny" / f"{name}-{digest(_recipe_and_builder(name)[0](seed))}")
    if uri.startswith(("/", "./", "../", "~", "file://")):
        return str(Path(uri.removeprefix("file://")).expanduser().resolve())
    return uri


# ---- reward files --------------------------------------------------------------------------------


def staged_reward_path(path: str | Path, shared_dir: str | Path) -> str:
    """Where `stage_reward` puts a custom reward file: shared_dir/rewards/{sha256[:16]}/{name}, so every
    node reads it at one path and an edit made while a job runs reaches only the next job."""
    source = Path(path).expanduser()
    return str(Path(shared_dir) / "rewards" / file_digest(source)[1][:16] / source.name)


def stage_reward(path: str | Path, shared_dir: str | Path) -> str:
    """Copy a custom reward file onto the shared path (once per content); returns its staged path."""
    final = Path(staged_reward_path(path, shared_dir))
    if not final.is_file():
        materialise(final.parent, lambda tmp: shutil.copy2(Path(path).expanduser(), tmp / final.name))
    return str(final)
