"""Stage kinds: one module each, registered by `kind`. A runner gets (pipeline run, stage, MLflow run id)
and returns the stage's outputs as plain data (with `reused: True` when no work was needed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

StageRunner = Callable[[Any, Any, str], dict[str, Any]]
_RUNNERS: dict[str, StageRunner] = {}


def register_stage(kind: str) -> Callable[[StageRunner], StageRunner]:
    def decorate(fn: StageRunner) -> StageRunner:
        _RUNNERS[kind] = fn
        return fn

    return decorate


def stage_runner(kind: str) -> StageRunner:
    return _RUNNERS[kind]


from omni_core.pipeline.stages import build_images, ingest, rl  # noqa: E402,F401  (register the kinds)
