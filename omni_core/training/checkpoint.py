"""Checkpoints in the store: global_step_{N}/ with safetensors weights, committed by a manifest.

runs/{pipeline}/{run_key}/{stage}/checkpoints/global_step_{N}/   model files + _manifest.json (last)
runs/{pipeline}/{run_key}/{stage}/latest_checkpointed_iteration.txt  (after the commit)

What is written is the model's `save_pretrained` (a transformers model: config + model.safetensors;
a LoRA (peft) model: only adapter_config.json + adapter_model.safetensors) and its tokenizer or
processor. An `SD3Model` (no `save_pretrained` of its own) is written as the component folder
`load_model` reads: transformer/ (only the adapter with LoRA), scheduler/, text_encoder/, tokenizer/
and omni_pipeline.json. The manifest's `weights` names the file of the trained weights.

A checkpoint a run can resume from also holds `state/` (`TrainingState`): the trainable parameters
(`policy.safetensors`: the whole model, or only the LoRA adapter; when every one of them is already in
the exported weights under its own name, bit for bit, as after a full fine-tune, `policy.json` names
the weights file to read them from instead, so the model is not stored twice), the optimizer (`optimizer.pt`, read
back with `torch.load(weights_only=True)`, never unpickling arbitrary objects), every actor's RNG
(`rng.safetensors`), the weights of older policy versions that batches still to come are generated
with (`rollout_version_{v}.safetensors`, separate_async), and `state.json` (global step, policy
version, data cursor, config digest, the learning-rate schedule). Everything is listed in the
manifest with its sha256 and verified when loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omni_core.errors import OmniError
from omni_core.storage import Store, settle_pointer

if TYPE_CHECKING:  # torch loads when a checkpoint is written or read: not for its paths (a cached re-run)
    import torch

MANIFEST = "_manifest.json"
LATEST = "latest_checkpointed_iteration.txt"


def stage_prefix(pipeline: str, run_key: str, stage: str) -> str:
    return f"runs/{pipeline}/{run_key}/{stage}"


def checkpoint_prefix(stage_root: str, step: int) -> str:
    return f"{stage_root}/checkpoints/global_step_{step}"


class CheckpointError(OmniError):
    """A checkpoint that cannot be used (another config, missing or corrupt files)."""


@dataclass
class TrainingState:
    """What resuming needs besides the exported model (module docstring)."""

    policy: dict[str, torch.Tensor]  # trainable parameters by name (full model, or the LoRA adapter)
    optimizer: dict[str, Any]  # optimizer.state_dict()
    rng: dict[str, torch.Tensor]  # torch RNG state (uint8) of every actor, by actor name
    info: dict[str, Any]  # global_step, policy_version, data cursor, config digest, lr schedule, ...
    rollout_versions: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


POLICY_REFERENCE = "state/policy.json"


def _state_files(state: TrainingState, policy_in: dict[str, list[str]] | None = None) -> dict[str, bytes]:
    import torch
    from safetensors.torch import save as save_safetensors

    buffer = io.BytesIO()
    torch.save(state.optimizer, buffer)
    policy = ({POLICY_REFERENCE: (json.dumps({"weights": policy_in}, sort_keys=True, indent=2) + "\n").encode()}
              if policy_in else {"state/policy.safetensors": save_safetensors(_contiguous(state.policy))})
    files = {**policy,
             "state/optimizer.pt": buffer.getvalue(),
             "state/rng.safetensors": save_safetensors(_contiguous(state.rng)),
             "state/state.json": (json.dumps({**state.info, "rollout_versions": sorted(state.rollout_versions)},
                                             sort_keys=True, indent=2) + "\n").encode()}
    for version, weights in state.rollout_versions.items():
        files[f"state/rollout_version_{version}.safetensors"] = save_safetensors(_contiguous(weights))
    return files


def _policy_in_weights(policy: dict[str, torch.Tensor], folder: Path, weights: list[str]
                       ) -> dict[str, list[str]] | None:
    """{weights file: the policy names it holds} when every policy tensor is in the exported weights
    files under its own name with the same dtype and values; else None (a LoRA adapter's names, tied
    or converted weights: the policy is then written out whole)."""
    import torch
    from safetensors import safe_open

    if not policy or not weights:
        return None
    found: dict[str, list[str]] = {}
    left = set(policy)
    for rel in weights:
        with safe_open(str(folder / rel), framework="pt") as f:
            for name in sorted(left & set(f.keys())):
                saved, ours = f.get_tensor(name), policy[name].detach().cpu()
                if saved.dtype != ours.dtype or saved.shape != ours.shape or not torch.equal(saved, ours):
                    return None
                found.setdefault(rel, []).append(name)
                left.discard(name)
    return found if not left else None


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous() for k, v in tensors.items()}


def save_checkpoint(store: Store, stage_root: str, step: int, model: Any, tokenizer: Any,
                    metadata: dict[str, Any], *, state: TrainingState | None = None,
                    keep: int | None = None) -> dict[str, Any]:
    """Writes model (safetensors) and tokenizer files and the training `state`, then the manifest
    (the commit), then the latest pointer; then deletes all but the newest `keep` committed
    checkpoints, and any uncommitted (half-written) one older than this that nobody writes any more.

    Nothing is deleted before the write: each file replaces its name whole, so the leftovers of an
    earlier, failed write of this step are overwritten, and a concurrent identical run (same run key,
    same seed: the same bytes) writing the same step never finds the other's files gone under it."""
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
        if state is not None:
            policy_in = _policy_in_weights(state.policy, Path(tmp), weights)
            for rel, data in _state_files(state, policy_in).items():
                (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(tmp) / rel).write_bytes(data)
        for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            rel = path.relative_to(tmp).as_posix()
            key = f"{prefix}/{rel}"
            digest = hashlib.sha256()  # of the bytes as sent: reading the object back doubles an S3 save
            with open(path, "rb") as src, store.open_write(key) as dst:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
            files.append({"path": rel, "sha256": digest.hexdigest(), "bytes": path.stat().st_size})
    manifest = {"global_step": step, "uri": store.uri(prefix), "files": files,
                "weights": weights[0] if weights else None, **metadata}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)
    settle_latest(store, stage_root)
    prune_checkpoints(store, stage_root, keep=keep, newest=step)
    return manifest


