"""An `rl` stage with `backend: {name: verl_omni, ...}` -> the recipe options, the rendered command, the
checks `omni validate` runs, and the plan `omni plan` prints.

The stage's own keys map onto a recipe option where they mean the same thing (`STAGE_OPTIONS`: clip
ratios, rollout n, `max_num_seqs`, `step_execution`, `execution.mode` / `parameter_sync_step` /
`max_staleness` / `staleness_policy`, LoRA rank / alpha, steps, batch sizes, lr, checkpoint options);
only keys the file sets count (the algorithm's defaults for trainer keys do not: the recipe's values
stay). The same option may also be written in `backend:` (`omni recipes show` prints them there); both
with different values is an error. Anything else the file sets that the recipe cannot honour is a
ConfigError naming the stage key, as is an option the recipe's script has no key for (render.py), a
dataset whose converter the recipe cannot read (export.recipe_layout), and a stage algorithm that is
not the recipe's (`NATIVE_ALGORITHM`: the native algorithm the same stage trains with `backend:
native`; Flow-DPPO and DanceGRPO, which omni does not implement, map to flow_grpo, the native
diffusion RL algorithm).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.backends.jobs.export import planned_model_path
from omni_core.backends.jobs.job import command_digest, describe_env, runtime_env, submission_id
from omni_core.backends.jobs.metrics import metrics_file
from omni_core.backends.verl_omni.catalog import Recipe, get_recipe
from omni_core.backends.verl_omni.export import (
    LAYOUT_CONVERTERS,
    MODALITIES,
    RECIPE_LAYOUTS,
    TOKENIZED,
    recipe_layout,
)
from omni_core.backends.verl_omni.options import VerlOmniBackend
from omni_core.backends.verl_omni.render import RecipeCommand, RecipePaths, render_recipe, render_stage
from omni_core.errors import ConfigError

# stage key -> recipe option (render.OPTION_KEYS says which Hydra key each writes)
STAGE_OPTIONS = {
    "algorithm.clip_ratio_low": "clip_ratio_low", "algorithm.clip_ratio_high": "clip_ratio_high",
    "algorithm.clip_range": "clip_ratio",
    "rollout.n": "rollout_n", "rollout.max_num_seqs": "max_num_seqs", "rollout.step_execution": "step_execution",
    "execution.mode": "execution_mode", "execution.parameter_sync_step": "parameter_sync_step",
    "execution.max_staleness": "max_staleness", "execution.staleness_policy": "staleness_policy",
    "lora.rank": "lora_rank", "lora.alpha": "lora_alpha",
    "trainer.total_steps": "total_steps", "trainer.batch_size": "batch_size", "trainer.lr": "lr",
    "trainer.ppo_mini_batch_size": "ppo_mini_batch_size",
    "checkpoint.save_freq": "save_freq", "checkpoint.max_to_keep": "max_to_keep",
    "checkpoint.resume_mode": "resume_mode",
}
# keys the stage honours around the job itself (resubmissions), or checks against the recipe
AROUND_THE_JOB = frozenset({"algorithm.name", "reward.name", "execution.max_failures", "execution.retry_backoff_s"})
# the recipe's algorithm -> the stage's algorithm.name (what the same stage trains with backend: native)
NATIVE_ALGORITHM = {"gspo": "gspo", "dpo": "dpo", "flowgrpo": "flow_grpo", "flow-dppo": "flow_grpo",
                    "dancegrpo": "flow_grpo"}
# the recipe's dataset -> our reward of the same scoring (the recipe's own reward function scores it)
RECIPE_REWARD = {"gsm8k": "gsm8k", "mmk12": "mmk12", "avqa": "choice", "ocr": "ocr"}
NOT_FOR_RECIPES = {
    "adapter": "VeRL-Omni loads the model with its own classes",
    "adapter_stage": "VeRL-Omni loads the model with its own classes",
    "resources": "the recipe places its workers from backend.nnodes and backend.n_gpus_per_node",
    "num_cpus": "the recipe places its workers from backend.nnodes and backend.n_gpus_per_node",
}
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
GIVEN = "given"  # the recipe's data prepared by its own data_process script, named in backend.overrides
CHECKPOINTS = "checkpoints"  # trainer.default_local_dir = run_dir/checkpoints; the scripts' log folders in run_dir
METRICS = "metrics"  # run_dir/metrics: verl's file logger (omni_core.backends.jobs.metrics)


def recipe_of(stage: Any) -> Recipe | None:
    backend: VerlOmniBackend = stage.backend
    return get_recipe(backend.recipe) if backend.recipe else None


def recipe_options(stage: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(options for render, option -> the stage key it came from); ConfigError naming the stage key for
    a key the recipe cannot honour."""
    where = f"stages.{stage.name}"
    backend: VerlOmniBackend = stage.backend
    recipe = recipe_of(stage)
    for key, why in NOT_FOR_RECIPES.items():
        if key in stage.model_fields_set:
            raise ConfigError(f"{where}.{key}: not used by backend verl_omni ({why}); remove it")
    if recipe is not None:
        wanted = NATIVE_ALGORITHM.get(recipe.algorithm.lower())
        if wanted and stage.algorithm.name != wanted:
            raise ConfigError(f"{where}.algorithm.name: recipe {recipe.name!r} trains {recipe.algorithm}, the stage "
                              f"{stage.algorithm.name}; write algorithm: {{name: {wanted}}} (what the same stage trains "
                              "with backend: native) or pick a recipe of that algorithm (`omni recipes list`)")
        if "reward.name" in stage.keys_given() and stage.reward.name != RECIPE_REWARD.get(recipe.dataset):
            raise ConfigError(f"{where}.reward.name: {stage.reward.name}: recipe {recipe.name!r} scores with its own "
                              f"reward function ({recipe.dataset} data); remove it, or set "
                              "reward.custom_reward_function.path/.name in backend.overrides")
    options = backend.options()
    origin: dict[str, str] = {}
    for key in stage.keys_given():
        if key in AROUND_THE_JOB:
            continue
        option = STAGE_OPTIONS.get(key)
        if option is None:
            raise ConfigError(f"{where}.{key}: backend verl_omni has no counterpart for it (the recipe's script "
                              "decides it); remove it, or set the recipe's own key in backend.overrides")
        section, name = key.split(".")
        value = getattr(getattr(stage, section), name)
        if option == "save_freq" and value == 0:
            raise ConfigError(f"{where}.checkpoint.save_freq: 0 (only at the end) has no VeRL-Omni counterpart "
                              "(it saves only with save_freq > 0); give a step count")
        if option == "resume_mode" and value == "resume_path":
            raise ConfigError(f"{where}.checkpoint.resume_mode: resume_path: give trainer.resume_mode and "
                              "trainer.resume_from_path in backend.overrides")
        if option in options and options[option] != value:
            raise ConfigError(f"{where}.{key}: {value!r}, but backend.{option} says {options[option]!r}; "
                              "set one of them")
        if option == "lora_alpha" and float(value).is_integer():
            value = int(value)  # our LoraConfig holds a float; the scripts write 64, not 64.0
        options[option] = value
        origin[option] = key
    return options, origin


