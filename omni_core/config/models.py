"""Pydantic models of a pipeline file. They are the source of truth for what a pipeline may say.

Every model forbids unknown keys, so a typo fails before anything runs, naming the key.
Stage models are discriminated by `kind`; adding a stage kind means adding one model here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RayConfig(Strict):
    address: str = Field("local", description="'local' starts a fresh Ray in-process (never joins a running one); "
                                              "else a cluster address (HOST:PORT, ray://HOST:PORT or auto).")
    num_cpus: int | None = Field(None, ge=1, description="CPUs for a local Ray (default: all).")
    code: Literal["auto", "image", "py_modules", "working_dir"] = Field(
        "auto", description="How a cluster's workers get this project's code: image (already installed there), "
                            "py_modules (the omni_core package is uploaded), working_dir (the project folder is "
                            "uploaded); auto: py_modules on a cluster, nothing for a local Ray.")
    env_vars: list[str] = Field(
        default_factory=list, description="Names of more environment variables the driver hands to the actors "
                                          "(besides the store's and the tracking server's; see omni_core.training.ray_env).")

    @model_serializer(mode="wrap")
    def _dump_without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """`code` and `env_vars` left at their defaults are not dumped: config digests stay what they were."""
        data = handler(self)
        if data.get("code") == "auto":
            data.pop("code", None)
        if not data.get("env_vars"):
            data.pop("env_vars", None)
        return data


class DatasetConfig(Strict):
    source: str = Field(description="fixtures://NAME?rows=N&seed=S, a local directory, s3://... or hf://...")
    converter: str = Field(description="Name of the converter in omni_core.data (e.g. gsm8k).")
    shard_rows: int = Field(10_000, ge=1, description="Rows per output Parquet shard.")
    shard_bytes: ByteSize | None = Field(
        None, gt=0, description="Also end a shard before its rows pass about this much Arrow data (e.g. 512MiB; "
                                "for image, audio and video datasets, whose rows are large); default: rows only.")
    max_quarantine_fraction: float = Field(
        0.05, ge=0, le=1, description="Fail the ingest when more than this share of rows is quarantined.")

    @model_serializer(mode="wrap")
    def _dump_without_unset_byte_limit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `shard_bytes` key while it is unset: config digests and cache keys stay what they were."""
        data = handler(self)
        if data.get("shard_bytes") is None:
            data.pop("shard_bytes", None)
        return data


