"""Pydantic models of a pipeline file. They are the source of truth for what a pipeline may say.

Every model forbids unknown keys, so a typo fails before anything runs, naming the key.
Stage models are picked by `kind` from the stage-kind table (`register_stage_config`: the built-in
kinds below, a plugin's own kinds beside them). The `algorithm:` and `backend:` sections of a training
stage are parsed through tables that plugins fill (omni_core.config.algorithms, .backends): nothing
here names an algorithm or a backend besides the default one, and nothing here imports a trainer or
a backend's code.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from omni_core.config.algorithms import (
    ALL,
    DIFFUSION_MODEL,
    LANGUAGE_MODEL,
    PAIRS,
    SUPERVISED,
    AlgorithmOptions,
    algorithm_names,
    describe_algorithms,
    describe_trainer_defaults,
    get_algorithm,
    model_kind,
    pair_converters,
    parse_options,
)
from omni_core.config.backends import (
    DEFAULT_BACKEND,
    BackendOptions,
    backend_of,
    describe_backends,
    parse_backend,
)
from omni_core.config.names import (
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    check_env_name,
    check_name,
    check_relative_store_path,
    source_problem,
)
from omni_core.registry import Registry


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

    @field_validator("env_vars")
    @classmethod
    def _env_names(cls, value: list[str]) -> list[str]:
        return [check_env_name(name, "ray.env_vars:") for name in value]

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
    # Media limits, read from each file's header (never by decoding it): a row over one is quarantined,
    # and rollout and eval refuse such media (omni_core/media_limits.py). PIL refuses images over
    # 2 x Image.MAX_IMAGE_PIXELS (178956970 pixels) whatever is set here.
    max_image_pixels: int = Field(40_000_000, ge=1, le=178_956_970,
                                  description="Largest width x height an image may declare.")
    max_audio_seconds: float = Field(600.0, gt=0, description="Longest duration an audio clip may declare.")
    max_video_seconds: float = Field(600.0, gt=0, description="Longest duration a video may declare.")

    @field_validator("source")
    @classmethod
    def _readable_source(cls, value: str) -> str:
        if problem := source_problem(value):
            raise ValueError(problem)
        return value

    @model_serializer(mode="wrap")
    def _dump_without_unset_byte_limit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `shard_bytes` key while it is unset, no media limit at its default: config digests and
        cache keys stay what they were."""
        data = handler(self)
        if data.get("shard_bytes") is None:
            data.pop("shard_bytes", None)
        for key in MEDIA_LIMIT_KEYS:
            if data.get(key) == type(self).model_fields[key].default:
                data.pop(key, None)
        return data


MEDIA_LIMIT_KEYS = ("max_image_pixels", "max_audio_seconds", "max_video_seconds")


class StageBase(Strict):
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH,
                      description="The stage's name, unique in the pipeline; overrides address it "
                                  "(stages.NAME.key=value). One path segment: letters, digits, _, ., -.")
    after: list[str] = Field(default_factory=list, description="Stages that must finish first.")

    @field_validator("data", check_fields=False)
    @classmethod
    def _data_names(cls, value: str) -> str:
        """`KEY` or `KEY:SPLIT` (rl, sft, eval): both parts are names (they become store paths)."""
        key, sep, split = value.partition(":")
        check_name(key, "dataset key")
        if sep:
            check_name(split, "split")
        return value

    @field_validator("model_name", check_fields=False)
    @classmethod
    def _registered_name(cls, value: str) -> str:
        return check_name(value, "registered model name")


class IngestStage(StageBase):
    kind: Literal["ingest"] = Field("ingest", description="Converts raw datasets into versioned Parquet in the store.")
    datasets: list[str] = Field(min_length=1, description="Keys of `datasets:` to ingest.")
    workers: int = Field(1, ge=1, description="Processes converting rows in parallel.")


