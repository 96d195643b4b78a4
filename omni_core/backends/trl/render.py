"""A stage's keys -> TRL's trainer and the fields of its config class, in plain values (no TRL import):
what `omni plan` shows and every Ray Train worker builds its `SFTConfig` / `GRPOConfig` / `DPOConfig` from.

    trainer, fields = render(stage, seed)       # "GRPOTrainer", {"max_steps": 40, "num_generations": 8, ...}

`STAGE_FIELDS` is the map (docs/trl.md has it as a table); `RUNTIME_FIELDS` are set by the worker
(output folder, device, logging, saving, resume): `backend.overrides` may set neither, but it may set any
other field of the class, last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRAINERS = {"sft": "SFTTrainer", "grpo": "GRPOTrainer", "gspo": "GRPOTrainer", "dpo": "DPOTrainer",
            "mpo": "DPOTrainer"}
CONFIGS = {"SFTTrainer": "SFTConfig", "GRPOTrainer": "GRPOConfig", "DPOTrainer": "DPOConfig"}
CONFIG_MODULES = {"SFTConfig": "trl/trainer/sft_config.py", "GRPOConfig": "trl/trainer/grpo_config.py",
                  "DPOConfig": "trl/trainer/dpo_config.py"}
GENERATORS = ("grpo", "gspo")  # sample responses to prompts

# our loss aggregation (verl's loss_agg_mode) -> GRPOConfig.loss_type: `dapo` normalises by the active tokens
# of the whole (global) batch, as our token-mean does; `grpo` averages each sequence's tokens, then the
# sequences; `dr_grpo` sums each sequence's tokens over a constant (max_completion_length)
LOSS_AGG = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
# DPOConfig.loss_type's values (trl 1.16); ours (omni_core.algorithms.preference) must be among them
DPO_LOSS_TYPES = frozenset({"sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                            "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"})

# stage key -> TRL config field (the trainers that read it)
STAGE_FIELDS: dict[str, str] = {
    "trainer.total_steps": "max_steps",
    "trainer.batch_size": "per_device_train_batch_size",
    "trainer.lr": "learning_rate",
    "trainer.max_grad_norm": "max_grad_norm",
    "rollout.n": "num_generations",
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "rollout.max_new_tokens": "max_completion_length",
    "algorithm.clip_ratio_low": "epsilon",
    "algorithm.clip_ratio_high": "epsilon_high",
    "algorithm.kl_beta": "beta",
    "algorithm.adv_scale": "scale_rewards",
    "algorithm.loss_agg_mode": "loss_type",
    "algorithm.name": "importance_sampling_level",
    "algorithm.loss_type": "loss_type",
    "algorithm.loss_weights": "loss_weights",
    "algorithm.beta": "beta",
    "algorithm.label_smoothing": "label_smoothing",
    "algorithm.weight_decay": "weight_decay",
    "checkpoint.save_freq": "save_steps",
    "seed": "seed",
}
# set by the worker for every run (module docstring)
RUNTIME_FIELDS = frozenset({
    "output_dir", "overwrite_output_dir", "report_to", "run_name", "logging_dir", "logging_strategy", "logging_steps",
    "use_cpu", "save_strategy", "save_steps", "save_total_limit", "save_only_model", "resume_from_checkpoint",
    "seed", "data_seed", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
    "disable_tqdm", "push_to_hub", "hub_model_id", "ddp_backend", "use_vllm", "vllm_mode", "dataset_kwargs"})


@dataclass(frozen=True)
class Rendered:
    trainer: str  # GRPOTrainer, DPOTrainer or SFTTrainer
    fields: dict[str, Any]  # the config class's fields (the stage's keys, then backend.overrides)
    lora: dict[str, Any] | None  # peft.LoraConfig's keyword arguments; target_modules None: the adapter's

    @property
    def config_class(self) -> str:
        return CONFIGS[self.trainer]

    @property
    def generation_block(self) -> int:
        """Steps that train on one generation (GRPO: steps_per_generation x num_iterations; else 1): a
        checkpoint is resumable on such a boundary only."""
        if self.trainer != "GRPOTrainer":
            return 1
        return int(self.fields.get("steps_per_generation") or 1) * int(self.fields.get("num_iterations") or 1)


def per_device_batch(stage: Any) -> tuple[int, int]:
    """(sequences per step of all workers, per worker): GRPO's completions (prompts x rollout.n), else rows."""
    total = stage.trainer.batch_size * (stage.rollout.n if stage.algorithm.name in GENERATORS else 1)
    return total, total // stage.backend.num_workers


def render(stage: Any, seed: int) -> Rendered:
    """The TRL trainer of `stage` and its config fields (module docstring)."""
    name, trainer = stage.algorithm.name, stage.trainer
    fields: dict[str, Any] = {
        "max_steps": trainer.total_steps, "learning_rate": trainer.lr, "max_grad_norm": trainer.max_grad_norm,
        "per_device_train_batch_size": per_device_batch(stage)[1], "gradient_accumulation_steps": 1,
        "lr_scheduler_type": "constant", "warmup_steps": 0,  # our trainers' schedule
        "seed": seed, "data_seed": seed,
        "gradient_checkpointing": False,  # TRL's default is on: ~20% slower, and our trainers do not
        "ddp_find_unused_parameters": False,  # every parameter takes part (else DDP walks the graph each step)
        "bf16": None if stage.backend.use_gpu else False,  # TRL turns bf16 on by default (on a CPU too)
    }
    algo = stage.algorithm
    if name in GENERATORS:
        rollout = stage.rollout
        fields.update({
            "num_generations": rollout.n, "temperature": rollout.temperature, "top_p": rollout.top_p,
            "max_completion_length": rollout.max_new_tokens, "steps_per_generation": 1, "num_iterations": 1,
            "epsilon": algo.clip_ratio_low, "epsilon_high": algo.clip_ratio_high, "beta": algo.kl_beta,
            "scale_rewards": algo.adv_scale, "loss_type": LOSS_AGG[algo.loss_agg_mode],
            "importance_sampling_level": "sequence" if name == "gspo" else "token"})
        if stage.backend.vllm_mode == "colocate":
            fields.update({"use_vllm": True, "vllm_mode": "colocate"})
    elif name in ("dpo", "mpo"):
        fields.update({"loss_type": algo.loss_types, "loss_weights": algo.weights, "beta": algo.beta,
                       "label_smoothing": algo.label_smoothing, "weight_decay": algo.weight_decay})
    fields.update(stage.backend.overrides)
    lora = None
    if stage.lora is not None:
        lora = {"r": stage.lora.rank, "lora_alpha": stage.lora.alpha, "lora_dropout": stage.lora.dropout,
                "target_modules": stage.lora.target_modules, "bias": "none", "task_type": "CAUSAL_LM"}
    return Rendered(TRAINERS[name], fields, lora)
