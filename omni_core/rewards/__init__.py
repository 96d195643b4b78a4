"""Rewards: functions scoring a response against its ground truth, and their registry."""

from omni_core.rewards import gsm8k  # noqa: F401  (registers "gsm8k" / "openai/gsm8k")
from omni_core.rewards.registry import (
    as_score_dict,
    get_reward,
    register_reward,
    reward_data_sources,
    reward_names,
)

__all__ = ["as_score_dict", "get_reward", "register_reward", "reward_data_sources", "reward_names"]