class BuildImagesStage(StageBase):
    kind: Literal["build_images"] = Field("build_images", description="Builds container images under "
                                                                      "content-addressed tags.")
    targets: list[str] = Field(min_length=1, description="cuda, ascend, or image spec files (.yaml/.json).")
    push: bool = Field(False, description="Push each image to the registry once built.")
    registry: str | None = Field(None, description="HOST[:PORT][/NAMESPACE]; default $OMNI_IMAGE_REGISTRY.")
    builder: Literal["auto", "buildah", "docker"] = Field(
        "auto", description="The image builder; auto: docker buildx where it runs, else buildah.")


# ---- the training stages (rl, sft) --------------------------------------------------------------
# An algorithm is one record in omni_core.config.algorithms (options model, trainer, data, model
# kind, the stage keys it reads and its defaults for them): nothing here names an algorithm.

AlgorithmConfig = AlgorithmOptions  # the `algorithm:` section: the chosen algorithm's options model
# For forms (the Prefect UI): `name` plus the chosen algorithm's keys, checked when the pipeline loads.
_ALGORITHM_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "default": "grpo"}},
                     "additionalProperties": True, "title": "Algorithm"}
# `backend:` for forms: a backend's name, or its options with `name`, checked when the pipeline loads.
_BACKEND_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"name": {"type": "string"}},
                                                  "required": ["name"], "additionalProperties": True}],
                   "title": "Backend"}


class RolloutConfig(Strict):
    n: int = Field(4, ge=1, description="Responses per prompt (the GRPO group size).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollout.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens whose "
                                                      "probabilities add up to top_p.")
    max_new_tokens: int = Field(32, ge=1, description="Longest response in tokens.")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences the rollout engine (ARengine) generates "
                                                      "together; a larger step batch runs in several batches.")
    step_execution: bool = Field(False, description="Rollout engine scheduling: false = request-level batches, "
                                                    "true = step-level continuous batching (docs/reference/rollout.md).")


class RewardConfig(Strict):
    name: str = Field("gsm8k", description="Registered reward name, data_source, or path.py:function.")


class TrainerConfig(Strict):
    total_steps: int = Field(3, ge=1, description="Training steps (one batch each).")
    batch_size: int = Field(4, ge=1, description="Prompts per step (preference pairs for dpo/mpo).")
    lr: float = Field(1e-4, gt=0, description="Learning rate (AdamW).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradients are clipped to this norm.")
    max_prompt_tokens: int = Field(256, ge=8, description="Prompts are truncated to this many tokens.")
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch (verl actor.ppo_epochs).")
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="Prompts per optimizer step within a pass (with their n responses); "
                                "default: the whole batch, one step per pass.")