class StageBase(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    after: list[str] = Field(default_factory=list, description="Stages that must finish first.")


class IngestStage(StageBase):
    kind: Literal["ingest"] = "ingest"
    datasets: list[str] = Field(min_length=1, description="Keys of `datasets:` to ingest.")
    workers: int = Field(1, ge=1, description="Processes converting rows in parallel.")


class BuildImagesStage(StageBase):
    kind: Literal["build_images"] = "build_images"
    targets: list[str] = Field(min_length=1, description="cuda, ascend, or image spec files (.yaml/.json).")
    push: bool = False
    registry: str | None = Field(None, description="HOST[:PORT][/NAMESPACE]; default $OMNI_IMAGE_REGISTRY.")
    builder: Literal["auto", "buildah", "docker"] = "auto"


# ---- the rl stage -------------------------------------------------------------------------------

RL_ALGORITHMS = ("grpo", "gspo", "dpo", "mpo", "flow_grpo")
PREFERENCE_ALGORITHMS = ("dpo", "mpo")
ALL = "*"  # every key of a section

_POLICY_OPTIONS = ("clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "adv_scale", "kl_beta")
_PREFERENCE_OPTIONS = ("loss_type", "loss_weights", "beta", "label_smoothing", "average_log_prob", "weight_decay",
                       "modality_weights")
_FLOW_OPTIONS = ("num_steps", "noise_level", "sde_type", "guidance_scale", "negative_prompt", "adv_std", "adv_clip",
                 "clip_range", "kl_beta", "timestep_fraction", "weight_decay", "mini_batches")
# The `algorithm:` keys (besides `name`) each algorithm takes. dpo/mpo keys are PreferenceConfig's
# (omni_core.training.preference), flow_grpo keys FlowGRPOConfig's (omni_core.training.flow_grpo).
ALGORITHM_OPTIONS: dict[str, tuple[str, ...]] = {
    "grpo": _POLICY_OPTIONS, "gspo": _POLICY_OPTIONS,
    "dpo": _PREFERENCE_OPTIONS, "mpo": _PREFERENCE_OPTIONS,
    "flow_grpo": _FLOW_OPTIONS,
}
# The keys of the stage's trainer/rollout/reward sections each algorithm reads; a section left out
# here is not used at all. Setting a key the chosen algorithm does not read is an error.
STAGE_KEYS: dict[str, dict[str, tuple[str, ...] | str]] = {
    "grpo": {"trainer": ALL, "rollout": ALL, "reward": ALL},
    "gspo": {"trainer": ALL, "rollout": ALL, "reward": ALL},
    "dpo": {"trainer": ("total_steps", "batch_size", "lr", "max_grad_norm")},
    "mpo": {"trainer": ("total_steps", "batch_size", "lr", "max_grad_norm")},
    "flow_grpo": {"trainer": ("total_steps", "batch_size", "lr", "max_grad_norm", "ppo_epochs"),
                  "rollout": ("n",), "reward": ("name",)},
}
# Defaults that differ by algorithm (PreferenceConfig's and FlowGRPOConfig's), for keys left unset.
ALGORITHM_DEFAULTS: dict[str, dict[str, object]] = {
    "dpo": {"trainer.lr": 1e-3, "trainer.batch_size": 8, "algorithm.weight_decay": 0.0},
    "mpo": {"trainer.lr": 1e-3, "trainer.batch_size": 8, "algorithm.weight_decay": 0.0},
    "flow_grpo": {"trainer.lr": 3e-4, "trainer.batch_size": 2, "reward.name": "jpeg_compressibility",
                  "algorithm.weight_decay": 1e-4},
}
# Keys that belong in another section of the stage (the trainers' own spelling -> the stage's).
_SET_ELSEWHERE = {"lr": "trainer.lr", "batch_size": "trainer.batch_size", "prompts_per_step": "trainer.batch_size",
                  "total_steps": "trainer.total_steps", "max_grad_norm": "trainer.max_grad_norm",
                  "ppo_epochs": "trainer.ppo_epochs", "group_size": "rollout.n", "reward": "reward.name",
                  "loss_mode": "algorithm.name"}


class AlgorithmConfig(Strict):
    """`name` picks the algorithm; the other keys are its options (`ALGORITHM_OPTIONS`). A key of
    another algorithm fails naming the algorithms it belongs to; an unknown key fails as unknown."""

    name: Literal["grpo", "gspo", "dpo", "mpo", "flow_grpo"] = "grpo"
    # grpo, gspo: the PPO-clip policy loss (kl_beta also flow_grpo's)
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    adv_scale: Literal["group", "batch", "none"] = "group"
    kl_beta: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")
    # dpo, mpo (PreferenceConfig)
    loss_type: str | list[str] | None = Field(
        None, description="dpo: sigmoid | ipo | bco_pair (default sigmoid); mpo: a list (default sigmoid, bco_pair, sft)")
    loss_weights: list[float] | None = Field(None, description="One per loss type; mpo default 0.8, 0.2, 1.0.")
    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    average_log_prob: bool = Field(False, description="Length-normalised sequence log-probs.")
    modality_weights: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Chance of each modality per training batch; absent modalities weigh 1.")
    weight_decay: float | None = Field(None, ge=0, description="AdamW weight decay; default 0 (dpo, mpo), 1e-4 (flow_grpo).")
    # flow_grpo (FlowGRPOConfig)
    num_steps: int = Field(10, ge=1, description="Denoising steps of a training rollout (SDE).")
    noise_level: float = Field(0.7, gt=0, description="SDE noise level of the rollout.")
    sde_type: Literal["sde", "cps"] = "sde"
    guidance_scale: float = Field(4.5, ge=1.0, description="True-CFG weight; 1.0 turns CFG off.")
    negative_prompt: str = Field("", description="Prompt of the unconditional CFG branch.")
    adv_std: Literal["group", "global"] = "group"
    adv_clip: float = Field(5.0, gt=0)
    clip_range: float = Field(1e-4, gt=0)
    timestep_fraction: float = Field(1.0, gt=0, le=1, description="Share of the denoising steps trained (the first).")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass over the rollout.")

    @model_validator(mode="before")
    @classmethod
    def _keys_set_elsewhere(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, where in _SET_ELSEWHERE.items():
                if key in data:
                    raise ValueError(f"`{key}` is not an algorithm option; set {where} in the stage instead")
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _belongs_to_algorithm(cls, value: Any, info: ValidationInfo) -> Any:
        """Runs for the keys given (defaults are not validated): each must be an option of `name`."""
        name = info.data.get("name")
        if info.field_name == "name" or name is None or info.field_name in ALGORITHM_OPTIONS[name]:
            return value
        owners = [a for a, keys in ALGORITHM_OPTIONS.items() if info.field_name in keys]
        raise ValueError(f"not an option of {name} (it is one of {', '.join(owners)}); "
                         f"{name} takes: {', '.join(ALGORITHM_OPTIONS[name])}")

    @model_validator(mode="after")
    def _resolve(self) -> AlgorithmConfig:
        default = ALGORITHM_DEFAULTS.get(self.name, {}).get("algorithm.weight_decay")
        if self.weight_decay is None and default is not None:
            self.weight_decay = float(default)  # type: ignore[arg-type]
        if self.name in PREFERENCE_ALGORITHMS:
            _check_preference_losses(self)
        return self

    def options(self) -> dict[str, Any]:
        """The options of the chosen algorithm, by key (what `model_dump` holds besides `name`)."""
        return {key: getattr(self, key) for key in ALGORITHM_OPTIONS[self.name]}

    @model_serializer(mode="wrap")
    def _dump_chosen_options(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        keep = {"name", *ALGORITHM_OPTIONS[self.name]}
        return {k: v for k, v in data.items() if k in keep}


def _check_preference_losses(algo: AlgorithmConfig) -> None:
    """PreferenceConfig's loss checks, without importing torch unless a loss type is named."""
    if algo.loss_type is None:
        types = ["sigmoid"] if algo.name == "dpo" else ["sigmoid", "bco_pair", "sft"]
    else:
        types = [algo.loss_type] if isinstance(algo.loss_type, str) else list(algo.loss_type)
        from omni_core.algorithms.preference import SFT, get_preference_loss
        from omni_core.errors import ConfigError

        for name in types:
            if name != SFT:
                try:
                    get_preference_loss(name)
                except ConfigError as exc:
                    raise ValueError(f"loss_type: {exc}") from None
    if algo.loss_weights is not None and len(algo.loss_weights) != len(types):
        raise ValueError(f"loss_weights: {len(types)} loss types ({', '.join(types)}) but "
                         f"{len(algo.loss_weights)} loss_weights; give one weight each")
    if algo.name == "dpo" and (len(types) != 1 or types[0] == "sft"):
        raise ValueError(f"loss_type: dpo takes one pairwise loss type (sigmoid, ipo, bco_pair), not {types}; "
                         "for a weighted list use name: mpo")


class RolloutConfig(Strict):
    n: int = Field(4, ge=1, description="Responses per prompt (the GRPO group size).")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    max_num_seqs: int = Field(256, ge=1, description="Most sequences the rollout engine (ARengine) generates "
                                                      "together; a larger step batch runs in several batches.")
    step_execution: bool = Field(False, description="Rollout engine scheduling: false = request-level batches, "
                                                    "true = step-level continuous batching (REFERENCE.md 4).")


class RewardConfig(Strict):
    name: str = Field("gsm8k", description="Registered reward name, data_source, or path.py:function.")


class TrainerConfig(Strict):
    total_steps: int = Field(3, ge=1)
    batch_size: int = Field(4, ge=1, description="Prompts per step.")
    lr: float = Field(1e-4, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_prompt_tokens: int = Field(256, ge=8)
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch (verl actor.ppo_epochs).")
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="Prompts per optimizer step within a pass (with their n responses); "
                                "default: the whole batch, one step per pass.")


class LoraConfig(Strict):
    """LoRA on the trained model (omni_core.models.lora.LoraSpec); then only adapter weights train and
    are saved. `target_modules`: module-name suffixes, or one regex matching whole module names."""

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | str | None = Field(None, description="Default: the adapter's targets.")


class CheckpointConfig(Strict):
    """When a training stage checkpoints and where a (re)started one picks up (verl's trainer.save_freq,
    resume_mode, resume_from_path). Not part of the run key: they do not change the weights."""

    save_freq: int = Field(0, ge=0, description="Checkpoint every N steps (and always at the end); 0: only at the end.")
    max_to_keep: int | None = Field(2, ge=1, description="Committed checkpoints kept (oldest deleted); null: all.")
    resume_mode: Literal["auto", "disable", "resume_path"] = Field(
        "auto", description="auto: from the latest committed checkpoint of the run key; disable: from step 0; "
                            "resume_path: from resume_from_path.")
    resume_from_path: str | None = Field(None, description="A global_step_N folder (store key or URI) for resume_path.")
    force_resume: bool = Field(False, description="Resume from a checkpoint written with a different config digest.")

    @model_validator(mode="after")
    def _path_with_mode(self) -> CheckpointConfig:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("resume_mode resume_path needs resume_from_path (a global_step_N folder)")
        if self.resume_from_path and self.resume_mode != "resume_path":
            raise ValueError(f"resume_from_path is only read with resume_mode: resume_path (it is {self.resume_mode})")
        return self


class ExecutionConfig(Strict):
    """How the stage's Ray actors run (REFERENCE.md section 5). `sync`: generate, reward, old log-probs,
    update, push weights, in sequence. `separate_async`: rollout workers generate the next batches while
    the trainer updates; batch k is generated with policy version max(0, k - max_staleness) rounded to a
    version the trainer pushed (every parameter_sync_step steps): up for `wait`, down for `drop`, where a
    batch staler than max_staleness is dropped. The schedule depends on k only, never on timing."""

    mode: Literal["sync", "separate_async"] = "sync"
    parameter_sync_step: int = Field(1, ge=1, description="Push weights to the rollout workers every N steps.")
    max_staleness: int = Field(1, ge=0, description="separate_async: how many policy versions a batch may lag.")
    staleness_policy: Literal["wait", "drop"] = "wait"
    async_reward: bool = Field(True, description="Score on reward workers while the next rollout runs; "
                                                 "false: the rollout worker scores its own batch.")
    rollout_workers: int = Field(1, ge=1)
    reward_workers: int = Field(1, ge=1)
    max_failures: int = Field(3, ge=0, description="Restarts from the latest checkpoint after a lost actor or a "
                                                   "failed checkpoint write before the stage fails.")
    retry_backoff_s: float = Field(2.0, ge=0, description="Wait before a restart (doubles each time).")

    @model_validator(mode="after")
    def _schedule_possible(self) -> ExecutionConfig:
        if self.mode == "separate_async" and self.staleness_policy == "wait" \
                and self.parameter_sync_step > self.max_staleness + 1:
            raise ValueError(
                f"parameter_sync_step {self.parameter_sync_step} > max_staleness + 1 ({self.max_staleness + 1}) with "
                "staleness_policy wait: a batch would wait for weights the trainer pushes only after training it; "
                "raise max_staleness, lower parameter_sync_step, or use staleness_policy drop")
        return self


ROLES = ("trainer", "rollout", "reward")
# Keys of the stage that change how it runs, not the weights it trains: left out of the run key.
RUN_KEY_EXCLUDED = frozenset({"name", "after", "num_cpus", "resources", "checkpoint"})
RUN_KEY_EXCLUDED_EXECUTION = frozenset({"max_failures", "retry_backoff_s"})


class RLStage(StageBase):
    kind: Literal["rl"] = "rl"
    model: str = Field("tiny://lm", description="Model URI: tiny://NAME, a save_pretrained folder, s3://..., org/name.")
    adapter: str | None = Field(None, description="Training adapter by name (causal_lm, qwen3_omni, "
                                                  "qwen3_omni_thinker, sd3); default: the model's own.")
    adapter_stage: str | None = Field(None, description="The part of the model trained (all, thinker); "
                                                        "picks the adapter registered for it.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of the full model.")
    data: str = Field(description="Dataset key, optionally with a split: `gsm8k` or `gsm8k:train`.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(
        default_factory=TrainerConfig,
        description="lr and batch_size default by algorithm: 1e-4/4 (grpo, gspo), 1e-3/8 (dpo, mpo), 3e-4/2 (flow_grpo).")
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved for the trainer actor (resources.trainer.CPU).")
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    resources: dict[Literal["trainer", "rollout", "reward"], dict[str, Annotated[float, Field(ge=0)]]] = Field(
        default_factory=dict, description="Ray resources per role, e.g. {rollout: {CPU: 1, GPU: 1}}; defaults: "
                                          "trainer CPU num_cpus, rollout CPU 1, reward CPU 0.")

    def role_resources(self, role: str) -> dict[str, float]:
        """The Ray resources of one actor of `role` (CPU plus any GPU / NPU / custom resource)."""
        default = {"trainer": self.num_cpus, "rollout": 1.0, "reward": 0.0}[role]
        return {"CPU": default, **self.resources.get(role, {})}  # type: ignore[call-overload]

    @model_validator(mode="after")
    def _algorithm_defaults(self) -> RLStage:
        """Keys left unset whose default depends on the algorithm get that algorithm's default."""
        for path, value in ALGORITHM_DEFAULTS.get(self.algorithm.name, {}).items():
            section, key = path.split(".")
            part = getattr(self, section)
            if key not in part.model_fields_set:
                setattr(part, key, value)
        return self

    def unused_keys(self) -> list[str]:
        """`section.key` of trainer/rollout/reward keys set in the file that the algorithm does not read."""
        uses = STAGE_KEYS[self.algorithm.name]
        unused = []
        for section in ("trainer", "rollout", "reward"):
            keys = uses.get(section, ())
            unused += [f"{section}.{k}" for k in sorted(getattr(self, section).model_fields_set)
                       if keys != ALL and k not in keys]
        return unused

    @model_serializer(mode="wrap")
    def _dump_what_applies(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Unset model options and the sections (keys) the algorithm does not read are left out, so the
        dump (and the run key made from it) holds what determines the weights and nothing else."""
        data = handler(self)
        for key in ("adapter", "adapter_stage", "lora"):
            if data.get(key, "") is None:
                del data[key]
        uses = STAGE_KEYS[self.algorithm.name]
        for section in ("trainer", "rollout", "reward"):
            if section not in data:
                continue
            keys = uses.get(section)
            if keys is None:
                del data[section]
            elif keys != ALL:
                data[section] = {k: v for k, v in data[section].items() if k in keys}
        return data


# What a model URI or adapter name is, where that is known without loading anything.
_DIFFUSION, _LM = "a text-to-image diffusion model", "a language model"
_KNOWN_MODELS = {"tiny://sd3": _DIFFUSION, "tiny://lm": _LM, "tiny://qwen3-omni": _LM}
_KNOWN_ADAPTERS = {"sd3": _DIFFUSION, "causal_lm": _LM, "qwen3_omni": _LM, "qwen3_omni_thinker": _LM}
PREFERENCE_CONVERTERS = ("omni_preference",)


def _rl_stage_problem(stage: RLStage, datasets: dict[str, DatasetConfig]) -> str | None:
    """The first combination in an rl stage that cannot work, as `key.path: message`, or None."""
    where = f"stages.{stage.name}"
    algo = stage.algorithm.name
    unused = stage.unused_keys()
    if unused:
        reads = STAGE_KEYS[algo]
        said = "; ".join(f"{s}: {', '.join(k) if k != ALL else 'all'}" for s, k in reads.items()) or "none"
        return (f"{where}.{unused[0]}: not used by {algo} (remove it; {algo} reads {said}; "
                f"its own options go under algorithm:)")
    if stage.execution.mode == "separate_async" and algo not in ("grpo", "gspo"):
        return (f"{where}.execution.mode: separate_async runs rollout workers beside the trainer, for grpo and gspo; "
                f"{algo} trains in one actor (mode: sync)")
    model_kind = _KNOWN_MODELS.get(stage.model)
    adapter_kind = _KNOWN_ADAPTERS.get(stage.adapter or "")
    if model_kind and adapter_kind and model_kind != adapter_kind:
        return f"{where}.adapter: {stage.adapter} is for {adapter_kind}, but {stage.model} is {model_kind}"
    kind, key = (adapter_kind, "adapter") if adapter_kind else (model_kind, "model")
    wanted = _DIFFUSION if algo == "flow_grpo" else _LM
    if kind and kind != wanted:
        value = stage.adapter if key == "adapter" else stage.model
        hint = "e.g. tiny://sd3" if algo == "flow_grpo" else "e.g. tiny://lm; flow_grpo trains diffusion models"
        return f"{where}.{key}: {algo} trains {wanted} ({hint}), but {value} is {kind}"
    dataset_key = stage.data.split(":", 1)[0]
    dataset = datasets.get(dataset_key)
    if dataset is not None:
        pairs = dataset.converter in PREFERENCE_CONVERTERS
        if algo in PREFERENCE_ALGORITHMS and not pairs:
            return (f"{where}.data: {algo} trains on preference pairs (a dataset with converter "
                    f"{' or '.join(PREFERENCE_CONVERTERS)}), but '{dataset_key}' uses converter {dataset.converter}")
        if algo not in PREFERENCE_ALGORITHMS and pairs:
            return (f"{where}.data: {algo} samples responses to prompts and rewards them, but '{dataset_key}' "
                    f"holds preference pairs (converter {dataset.converter}); use algorithm.name dpo or mpo")
    return None


# ---- the eval and register stages ---------------------------------------------------------------


class EvalStage(StageBase):
    """Scores the checkpoint of an upstream rl stage on a dataset split with the dataset's rewards;
    logs verl's `val/*` metrics on its MLflow run, linked to the checkpoint's logged model."""

    kind: Literal["eval"] = "eval"
    checkpoint_from: str | None = Field(None, description="The rl stage whose checkpoint is scored; "
                                                          "default: the nearest upstream rl stage.")
    data: str = Field(description="Dataset key with a split: `gsm8k:test` (split default: test).")
    reward: RewardConfig | None = Field(None, description="Default: each row's data_source picks its reward; "
                                                          "else a registered name or path.py:function.")
    n: int = Field(1, ge=1, description="Responses per prompt (metrics are mean@n).")
    greedy: bool = Field(True, description="Greedy decoding; false samples with temperature and top_p.")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    max_prompt_tokens: int = Field(256, ge=8)
    max_rows: int | None = Field(None, ge=1, description="Score only the first N rows of the split; null: all.")
    batch_size: int = Field(64, ge=1, description="Prompts generated together.")
    samples: int = Field(16, ge=0, description="Rows whose prompt, responses, ground truth and scores are kept "
                                               "as the eval_samples.json table.")

    def split(self) -> tuple[str, str]:
        key, _, split = self.data.partition(":")
        return key, split or "test"

    def pipeline_problem(self, config: Any) -> str | None:
        """What in the pipeline keeps this stage from running, as `key.path: message`, or None."""
        where = f"stages.{self.name}"
        key = self.split()[0]
        if key not in config.datasets:
            return f"{where}.data: '{key}' is not under datasets: ({', '.join(config.datasets) or 'none declared'})"
        if config.datasets[key].converter in PREFERENCE_CONVERTERS:
            return (f"{where}.data: '{key}' holds preference pairs (converter {config.datasets[key].converter}); "
                    "eval scores responses to prompts with rewards: use a prompt dataset (e.g. gsm8k:test)")
        problem = _upstream_problem(config, self.name, "checkpoint_from", self.checkpoint_from, "rl",
                                    "a trained checkpoint to score")
        if problem:
            return problem
        source = config.stage(upstream_stage(config, self.name, "checkpoint_from", self.checkpoint_from, "rl"))
        if source.algorithm.name == "flow_grpo":
            return (f"{where}.checkpoint_from: stage '{source.name}' trains a text-to-image diffusion model "
                    "(flow_grpo); eval generates text with a language model: point it at an rl stage that trains one")
        return None


class RegisterStage(StageBase):
    """Registers the checkpoint an upstream eval stage scored as a new version of `model_name`, sets
    alias `candidate` on it, and moves `champion` to it when `metric` beats the champion's by more than
    `margin`."""

    kind: Literal["register"] = "register"
    model_name: str = Field(min_length=1, description="Registered model name in the MLflow model registry.")
    eval_from: str | None = Field(None, description="The eval stage whose result is registered; "
                                                    "default: the nearest upstream eval stage.")
    metric: str = Field("val/reward_mean", description="Eval metric that decides the promotion to champion.")
    greater_is_better: bool = True
    margin: float = Field(0.0, ge=0, description="How much the new score must beat the champion's by.")

    def pipeline_problem(self, config: Any) -> str | None:
        """What in the pipeline keeps this stage from running, as `key.path: message`, or None."""
        return _upstream_problem(config, self.name, "eval_from", self.eval_from, "eval", "an eval result to register")


def _ancestors(config: Any, name: str) -> list[str]:
    """Every stage `name` depends on, nearest first (reverse dependency order)."""
    after = {s.name: list(s.after) for s in config.stages}
    found: set[str] = set()
    pending = list(after.get(name, []))
    while pending:
        dep = pending.pop()
        if dep not in found and dep in after:
            found.add(dep)
            pending.extend(after[dep])
    order = [s.name for s in config.ordered_stages()]
    return [n for n in reversed(order) if n in found]


def upstream_stage(config: Any, name: str, field: str, chosen: str | None, kind: str) -> str | None:
    """The stage `field` names (when it is an upstream stage of `kind`), else the nearest upstream one."""
    kinds = {s.name: s.kind for s in config.stages}
    ancestors = [a for a in _ancestors(config, name) if kinds[a] == kind]
    if chosen is not None:
        return chosen if chosen in ancestors else None
    return ancestors[0] if ancestors else None


def _upstream_problem(config: Any, name: str, field: str, chosen: str | None, kind: str, what: str) -> str | None:
    if upstream_stage(config, name, field, chosen, kind) is not None:
        return None
    where = f"stages.{name}"
    kinds = {s.name: s.kind for s in config.stages}
    if chosen is None:
        return (f"{where}.after: no upstream {kind} stage to take {what} from; add a {kind} stage to its after: "
                f"list (directly or through another stage), or name one with {field}:")
    if chosen not in kinds:
        return f"{where}.{field}: '{chosen}' is not a stage (stages: {', '.join(kinds)})"
    if kinds[chosen] != kind:
        return f"{where}.{field}: '{chosen}' is a stage of kind {kinds[chosen]}, not {kind}; name an upstream {kind} stage"
    return f"{where}.{field}: '{chosen}' is not upstream of {name}; add it to {name}'s after: list"


AnyStage = IngestStage | BuildImagesStage | RLStage | EvalStage | RegisterStage
Stage = Annotated[AnyStage, Field(discriminator="kind")]


class PipelineConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    store: str = ".omni/store"
    tracking_uri: str = "sqlite:///.omni/mlflow.db"
    ray: RayConfig = Field(default_factory=RayConfig)
    seed: int = 0
    datasets: dict[str, DatasetConfig] = Field(default_factory=dict)
    stages: list[Stage] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> PipelineConfig:
        names = [s.name for s in self.stages]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"stages: duplicate stage names: {', '.join(duplicates)}")
        for stage in self.stages:
            for dep in stage.after:
                if dep not in names:
                    raise ValueError(f"stages.{stage.name}.after: '{dep}' is not a stage (stages: {', '.join(names)})")
            for key in _dataset_refs(stage):
                if key not in self.datasets:
                    known = ", ".join(self.datasets) or "none declared"
                    field = "datasets" if isinstance(stage, IngestStage) else "data"
                    raise ValueError(f"stages.{stage.name}.{field}: '{key}' is not under datasets: ({known})")
            if isinstance(stage, RLStage) and (problem := _rl_stage_problem(stage, self.datasets)):
                raise ValueError(problem)
        self.ordered_stages()  # raises on a cycle
        for stage in self.stages:  # checks that need the whole graph (an eval's upstream rl stage, ...)
            if (check := getattr(stage, "pipeline_problem", None)) and (problem := check(self)):
                raise ValueError(problem)
        return self

    def ordered_stages(self) -> list[AnyStage]:
        """Stages in dependency order; among ready stages, file order (so runs are reproducible)."""
        done: list[str] = []
        pending = list(self.stages)
        while pending:
            ready = [s for s in pending if all(d in done for d in s.after)]
            if not ready:
                raise ValueError("stages: after: dependencies form a cycle among " + ", ".join(s.name for s in pending))
            done.append(ready[0].name)
            pending.remove(ready[0])
        return [self.stage(n) for n in done]

    def stage(self, name: str) -> AnyStage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)


def _dataset_refs(stage: AnyStage) -> list[str]:
    if isinstance(stage, IngestStage):
        return list(stage.datasets)
    if isinstance(stage, RLStage):
        return [stage.data.split(":", 1)[0]]
    return []
