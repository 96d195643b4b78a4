"""Stage kinds `rl` (GRPO/GSPO, DPO/MPO, FlowGRPO) and `sft` (supervised fine-tuning): an algorithm
(omni_core.training.algorithms) on a dataset version, on Ray, ending in a checkpoint.

`model: {from: STAGE}` starts from the final checkpoint of an upstream rl or sft stage: its weights
digest is part of this stage's cache key and run key, and the stage's MLflow run is tagged with the
upstream checkpoint and logged model (`omni.model_from.*`), which `omni lineage` follows.

Cache inputs: the seed, the dataset version it trains on (from an ancestor ingest stage, else the
store's LATEST, fixed when the key is computed), the digests of images built upstream, and the bytes
of a custom reward file (`path.py:function`). The training itself is also keyed (`rl_run_key`): a
stage whose cache key changed for a reason that does not touch the weights finds its checkpoint
committed and trains nothing. A retried or re-run stage keeps its keys, so its latest checkpoint is
where a resumed training picks up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.backends import TrainingRun
from omni_core.config import RLStage
from omni_core.config.backends import DEFAULT_BACKEND, backend_name, backend_of
from omni_core.config.models import ModelFrom
from omni_core.data import DatasetVersion, load_version
from omni_core.errors import ConfigError
from omni_core.lineage import log_dataset_version
from omni_core.lineage.models import checkpoint_models
from omni_core.lineage.training import log_training_result, log_training_start
from omni_core.pipeline.report import curve_png
from omni_core.pipeline.stages import register_stage
from omni_core.pipeline.stages.build_images import upstream_images
from omni_core.rewards.registry import custom_reward_file
from omni_core.storage import file_sha256

REWARD_METRICS = ("critic/score/mean", "actor/reward_margin", "actor/reward_accuracy")  # first one found

def data_split(stage: RLStage) -> tuple[str, str]:
    key, _, split = stage.data.partition(":")
    return key, split or "train"


def dataset_for(ctx: Any, key: str) -> DatasetVersion:
    """The version the nearest ancestor stage produced, else the store's LATEST."""
    for outcome in reversed(list(ctx.upstream.values())):
        produced = outcome.outputs.get("datasets", {}).get(key)
        if produced:
            return load_version(ctx.store, key, produced["version"])
    return load_version(ctx.store, key)


def input_dataset(ctx: Any) -> tuple[str, str, DatasetVersion]:
    """(dataset key, split, version) of the stage's `dataset` input, the split checked to exist."""
    key, split = ctx.inputs["dataset"]["name"], ctx.inputs["dataset"]["split"]
    dv = load_version(ctx.store, key, ctx.inputs["dataset"]["version"])
    if split not in dv.manifest["splits"]:
        raise ConfigError(f"stages.{ctx.stage.name}.data: dataset '{key}' has no split '{split}' "
                          f"(has: {', '.join(dv.manifest['splits'])}); use {key}:SPLIT")
    return key, split, dv


def reward_file(stage: RLStage) -> Path | None:
    """The file of a custom `path.py:function` reward the algorithm uses, if any."""
    if "reward" not in stage.model_dump(mode="json"):
        return None
    return custom_reward_file(stage.reward.name)


def resolved_stage(ctx: Any) -> RLStage:
    """The stage with `model: {from: STAGE}` resolved to that stage's final checkpoint (URI and weights
    digest); the stage itself otherwise."""
    stage: RLStage = ctx.stage
    if isinstance(stage.model, str):
        return stage
    name = stage.model.from_
    if name not in ctx.upstream:
        raise ConfigError(f"stages.{stage.name}.model.from: '{name}' is not an upstream stage of {stage.name}; "
                          f"add it to {stage.name}'s after: list")
    trained = ctx.upstream[name].outputs
    return stage.model_copy(update={"model": ModelFrom(from_=name, weights_sha256=trained["weights_sha256"],
                                                       uri=trained["checkpoint_uri"])})


def rl_inputs(ctx: Any) -> dict[str, Any]:
    key, split = data_split(ctx.stage)
    dv = dataset_for(ctx, key)
    inputs: dict[str, Any] = {
        "seed": ctx.config.seed, "dataset": {"name": key, "version": dv.version, "split": split},
        "images": {t: i.get("digest") or i["tag"] for t, i in upstream_images(ctx).items()}}
    if not isinstance(ctx.stage.model, str):
        model = resolved_stage(ctx).model
        inputs["model"] = {"from": model.from_, "weights_sha256": model.weights_sha256}
    if (path := reward_file(ctx.stage)) is not None:
        inputs["reward_file_sha256"] = file_sha256(path)
    from omni_core.training.ray_stage import backend_files_sha256

    if files := backend_files_sha256(ctx.stage):
        inputs["backend_files_sha256"] = files
    return inputs


def weights(outputs: dict[str, Any]) -> dict[str, Any]:
    return {"weights_sha256": outputs["weights_sha256"], "global_step": outputs["global_step"]}


def checkpoint_committed(ctx: Any, outputs: dict[str, Any]) -> bool:
    from omni_core.training.checkpoint import MANIFEST, checkpoint_prefix, stage_prefix

    root = stage_prefix(ctx.config.name, outputs["run_key"], ctx.stage.name)
    return ctx.store.exists(f"{checkpoint_prefix(root, outputs['global_step'])}/{MANIFEST}")