def settle_latest(store: Store, stage_root: str) -> None:
    """The latest pointer on the newest committed step (`settle_pointer`): a concurrent writer of the
    same run key that commits an older step after this one's newer never moves it back."""
    def newest() -> str | None:
        step = newest_committed_step(store, stage_root)
        return None if step is None else str(step)

    settle_pointer(store, f"{stage_root}/{LATEST}", newest)


_STEP_DIR = re.compile(r"checkpoints/global_step_(\d+)/")


def checkpoint_steps(store: Store, stage_root: str) -> dict[int, bool]:
    """Every global_step_N folder under the stage: N -> committed (has its manifest)."""
    return {step: committed for step, (committed, _) in _step_folders(store, stage_root).items()}


def _step_folders(store: Store, stage_root: str) -> dict[int, tuple[bool, float]]:
    """N -> (committed, when its newest file was written), from one listing."""
    steps: dict[int, tuple[bool, float]] = {}
    for key, modified in store.list_modified(f"{stage_root}/checkpoints").items():
        match = _STEP_DIR.search(key[len(stage_root):])
        if match:
            step = int(match.group(1))
            committed, newest = steps.get(step, (False, 0.0))
            steps[step] = (committed or key.endswith(f"/{MANIFEST}"), max(newest, modified))
    return steps


# An uncommitted step folder is a leftover once nothing was written to it for this long; before that
# it may be a write in progress (a concurrent run of the same run key behind this one: deleting its
# files under it would let it commit a manifest that lists files that are gone).
LEFTOVER_AFTER_S = 3600.0


