"""Rollout engines: batched generation with the log-probs a trainer recomputes (REFERENCE.md section 4)."""

from omni_core.rollout.engine import EngineConfig, RolloutEngine, RolloutRequest, RolloutResult

__all__ = ["EngineConfig", "RolloutEngine", "RolloutRequest", "RolloutResult"]
