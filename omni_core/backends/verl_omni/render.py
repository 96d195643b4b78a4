"""A VeRL-Omni recipe + our stage options + our paths -> the command a Ray Job runs (argv + env).

Order: the recipe's base overrides (its script's, with our substitutions), each stage option written
onto the key it maps to (in place when the script sets that key, else appended), then `overrides:`
verbatim (Hydra takes the last value of a key). A value equal to the script's keeps the script's
spelling (`3e-6` stays `3e-6`).

An option is honoured by a recipe when its script sets the key it maps to, or the key is one every
VeRL-Omni trainer has (`ALWAYS`); anything else is a ConfigError naming the option.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_core.backends.verl_omni.catalog import Recipe, get_recipe
from omni_core.errors import ConfigError

LOGGER = '["console","file"]'  # verl's file logger: the driver relays it into MLflow (jobs.metrics)
VERL_OMNI_ROOT = "/opt/venv/lib/python3.12/site-packages"  # where the CUDA image's pip puts verl_omni/
VERL_OMNI_EXAMPLES = "/opt/verl-omni/examples"  # a recipe's non-package file (BAGEL's deploy config)

# our option -> the Hydra keys it may write (the first one the script sets; else the first, if ALWAYS)
OPTION_KEYS: dict[str, tuple[str, ...]] = {
    "clip_ratio_low": ("actor_rollout_ref.actor.clip_ratio_low",),
    "clip_ratio_high": ("actor_rollout_ref.actor.clip_ratio_high",),
    "clip_ratio": ("actor_rollout_ref.actor.diffusion_loss.clip_ratio",),
    "rollout_n": ("actor_rollout_ref.rollout.n",),
    "max_num_seqs": ("actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs",
                     "actor_rollout_ref.rollout.max_num_seqs"),
    "step_execution": ("actor_rollout_ref.rollout.step_execution",),
    "execution_mode": ("trainer.v1.trainer_mode",),
    "parameter_sync_step": ("trainer.v1.separate_async.parameter_sync_step",),
    "max_staleness": ("trainer.v1.sampler.max_off_policy_threshold",),
    "staleness_policy": ("trainer.v1.sampler.max_off_policy_strategy",),
    "lora_rank": ("actor_rollout_ref.model.lora_rank",),
    "lora_alpha": ("actor_rollout_ref.model.lora_alpha",),
    "total_steps": ("trainer.total_training_steps",),
    "total_epochs": ("trainer.total_epochs",),
    "batch_size": ("data.train_batch_size",),
    "ppo_mini_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size",),
    "lr": ("actor_rollout_ref.actor.optim.lr",),
    "save_freq": ("trainer.save_freq",),
    "test_freq": ("trainer.test_freq",),
    "max_to_keep": ("trainer.max_actor_ckpt_to_keep",),
    "resume_mode": ("trainer.resume_mode",),
    "nnodes": ("trainer.nnodes",),
    "n_gpus_per_node": ("trainer.n_gpus_per_node",),
}
ALWAYS = {"total_steps", "total_epochs", "batch_size", "save_freq", "test_freq", "max_to_keep", "resume_mode",
          "nnodes", "n_gpus_per_node", "lr", "ppo_mini_batch_size"}
STALENESS = {"drop": "drop"}  # VeRL-Omni's V1 sampler drops a batch staler than the threshold

# substitution kinds (catalog `substitutions`): what our pipeline writes in place of the script's value
SUBSTITUTIONS = {
    "train_files": "our dataset version's train export on the shared path",
    "val_files": "our dataset version's validation export on the shared path",
    "model": "the stage's model, staged where every node reads it",
    "logger": f"trainer.logger={LOGGER} replaces the script's W&B/TensorBoard default",
    "default_local_dir": "absolute checkpoint folder on the shared path (mirrored, resumed)",
    "run_dir": "the script's log folder under the run folder (same last name)",
    "package_file": "a file of the verl_omni package, absolute inside the image",
    "examples_file": "a file of verl-omni's examples/ (arg: its path there), absolute inside the image",
    "experiment_name": "the run's experiment name in place of a timestamped one",
}


class RecipeOptions(BaseModel):
    """`backend: {name: verl_omni, recipe: NAME, ...}`: the stage options a recipe may honour."""

    model_config = ConfigDict(extra="forbid")

    algorithm: str | None = Field(None, description="The recipe's algorithm as a check (GSPO, DPO, FlowGRPO, ...); "
                                                    "another is an error naming the recipe's.")
    clip_ratio_low: float | None = Field(None, description="actor_rollout_ref.actor.clip_ratio_low.")
    clip_ratio_high: float | None = Field(None, description="actor_rollout_ref.actor.clip_ratio_high.")
    clip_ratio: float | None = Field(None, description="A diffusion recipe's actor_rollout_ref.actor.diffusion_loss."
                                                       "clip_ratio.")
    rollout_n: int | None = Field(None, ge=1, description="Responses (images) per prompt: actor_rollout_ref.rollout.n.")
    max_num_seqs: int | None = Field(None, ge=1, description="The vLLM-Omni engine's max_num_seqs (rollout batching).")
    step_execution: bool | None = Field(None, description="vLLM-Omni's step-level batching: "
                                                          "actor_rollout_ref.rollout.step_execution.")
    execution_mode: Literal["sync", "separate_async"] | None = Field(None, description="trainer.v1.trainer_mode.")
    parameter_sync_step: int | None = Field(None, ge=1, description="separate_async: push weights every N steps "
                                                                    "(trainer.v1.separate_async.parameter_sync_step).")
    max_staleness: int | None = Field(None, ge=0, description="The V1 sampler's max_off_policy_threshold.")
    staleness_policy: Literal["wait", "drop"] | None = Field(None, description="The V1 sampler's "
                                                                               "max_off_policy_strategy.")
    # 64 stays 64 (the scripts spell it so), 0.5 stays 0.5
    lora_rank: int | None = Field(None, ge=0, description="actor_rollout_ref.model.lora_rank (0: no LoRA).")
    lora_alpha: int | float | None = Field(None, description="actor_rollout_ref.model.lora_alpha.")
    total_steps: int | None = Field(None, ge=1, description="trainer.total_training_steps.")
    total_epochs: int | None = Field(None, ge=1, description="trainer.total_epochs.")
    batch_size: int | None = Field(None, ge=1, description="Prompts per step: data.train_batch_size.")
    ppo_mini_batch_size: int | None = Field(None, ge=1, description="actor_rollout_ref.actor.ppo_mini_batch_size.")
    lr: float | None = Field(None, description="actor_rollout_ref.actor.optim.lr.")
    save_freq: int | None = Field(None, description="Checkpoint every N steps: trainer.save_freq.")
    test_freq: int | None = Field(None, description="Validate every N steps: trainer.test_freq.")
    max_to_keep: int | None = Field(None, ge=1, description="trainer.max_actor_ckpt_to_keep.")
    resume_mode: Literal["auto", "disable"] | None = Field(None, description="trainer.resume_mode.")
    nnodes: int | None = Field(None, ge=1, description="Nodes of the job: trainer.nnodes.")
    n_gpus_per_node: int | None = Field(None, ge=1, description="GPUs (NPUs) per node: trainer.n_gpus_per_node.")
    overrides: list[str] = Field(default_factory=list, description="Hydra overrides appended verbatim, last (after "
                                                                   "the recipe's and these options').")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables of the job, over the "
                                                                  "script's exports (never secrets: those are "
                                                                  "forwarded by name from the driver).")


@dataclass(frozen=True)
class RecipePaths:
    """Where our pipeline put things (absolute, on the shared path)."""

    train_files: list[str]
    val_files: list[str]
    model: str
    default_local_dir: str
    run_dir: str = ""  # the script's log folders go under it; default: default_local_dir
    experiment_name: str = "verl_omni"
    verl_omni_root: str = VERL_OMNI_ROOT
    verl_omni_examples: str = VERL_OMNI_EXAMPLES


@dataclass
class RecipeCommand:
    recipe: str
    python: str
    module: str
    overrides: list[str]
    env: dict[str, str]
    substituted: list[str] = field(default_factory=list)  # "key: kind" for each substitution made

    @property
    def argv(self) -> list[str]:
        return [self.python, "-m", self.module, *self.overrides]

    @property
    def entrypoint(self) -> str:
        return shlex.join(self.argv)


def split_override(item: str) -> tuple[str, str, str]:
    """`++a.b=c` -> ('++', 'a.b', 'c')."""
    key, sep, value = item.partition("=")
    if not sep:
        raise ConfigError(f"override {item!r} is not key=value")
    prefix = key[: len(key) - len(key.lstrip("+~"))]
    return prefix, key[len(prefix):], value


def _same(value: Any, text: str) -> bool:
    if isinstance(value, bool):
        return text.strip().lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return str(value) == text


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(f"'{v}'" for v in value) + "]"
    return str(value)


def _files(files: list[str], script_value: str) -> str:
    if script_value.startswith("[") or len(files) != 1:
        return _fmt(files)
    return files[0]


def _substitute(kind: str, value: str, paths: RecipePaths, key: str) -> str:
    kind, _, arg = kind.partition(":")
    if kind == "train_files":
        return _files(paths.train_files, value)
    if kind == "val_files":
        return _files(paths.val_files or paths.train_files, value)
    if kind == "model":
        return paths.model
    if kind == "logger":
        return LOGGER
    if kind == "default_local_dir":
        return paths.default_local_dir
    if kind == "run_dir":
        return str(PurePosixPath(paths.run_dir or paths.default_local_dir) / PurePosixPath(value).name)
    if kind == "package_file":
        at = value.find("verl_omni/")
        if at < 0:
            raise ConfigError(f"{key}: {value!r} is not a file of the verl_omni package")
        return f"{paths.verl_omni_root}/{value[at:]}"
    if kind == "examples_file":
        return f"{paths.verl_omni_examples}/{arg}"
    if kind == "experiment_name":
        return paths.experiment_name
    raise ConfigError(f"VeRL-Omni catalog: unknown substitution {kind!r} for {key}")


def _check_paths(paths: RecipePaths) -> None:
    for name in ("default_local_dir",):
        value = getattr(paths, name)
        if not value.startswith("/"):
            raise ConfigError(f"trainer.default_local_dir {value!r} is relative: verl resolves it against each "
                              "worker's working directory; give an absolute folder on the shared path")
    if not paths.train_files:
        raise ConfigError("data.train_files: no train export for the recipe")


def _option_values(recipe: Recipe, options: RecipeOptions, keys_in_base: set[str]) -> list[tuple[str, str, Any]]:
    """(option, hydra key, value) for every option the stage set; ConfigError for one the recipe cannot honour."""
    out: list[tuple[str, str, Any]] = []
    set_fields = {k: v for k, v in options.model_dump(exclude={"overrides", "env"}).items() if v is not None}
    algorithm = set_fields.pop("algorithm", None)
    if algorithm is not None and algorithm.lower() != recipe.algorithm.lower():
        raise ConfigError(f"backend.algorithm: recipe {recipe.name!r} runs {recipe.algorithm}, not {algorithm!r}; "
                          "pick a recipe of that algorithm (`omni recipes list`)")
    mode = set_fields.get("execution_mode")
    if mode == "separate_async" and "actor_rollout_ref.rollout.nnodes" not in keys_in_base:
        raise ConfigError(f"backend.execution_mode: separate_async needs standalone rollout GPUs, which recipe "
                          f"{recipe.name!r} does not lay out; use sd35-medium-flowgrpo-ocr-lora-v1-separate-async")
    policy = set_fields.get("staleness_policy")
    if policy is not None:
        if policy not in STALENESS:
            raise ConfigError(f"backend.staleness_policy: {policy!r} has no VeRL-Omni counterpart (its V1 sampler "
                              f"drops batches staler than max_off_policy_threshold); use one of {sorted(STALENESS)}")
        set_fields["staleness_policy"] = STALENESS[policy]
    for option, value in set_fields.items():
        candidates = OPTION_KEYS[option]
        key = next((k for k in candidates if k in keys_in_base), None)
        if key is None and option in ALWAYS:
            key = candidates[0]
        if key is None:
            raise ConfigError(f"backend.{option}: recipe {recipe.name!r} ({recipe.script}) does not set "
                              f"{' or '.join(candidates)}, so it cannot honour {option}; drop the option or "
                              "write the override in backend.overrides")
        out.append((option, key, value))
    return out


def parse_options(options: dict[str, Any]) -> RecipeOptions:
    """RecipeOptions from a pipeline's `backend:` mapping; a bad key is a ConfigError naming it."""
    try:
        return RecipeOptions(**options)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"backend.{key}: {first['msg']} (options: {', '.join(RecipeOptions.model_fields)})") from exc