def model_from_tags(ctx: Any) -> None:
    """Where a `model: {from: STAGE}` stage started: the upstream checkpoint and its logged model."""
    if isinstance(ctx.stage.model, str):
        return
    name = ctx.stage.model.from_
    trained = ctx.upstream[name].outputs
    ctx.tracker.set_tags(ctx.mlflow_run_id, {
        "omni.model_from.stage": name, "omni.model_from.checkpoint_uri": trained["checkpoint_uri"],
        "omni.model_from.checkpoint_sha256": trained["weights_sha256"],
        "omni.model_from.model_id": trained.get("model_id") or ""})


def image_tags(ctx: Any) -> None:
    for target, image in upstream_images(ctx).items():  # the images this pipeline built for its stages
        ctx.tracker.set_tags(ctx.mlflow_run_id, {f"omni.image.{target}.ref": image["pinned_ref"],
                                                 f"omni.image.{target}.digest": image["digest"] or ""})


def lineage_tags(ctx: Any, outputs: dict[str, Any]) -> None:
    image_tags(ctx)
    model_from_tags(ctx)
    ctx.tracker.set_tags(ctx.mlflow_run_id, {
        "omni.run_key": outputs["run_key"], "omni.checkpoint_uri": outputs["checkpoint_uri"],
        "omni.checkpoint_sha256": outputs["weights_sha256"], "omni.cache_hit": str(outputs["reused"]).lower()})


def log_reused(ctx: Any, record: Any) -> None:
    dataset = ctx.inputs["dataset"]
    log_dataset_version(ctx.tracker, ctx.mlflow_run_id, load_version(ctx.store, dataset["name"], dataset["version"]),
                        context="training")
    lineage_tags(ctx, {**record.outputs, "reused": True})


def training_run(ctx: Any, run_key: str) -> str | None:
    """The MLflow run that trained the checkpoint of `run_key` (when this stage found it committed)."""
    experiment = ctx.tracker.experiment_id(ctx.config.name)
    runs = ctx.tracker.client.search_runs(
        [experiment], f"tags.`omni.run_key` = '{run_key}' and tags.`omni.cache_hit` = 'false'",
        max_results=1, order_by=["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None


def save_reward_curve(ctx: Any, run_id: str | None) -> dict[str, Any] | None:
    """The reward per step of the training run as a PNG beside the stage's record, and its points."""
    for metric in REWARD_METRICS if run_id else ():
        history = ctx.tracker.client.get_metric_history(run_id, metric)
        if history:
            points = sorted({m.step: m.value for m in history}.items())
            key = ctx.file_key("reward_curve.png")
            ctx.store.write_bytes(key, curve_png(points, metric, f"{ctx.config.name}: {ctx.stage.name}"))
            return {"metric": metric, "points": [[s, v] for s, v in points], "key": key, "uri": ctx.store.uri(key),
                    "mlflow_run_id": run_id}
    return None


def run_rl(ctx: Any) -> dict[str, Any]:
    """Train the stage on its backend (omni_core.backends: native, verl, verl_omni, or a plugin's), then
    the same outputs, tags, logged model and reward curve whichever backend trained it."""
    from omni_core.training import rl_run_key

    stage = resolved_stage(ctx)
    key, split, dv = input_dataset(ctx)
    log_training_start(ctx.tracker, ctx.mlflow_run_id, stage, ctx.config.seed, dv, split)
    run_key = rl_run_key(stage, ctx.config.seed, dv.version)
    if ctx.force and stage.checkpoint.resume_mode == "auto":
        # train again on purpose: from step 0, not from the committed checkpoints (which stay: a registered
        # model may point at them; the new ones, of the same run key, replace them step by step)
        ctx.progress(f"stage {stage.name}: --force: training again from step 0 (checkpoint.resume_mode: disable)")
        stage = stage.model_copy(update={"checkpoint": stage.checkpoint.model_copy(update={"resume_mode": "disable"})})
    total = stage.trainer.total_steps
    ctx.on_step(0, total)
    result = backend_of(stage).run(TrainingRun(ctx, stage, key, split, dv, run_key))
    ctx.on_step(total, total)
    outputs = {"run_key": result.run_key, "global_step": result.global_step, "checkpoint_uri": result.checkpoint_uri,
               "weights_sha256": result.weights_sha256, "dataset_version": dv.version,
               "final_metrics": result.final_metrics, "reused": result.reused}
    if (name := backend_name(stage.backend)) != DEFAULT_BACKEND:
        outputs["backend"] = name
    image_tags(ctx)
    model_from_tags(ctx)
    outputs["model_id"] = log_training_result(
        ctx.tracker, ctx.mlflow_run_id, pipeline=ctx.config.name, experiment=ctx.config.name, stage=stage,
        seed=ctx.config.seed, dataset=f"{key}@{dv.version}:{split}", result=result)
    if result.reused:  # its logged model is the one the run that trained it logged
        found = checkpoint_models(ctx.tracker, ctx.config.name, result.run_key)
        outputs["model_id"] = found[0].model_id if found else None
    curve = save_reward_curve(ctx, training_run(ctx, result.run_key) if result.reused else ctx.mlflow_run_id)
    if curve:
        ctx.report["reward_curve"] = curve
    return outputs


def backend_retries(stage: Any) -> tuple[int, list[float]] | None:
    """How the stage's backend has a failed try retried (a job backend: resubmitted, resuming from the
    mirrored checkpoint); None: the kind's own retries (the native trainer restarts its actors itself)."""
    return backend_of(stage).retries(stage)


for _kind in ("rl", "sft"):  # one runner; the algorithm record decides what trains
    register_stage(_kind, version="1", retries=1, retry_delay_s=5.0, inputs=rl_inputs, digest=weights,
                   verify=checkpoint_committed, reuse=log_reused, reads=lambda stage: [data_split(stage)[0]],
                   volatile_config=frozenset({"num_cpus"}), retry_plan=backend_retries)(run_rl)
