"""Pipeline runs: the stage graph, the stage cache in the store, and the MLflow run hierarchy.

Exports load on first use, so `omni_core.pipeline.params` (checked by the CLI before anything starts)
does not import MLflow and Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "PipelineRun": "run", "StageContext": "run", "StageOutcome": "run",
    "StageGraph": "graph", "check_data_flow": "graph",
    "check_force": "params", "resolve_pipeline": "params",
    "StageKind": "stages", "register_stage": "stages", "stage_kind": "stages",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'omni_core.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(f"omni_core.pipeline.{_EXPORTS[name]}"), name)
