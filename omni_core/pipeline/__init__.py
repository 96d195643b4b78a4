"""Pipeline runs: stages in dependency order, with the MLflow run hierarchy around them."""

from omni_core.pipeline.run import PipelineRun, StageOutcome

__all__ = ["PipelineRun", "StageOutcome"]