def render_recipe(name: str, options: RecipeOptions | dict[str, Any] | None, paths: RecipePaths) -> RecipeCommand:
    """The command for recipe `name` with our stage `options` and `paths`."""
    return render_with(get_recipe(name), options, paths)


def render_with(recipe: Recipe, options: RecipeOptions | dict[str, Any] | None, paths: RecipePaths) -> RecipeCommand:
    """The command for `recipe` (a catalog one, or custom_recipe(...) for an imported script)."""
    opts = options if isinstance(options, RecipeOptions) else parse_options(options or {})
    _check_paths(paths)
    rows = [list(split_override(item)) for item in recipe.base]
    index = {key: i for i, (_, key, _) in enumerate(rows)}
    substituted: list[str] = []
    for key, kind in recipe.substitutions.items():
        if key in index:
            row = rows[index[key]]
            row[2] = _substitute(kind, row[2], paths, key)
        else:  # a key the script leaves to the config's default (checkpoint folder, logger): appended
            rows.append(["", key, _substitute(kind, "", paths, key)])
            index[key] = len(rows) - 1
        substituted.append(f"{key}: {kind}")
    for _option, key, value in _option_values(recipe, opts, set(index)):
        if key in index:
            row = rows[index[key]]
            if not _same(value, row[2]):
                row[2] = _fmt(value)
        else:
            rows.append(["", key, _fmt(value)])
            index[key] = len(rows) - 1
    overrides = [f"{p}{k}={v}" for p, k, v in rows] + list(opts.overrides)
    env = {k: v for k, v in recipe.env.items() if k not in recipe.env_drop}
    env.update(opts.env)
    for item in overrides:
        if re.search(r"\$\{[A-Za-z_]", item):
            raise ConfigError(f"backend.overrides: {item!r} names a folder of the script's machine; set the key "
                              "in backend.overrides")
    for k, v in env.items():
        if re.search(r"\$\{[A-Za-z_]", v):
            raise ConfigError(f"backend.env.{k}: {v!r} names a folder of the script's machine; set backend.env.{k}")
    return RecipeCommand(recipe=recipe.name, python=recipe.python, module=recipe.module, overrides=overrides,
                         env=env, substituted=substituted)


