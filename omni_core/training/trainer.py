"""The interface every algorithm's trainer implements, and what the Ray actors and checkpoints use.

    trainer.step() -> metrics          one training step (verl metric names)
    trainer.global_step                steps taken (a dropped separate_async batch advances it too)
    trainer.model, trainer.text_io     what a checkpoint saves (text_io: tokenizer or processor; None for SD3)
    trainer.state_dict()               {"global_step", "optimizer", "rng": {"torch", "python"}}
    trainer.load_state_dict(state)     back to exactly that state (the weights are restored separately:
                                       a checkpoint holds only the trainable ones)

`TrainerState` implements the last two from `optimizer` and `global_step`; the trainers inherit it.

Construction, the same for every algorithm: the trainer's module has the factory its algorithm record
names (`"omni_core.training.sft:build_trainer"`), and the trainer class takes the same things in the
same order, the stage turned into the trainer's settings:

    build_trainer(stage, rows, seed, *, model, text_io, rollout=True) -> Trainer
    SomeTrainer(config, rows, seed, *, model, text_io)

`stage`: the training stage (RLStage); `rows`: the dataset rows it trains on; `seed`: the run's seed;
`model` and `text_io`: the loaded model (trained in place) and its tokenizer or processor;
`rollout=False`: no own rollout engine (separate_async rollout workers feed `learn`; trainers without
a rollout ignore it). `config` is the stage itself for GRPO (`GRPOTrainer(stage, ...)`, which also
takes `rollout`), the algorithm's options plus the stage keys it reads for the others
(`PreferenceConfig`, `FlowGRPOConfig`, the stage's `TrainerConfig` for SFT, whose rows are
(prompt, response) examples).
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Trainer(Protocol):
    global_step: int
    model: Any
    optimizer: torch.optim.Optimizer

    @property
    def text_io(self) -> Any: ...

    def step(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(torch_state: torch.Tensor, python_state: Any | None) -> None:
    torch.set_rng_state(torch_state)
    if python_state is not None:
        version, internal, gauss = python_state
        random.setstate((version, tuple(internal), gauss))


class TrainerState:
    """`state_dict` / `load_state_dict` of a trainer with `optimizer` and `global_step`."""

    optimizer: torch.optim.Optimizer
    global_step: int

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "optimizer": self.optimizer.state_dict(), "rng": rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.global_step = int(state["global_step"])
        if state.get("rng") is not None:
            set_rng_state(state["rng"]["torch"], state["rng"].get("python"))
