"""The trainer a training stage (`rl`, `sft`) runs, chosen by `algorithm.name` through the algorithm
records (`omni_core.training.algorithms`): one factory for the Ray actor.

    trainer = build_stage_trainer(stage, rows, seed)     # loads the model with adapter / LoRA
    metrics = trainer.step()                             # the algorithm's own metric names
    state = trainer.state_dict()                         # optimizer, step, RNG (omni_core.training.trainer)
"""

from __future__ import annotations

from typing import Any

import torch

from omni_core.config.models import RLStage
from omni_core.errors import ConfigError
from omni_core.models import SD3Model, load_model
from omni_core.models.lora import LoraSpec
from omni_core.training.algorithms import DIFFUSION_MODEL
from omni_core.training.trainer import Trainer


def lora_spec(stage: RLStage) -> LoraSpec | None:
    return None if stage.lora is None else LoraSpec.parse(stage.lora.model_dump())


def load_stage_model(stage: RLStage, seed: int) -> tuple[Any, Any]:
    """The stage's starting model (its `model` URI, or the upstream checkpoint of `model: {from: ...}`)
    with its adapter and LoRA, and its tokenizer or processor."""
    return load_model(stage.model_uri, seed=seed, adapter=stage.adapter, stage=stage.adapter_stage,
                      lora=lora_spec(stage))


def build_stage_trainer(stage: RLStage, rows: list[dict[str, Any]], seed: int, *, rollout: bool = True) -> Trainer:
    """Load the stage's model (adapter, adapter_stage, LoRA) and build the algorithm's trainer.
    `rollout=False`: a trainer without its own rollout engine, for an algorithm whose batches come
    from rollout workers (`separate_async`; the trainer's `learn(batch, rewards)`)."""
    record = stage.record
    model, text_io = load_stage_model(stage, seed)
    diffusion = isinstance(model, SD3Model)
    if diffusion != (record.model_kind == DIFFUSION_MODEL):
        wanted = f"{record.model_kind} (e.g. tiny://sd3)" if record.model_kind == DIFFUSION_MODEL else record.model_kind
        found = "a diffusion model" if diffusion else f"a {type(model).__name__}"
        raise ConfigError(f"stages.{stage.name}.model: {stage.algorithm.name} trains {wanted}, but "
                          f"{stage.model_uri} loads as {found}")
    torch.manual_seed(seed)
    return record.build_trainer(stage, rows, seed, model=model, text_io=text_io, rollout=rollout)
