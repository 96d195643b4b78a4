"""What a training stage records in its MLflow run, whichever process runs it (a pipeline's stage
task or a submitted Ray Job): the dataset input and key params at the start; the run key, the
checkpoint and its logged model at the end."""

from __future__ import annotations

from typing import Any

from omni_core.lineage.datasets import log_dataset_version
from omni_core.lineage.models import log_checkpoint_model
from omni_core.lineage.tracking import Tracker


def model_label(stage: Any) -> str:
    """The starting model as a param: its URI, or `from STAGE (sha256 PREFIX)` for an upstream checkpoint."""
    model = stage.model
    if isinstance(model, str):
        return model
    return f"from {model.from_}" + (f" (sha256 {model.weights_sha256[:16]})" if model.weights_sha256 else "")


def log_training_start(tracker: Tracker, run_id: str, stage: Any, seed: int, dv: Any, split: str) -> None:
    log_dataset_version(tracker, run_id, dv, context="training")
    params: dict[str, Any] = {
        "algorithm": stage.algorithm.name, "model": model_label(stage), "seed": seed,
        "dataset": f"{dv.name}@{dv.version}:{split}", "rollout.n": stage.rollout.n,
        "trainer.total_steps": stage.trainer.total_steps, "trainer.batch_size": stage.trainer.batch_size,
        "trainer.lr": stage.trainer.lr, "reward": stage.reward.name,
    }
    record = stage.record  # only the keys the algorithm reads (sft: no rollout, no reward)
    reads = {"rollout.n": record.reads("rollout", "n"), "reward": record.reads("reward", "name")}
    tracker.log_params(run_id, {k: v for k, v in params.items() if reads.get(k, True)})


def log_training_result(tracker: Tracker, run_id: str, *, pipeline: str, experiment: str, stage: Any, seed: int,
                        dataset: str, result: Any) -> str | None:
    """Tags the run with the run key and checkpoint; logs a newly trained checkpoint as a logged
    model (returns its id; None for a reused checkpoint, whose model the run that trained it logged)."""
    tracker.set_tags(run_id, {"omni.run_key": result.run_key, "omni.checkpoint_uri": result.checkpoint_uri,
                              "omni.checkpoint_sha256": result.weights_sha256,
                              "omni.cache_hit": str(result.reused).lower()})
    if result.reused:
        return None
    return log_checkpoint_model(
        tracker, run_id, experiment, name=f"{pipeline}-{stage.name}", checkpoint_uri=result.checkpoint_uri,
        weights_sha256=result.weights_sha256, global_step=result.global_step, run_key=result.run_key,
        params={"algorithm": stage.algorithm.name, "model": model_label(stage), "dataset": dataset, "seed": seed})
