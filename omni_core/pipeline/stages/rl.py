"""Stage kind `rl`: GRPO/GSPO on a dataset version, inside a Ray actor, ending in a checkpoint."""

from __future__ import annotations

from typing import Any

from omni_core.config import RLStage
from omni_core.data import DatasetVersion, load_version
from omni_core.errors import ConfigError
from omni_core.lineage import log_dataset_version
from omni_core.pipeline.stages import register_stage
from omni_core.pipeline.stages.build_images import upstream_images
from omni_core.training import run_rl_stage


def dataset_for(run: Any, key: str) -> DatasetVersion:
    """The version an upstream ingest stage produced in this run, else the store's LATEST."""
    for outcome in run.outcomes.values():
        produced = outcome.outputs.get("datasets", {}).get(key)
        if produced:
            return load_version(run.store, key, produced["version"])
    return load_version(run.store, key)


@register_stage("rl")
def run_rl(run: Any, stage: RLStage, mlflow_run_id: str) -> dict[str, Any]:
    key, _, split = stage.data.partition(":")
    split = split or "train"
    dv = dataset_for(run, key)
    if split not in dv.manifest["splits"]:
        raise ConfigError(f"stages.{stage.name}.data: dataset '{key}' has no split '{split}' "
                          f"(has: {', '.join(dv.manifest['splits'])})")
    log_dataset_version(run.tracker, mlflow_run_id, dv, context="training")
    run.tracker.log_params(mlflow_run_id, {
        "algorithm": stage.algorithm.name, "model": stage.model, "seed": run.config.seed,
        "dataset": f"{key}@{dv.version}:{split}", "rollout.n": stage.rollout.n,
        "trainer.total_steps": stage.trainer.total_steps, "trainer.batch_size": stage.trainer.batch_size,
        "trainer.lr": stage.trainer.lr, "reward": stage.reward.name,
    })
    result = run_rl_stage(
        pipeline=run.config.name, stage=stage, seed=run.config.seed, store=run.store,
        shard_keys=dv.shard_keys(split), dataset_version=dv.version, ray_config=run.config.ray,
        tracking_uri=run.tracker.tracking_uri, mlflow_run_id=mlflow_run_id, progress=run.progress,
    )
    for target, image in upstream_images(run).items():  # the images this pipeline built for its stages
        run.tracker.set_tags(mlflow_run_id, {f"omni.image.{target}.ref": image["pinned_ref"],
                                             f"omni.image.{target}.digest": image["digest"] or ""})
    run.tracker.set_tags(mlflow_run_id, {"omni.run_key": result.run_key, "omni.checkpoint_uri": result.checkpoint_uri,
                                         "omni.checkpoint_sha256": result.weights_sha256,
                                         "omni.cache_hit": str(result.reused).lower()})
    return {"run_key": result.run_key, "global_step": result.global_step, "checkpoint_uri": result.checkpoint_uri,
            "weights_sha256": result.weights_sha256, "dataset_version": dv.version,
            "final_metrics": result.final_metrics, "reused": result.reused}
