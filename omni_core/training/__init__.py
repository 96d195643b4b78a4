"""Training stages on Ray: the trainer actor, the GRPO loop, checkpoints."""

from omni_core.training.checkpoint import latest_checkpoint, save_checkpoint, stage_prefix
from omni_core.training.ray_stage import RLStageResult, ensure_ray, rl_run_key, run_rl_stage

__all__ = ["RLStageResult", "ensure_ray", "latest_checkpoint", "rl_run_key", "run_rl_stage", "save_checkpoint",
           "stage_prefix"]