ENV_DROP = {"WANDB_MODE": "W&B is replaced by MLflow", "CUDA_VISIBLE_DEVICES": "Ray assigns the GPUs",
            "PYTHONPATH": "verl-omni is installed in the image (the script points at its checkout)"}


def infer_substitutions(base: list[str]) -> dict[str, str]:
    """The keys of a script's overrides our pipeline fills in (data, model, logger, checkpoint folder, log
    folders, verl_omni package files), by key and value."""
    subs: dict[str, str] = {}
    rows = [split_override(item) for item in base]
    model_value = next((v for _, k, v in rows if k == "actor_rollout_ref.model.path"), None)
    for _, key, value in rows:
        if key == "data.train_files":
            subs[key] = "train_files"
        elif key == "data.val_files":
            subs[key] = "val_files"
        elif key == "actor_rollout_ref.model.path" or (key.endswith("tokenizer_path") and value == model_value):
            subs[key] = "model"
        elif key == "trainer.logger":
            subs[key] = "logger"
        elif key == "trainer.default_local_dir":
            subs[key] = "default_local_dir"
        elif key in ("trainer.rollout_data_dir", "trainer.validation_data_dir"):
            subs[key] = "run_dir"
        elif key == "trainer.experiment_name" and "${" in value:
            subs[key] = "experiment_name"
        elif "verl_omni/utils/" in value and not value.startswith("pkg://"):
            subs[key] = "package_file"
        elif value == "${BAGEL_DEPLOY_CONFIG}":
            subs[key] = "examples_file:flowgrpo_trainer/bagel/bagel_deploy_config.yaml"
    subs.setdefault("trainer.logger", "logger")
    subs.setdefault("trainer.default_local_dir", "default_local_dir")
    return subs


