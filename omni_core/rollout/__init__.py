"""Rollout engines: batched generation with the log-probs a trainer recomputes (docs/reference/rollout.md)."""

from omni_core.rollout.autoregressive import ARengine, ARPrompt, ARSampling
from omni_core.rollout.diffusion import DiffusionEngine, DiffusionSampling
from omni_core.rollout.engine import EngineConfig, RolloutEngine, RolloutRequest, RolloutResult
from omni_core.rollout.metrics import rollout_consistency
from omni_core.rollout.vllm_omni import VllmOmniEngine, verl_omni_overrides

__all__ = ["ARPrompt", "ARSampling", "ARengine", "DiffusionEngine", "DiffusionSampling", "EngineConfig",
           "RolloutEngine", "RolloutRequest", "RolloutResult", "VllmOmniEngine", "rollout_consistency", "verl_omni_overrides"]
