"""An eval stage with `engine: trainer` on a `backend: verl` grpo / gspo stage (omni_core.backends.jobs.validation):
verl's main_ppo, rendered as the trained stage's own command (its rollout, reward and Hydra overrides,
`device: cpu` included), with

- `actor_rollout_ref.model.path` = the trained checkpoint (what our registry points at: the Hugging Face
  folder committed at the top of the final checkpoint), staged on the shared path, `resume_mode=disable`;
- `data.train_files` = `data.val_files` = the eval split, exported (verl builds a train loader even for
  val_only); `data.val_max_samples` = `max_rows`, `data.max_response_length` = `max_new_tokens`;
- the eval's sampling as `val_kwargs` (greedy by default, which is verl's default too);
  `trainer.validation_data_dir` = run_dir/generations: verl dumps every validated row (input, output,
  ground truth, score) as JSON lines there, logged as the eval run's artifacts `verl/generations/`
  (`trainer.log_val_generations` = `samples` is what verl's own trackers would log);
- `trainer.val_before_train=True trainer.val_only=True`, replacing any of these keys in `backend.overrides`;
- checkpoints folder: shared_dir/runs/{pipeline}/{eval run}/{eval stage} (nothing is saved there).

verl's sft_trainer validates by loss only (no generation, no reward): an sft checkpoint is scored with
`engine: native`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from omni_core.backends.jobs import export
from omni_core.backends.jobs.job import describe_env, runtime_env
from omni_core.backends.jobs.runner import PreparedJob
from omni_core.backends.jobs.validation import (
    VAL_ONLY,
    job_eval_problem,
    run_validation_job,
    val_kwargs,
    with_overrides,
)
from omni_core.backends.verl.render import VerlCommand, hydra_value, render
from omni_core.backends.verl.runner import (
    entrypoint_resources,
    metrics_dir,
    require_verl_on_nodes,
    stage_reward_file,
)
from omni_core.backends.verl.stage import training
from omni_core.errors import ConfigError


def validation_problem(eval_stage: Any, trained: Any) -> str | None:
    where = f"stages.{eval_stage.name}"
    if trained.algorithm.name == "sft":
        return (f"{where}.engine: trainer: stage '{trained.name}' runs verl's sft_trainer, whose validation is a "
                "loss on held-out messages (no generation, no reward); use engine: native")
    if problem := job_eval_problem(eval_stage):
        return problem
    if eval_stage.reward is not None and eval_stage.reward.name != trained.reward.name:
        return (f"{where}.reward: verl's validation scores with the trained stage's reward "
                f"({trained.reward.name}); remove it, or use engine: native")
    return None


def validation_command(eval_stage: Any, trained: Any, *, pipeline: str, key: str, model: str,
                       files: list[str], seed: int) -> VerlCommand:
    """The val-only command (module docstring); `key` names its folder on the shared path."""
    backend = trained.backend
    try:
        cmd = render(training(trained, model=model, train_files=files, val_files=files, seed=seed, pipeline=pipeline),
                     backend.for_job(), backend.run_dir(pipeline, key, eval_stage.name))
    except ConfigError as exc:
        raise ConfigError(f"stages.{trained.name}.{exc}") from None
    values: dict[str, Any] = {"trainer.resume_mode": "disable", "data.max_response_length": eval_stage.max_new_tokens,
                              "trainer.log_val_generations": eval_stage.samples,
                              "trainer.validation_data_dir": str(generations_dir(backend.run_dir(pipeline, key, eval_stage.name))),
                              **val_kwargs(eval_stage), **VAL_ONLY}
    if eval_stage.max_rows is not None:
        values["data.val_max_samples"] = eval_stage.max_rows
    overrides = with_overrides(cmd.overrides, {k: hydra_value(v) for k, v in values.items()})
    return replace(cmd, argv=cmd.argv[:len(cmd.argv) - len(cmd.overrides)] + overrides, overrides=overrides)


def prepare(validation: Any) -> PreparedJob:
    ctx, trained = validation.ctx, validation.trained
    backend = trained.backend
    exported = export.export_dataset(ctx.store, validation.dataset, validation.version.version, backend.shared_dir, "rl")
    if validation.split not in exported.files:
        raise ConfigError(f"stages.{ctx.stage.name}.data: dataset {validation.dataset}@{validation.version.version} "
                          f"has no split {validation.split!r}")
    model = export.stage_model(validation.outputs["checkpoint_uri"], backend.shared_dir, seed=ctx.config.seed)
    stage_reward_file(trained)
    cmd = validation_command(ctx.stage, trained, pipeline=ctx.config.name, key=ctx.mlflow_run_id[:16], model=model,
                             files=exported.files[validation.split], seed=ctx.config.seed)
    resources = dict(backend.entrypoint_resources) if backend.entrypoint_resources is not None \
        else entrypoint_resources(cmd, backend.n_gpus_per_node, backend.device)
    return PreparedJob(command=cmd, env=runtime_env(cmd), resources=resources, checkpoints=Path(cmd.default_local_dir),
                       announce="Ray Job", tags={},
                       record={"entrypoint": cmd.entrypoint, "argv": cmd.argv, "overrides": cmd.overrides},
                       model=model, metrics_dir=metrics_dir(cmd))


def generations_dir(run_dir: Path) -> Path:
    return run_dir / "generations"


def validate(validation: Any) -> dict[str, Any]:
    prepared = prepare(validation)
    ctx = validation.ctx

    def probe(client: Any) -> None:
        require_verl_on_nodes(client, validation.trained, prepared.command.argv[0], ctx.config.ray.address)  # type: ignore[attr-defined]

    result = run_validation_job(validation, prepared, "verl", before_submit=probe)
    dumped = generations_dir(prepared.checkpoints)
    if dumped.is_dir() and any(dumped.iterdir()):
        ctx.tracker.client.log_artifacts(ctx.mlflow_run_id, str(dumped), "verl/generations")
    return result


def placeholder_command(eval_stage: Any, trained: Any, pipeline: str, seed: int) -> VerlCommand:
    """The val-only command with placeholders for what is known only when it runs (precheck, plan)."""
    data = Path(trained.backend.shared_dir) / "datasets" / "DATASET" / "VERSION" / "test-00000.parquet"
    return validation_command(eval_stage, trained, pipeline=pipeline, key="EVAL_RUN", model="MODEL",
                              files=[str(data)], seed=seed)


def plan_validation(eval_stage: Any, trained: Any, config: Any) -> dict[str, Any]:
    backend = trained.backend
    dataset, _, split = eval_stage.data.partition(":")
    split = split or "test"
    model_uri = f"<checkpoint of {trained.name}>"
    folder = Path(backend.shared_dir) / "datasets" / dataset / "<version>" / "rl"
    files = [str(folder / f"{split}-00000.parquet")]
    cmd = validation_command(eval_stage, trained, pipeline=config.name, key="<eval run>", model=model_uri,
                             files=files, seed=config.seed)
    env = runtime_env(cmd, metrics_file=Path(cmd.default_local_dir) / "metrics" / "<submission id>.jsonl")
    return {"backend": "verl", "does": f"validates the checkpoint of {trained.name} with verl's own trainer "
                                       f"(trainer.val_only=True) as a Ray Job on {config.ray.address} on {eval_stage.data}",
            "entrypoint": cmd.entrypoint, "overrides": cmd.overrides, "runtime_env": describe_env(env),
            "stages": {"dataset": {"from": f"{dataset}@<version>:{split}", "to": str(folder), "files": files,
                                   "layout": "rl"},
                       "model": {"from": model_uri, "to": model_uri}},
            "run_dir": cmd.default_local_dir}
