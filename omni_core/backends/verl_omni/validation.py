"""An eval stage with `engine: trainer` on a `backend: verl_omni` stage (omni_core.backends.jobs.validation):
the recipe's own command, as the stage trained it, with

- `trainer.val_before_train=True trainer.val_only=True`, `trainer.resume_mode=resume_path` and
  `trainer.resume_from_path` = the recipe's final `global_step_N` on the shared path (put back from the
  store's mirror when the shared path lost it): every VeRL-Omni trainer loads it, syncs the weights to
  its rollout, validates and exits (main_omni GSPO and DPO, main_diffusion v0 and v1);
- the eval split (exported in the recipe's layout) as `data.val_files`, `data.val_max_samples` = `max_rows`,
  `trainer.log_val_generations` = `samples`;
- the recipe's own `val_kwargs` (n, temperature, top_p; a diffusion recipe's steps and noise level), so the
  eval reports what the recipe's published runs report; only sampling keys set on the eval stage (`n`,
  `greedy`, `temperature`, `top_p`) replace them.

A DPO recipe's validation scores held-out pairs (`val/dpo_loss`, `val/reward_accuracy`, ...; no `val-core`):
its eval has no `val/reward_mean`, so its register stage names one of those (e.g. `metric:
val/reward_accuracy`). The entry points need GPUs (or NPUs) and vLLM-Omni: here it runs up to the job's start.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from omni_core.backends.jobs import mirror
from omni_core.backends.jobs.export import planned_model_path
from omni_core.backends.jobs.job import describe_env
from omni_core.backends.jobs.runner import PreparedJob
from omni_core.backends.jobs.validation import (
    VAL_ONLY,
    job_eval_problem,
    run_validation_job,
    val_kwargs,
    with_overrides,
)
from omni_core.backends.verl_omni.render import RecipeCommand, _fmt
from omni_core.backends.verl_omni.stage import (
    CHECKPOINTS,
    METRICS,
    job_env,
    layout,
    model_for,
    paths_for,
    recipe_command,
)
from omni_core.training.checkpoint import stage_prefix

SAMPLING_KEYS = frozenset({"n", "greedy", "temperature", "top_p"})


def validation_problem(eval_stage: Any, trained: Any) -> str | None:
    where = f"stages.{eval_stage.name}"
    if problem := job_eval_problem(eval_stage):
        return problem
    if eval_stage.reward is not None:
        return f"{where}.reward: a recipe's validation scores with the recipe's own reward; remove it"
    return None


def checkpoint_dir(trained: Any, pipeline: str, run_key: str) -> Path:
    return trained.backend.run_dir(pipeline, run_key, trained.name) / CHECKPOINTS


def validation_command(eval_stage: Any, trained: Any, *, pipeline: str, run_key: str, step: int | str, model: str,
                       train_files: list[str], val_files: list[str]) -> RecipeCommand:
    """The recipe's val-only command (module docstring)."""
    cmd = recipe_command(trained, paths_for(trained, pipeline=pipeline, run_key=run_key, model=model,
                                            train_files=train_files, val_files=val_files))
    values: dict[str, Any] = {
        **VAL_ONLY, "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": str(checkpoint_dir(trained, pipeline, run_key) / f"global_step_{step}"),
        "trainer.log_val_generations": eval_stage.samples}
    if eval_stage.model_fields_set & SAMPLING_KEYS:
        values.update(val_kwargs(eval_stage))
    if eval_stage.max_rows is not None:
        values["data.val_max_samples"] = eval_stage.max_rows
    return replace(cmd, overrides=with_overrides(cmd.overrides, {k: _fmt(v) for k, v in values.items()}))


def prepare(validation: Any) -> PreparedJob:
    from omni_core.backends.verl_omni.runner import _inputs

    ctx, trained, outputs = validation.ctx, validation.trained, validation.outputs
    train, val, model = _inputs(trained, ctx.store, validation.dataset, validation.version.version,
                                validation.split, ctx.config.seed)
    step = outputs["global_step"]
    folder = checkpoint_dir(trained, ctx.config.name, outputs["run_key"])
    if not (folder / f"global_step_{step}").is_dir():  # a new cluster: the store's mirror has it
        mirror.restore(ctx.store, stage_prefix(ctx.config.name, outputs["run_key"], trained.name), step, folder)
    cmd = validation_command(ctx.stage, trained, pipeline=ctx.config.name, run_key=outputs["run_key"], step=step,
                             model=model, train_files=train, val_files=train if validation.split == "train" else val)
    return PreparedJob(command=cmd, env=job_env(cmd), metrics_dir=folder.parent / METRICS,
                       resources=dict(trained.backend.entrypoint_resources or {}), checkpoints=folder,
                       announce=f"VeRL-Omni recipe {cmd.recipe} as Ray Job", tags={},
                       record={"entrypoint": cmd.entrypoint, "argv": cmd.argv, "overrides": cmd.overrides,
                               "env": cmd.env}, model=model)


def validate(validation: Any) -> dict[str, Any]:
    return run_validation_job(validation, prepare(validation), "VeRL-Omni")


def plan_validation(eval_stage: Any, trained: Any, config: Any) -> dict[str, Any]:
    dataset, _, split = eval_stage.data.partition(":")
    layout_name = layout(trained, config.datasets[dataset].converter)
    folder = Path(trained.backend.shared_dir) / "datasets" / dataset / "<version>" / f"verl_omni-{layout_name}"
    files = [str(folder / f"{split or 'test'}.parquet")]
    model_uri = model_for(trained)
    model = planned_model_path(model_uri, trained.backend.shared_dir, config.seed) if "<" not in model_uri else model_uri
    cmd = validation_command(eval_stage, trained, pipeline=config.name, run_key="<run_key>", step="<N>",
                             model=model, train_files=files, val_files=files)
    env = job_env(cmd, metrics_file=f"<{METRICS} folder of the trained stage's run>/<submission id>.jsonl")
    return {"backend": "verl_omni",
            "does": f"validates the final checkpoint of {trained.name} with its recipe's own trainer "
                    f"(trainer.val_only=True) as a Ray Job on {config.ray.address} on {eval_stage.data}",
            "entrypoint": cmd.entrypoint, "overrides": cmd.overrides, "runtime_env": describe_env(env),
            "stages": {"dataset": {"from": f"{dataset}@<version>:{split or 'test'}", "to": str(folder),
                                   "files": files, "layout": layout_name},
                       "model": {"from": f"<checkpoint of {trained.name}>",
                                 "to": str(checkpoint_dir(trained, config.name, "<run_key>") / "global_step_<N>")}}}
