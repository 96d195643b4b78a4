"""Pipeline configuration: pydantic models, YAML loading and dotted overrides."""

from omni_core.config.loader import (
    ConfigValidationError,
    apply_overrides,
    config_digest,
    load_pipeline,
    read_yaml,
    validate_dataset,
    validate_pipeline,
)
from omni_core.config.models import (
    AlgorithmConfig,
    AnyStage,
    BuildImagesStage,
    DatasetConfig,
    IngestStage,
    PipelineConfig,
    RayConfig,
    RewardConfig,
    RLStage,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig",
    "AnyStage",
    "BuildImagesStage",
    "ConfigValidationError",
    "DatasetConfig",
    "IngestStage",
    "PipelineConfig",
    "RLStage",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "apply_overrides",
    "config_digest",
    "load_pipeline",
    "read_yaml",
    "validate_dataset",
    "validate_pipeline",
]
