"""What a verl stage is told: the backend options from the pipeline file (`VerlBackend`) and the
training itself in plain values (`VerlTraining`), which the `sft` / `rl` stage fills from its own
options. `render.py` turns both into verl's command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer

from omni_core.backends.jobs.options import JobBackendOptions

Task = Literal["sft", "grpo", "gspo"]
# where verl reads a custom reward function's file (0.9.1 / the image's pin; older verl: top level)
REWARD_PATH_KEYS = ("reward.custom_reward_function.path", "custom_reward_function.path")


def _split(override: str) -> tuple[str, str]:
    """(key, value) of a Hydra override, its +/++ prefix and the value's quotes removed."""
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value.strip().strip("'\"")


class VerlBackend(JobBackendOptions):
    """`backend: {name: verl, ...}` on an `sft` or `rl` stage (shared_dir, entrypoint_resources: the
    base's; by default an sft job's entry point asks for the node's GPUs, runner.entrypoint_resources)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["verl"] = Field("verl", description="verl's trainer as a Ray Job.")
    python: str | None = Field(
        None, description="The interpreter the Ray Job runs, which must have verl on the Ray nodes; left out: this "
                          "checkout's .venv-verl when it has verl (a laptop after `make setup`), else python3 (the "
                          "CUDA image's).")
    nnodes: int = Field(1, ge=1, description="Nodes of the job (trainer.nnodes); sft runs on one.")
    n_gpus_per_node: int = Field(1, ge=1, description="GPUs per node (trainer.n_gpus_per_node).")
    rollout_engine: Literal["vllm", "sglang"] = Field("vllm", description="main_ppo's rollout engine.")
    device: Literal["gpu", "cpu"] = Field(
        "gpu", description="cpu: the same command on one CPU rank, with verl's `omni_cpu` rollout (transformers) "
                           "and a CPU platform for verl (backends/verl/cpu.py); the Ray node needs >= 8 CPUs.")
    overrides: list[str] = Field(default_factory=list, description="Hydra overrides appended verbatim, last.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables of the job "
                                "(never secrets: those are forwarded by name from the driver).")
    hf_model: Literal["save", "merge"] = Field(
        "save", description="How the final model becomes a Hugging Face folder. save: verl writes "
        "global_step_N/huggingface/model.safetensors with every checkpoint (checkpoint.save_contents adds hf_model) "
        "and the final one is committed as is; merge: only FSDP shards are saved and verl's model merger runs as a "
        "second Ray Job after the final step (for models too big to write twice at every save; it costs a new "
        "interpreter importing torch/verl, ~15-25 s here).")

    @field_validator("overrides")
    @classmethod
    def _overrides(cls, value: list[str]) -> list[str]:
        for item in value:
            if "=" not in item and not item.startswith("~"):
                raise ValueError(f"backend.overrides: {item!r} is not a Hydra override; write key=value "
                                 "(+key=value adds a key, ~key deletes one)")
        return value

    @model_serializer(mode="wrap")
    def _dump_without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """`device` left at gpu and `python` left out are not dumped: config digests stay what they were."""
        data = handler(self)
        if data.get("device") == "gpu":
            data.pop("device", None)
        if data.get("python") is None:
            data.pop("python", None)
        return data

    def input_files(self) -> list[str]:
        """The reward files named in `overrides` (verl's custom reward function): their bytes key the stage."""
        return [path for key, path in (_split(item) for item in self.overrides) if key in REWARD_PATH_KEYS and path]

    def for_job(self) -> VerlBackend:
        """These options with `python` the interpreter the job runs (interpreter.resolve)."""
        from omni_core.backends.verl.interpreter import resolve

        return self.model_copy(update={"python": resolve(self.python).job})


@dataclass(frozen=True)
class VerlTraining:
    """One training in plain values. Fields left None are options the stage did not set: an RL-only
    one set on an `sft` task is refused by the renderer, never dropped."""

    task: Task
    model: str  # a folder (or hub id) the job's nodes can read: see export.stage_model
    train_files: list[str]
    total_steps: int
    batch_size: int  # sft: sequences per step; grpo/gspo: prompts per step (data.train_batch_size)
    lr: float
    val_files: list[str] = field(default_factory=list)
    micro_batch_size_per_gpu: int = 1
    max_grad_norm: float = 1.0
    max_length: int = 1024  # sft: tokens of prompt + response
    max_prompt_tokens: int = 512  # grpo/gspo
    seed: int = 0
    project_name: str = "omni"
    experiment_name: str = "verl"
    # checkpoints
    save_freq: int = 0  # 0: only at the end (sft_trainer: -1; main_ppo: total_steps, as its -1 never saves)
    max_to_keep: int | None = None
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    # LoRA (None: full fine-tune)
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: list[str] | str | None = None
    # RL only (grpo / gspo)
    ppo_mini_batch_size: int | None = None
    ppo_epochs: int | None = None
    rollout_n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    loss_agg_mode: str | None = None
    kl_beta: float | None = None
    adv_scale: Literal["group", "batch", "none"] | None = None
    reward_file: str | None = None  # verl's reward.custom_reward_function.path (None: by the rows' data_source)
    reward_function: str = "compute_score"  # ... and .name

    RL_ONLY = ("ppo_mini_batch_size", "ppo_epochs", "rollout_n", "temperature", "top_p", "max_new_tokens",
               "clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "kl_beta", "adv_scale", "reward_file")
