"""Checkpoints in the store: global_step_{N}/ with safetensors weights, committed by a manifest.

runs/{pipeline}/{run_key}/{stage}/checkpoints/global_step_{N}/   model files + _manifest.json (last)
runs/{pipeline}/{run_key}/{stage}/latest_checkpointed_iteration.txt  (after the commit)
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from omni_core.storage import Store

MANIFEST = "_manifest.json"
LATEST = "latest_checkpointed_iteration.txt"


def stage_prefix(pipeline: str, run_key: str, stage: str) -> str:
    return f"runs/{pipeline}/{run_key}/{stage}"


def checkpoint_prefix(stage_root: str, step: int) -> str:
    return f"{stage_root}/checkpoints/global_step_{step}"


def save_checkpoint(store: Store, stage_root: str, step: int, model: Any, tokenizer: Any,
                    metadata: dict[str, Any]) -> dict[str, Any]:
    """Writes model (safetensors) and tokenizer files, then the manifest, then the latest pointer."""
    prefix = checkpoint_prefix(stage_root, step)
    files = []
    with tempfile.TemporaryDirectory(prefix="omni-ckpt-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            key = f"{prefix}/{rel}"
            with open(path, "rb") as src, store.open_write(key) as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            files.append({"path": rel, "sha256": store.sha256(key), "bytes": path.stat().st_size})
    manifest = {"global_step": step, "uri": store.uri(prefix), "files": files, **metadata}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)
    store.write_text(f"{stage_root}/{LATEST}", f"{step}\n")
    return manifest


def latest_checkpoint(store: Store, stage_root: str) -> dict[str, Any] | None:
    """The manifest of the newest committed checkpoint, or None."""
    if not store.exists(f"{stage_root}/{LATEST}"):
        return None
    step = int(store.read_text(f"{stage_root}/{LATEST}").strip())
    key = f"{checkpoint_prefix(stage_root, step)}/{MANIFEST}"
    return store.read_json(key) if store.exists(key) else None