def custom_recipe(module: str, overrides: list[str], env: dict[str, str], python: str = "python3") -> Recipe:
    """A recipe for a script outside the catalog: its overrides verbatim, our substitutions by key."""
    return Recipe(name="custom", family="custom", script="(imported)", python=python, module=module, env=env,
                  base=list(overrides), substitutions=infer_substitutions(overrides),
                  env_drop=[k for k in env if k in ENV_DROP], model="", algorithm="", modalities="", published="",
                  device="", data_layout="", dataset="")


def render_stage(backend: dict[str, Any], paths: RecipePaths) -> RecipeCommand:
    """`backend: {name: verl_omni, recipe: NAME, ...options}` or `{name: verl_omni, entry_point: MODULE,
    overrides: [...], env: {...}}` (an imported script outside the catalog) -> the command."""
    options = {k: v for k, v in backend.items() if k not in ("name", "recipe", "entry_point", "python", "shared_dir")}
    if backend.get("recipe"):
        return render_recipe(backend["recipe"], options, paths)
    if not backend.get("entry_point"):
        raise ConfigError("backend: a verl_omni stage names a recipe (`omni recipes list`) or an entry_point "
                          "with its overrides (`omni recipes import run_x.sh` writes one)")
    custom = custom_recipe(backend["entry_point"], options.pop("overrides", []), options.pop("env", {}),
                           backend.get("python", "python3"))
    return render_with(custom, options, paths)
