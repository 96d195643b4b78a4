"""Rewards: functions scoring a response against its ground truth, their registry, batch scoring.

Every reward has verl's custom-reward signature
`compute_score(data_source, solution_str, ground_truth, extra_info=None)` returning a float or a dict
with "score" (registry.py); for image rewards `solution_str` is the image (images.py).

| name                 | data_source          | module   |
| -------------------- | -------------------- | -------- |
| digits               | digits_rotate        | digits   |
| gsm8k                | openai/gsm8k         | gsm8k    |
| mmk12                | mmk12                | mmk12    |
| choice               | avqa_r1_6k           | choice   |
| ocr                  | flow_grpo/ocr        | ocr      |
| jpeg_compressibility | jpeg_compressibility | jpeg     |
| default              | (dispatches by data_source)    |
"""

from omni_core.rewards import choice, digits, gsm8k, jpeg, mmk12, ocr  # noqa: F401  (register the rewards)
from omni_core.rewards.batch import resolve_reward, score_batch
from omni_core.rewards.math_verify_pool import configure_math_verify, math_verify_score, shutdown_math_verify
from omni_core.rewards.registry import (
    as_score_dict,
    default_compute_score,
    get_reward,
    register_reward,
    reward_data_sources,
    reward_for_data_source,
    reward_names,
)

__all__ = [
    "as_score_dict", "configure_math_verify", "default_compute_score", "get_reward", "math_verify_score",
    "register_reward", "resolve_reward", "reward_data_sources", "reward_for_data_source", "reward_names",
    "score_batch", "shutdown_math_verify",
]
