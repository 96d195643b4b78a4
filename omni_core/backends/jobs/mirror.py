"""A trainer's checkpoints on the shared path <-> our checkpoint layout in the store (both external
backends: their trainers are verl's, which writes checkpoints this way).

verl writes `{default_local_dir}/global_step_N/` and then moves `latest_checkpointed_iteration.txt`
to N: a folder at or below the latest step is complete, one above it is still being written.

- `mirror_new`: every complete step not yet in the store is uploaded to
  `runs/{pipeline}/{run_key}/{stage}/checkpoints/global_step_N/` (omni_core.training.checkpoint's
  layout) with a `_manifest.json` (sha256 and size of every file) written last, then the store's
  latest file; `keep` prunes the store's older checkpoints as the native trainer does.
- `prepare_resume`: before a (re)submission with resume_mode=auto. A shared path that lost the
  checkpoints (a new cluster) gets the latest mirrored one back; a `global_step_N` folder without the
  latest file (verl #7952: async save never writes it, and verl then silently restarts from step 0)
  is repaired from the mirror, or refused with a CheckpointError when there is none.
- `upload_file`: one file into a checkpoint folder of the store, as its manifest entry (what a
  backend adds to a mirrored checkpoint after the job: a merged model, an exported adapter).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from omni_core.storage import Store, file_digest
from omni_core.training.checkpoint import (
    LATEST,
    MANIFEST,
    CheckpointError,
    checkpoint_prefix,
    newest_committed_step,
    prune_checkpoints,
    settle_latest,
)

STEP_DIR = re.compile(r"^global_step_(\d+)$")
UPLOAD_THREADS = 4


def local_latest(run_dir: str | Path) -> int | None:
    """The step verl's latest file names, or None."""
    try:
        text = (Path(run_dir) / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def local_steps(run_dir: str | Path) -> list[int]:
    """Every global_step_N folder under `run_dir`, complete or not."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name)))


def committed_steps(run_dir: str | Path) -> list[int]:
    """The complete steps: those at or below the step the latest file names."""
    latest = local_latest(run_dir)
    return [] if latest is None else [s for s in local_steps(run_dir) if s <= latest]


def mirror_new(run_dir: str | Path, store: Store, stage_root: str, *, keep: int | None = None,
               metadata: dict[str, Any] | None = None) -> list[int]:
    """Upload the complete steps the store lacks (oldest first); returns the steps uploaded."""
    done = []
    for step in committed_steps(run_dir):
        prefix = checkpoint_prefix(stage_root, step)
        if store.exists(f"{prefix}/{MANIFEST}"):
            continue
        folder = Path(run_dir) / f"global_step_{step}"
        rels = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
            entries = list(pool.map(partial(upload_file, store, folder, prefix), rels))
        manifest = {"global_step": step, "uri": store.uri(prefix), "source": "verl", "files": entries,
                    **(metadata or {})}
        store.write_json(f"{prefix}/{MANIFEST}", manifest)  # the commit point
        settle_latest(store, stage_root)  # the pointer, as the native trainer's: never back to an older step
        done.append(step)
    if done:
        prune_checkpoints(store, stage_root, keep=keep, newest=done[-1])
    return done


def upload_file(store: Store, folder: Path, prefix: str, rel: str) -> dict[str, Any]:
    """One file `folder/rel` to `prefix/rel`, returned as its manifest entry (path, sha256, bytes): the store's parallel multipart upload (Store.put_file: boto3's managed transfer on S3,
    bench/verl_launcher.py) while its sha256 is computed beside it (a committed verl step does not change)."""
    path = folder / rel
    with ThreadPoolExecutor(1) as hasher:
        digest = hasher.submit(file_digest, path)
        store.put_file(path, f"{prefix}/{rel}")
        size, sha256 = digest.result()
    return {"path": rel, "sha256": sha256, "bytes": size}


def prepare_resume(run_dir: str | Path, store: Store, stage_root: str) -> int | None:
    """Make `run_dir` resumable by verl's resume_mode=auto; returns the step it will resume from
    (None: a fresh start). See the module docstring."""
    run_dir = Path(run_dir)
    latest = local_latest(run_dir)
    if latest is not None and (run_dir / f"global_step_{latest}").is_dir():
        return latest
    mirrored = newest_committed_step(store, stage_root)  # mirrored and committed (manifest present)
    if mirrored is not None:
        restore(store, stage_root, mirrored, run_dir)
        return mirrored
    stranded = local_steps(run_dir)
    if stranded:
        raise CheckpointError(
            f"{run_dir} holds global_step_{stranded[-1]} but no usable {LATEST} (verl #7952: an async save never "
            f"writes it), and the store has no mirrored checkpoint of this stage ({store.uri(stage_root)}): "
            "resume_mode=auto would silently restart from step 0. Write the step into "
            f"{run_dir / LATEST} if that folder is complete, or remove the folders to start over")
    return None


def restore(store: Store, stage_root: str, step: int, run_dir: str | Path) -> Path:
    """Download mirrored step `step` into run_dir/global_step_{step} (each file checked against the
    manifest's sha256), then point verl's latest file at it."""
    run_dir = Path(run_dir)
    prefix = checkpoint_prefix(stage_root, step)
    manifest = store.read_json(f"{prefix}/{MANIFEST}")
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"global_step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".global_step_{step}.tmp-", dir=run_dir))
    try:
        for entry in manifest["files"]:
            target = tmp / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            with store.open_read(f"{prefix}/{entry['path']}") as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            if file_digest(target)[1] != entry["sha256"]:
                raise CheckpointError(f"{store.uri(prefix)}/{entry['path']} does not match its manifest sha256; "
                                      "the mirrored checkpoint is corrupt: resume from an earlier one")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    latest_tmp = run_dir / f".{LATEST}.tmp"
    latest_tmp.write_text(f"{step}\n")
    os.replace(latest_tmp, run_dir / LATEST)
    return final
