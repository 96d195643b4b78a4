"""A pipeline run's parameters: a pipeline file or an inline config, dotted overrides, stages to force.

Everything here runs before any work, so a bad parameter fails the run with the validation message
and nothing else happens.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from omni_core.config import PipelineConfig, apply_overrides, load_pipeline, validate_pipeline
from omni_core.errors import ConfigError

INLINE = "<inline config>"


def resolve_pipeline(pipeline_file: str | Path | None = None,
                     config: PipelineConfig | Mapping[str, Any] | None = None,
                     overrides: Iterable[str] | None = None) -> PipelineConfig:
    """The validated config from exactly one of `pipeline_file` and `config` (a model or its dict, as
    the Prefect UI sends it), with `overrides` (`stages.rl.trainer.total_steps=3`) applied."""
    overrides = list(overrides or [])
    if (pipeline_file is None) == (config is None):
        raise ConfigError("pipeline: give either pipeline_file (a YAML path) or config (an inline pipeline), "
                          f"not {'both' if config is not None else 'neither'}")
    if pipeline_file is not None:
        return load_pipeline(pipeline_file, overrides)
    if isinstance(config, BaseModel):
        data = config.model_dump(mode="json")
    elif isinstance(config, Mapping):
        data = copy.deepcopy(dict(config))
    else:
        raise ConfigError(f"pipeline: config must be a pipeline mapping (name:, stages:, ...), got {type(config).__name__}")
    return validate_pipeline(apply_overrides(data, overrides), INLINE)


def check_force(config: PipelineConfig, force: Iterable[str] | None) -> frozenset[str]:
    """The stage names given to `--force`, each checked against the pipeline's stages."""
    names = [s.name for s in config.stages]
    chosen = list(force or [])
    for name in chosen:
        if name not in names:
            raise ConfigError(f"--force {name}: no stage '{name}' in pipeline {config.name} (stages: {', '.join(names)})")
    return frozenset(chosen)