def _restate(exc: ConfigError, stage: Any, origin: dict[str, str]) -> ConfigError:
    """A render error on `backend.OPTION` named by the stage key the option came from."""
    text = str(exc)
    for option, key in origin.items():
        if text.startswith(f"backend.{option}:"):
            return ConfigError(f"stages.{stage.name}.{key}:{text.removeprefix(f'backend.{option}:')}")
    return ConfigError(f"stages.{stage.name}.{text}")


def recipe_command(stage: Any, paths: RecipePaths) -> RecipeCommand:
    """The command the stage runs with `paths`; a ConfigError names the stage key."""
    options, origin = recipe_options(stage)
    backend: VerlOmniBackend = stage.backend
    try:
        if backend.recipe:
            command = render_recipe(backend.recipe, options, paths)
        else:
            command = render_stage({"name": "verl_omni", "entry_point": backend.entry_point,
                                    "python": backend.python or "python3", **options}, paths)
    except ConfigError as exc:
        raise _restate(exc, stage, origin) from None
    if backend.python:
        command.python = backend.python
    return command


def given_files(stage: Any, key: str) -> list[str]:
    """The files `backend.overrides` gives for `key` (data.train_files / data.val_files), last one wins."""
    found: list[str] = []
    for item in stage.backend.overrides:
        name, _, value = item.partition("=")
        if name.lstrip("+") == key:
            value = value.strip()
            found = [v.strip().strip("'\"") for v in value[1:-1].split(",")] if value.startswith("[") else [value]
    return [f for f in found if f]


def layout(stage: Any, converter: str) -> str:
    """The export layout the stage's recipe reads from a dataset of `converter` (ConfigError otherwise);
    `given` for a recipe whose data omni does not export when backend.overrides sets data.train_files."""
    recipe = recipe_of(stage)
    if recipe is not None:
        if recipe.name not in RECIPE_LAYOUTS and given_files(stage, "data.train_files"):
            return GIVEN
        try:
            return recipe_layout(recipe.name, converter)
        except ConfigError as exc:
            raise ConfigError(f"stages.{stage.name}.{exc}") from None
    if converter not in LAYOUT_CONVERTERS["inline"]:
        raise ConfigError(f"stages.{stage.name}.data: an imported entry point reads the store's verl Parquet "
                          f"({', '.join(sorted(LAYOUT_CONVERTERS['inline']))} data), not converter {converter!r}; "
                          "use a catalog recipe for it")
    return "inline"


def paths_for(stage: Any, *, pipeline: str, run_key: str, model: str, train_files: list[str],
              val_files: list[str]) -> RecipePaths:
    run = stage.backend.run_dir(pipeline, run_key, stage.name)
    return RecipePaths(train_files=list(train_files), val_files=list(val_files), model=model,
                       default_local_dir=str(run / CHECKPOINTS), run_dir=str(run),
                       experiment_name=f"{pipeline}-{stage.name}")


