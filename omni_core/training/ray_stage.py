"""The RL stage on Ray: a trainer actor runs the stage's algorithm (GRPO/GSPO, DPO/MPO, FlowGRPO; see
`stage_trainers`), logs metrics and writes the checkpoint.

The driver (a Prefect task, a notebook, a Ray Job) calls `run_rl_stage`; everything the actor needs
travels as plain data (store URI, dataset version, MLflow run id), so it can run on any Ray node.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq
import ray

import omni_core
from omni_core.config.models import RayConfig, RLStage
from omni_core.errors import DataError, OmniError
from omni_core.storage import Store
from omni_core.training.checkpoint import latest_checkpoint, save_checkpoint, stage_prefix


@dataclass(frozen=True)
class RLStageResult:
    run_key: str
    global_step: int
    checkpoint_uri: str
    weights_sha256: str
    final_metrics: dict[str, float]
    reused: bool


def rl_run_key(stage: RLStage, seed: int, dataset_version: str) -> str:
    """Digest of everything that determines the trained weights."""
    payload = {"stage": stage.model_dump(mode="json", exclude={"name", "after"}), "seed": seed,
               "dataset_version": dataset_version, "code_version": omni_core.__version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def ensure_ray(cfg: RayConfig) -> None:
    if ray.is_initialized():
        return
    try:
        if cfg.address == "local":
            ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, logging_level=logging.WARNING)
        else:
            ray.init(address=cfg.address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise OmniError(f"ray.address {cfg.address}: cannot connect ({exc}); start the cluster or use "
                        "ray.address=local") from exc


def read_split(store: Store, shard_keys: list[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for key in shard_keys:
        with store.open_read(key) as f:
            rows.extend(pq.read_table(f).to_pylist())
    return rows


def _weights_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the trained weights: the manifest's `weights` file, else (older manifests) the first
    .safetensors file."""
    path = manifest.get("weights")
    return next((f["sha256"] for f in manifest["files"]
                 if (f["path"] == path if path else f["path"].endswith(".safetensors"))), "")


@ray.remote
class RLTrainerActor:
    """Holds the model and optimizer; runs every step of the stage and writes the checkpoint."""

    def run(self, *, pipeline: str, stage_json: dict, seed: int, store_root: str, shard_keys: list[str],
            dataset_version: str, run_key: str, tracking_uri: str, mlflow_run_id: str) -> dict[str, Any]:
        from transformers.utils import logging as hf_logging

        from omni_core.lineage import Tracker
        from omni_core.training.stage_trainers import build_stage_trainer

        hf_logging.disable_progress_bar()  # per-file load/save bars drown the per-step progress lines

        stage = RLStage.model_validate(stage_json)
        store = Store(store_root)
        rows = read_split(store, shard_keys)
        if not rows:
            raise DataError(f"stage {stage.name}: dataset split {stage.data} has no rows; check the ingest quarantine")
        trainer = build_stage_trainer(stage, rows, seed)
        tracker = Tracker(tracking_uri)
        total = stage.trainer.total_steps
        metrics: dict[str, float] = {}
        for _ in range(total):
            metrics = trainer.step()
            step = trainer.global_step
            tracker.log_metrics(mlflow_run_id, metrics, step=step, timestamp_ms=int(time.time() * 1000))
            print(f"[{stage.name}] step {step}/{total}  {trainer.progress(metrics)}", flush=True)
        root = stage_prefix(pipeline, run_key, stage.name)
        manifest = save_checkpoint(store, root, trainer.global_step, trainer.model, trainer.text_io, {
            "run_key": run_key, "stage": stage.name, "seed": seed, "dataset_version": dataset_version,
            "model": stage.model, "algorithm": stage.algorithm.name, "final_metrics": metrics,
        })
        return {"manifest": manifest, "metrics": metrics}


def run_rl_stage(*, pipeline: str, stage: RLStage, seed: int, store: Store, shard_keys: list[str],
                 dataset_version: str, ray_config: RayConfig, tracking_uri: str, mlflow_run_id: str,
                 progress: Callable[[str], None] = print) -> RLStageResult:
    run_key = rl_run_key(stage, seed, dataset_version)
    existing = latest_checkpoint(store, stage_prefix(pipeline, run_key, stage.name))
    if existing is not None and existing["global_step"] >= stage.trainer.total_steps:
        progress(f"stage {stage.name}: checkpoint for run key {run_key} already committed; nothing to do")
        return RLStageResult(run_key, existing["global_step"], existing["uri"], _weights_digest(existing),
                             existing.get("final_metrics", {}), reused=True)
    ensure_ray(ray_config)
    progress(f"stage {stage.name}: training {stage.trainer.total_steps} step(s) in a Ray actor (run key {run_key})")
    actor = RLTrainerActor.options(num_cpus=stage.num_cpus).remote()
    try:
        out = ray.get(actor.run.remote(
            pipeline=pipeline, stage_json=stage.model_dump(mode="json"), seed=seed, store_root=store.root,
            shard_keys=shard_keys, dataset_version=dataset_version, run_key=run_key,
            tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id,
        ))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, OmniError):  # a user-fixable error inside the actor: show it as such
            raise exc.cause from None
        raise
    finally:
        ray.kill(actor)
    manifest = out["manifest"]
    return RLStageResult(run_key, manifest["global_step"], manifest["uri"], _weights_digest(manifest),
                         out["metrics"], reused=False)

