"""The RL stage on Ray: `run_rl_stage` is the driver's entry (a Prefect task, a notebook, a Ray Job
via `python -m omni_core.training`). It finds the stage's run key and checkpoints, reads the dataset
split and hands the training to `omni_core.training.runner.StageRunner` (rollout, reward and trainer
actors; sync or separate_async; checkpoints; restarts). Everything the actors need travels as plain
data, so they can run on any Ray node.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

import omni_core
from omni_core.config.models import (
    RUN_KEY_EXCLUDED,
    RUN_KEY_EXCLUDED_EXECUTION,
    RayConfig,
    RLStage,
)
from omni_core.data.ingest import read_rows
from omni_core.errors import DataError
from omni_core.media_limits import MediaLimits, check_rows
from omni_core.rewards.registry import custom_reward_file
from omni_core.storage import Store, file_sha256
from omni_core.training.checkpoint import latest_checkpoint, stage_prefix, weights_digest
from omni_core.training.ray_env import init_ray, is_local
from omni_core.training.runner import StageRun, StageRunner


@dataclass(frozen=True)
class RLStageResult:
    run_key: str
    global_step: int
    checkpoint_uri: str
    weights_sha256: str
    final_metrics: dict[str, float]
    reused: bool
    recoveries: int = 0


def run_key_payload(stage: RLStage, seed: int, dataset_version: str) -> dict[str, Any]:
    """What determines the trained weights: the stage without the keys that only change how it runs
    (`RUN_KEY_EXCLUDED`: resources, checkpoint cadence, restarts), the seed and the dataset version."""
    spec = stage.model_dump(mode="json", exclude=set(RUN_KEY_EXCLUDED))
    spec["execution"] = {k: v for k, v in spec["execution"].items() if k not in RUN_KEY_EXCLUDED_EXECUTION}
    if isinstance(spec.get("model"), dict):  # `model: {from: STAGE}`: the upstream weights' digest, not where they are
        spec["model"] = {k: v for k, v in spec["model"].items() if k != "uri"}
    if isinstance(spec.get("backend"), dict):  # the backend's rules: where it runs (interpreter, shared path, env) is out
        spec["backend"] = stage.backend.run_key_options(spec["backend"])
    payload = {"stage": spec, "seed": seed, "dataset_version": dataset_version}
    # the bytes of the files the training reads besides its data (a custom reward; a file named in the
    # backend's options), so an edited reward trains again; left out when there are none (keys stay)
    if (reward := custom_reward_file(stage.reward.name if "reward" in spec else None)) is not None:
        payload["reward_file_sha256"] = file_sha256(reward)
    if files := backend_files_sha256(stage):
        payload["backend_files_sha256"] = files
    return payload


def backend_files_sha256(stage: RLStage) -> dict[str, str]:
    """{path: sha256} of the files the stage's backend options name (`BackendOptions.input_files`)."""
    if isinstance(stage.backend, str):
        return {}
    return {path: file_sha256(path) for path in stage.backend.input_files()}


def rl_run_key(stage: RLStage, seed: int, dataset_version: str) -> str:
    """Digest of everything that determines the trained weights, and the code version."""
    payload = {**run_key_payload(stage, seed, dataset_version), "code_version": omni_core.__version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def config_digest(stage: RLStage, seed: int, dataset_version: str) -> str:
    """The digest a checkpoint records: resuming from one of another config is refused unless forced."""
    return hashlib.sha256(json.dumps(run_key_payload(stage, seed, dataset_version), sort_keys=True).encode()).hexdigest()


def ensure_ray(cfg: RayConfig) -> None:
    """A fresh local Ray, or the cluster with the runtime env the actors need (`ray_env.init_ray`)."""
    init_ray(cfg)


SUBMISSION_ENV = "OMNI_RAY_SUBMISSION_ID"  # `submit` sets it in the job's environment


def ray_tags(cfg: RayConfig) -> dict[str, str]:
    """The Ray job this process drives (and its submission id when it runs as a submitted Ray Job)."""
    tags = {"ray.job_id": ray.get_runtime_context().get_job_id(), "ray.address": cfg.address}
    if submission := os.environ.get(SUBMISSION_ENV):
        tags["ray.submission_id"] = submission
    return tags


read_split = read_rows  # the rows of a split's shards (`DatasetVersion.rows` reads a version's split)


def run_rl_stage(*, pipeline: str, stage: RLStage, seed: int, store: Store, shard_keys: list[str],
                 dataset_version: str, ray_config: RayConfig, tracking_uri: str | None, mlflow_run_id: str | None,
                 progress: Callable[[str], None] = print, media_limits: MediaLimits | None = None) -> RLStageResult:
    """Train `stage` on Ray (`StageRunner`), resuming from its latest committed checkpoint; a run key
    whose final checkpoint is committed trains nothing. Rows whose media is over `media_limits` (the
    dataset's; default: the defaults) are refused before any actor decodes them."""
    from omni_core.lineage import Tracker

    run_key = rl_run_key(stage, seed, dataset_version)
    existing = latest_checkpoint(store, stage_prefix(pipeline, run_key, stage.name))
    if (existing is not None and existing["global_step"] >= stage.trainer.total_steps
            and stage.checkpoint.resume_mode != "disable"):
        progress(f"stage {stage.name}: checkpoint for run key {run_key} already committed; nothing to do")
        return RLStageResult(run_key, existing["global_step"], existing["uri"], weights_digest(existing),
                             existing.get("final_metrics", {}), reused=True)
    rows = read_split(store, shard_keys)
    if not rows:
        raise DataError(f"stage {stage.name}: dataset split {stage.data} has no rows; check the ingest quarantine")
    check_rows(rows, media_limits or MediaLimits(), f"stage {stage.name}: dataset split {stage.data}")
    ensure_ray(ray_config)
    tracker = Tracker(tracking_uri) if tracking_uri else None
    if tracker is not None and mlflow_run_id:
        tracker.set_tags(mlflow_run_id, ray_tags(ray_config))
    ex = stage.execution
    progress(f"stage {stage.name}: training {stage.trainer.total_steps} step(s) on Ray, mode {ex.mode} "
             f"(run key {run_key})")
    runner = StageRunner(StageRun(
        pipeline=pipeline, stage=stage, seed=seed, store=store, rows=rows, dataset_version=dataset_version,
        run_key=run_key, config_digest=config_digest(stage, seed, dataset_version),
        tracker=tracker, mlflow_run_id=mlflow_run_id, progress=progress,
        local_ray=is_local(ray_config)))
    manifest = runner.run()
    return RLStageResult(run_key, manifest["global_step"], manifest["uri"], weights_digest(manifest),
                         manifest["metrics"], reused=False, recoveries=runner.recoveries)