class LoraConfig(Strict):
    """LoRA on the trained model (omni_core.models.lora.LoraSpec); then only adapter weights train and
    are saved. `target_modules`: module-name suffixes, or one regex matching whole module names."""

    rank: int = Field(8, gt=0, description="Rank of the adapter matrices.")
    alpha: float = Field(16.0, gt=0, description="Scaling: the adapter's update is multiplied by alpha / rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
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

    @field_validator("resume_from_path")
    @classmethod
    def _inside_the_store(cls, value: str | None) -> str | None:
        return value if value is None else check_relative_store_path(value, "resume_from_path")

    @model_validator(mode="after")
    def _path_with_mode(self) -> CheckpointConfig:
        if self.resume_mode == "resume_path" and not self.resume_from_path:
            raise ValueError("resume_mode resume_path needs resume_from_path (a global_step_N folder)")
        if self.resume_from_path and self.resume_mode != "resume_path":
            raise ValueError(f"resume_from_path is only read with resume_mode: resume_path (it is {self.resume_mode})")
        return self


class ExecutionConfig(Strict):
    """How the stage's Ray actors run (docs/reference/training-on-ray.md). `sync`: generate, reward, old log-probs,
    update, push weights, in sequence (one rollout worker and no rollout or reward resources: inside the
    trainer actor, scoring its own batch). `separate_async`: rollout workers generate the next batches while
    the trainer updates; batch k is generated with policy version max(0, k - max_staleness) rounded to a
    version the trainer pushed (every parameter_sync_step steps): up for `wait`, down for `drop`, where a
    batch staler than max_staleness is dropped. The schedule depends on k only, never on timing."""

    mode: Literal["sync", "separate_async"] = Field(
        "sync", description="sync: generate, score and train in sequence; separate_async: rollout workers generate "
                            "the next batches while the trainer trains.")
    parameter_sync_step: int = Field(1, ge=1, description="Push weights to the rollout workers every N steps.")
    max_staleness: int = Field(1, ge=0, description="separate_async: how many policy versions a batch may lag.")
    staleness_policy: Literal["wait", "drop"] = Field(
        "wait", description="separate_async: a batch waits for fresh enough weights (wait), or a too stale batch is "
                            "generated but not trained on (drop).")
    async_reward: bool = Field(True, description="Score on reward workers while the next rollout runs; "
                                                 "false: the rollout worker scores its own batch (as one inside the "
                                                 "trainer does in sync mode).")
    rollout_workers: int = Field(1, ge=1, description="Rollout worker actors (each with its own policy copy).")
    reward_workers: int = Field(1, ge=1, description="Reward worker actors.")
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


class ModelFrom(Strict):
    """`model: {from: STAGE}`: start from the final checkpoint of an upstream training stage (sft or rl).
    The stage runner fills in `weights_sha256` (part of the run key) and `uri` (where the actors load it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    from_: str = Field(alias="from", description="An upstream sft or rl stage.")
    weights_sha256: str | None = Field(None, description="Set by the runner: the upstream checkpoint's weights digest.")
    uri: str | None = Field(None, description="Set by the runner: the upstream checkpoint folder.")

    @model_serializer(mode="wrap")
    def _dump_by_alias(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        out = {"from": data.get("from", data.get("from_"))}
        out.update({k: data[k] for k in ("weights_sha256", "uri") if data.get(k) is not None})
        return out


class RLStage(StageBase):
    """A training stage: `kind: rl` (an RL or preference algorithm) or `kind: sft` (supervised
    fine-tuning; `algorithm:` defaults to sft). Both run on Ray with checkpoints and resume."""

    kind: Literal["rl", "sft"] = Field("rl", description="rl: RL or preference training; sft: supervised "
                                                          "fine-tuning (algorithm sft).")
    model: str | ModelFrom = Field(
        "tiny://lm", description="Model URI: tiny://NAME, a save_pretrained folder, s3://..., org/name; or "
                                 "{from: STAGE}: the final checkpoint of an upstream sft or rl stage.")
    adapter: str | None = Field(None, description="Training adapter by name (causal_lm, qwen3_omni, "
                                                  "qwen3_omni_thinker, sd3); default: the model's own.")
    adapter_stage: str | None = Field(None, description="The part of the model trained (all, thinker); "
                                                        "picks the adapter registered for it.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of the full model.")
    data: str = Field(description="Dataset key, optionally with a split: `gsm8k` or `gsm8k:train`.")
    algorithm: Annotated[SerializeAsAny[AlgorithmOptions], WithJsonSchema(_ALGORITHM_SCHEMA)] = Field(
        default=None, validate_default=True,  # type: ignore[arg-type]
        description="The training algorithm and its options (default: grpo for rl, sft for sft).",
        json_schema_extra=describe_algorithms)  # its description lists the registered algorithms
    rollout: RolloutConfig = Field(default_factory=RolloutConfig,
                                   description="How responses (images) are sampled during training.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="What scores the samples.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Steps, batch and optimizer.",
                                   json_schema_extra=describe_trainer_defaults)  # the records' defaults
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved for the trainer actor (resources.trainer.CPU).")
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig,
                                       description="How the stage's Ray actors run and recover.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="When checkpoints are saved and where a restart resumes.")
    resources: dict[Literal["trainer", "rollout", "reward"], dict[str, Annotated[float, Field(ge=0)]]] = Field(
        default_factory=dict, description="Ray resources per role, e.g. {rollout: {CPU: 1, GPU: 1}}; defaults: "
                                          "trainer CPU num_cpus, rollout CPU 1, reward CPU 0.")
    backend: Annotated[str | SerializeAsAny[BackendOptions], WithJsonSchema(_BACKEND_SCHEMA)] = Field(
        DEFAULT_BACKEND, description="The trainer that runs the stage: a backend's name, or its options with name.",
        json_schema_extra=describe_backends)  # its description lists the registered backends

    @field_validator("backend", mode="before")
    @classmethod
    def _registered_backend(cls, value: Any) -> Any:
        return parse_backend(value)

    @field_validator("algorithm", mode="before")
    @classmethod
    def _chosen_algorithm(cls, value: Any, info: ValidationInfo) -> AlgorithmOptions:
        return parse_options(value, "sft" if info.data.get("kind") == "sft" else "grpo")

    @property
    def record(self) -> Any:
        """The algorithm's record (omni_core.training.algorithms.Algorithm)."""
        return get_algorithm(self.algorithm.name)

    @property
    def model_uri(self) -> str:
        """Where the starting model loads from (a `{from: STAGE}` model once the runner resolved it)."""
        if isinstance(self.model, str):
            return self.model
        if self.model.uri is None:
            raise ValueError(f"stages.{self.name}.model: from {self.model.from_} is not resolved yet (the stage "
                             "runner sets it from the upstream stage's checkpoint)")
        return self.model.uri

    def role_resources(self, role: str) -> dict[str, float]:
        """The Ray resources of one actor of `role` (CPU plus any GPU / NPU / custom resource)."""
        default = {"trainer": self.num_cpus, "rollout": 1.0, "reward": 0.0}[role]
        return {"CPU": default, **self.resources.get(role, {})}  # type: ignore[call-overload]

    @model_validator(mode="after")
    def _algorithm_defaults(self) -> RLStage:
        """Keys left unset whose default depends on the algorithm get that algorithm's default."""
        for path, value in self.record.defaults.items():
            section, key = path.split(".")
            part = getattr(self, section)
            if key not in part.model_fields_set:
                setattr(part, key, value)
                part.model_fields_set.discard(key)  # a default, not the file's: keys_given() leaves it out
        return self

    def keys_given(self) -> list[str]:
        """`section.key` of every trainer / rollout / execution / checkpoint / lora / algorithm key the
        file (or an override) set, without the algorithm's defaults filled in by `_algorithm_defaults`."""
        out = []
        for section in ("algorithm", "trainer", "rollout", "reward", "execution", "checkpoint", "lora"):
            part = getattr(self, section)
            if part is None:
                continue
            out += [f"{section}.{k}" for k in sorted(part.model_fields_set)]
        return out

    def unused_keys(self) -> list[str]:
        """`section.key` of trainer/rollout/reward keys set in the file that the algorithm does not read."""
        record = self.record
        return [f"{section}.{k}" for section in ("trainer", "rollout", "reward")
                for k in sorted(getattr(self, section).model_fields_set) if not record.reads(section, k)]

    @model_serializer(mode="wrap")
    def _dump_what_applies(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Unset model options and the sections (keys) the algorithm does not read are left out, so the
        dump (and the run key made from it) holds what determines the weights and nothing else."""
        data = handler(self)
        for key in ("adapter", "adapter_stage", "lora"):
            if data.get(key, "") is None:
                del data[key]
        if data.get("backend") == DEFAULT_BACKEND:  # the default: digests and run keys stay what they were
            del data["backend"]
        if isinstance(self.backend, BackendOptions):  # the backend's own rules (a recipe: only what the file set)
            data = self.backend.dump_stage(self, data)
        uses = self.record.stage_keys
        for section in ("trainer", "rollout", "reward"):
            if section not in data:
                continue
            keys = uses.get(section)
            if keys is None:
                del data[section]
            elif keys != ALL:
                data[section] = {k: v for k, v in data[section].items() if k in keys}
        return data


TrainingStage = RLStage
TRAINING_KINDS = ("rl", "sft")

def _example_model(kind: str) -> str:
    return "e.g. tiny://sd3" if kind == DIFFUSION_MODEL else "e.g. tiny://lm; flow_grpo trains diffusion models"


def _rl_stage_problem(stage: RLStage, datasets: dict[str, DatasetConfig]) -> str | None:
    """The first combination in a training stage that cannot work, as `key.path: message`, or None."""
    where = f"stages.{stage.name}"
    algo, record = stage.algorithm.name, stage.record
    if stage.kind == "sft" and record.data != SUPERVISED:
        return (f"{where}.algorithm.name: a stage of kind sft trains with a supervised algorithm (sft), not {algo}; "
                "use kind: rl for it")
    if stage.kind == "rl" and record.data == SUPERVISED:
        return f"{where}.algorithm.name: {algo} is supervised fine-tuning: use kind: sft for this stage"
    # a backend that decides what the stage's keys mean (a recipe) checks them itself (Backend.check)
    decides = isinstance(stage.backend, BackendOptions) and stage.backend.decides_stage_keys
    unused = [] if decides else stage.unused_keys()
    if unused:
        reads = record.stage_keys
        said = "; ".join(f"{s}: {', '.join(k) if k != ALL else 'all'}" for s, k in reads.items()) or "none"
        return (f"{where}.{unused[0]}: not used by {algo} (remove it; {algo} reads {said}; "
                f"its own options go under algorithm:)")
    if stage.execution.mode == "separate_async" and not record.separate_async and not decides:
        able = [n for n in algorithm_names() if get_algorithm(n).separate_async]
        return (f"{where}.execution.mode: separate_async runs rollout workers beside the trainer, for "
                f"{' and '.join(able)}; {algo} trains in one actor (mode: sync)")
    model_name = stage.model if isinstance(stage.model, str) else ""
    if isinstance(stage.backend, BackendOptions) and stage.backend.brings_model \
            and "model" not in stage.model_fields_set:
        model_name = ""  # the backend's own model (a recipe's)
    known_model = model_kind("model", model_name)
    adapter_kind = model_kind("adapter", stage.adapter or "")
    if known_model and adapter_kind and known_model != adapter_kind:
        return f"{where}.adapter: {stage.adapter} is for {adapter_kind}, but {model_name} is {known_model}"
    kind, key = (adapter_kind, "adapter") if adapter_kind else (known_model, "model")
    wanted = record.model_kind
    if kind and kind != wanted:
        value = stage.adapter if key == "adapter" else model_name
        return f"{where}.{key}: {algo} trains {wanted} ({_example_model(wanted)}), but {value} is {kind}"
    dataset_key = stage.data.split(":", 1)[0]
    dataset = datasets.get(dataset_key)
    if dataset is not None:
        pairs = dataset.converter in pair_converters()
        if record.data == PAIRS and not pairs:
            return (f"{where}.data: {algo} trains on preference pairs (a dataset with converter "
                    f"{' or '.join(pair_converters())}), but '{dataset_key}' uses converter {dataset.converter}")
        if record.data not in (PAIRS, SUPERVISED) and pairs:
            return (f"{where}.data: {algo} samples responses to prompts and rewards them, but '{dataset_key}' "
                    f"holds preference pairs (converter {dataset.converter}); use algorithm.name dpo or mpo")
    return None


def _model_from_problem(config: Any, stage: RLStage) -> str | None:
    """`model: {from: X}` names an upstream training stage that trains the same kind of model."""
    if isinstance(stage.model, str):
        return None
    chosen = stage.model.from_
    problem = _upstream_problem(config, stage.name, "model.from", chosen, TRAINING_KINDS, "a starting model")
    if problem:
        return problem
    source = config.stage(chosen)
    if source.record.model_kind != stage.record.model_kind:
        return (f"stages.{stage.name}.model.from: stage '{chosen}' trains {source.record.model_kind}, "
                f"but {stage.algorithm.name} trains {stage.record.model_kind}")
    return None


# ---- the eval and register stages ---------------------------------------------------------------


# Keys added to the eval and register stages after the first example pipelines: left at their
# defaults they are not dumped, so the stage cache keys and config digests stay what they were.
_EVAL_QUIET_DEFAULTS: dict[str, Any] = {"engine": "native", "resources": None, "baseline": False, "num_steps": None,
                                        "guidance_scale": None, "noise_level": 0.0, "beta": None, "skip_rows": 0}


class EvalStage(StageBase):
    """Scores the checkpoint of an upstream training stage (rl or sft) on a dataset split, in a Ray task
    with the stage's `resources`: a language model's responses (our batched rollout engine) or a
    diffusion model's images by the dataset's reward (verl's `val/*` names), a preference model on held-out
    pairs against its reference (TRL's `eval_rewards/*` names); logged on its MLflow run, linked to the
    checkpoint's logged model. `baseline: true` scores the stage's starting model too, on the same rows
    and seeds."""

    kind: Literal["eval"] = Field("eval", description="Scores an upstream training stage's checkpoint.")
    checkpoint_from: str | None = Field(None, description="The rl or sft stage whose checkpoint is scored; "
                                                          "default: the nearest upstream one.")
    data: str = Field(description="Dataset key with a split: `gsm8k:test` (split default: test).")
    reward: RewardConfig | None = Field(None, description="Default: each row's data_source picks its reward (a "
                                                          "diffusion checkpoint: its stage's reward); else a "
                                                          "registered name or path.py:function.")
    engine: Literal["native", "vllm_omni", "trainer"] = Field(
        "native", description="The generator: native (our rollout engines, request-level batches of batch_size); "
                              "vllm_omni (vLLM-Omni's AsyncOmni in the Ray task: GPU images, language models, "
                              "text prompts); trainer (a verl stage's own validation, trainer.val_only=True, as "
                              "a Ray Job).")
    resources: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Ray resources of the eval task, e.g. {CPU: 1, GPU: 1} (NPU or a custom resource by "
                          "name); default {CPU: 1}.")
    baseline: bool = Field(False, description="Also score the trained stage's starting model on the same rows "
                                              "and seeds: `<metric>_baseline` and `<metric>_gain` metrics.")
    n: int = Field(1, ge=1, description="Responses (images) per prompt (metrics are mean@n).")
    greedy: bool = Field(True, description="Greedy decoding; false samples with temperature and top_p.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature when greedy is false.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling when greedy is false.")
    max_new_tokens: int = Field(32, ge=1, description="Longest response in tokens.")
    max_prompt_tokens: int = Field(256, ge=8, description="Prompts are truncated to this many tokens.")
    num_steps: int | None = Field(None, ge=1, description="Diffusion: denoising steps; default: the trained "
                                                          "stage's algorithm.num_steps.")
    guidance_scale: float | None = Field(None, ge=1.0, description="Diffusion: True-CFG weight; default: the "
                                                                   "trained stage's.")
    noise_level: float = Field(0.0, ge=0, description="Diffusion: SDE noise level; 0 is the deterministic ODE "
                                                      "sampler.")
    beta: float | None = Field(None, gt=0, description="Preference: the implicit reward's beta; default: the "
                                                       "trained stage's algorithm.beta.")
    skip_rows: int = Field(0, ge=0, description="Leave out the first N rows of the split (e.g. a held-out part "
                                                "beside another eval's first rows); max_rows counts after them.")
    max_rows: int | None = Field(None, ge=1, description="Score only the first N rows of the split (after "
                                                         "skip_rows); null: all.")
    batch_size: int = Field(64, ge=1, description="Prompts (pairs) generated (scored) together.")
    samples: int = Field(16, ge=0, description="Rows whose prompt, responses, ground truth and scores are kept "
                                               "as the eval_samples.json table (diffusion: images in the grid).")

    @model_serializer(mode="wrap")
    def _dump_without_quiet_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key, default in _EVAL_QUIET_DEFAULTS.items():
            if key in data and data[key] == default:
                del data[key]
        return data

    def split(self) -> tuple[str, str]:
        key, _, split = self.data.partition(":")
        return key, split or "test"

    def task_resources(self) -> dict[str, float]:
        return {"CPU": 1.0, **(self.resources or {})}

    def pipeline_problem(self, config: Any) -> str | None:
        """What in the pipeline keeps this stage from running, as `key.path: message`, or None."""
        where = f"stages.{self.name}"
        key = self.split()[0]
        if key not in config.datasets:
            return f"{where}.data: '{key}' is not under datasets: ({', '.join(config.datasets) or 'none declared'})"
        problem = _upstream_problem(config, self.name, "checkpoint_from", self.checkpoint_from, TRAINING_KINDS,
                                    "a trained checkpoint to score")
        if problem:
            return problem
        source = config.stage(upstream_stage(config, self.name, "checkpoint_from", self.checkpoint_from, TRAINING_KINDS))
        pairs = config.datasets[key].converter in pair_converters()
        if pairs and source.record.data != PAIRS:
            return (f"{where}.data: '{key}' holds preference pairs (converter {config.datasets[key].converter}), "
                    f"scored against a preference model's reference, but stage '{source.name}' trains with "
                    f"{source.algorithm.name}: use a prompt dataset (e.g. gsm8k:test), or score a dpo/mpo stage")
        if pairs and isinstance(source.backend, BackendOptions) and not source.backend.trains_stage_model:
            return (f"{where}.data: preference pairs are scored against the trained stage's starting model; "
                    f"'{source.name}' runs on {source.backend.name}, which trains a model of its own")
        if self.engine == "trainer":
            if self.skip_rows:
                return f"{where}.skip_rows: a trainer's own validation scores the split from its first row; use engine: native"
            return backend_of(source).validation_problem(self, source)
        if self.engine == "vllm_omni":
            if pairs or source.record.model_kind != LANGUAGE_MODEL:
                return (f"{where}.engine: vllm_omni scores a language model's responses here; '{source.name}' "
                        f"trains {'preference pairs' if pairs else source.record.model_kind}: use engine: native")
            if self.baseline:
                return f"{where}.baseline: scored by engine native only; remove it or use engine: native"
        return None


class RegisterStage(StageBase):
    """Registers the checkpoint an upstream eval stage scored as a new version of `model_name`, sets
    alias `candidate` on it, and moves `champion` to it when `metric` beats the champion's by more than
    `margin`."""

    kind: Literal["register"] = Field("register", description="Registers the scored checkpoint in MLflow's model "
                                                              "registry.")
    model_name: str = Field(min_length=1, description="Registered model name in the MLflow model registry.")
    eval_from: str | None = Field(None, description="The eval stage whose result is registered; "
                                                    "default: the nearest upstream eval stage.")
    metric: str = Field("val/reward_mean", description="Eval metric that decides the promotion to champion.")
    greater_is_better: bool = Field(True, description="false: a lower metric is better (a loss).")
    margin: float = Field(0.0, ge=0, description="How much the new score must beat the champion's by.")
    min_gain_over_baseline: float | None = Field(
        None, description="Also require the score to beat the eval's baseline (its starting model, eval "
                          "baseline: true) by more than this; null: no baseline gate.")

    @model_serializer(mode="wrap")
    def _dump_without_unset_gate(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("min_gain_over_baseline") is None:
            data.pop("min_gain_over_baseline", None)
        return data

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


def upstream_stage(config: Any, name: str, field: str, chosen: str | None, kind: str | tuple[str, ...]) -> str | None:
    """The stage `field` names (when it is an upstream stage of `kind`, or one of the kinds), else the
    nearest upstream one."""
    wanted = (kind,) if isinstance(kind, str) else kind
    kinds = {s.name: s.kind for s in config.stages}
    ancestors = [a for a in _ancestors(config, name) if kinds[a] in wanted]
    if chosen is not None:
        return chosen if chosen in ancestors else None
    return ancestors[0] if ancestors else None


def _upstream_problem(config: Any, name: str, field: str, chosen: str | None, kind: str | tuple[str, ...],
                      what: str) -> str | None:
    if upstream_stage(config, name, field, chosen, kind) is not None:
        return None
    where = f"stages.{name}"
    kinds = {s.name: s.kind for s in config.stages}
    wanted = (kind,) if isinstance(kind, str) else kind
    kind = " or ".join(wanted)
    if chosen is None:
        return (f"{where}.after: no upstream {kind} stage to take {what} from; add an {kind} stage to its after: "
                f"list (directly or through another stage), or name one with {field}:")
    if chosen not in kinds:
        return f"{where}.{field}: '{chosen}' is not a stage (stages: {', '.join(kinds)})"
    if kinds[chosen] not in wanted:
        return f"{where}.{field}: '{chosen}' is a stage of kind {kinds[chosen]}, not {kind}; name an upstream {kind} stage"
    return f"{where}.{field}: '{chosen}' is not upstream of {name}; add it to {name}'s after: list"


AnyStage = IngestStage | BuildImagesStage | RLStage | EvalStage | RegisterStage  # the built-in kinds

_STAGE_CONFIGS: Registry[type[StageBase]] = Registry(
    "stage kind", hint="register its config model with register_stage_config and its runner with register_stage "
                       "(docs/concepts/plugins.md)")


def register_stage_config(model: type[StageBase], *kinds: str) -> type[StageBase]:
    """Register the config model of a stage kind: `kinds`, else the default of its `kind` field."""
    for kind in kinds or (model.model_fields["kind"].default,):
        _STAGE_CONFIGS.add(kind, model)
    return model


def stage_kinds() -> list[str]:
    return _STAGE_CONFIGS.names()


def _parse_stage(value: Any) -> Any:
    """A stage as written -> its kind's config model (an error on `kind` names the known kinds)."""
    if not isinstance(value, dict):
        return value
    kind = value.get("kind")
    if kind not in _STAGE_CONFIGS:
        known = ", ".join(repr(k) for k in stage_kinds())
        problem = f"unknown stage kind {kind!r} (known: {known})" if kind is not None else f"missing (known: {known})"
        raise ValidationError.from_exception_data("stage", [InitErrorDetails(
            type=PydanticCustomError("unknown_stage_kind", "{message}", {"message": problem}),
            loc=("kind",), input=kind)])
    return _STAGE_CONFIGS[kind].model_validate(value)


def _describe_stages(schema: dict[str, Any]) -> None:
    schema["description"] = f"A stage: `name`, `kind` ({', '.join(stage_kinds())}) and the kind's keys."


class _RegisteredStageSchemas:
    """For forms (the Prefect UI): a stage is one of the registered kinds' config models, each with its own
    keys. The kinds are read when the schema is made, so a plugin's stage kind is in the form too."""

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        models = list(dict.fromkeys(_STAGE_CONFIGS[kind] for kind in stage_kinds()))
        return {"anyOf": [handler(model.__pydantic_core_schema__) for model in models], "title": "Stage"}


Stage = Annotated[SerializeAsAny[StageBase], BeforeValidator(_parse_stage), _RegisteredStageSchemas()]
for _model in (IngestStage, BuildImagesStage, EvalStage, RegisterStage):
    register_stage_config(_model)
register_stage_config(RLStage, *TRAINING_KINDS)


class PipelineConfig(Strict):
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH,
                      description="The pipeline's name: its MLflow experiment and its folder under runs/ in the store.")
    store: str = Field(".omni/store", description="Where datasets and checkpoints go: a path, file://... or "
                                                  "s3://bucket/prefix.")
    tracking_uri: str = Field("sqlite:///.omni/mlflow.db", description="MLflow: a sqlite:/// database or a tracking "
                                                                        "server's http(s):// URL.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Which Ray runs the stages.")
    seed: int = Field(0, description="Seeds sampling, initialisation and data order: the same seed and inputs give "
                                     "the same digests and weights.")
    datasets: dict[str, DatasetConfig] = Field(default_factory=dict,
                                               description="Raw datasets by key; stages name them by that key.")
    stages: list[Stage] = Field(min_length=1, description="The stages; they run in the order their after: lists give.",
                                json_schema_extra=_describe_stages)

    @field_validator("datasets", mode="before")
    @classmethod
    def _dataset_keys(cls, value: Any) -> Any:
        for key in value if isinstance(value, dict) else ():
            check_name(key, "dataset key")
        return value

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
            if isinstance(stage, RLStage) and (problem := backend_of(stage).check(stage, self)):
                raise ValueError(problem)
        self.ordered_stages()  # raises on a cycle
        for stage in self.stages:  # checks that need the whole graph (an eval's upstream rl stage, ...)
            if (check := getattr(stage, "pipeline_problem", None)) and (problem := check(self)):
                raise ValueError(problem)
            if isinstance(stage, RLStage) and (problem := _model_from_problem(self, stage)):
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
