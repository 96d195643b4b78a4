"""Checkpoints in the store: global_step_{N}/ with safetensors weights, committed by a manifest.

runs/{pipeline}/{run_key}/{stage}/checkpoints/global_step_{N}/   model files + _manifest.json (last)
runs/{pipeline}/{run_key}/{stage}/latest_checkpointed_iteration.txt  (after the commit)

What is written is the model's `save_pretrained` (a transformers model: config + model.safetensors;
a LoRA (peft) model: only adapter_config.json + adapter_model.safetensors) and its tokenizer or
processor. An `SD3Model` (no `save_pretrained` of its own) is written as the component folder
`load_model` reads: transformer/ (only the adapter with LoRA), scheduler/, text_encoder/, tokenizer/
and omni_pipeline.json. The manifest's `weights` names the file of the trained weights.
"""

from __future__ import annotations

import json
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
        trained = Path(tmp)
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        elif hasattr(model, "transformer") and hasattr(model, "scheduler"):  # an SD3Model
            trained = _save_sd3(model, Path(tmp))
        else:
            raise TypeError(f"cannot checkpoint a {type(model).__name__}: it has no save_pretrained")
        weights = sorted(p.relative_to(tmp).as_posix() for p in trained.glob("*.safetensors"))
        for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            key = f"{prefix}/{rel}"
            with open(path, "rb") as src, store.open_write(key) as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            files.append({"path": rel, "sha256": store.sha256(key), "bytes": path.stat().st_size})
    manifest = {"global_step": step, "uri": store.uri(prefix), "files": files,
                "weights": weights[0] if weights else None, **metadata}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)
    store.write_text(f"{stage_root}/{LATEST}", f"{step}\n")
    return manifest


def _save_sd3(model: Any, out: Path) -> Path:
    """An `SD3Model` as its component folder (as `tiny_sd3.build` lays it out); returns the folder of
    the trained part (the transformer)."""
    from omni_core.models.diffusion import PIPELINE_FILE

    transformer = model.transformer
    base = transformer.get_base_model() if hasattr(transformer, "get_base_model") else transformer  # peft
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    model.scheduler.save_pretrained(out / "scheduler")
    model.text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    model.tokenizer.save_pretrained(out / "tokenizer")
    pipeline = {"architecture": type(base).__name__, "kind": "sd3", "space": model.space,
                "sample_size": model.sample_size, "channels": model.channels,
                "max_text_length": model.max_text_length,
                "components": {k: k for k in ("transformer", "scheduler", "text_encoder", "tokenizer")}}
    (out / PIPELINE_FILE).write_text(json.dumps(pipeline, indent=2, sort_keys=True) + "\n")
    return out / "transformer"


def latest_checkpoint(store: Store, stage_root: str) -> dict[str, Any] | None:
    """The manifest of the newest committed checkpoint, or None."""
    if not store.exists(f"{stage_root}/{LATEST}"):
        return None
    step = int(store.read_text(f"{stage_root}/{LATEST}").strip())
    key = f"{checkpoint_prefix(stage_root, step)}/{MANIFEST}"
    return store.read_json(key) if store.exists(key) else None