def prune_checkpoints(store: Store, stage_root: str, *, keep: int | None, newest: int,
                      now: float | None = None) -> list[int]:
    """Delete committed checkpoints beyond the newest `keep` and the uncommitted leftovers below
    `newest` (untouched for LEFTOVER_AFTER_S); returns the steps deleted."""
    folders = _step_folders(store, stage_root)
    now = time.time() if now is None else now
    steps = {s: ok for s, (ok, _) in folders.items()}
    committed = sorted((s for s, ok in steps.items() if ok), reverse=True)
    doomed = [s for s, (ok, written) in folders.items() if not ok and s < newest and now - written > LEFTOVER_AFTER_S]
    if keep is not None:
        doomed += [s for s in committed[keep:] if s != newest]
    for step in sorted(doomed):
        store.delete(checkpoint_prefix(stage_root, step))
    return sorted(doomed)


def load_training_state(store: Store, manifest: dict[str, Any]) -> TrainingState:
    """The `state/` of a committed checkpoint, each file checked against the manifest's sha256."""
    import torch
    from safetensors.torch import load as load_safetensors

    prefix = store_key(store, manifest["uri"])
    listed = {f["path"]: f for f in manifest["files"]}
    if "state/state.json" not in listed:
        raise CheckpointError(f"checkpoint {manifest['uri']} has no training state (state/): it was written "
                              "by an older version and can only be used as weights, not resumed from")

    def read(rel: str) -> bytes:
        data = store.read_bytes(f"{prefix}/{rel}")
        if hashlib.sha256(data).hexdigest() != listed[rel]["sha256"]:
            raise CheckpointError(f"checkpoint file {manifest['uri']}/{rel} does not match its manifest sha256; "
                                  "the checkpoint is corrupt: resume from an earlier one (resume_mode: resume_path)")
        return data

    info = json.loads(read("state/state.json"))
    optimizer = torch.load(io.BytesIO(read("state/optimizer.pt")), weights_only=True)
    if POLICY_REFERENCE in listed:  # the policy is the exported weights (module docstring)
        policy: dict[str, torch.Tensor] = {}
        for rel, names in json.loads(read(POLICY_REFERENCE))["weights"].items():
            tensors = load_safetensors(read(rel))
            policy.update((name, tensors[name]) for name in names)
    else:
        policy = load_safetensors(read("state/policy.safetensors"))
    return TrainingState(
        policy=policy, optimizer=optimizer,
        rng=load_safetensors(read("state/rng.safetensors")), info=info,
        rollout_versions={int(v): load_safetensors(read(f"state/rollout_version_{v}.safetensors"))
                          for v in info.get("rollout_versions", [])})


def store_key(store: Store, uri_or_key: str) -> str:
    """The key of a URI under `store`'s root (a key is returned as it is)."""
    root = store.uri("").rstrip("/") + "/"
    return (uri_or_key[len(root):] if uri_or_key.startswith(root) else uri_or_key).strip("/")


def read_manifest(store: Store, path: str) -> dict[str, Any]:
    """The manifest of a global_step_N folder given as a store key or a URI of this store."""
    key = store_key(store, path)
    if not store.exists(f"{key}/{MANIFEST}"):
        raise CheckpointError(f"{path}: no committed checkpoint there (no {MANIFEST}); give a global_step_N "
                              "folder of this store whose write finished")
    return store.read_json(f"{key}/{MANIFEST}")


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


def newest_committed_step(store: Store, stage_root: str) -> int | None:
    """The newest step whose manifest is written. The manifest is the commit and the latest pointer
    follows it, so a writer that died between the two left the pointer behind (or absent): the
    listing, not the pointer, says what is committed."""
    committed = [step for step, ok in checkpoint_steps(store, stage_root).items() if ok]
    return max(committed) if committed else None


def latest_checkpoint(store: Store, stage_root: str) -> dict[str, Any] | None:
    """The manifest of the newest committed checkpoint, or None."""
    step = newest_committed_step(store, stage_root)
    return None if step is None else store.read_json(f"{checkpoint_prefix(stage_root, step)}/{MANIFEST}")


def weights_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the trained weights: the manifest's `weights` file, else (older manifests) the first
    .safetensors file."""
    path = manifest.get("weights")
    return next((f["sha256"] for f in manifest["files"]
                 if (f["path"] == path if path else f["path"].endswith(".safetensors"))), "")