def model_for(stage: Any) -> str:
    """The model the stage trains: its `model:` when the file sets it, else the recipe's own (an imported
    script's: its actor_rollout_ref.model.path)."""
    recipe = recipe_of(stage)
    if "model" not in stage.model_fields_set:
        if recipe is not None:
            return recipe.model
        if script_model := given_files(stage, "actor_rollout_ref.model.path"):
            return script_model[-1]
    return stage.model_uri if isinstance(stage.model, str) or stage.model.uri else f"<checkpoint of {stage.model.from_}>"


def planned_files(layout_name: str, folder: Path, splits: list[str]) -> dict[str, list[str]]:
    """split -> the files export_for_recipe writes (without writing them)."""
    if layout_name == "dpo_modality":
        return {s: [str(folder / m / f"{'test' if s in ('test', 'validation') else s}.parquet") for m in MODALITIES]
                for s in splits}
    return {s: [str(folder / f"{s}.parquet")] for s in splits}


def verl_omni_problem(stage: Any, datasets: dict[str, Any]) -> str | None:
    """The first thing in a verl_omni stage that cannot work, as `stages.NAME.key: message`, or None."""
    if stage.kind != "rl":
        return (f"stages.{stage.name}.backend: VeRL-Omni recipes are RL and preference trainings; a stage of kind "
                f"{stage.kind} runs on backend native or verl")
    try:
        dataset = datasets.get(stage.data.split(":", 1)[0])
        if dataset is not None:
            layout(stage, dataset.converter)
        placeholder = str(Path(stage.backend.shared_dir) / "datasets" / "DATASET" / "VERSION")
        recipe_command(stage, paths_for(stage, pipeline="PIPELINE", run_key="RUN_KEY", model="MODEL",
                                        train_files=[f"{placeholder}/train.parquet"],
                                        val_files=[f"{placeholder}/test.parquet"]))
    except ConfigError as exc:
        return str(exc)
    return None


def job_env(command: RecipeCommand, *, metrics_file: str | Path | None = None) -> dict[str, Any]:
    """The Ray Job's runtime env: `VERL_USE_EXTERNAL_MODULES=verl_omni` (verl's hook that imports verl_omni in
    every worker; the omni scripts export it, the diffusion ones run verl_omni's own entry points and do
    not, it is set for every job), the script's exported variables, where verl's file logger writes (a
    plan's; `submit` sets it per job) and the credentials forwarded by name
    (omni_core.backends.jobs.job.runtime_env)."""
    env = runtime_env(command, metrics_file=metrics_file)
    return {**env, "env_vars": {EXTERNAL_MODULES: "verl_omni", **env["env_vars"]}}


def plan(stage: Any, *, pipeline: str, seed: int, dataset: str, converter: str | None, version: str | None,
         splits: list[str] | None, run_key: str | None, tracking_uri: str | None, ray_address: str) -> dict[str, Any]:
    """What the stage would do, without doing it (as backend verl plans its job)."""
    backend: VerlOmniBackend = stage.backend
    version_text = version or "<version>"
    key = run_key or "<run_key>"
    layout_name = layout(stage, converter) if converter else "inline"
    folder = Path(backend.shared_dir) / "datasets" / dataset / version_text / f"verl_omni-{layout_name}"
    if layout_name == GIVEN:  # nothing exported: the files the overrides name
        files = {"train": given_files(stage, "data.train_files"), "test": given_files(stage, "data.val_files")}
        folder = Path("(backend.overrides)")
    else:
        files = planned_files(layout_name, folder, splits or ["train", "test"])
    train = files.get("train", [])
    val = files.get("test") or files.get("validation") or []
    model_uri = model_for(stage)
    model = planned_model_path(model_uri, backend.shared_dir, seed) if "<" not in model_uri else model_uri
    command = recipe_command(stage, paths_for(stage, pipeline=pipeline, run_key=key, model=model, train_files=train,
                                              val_files=val))
    job_id = submission_id(pipeline, stage.name, key, command_digest(command))
    env = job_env(command, metrics_file=metrics_file(backend.run_dir(pipeline, key, stage.name) / METRICS, job_id))
    checkpoints = str(backend.run_dir(pipeline, key, stage.name) / CHECKPOINTS)
    dataset_entry = {"from": f"{dataset}@{version_text}", "to": str(folder),
                     "files": [f for split in files.values() for f in split], "layout": layout_name}
    if layout_name in TOKENIZED:  # the prompts are tokenized with the staged model's tokenizer
        dataset_entry["tokenizer"] = model
    return {
        "backend": "verl_omni",
        "task": f"{backend.recipe or backend.entry_point}",
        "recipe": backend.recipe,
        "ray_address": ray_address,
        "submission_id": job_id,
        "entrypoint": command.entrypoint,
        "overrides": command.overrides,
        "substituted": command.substituted,
        "runtime_env": describe_env(env),
        "stages": {"dataset": dataset_entry, "model": {"from": model_uri, "to": model}},
        "checkpoints": checkpoints,
    }
