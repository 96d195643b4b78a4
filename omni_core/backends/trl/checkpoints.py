"""TRL's `checkpoint-N` folders <-> the stage's checkpoints in the store (omni_core.training.checkpoint's
layout: `runs/{pipeline}/{run_key}/{stage}/checkpoints/global_step_N/` + `_manifest.json`, written last).

- `commit`: on every rank, when TRL saved `checkpoint-N` (its weights, optimizer, scheduler,
  `trainer_state.json` and one `rng_state_{rank}.pth` per rank; each worker writes into its own folder):
  rank 0 uploads its whole folder, every other rank its own RNG file; then rank 0 writes the manifest (the
  commit), the latest pointer and prunes to `checkpoint.max_to_keep`. A folder TRL is still writing (its
  JIT-checkpoint sentinel) or without `trainer_state.json` is never committed.
- `resume_point`: which committed checkpoint a (re)started worker group resumes from (`checkpoint.resume_mode`);
  `restore` downloads it (each file checked against the manifest) for `trainer.train(resume_from_checkpoint=)`.

The final step is not one of these: it is the plain Hugging Face folder (the merged model and its
tokenizer), committed by `omni_core.training.checkpoint.save_checkpoint` as our own trainers' are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.storage import Store
from omni_core.training.checkpoint import (
    MANIFEST,
    CheckpointError,
    checkpoint_prefix,
    checkpoint_steps,
    prune_checkpoints,
    read_manifest,
    settle_latest,
)

SOURCE = "trl"
STATE = "trainer_state.json"
FORMAT = "trl-checkpoint"  # a resumable checkpoint; the final step is a plain Hugging Face folder
INCOMPLETE = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint writes it while saving


def own_files(folder: Path, rank: int) -> list[str]:
    """What rank `rank` uploads of its `checkpoint-N` folder: rank 0 all of it, another rank its RNG state."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    if rank == 0:
        if STATE not in files or INCOMPLETE in files:
            raise CheckpointError(f"{folder} is not a complete TRL checkpoint (no {STATE}, or {INCOMPLETE})")
        return files
    return [f for f in files if f == f"rng_state_{rank}.pth"]


def upload(store: Store, folder: Path, prefix: str, rels: list[str]) -> list[dict[str, Any]]:
    from omni_core.backends.jobs.mirror import upload_file

    return [upload_file(store, folder, prefix, rel) for rel in rels]


def commit(store: Store, stage_root: str, step: int, folder: Path, *, rank: int, gather: Any,
           metadata: dict[str, Any], keep: int | None) -> dict[str, Any] | None:
    """Commit TRL's `folder` (checkpoint-`step`) from every rank (module docstring); `gather(obj)` returns
    every rank's `obj` (torch.distributed.all_gather_object). Returns the manifest on rank 0."""
    prefix = checkpoint_prefix(stage_root, step)
    entries = upload(store, folder, prefix, own_files(folder, rank))
    everyone = gather(entries)  # also the barrier: every rank's files are uploaded
    if rank != 0:
        return None
    files = sorted((e for part in everyone for e in part), key=lambda e: e["path"])
    weights = next((f["path"] for f in files if f["path"] in ("model.safetensors", "adapter_model.safetensors")), None)
    manifest = {"global_step": step, "uri": store.uri(prefix), "source": SOURCE, "files": files,
                "weights": weights, "model_format": FORMAT, **metadata}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)
    settle_latest(store, stage_root)
    prune_checkpoints(store, stage_root, keep=keep, newest=step)
    return manifest


def _committed_trl(store: Store, stage_root: str) -> list[dict[str, Any]]:
    """The committed TRL checkpoints of the stage, newest first."""
    steps = sorted((s for s, ok in checkpoint_steps(store, stage_root).items() if ok), reverse=True)
    manifests = (store.read_json(f"{checkpoint_prefix(stage_root, s)}/{MANIFEST}") for s in steps)
    return [m for m in manifests if m.get("model_format") == FORMAT]


def resume_point(store: Store, stage_root: str, checkpoint: Any, *, config_digest: str, ray_run: str,
                 ) -> dict[str, Any] | None:
    """The manifest a worker group resumes from, or None (step 0). `auto`: the newest committed TRL
    checkpoint of the run key; `disable`: only one this Ray Train run wrote (a restarted worker group);
    `resume_path`: that one, unless this run wrote a newer one. Another config's checkpoint is refused
    unless `force_resume`."""
    committed = _committed_trl(store, stage_root)
    ours = next((m for m in committed if m.get("ray_train_run") == ray_run), None)
    if checkpoint.resume_mode == "disable":
        return ours
    if checkpoint.resume_mode == "resume_path":
        given = read_manifest(store, checkpoint.resume_from_path)
        if given.get("model_format") != FORMAT:
            raise CheckpointError(f"checkpoint.resume_from_path: {given['uri']} was not written by TRL (no "
                                  f"{STATE}); give a global_step_N folder a trl stage committed")
        chosen = ours if ours is not None and ours["global_step"] > given["global_step"] else given
    else:
        chosen = committed[0] if committed else None
    if chosen is not None and chosen.get("config_digest") != config_digest and not checkpoint.force_resume:
        raise CheckpointError(
            f"checkpoint {chosen['uri']} was written with config digest {chosen.get('config_digest')}, this "
            f"stage's is {config_digest} (another model, data, algorithm, seed or world size); resume from a "
            "checkpoint of this config, set checkpoint.resume_mode: disable to start over, or "
            "checkpoint.force_resume: true to load it anyway")
    return chosen


def restore(store: Store, manifest: dict[str, Any], folder: Path) -> Path:
    """Download a committed TRL checkpoint into `folder` (every file checked against the manifest)."""
    from omni_core.storage import file_digest
    from omni_core.storage.local_copy import download_prefix
    from omni_core.training.checkpoint import store_key

    prefix = store_key(store, manifest["uri"])
    download_prefix(store, [f"{prefix}/{f['path']}" for f in manifest["files"]], folder)
    restored = folder / prefix
    for entry in manifest["files"]:
        if file_digest(restored / entry["path"])[1] != entry["sha256"]:
            raise CheckpointError(f"{manifest['uri']}/{entry['path']} does not match its manifest sha256; the "
                                  "checkpoint is corrupt: resume from an earlier one (checkpoint.resume_mode: "
                                  "resume_path)")
    return restored
