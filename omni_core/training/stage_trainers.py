"""The trainer an `rl` stage runs, chosen by `algorithm.name`: one factory for the Ray actor.

    trainer = build_stage_trainer(stage, rows, seed)     # loads stage.model with adapter / LoRA
    metrics = trainer.step()                             # the algorithm's own metric names
    save_checkpoint(store, root, trainer.global_step, trainer.model, trainer.text_io, ...)

| algorithm.name | trainer                                     | model                 | rows                   |
|----------------|---------------------------------------------|-----------------------|------------------------|
| grpo, gspo     | `grpo_loop.GRPOTrainer`                     | causal LM / Qwen3-Omni | prompt rows + reward  |
| dpo, mpo       | `preference.PreferenceTrainer`              | causal LM / Qwen3-Omni | Omni-Preference pairs |
| flow_grpo      | `flow_grpo.FlowGRPOTrainer`                 | SD3 (`tiny://sd3`)    | prompt rows            |

The stage's common sections map onto each trainer's config (PreferenceConfig, FlowGRPOConfig):
trainer.{total_steps, batch_size, lr, max_grad_norm} for all, plus trainer.ppo_epochs, rollout.n
(group_size) and reward.name for flow_grpo; `algorithm:` holds the rest of the algorithm's options.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from omni_core.config.models import PREFERENCE_ALGORITHMS, RLStage
from omni_core.errors import ConfigError
from omni_core.models import SD3Model, load_model
from omni_core.models.lora import LoraSpec

# Metrics shown on each step's progress line (those the algorithm logs), with their short labels.
PROGRESS_METRICS: dict[str, tuple[tuple[str, str], ...]] = {
    "grpo": (("critic/score/mean", "score"), ("actor/pg_loss", "pg_loss"), ("response_length/mean", "len")),
    "dpo": (("actor/dpo_loss", "loss"), ("actor/reward_accuracy", "reward_acc"), ("actor/reward_margin", "margin")),
    "mpo": (("actor/mpo_loss", "loss"), ("actor/reward_accuracy", "reward_acc"), ("actor/reward_margin", "margin")),
    "flow_grpo": (("critic/score/mean", "score"), ("actor/pg_loss", "pg_loss"), ("actor/grad_norm", "grad_norm")),
}
PROGRESS_METRICS["gspo"] = PROGRESS_METRICS["grpo"]


@dataclass
class StageTrainer:
    """One algorithm's trainer behind one interface: `step()` -> metrics (with `timing_s/step`),
    `global_step`, and the `model` and `text_io` (tokenizer or processor) a checkpoint saves."""

    algorithm: str
    trainer: Any  # has step() -> dict[str, float] and global_step
    model: Any
    text_io: Any

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        metrics = dict(self.trainer.step())
        metrics.setdefault("timing_s/step", time.perf_counter() - start)
        return metrics

    def progress(self, metrics: dict[str, float]) -> str:
        """`label=value` for the algorithm's headline metrics (those present), then the step time."""
        parts = [f"{label}={metrics[key]:.4g}" for key, label in PROGRESS_METRICS[self.algorithm] if key in metrics]
        return "  ".join([*parts, f"{metrics['timing_s/step']:.2f}s"])


def lora_spec(stage: RLStage) -> LoraSpec | None:
    return None if stage.lora is None else LoraSpec.parse(stage.lora.model_dump())


def preference_config(stage: RLStage) -> Any:
    """The PreferenceConfig of a dpo/mpo stage (its own checks run again here)."""
    from omni_core.training.preference import PreferenceConfig

    t = stage.trainer
    return PreferenceConfig(loss_mode=stage.algorithm.name, **stage.algorithm.options(), lr=t.lr,
                            batch_size=t.batch_size, total_steps=t.total_steps, max_grad_norm=t.max_grad_norm)


def flow_grpo_config(stage: RLStage) -> Any:
    """The FlowGRPOConfig of a flow_grpo stage."""
    from omni_core.training.flow_grpo import FlowGRPOConfig

    t = stage.trainer
    return FlowGRPOConfig(**stage.algorithm.options(), group_size=stage.rollout.n, prompts_per_step=t.batch_size,
                          lr=t.lr, max_grad_norm=t.max_grad_norm, ppo_epochs=t.ppo_epochs, reward=stage.reward.name)


def build_stage_trainer(stage: RLStage, rows: list[dict[str, Any]], seed: int, *, rollout: bool = True) -> StageTrainer:
    """Load `stage.model` (adapter, adapter_stage, LoRA) and wrap it in the algorithm's trainer.
    `rollout=False`: a GRPO/GSPO trainer without its own rollout engine (batches come from rollout
    workers, `GRPOTrainer.learn`)."""
    name = stage.algorithm.name
    model, text_io = load_model(stage.model, seed=seed, adapter=stage.adapter, stage=stage.adapter_stage,
                                lora=lora_spec(stage))
    diffusion = isinstance(model, SD3Model)
    if diffusion != (name == "flow_grpo"):
        wanted = "a text-to-image diffusion model (e.g. tiny://sd3)" if name == "flow_grpo" else "a language model"
        found = "a diffusion model" if diffusion else f"a {type(model).__name__}"
        raise ConfigError(f"stages.{stage.name}.model: {name} trains {wanted}, but {stage.model} loads as {found}")
    torch.manual_seed(seed)
    if name in ("grpo", "gspo"):
        from omni_core.training.grpo_loop import GRPOTrainer

        trainer: Any = GRPOTrainer(stage, rows, seed, model=model, tokenizer=text_io, rollout=rollout)
    elif name in PREFERENCE_ALGORITHMS:
        from omni_core.training.preference import PreferenceTrainer

        trainer = PreferenceTrainer(model, text_io, rows, preference_config(stage), seed=seed)
    elif name == "flow_grpo":
        from omni_core.training.flow_grpo import FlowGRPOTrainer

        trainer = FlowGRPOTrainer(flow_grpo_config(stage), model, rows, seed)
    else:  # the config's Literal keeps this unreachable
        raise ValueError(f"algorithm {name!r} has no trainer")
    return StageTrainer(name, trainer, model, text_io)
