"""Training stages on Ray: the trainer actor, the algorithms' trainers, checkpoints.

The names below load lazily, so `omni_core.training.algorithms` (the algorithm records the config
models use) imports without Ray or torch."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {"latest_checkpoint": "checkpoint", "save_checkpoint": "checkpoint", "stage_prefix": "checkpoint",
         "RLStageResult": "ray_stage", "ensure_ray": "ray_stage", "rl_run_key": "ray_stage", "run_rl_stage": "ray_stage"}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"omni_core.training.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'omni_core.training' has no attribute {name!r}")
