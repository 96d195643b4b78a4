"""GSM8K reward, verl's strict version (`verl/utils/reward_score/gsm8k.py`, method="strict").

Only the last 300 characters of the response count; the answer is the last `#### <number>` in them,
with "," and "$" removed; the score is 1.0 when it equals the ground truth string, else 0.0
(format_score 0.0); no `#### <number>` gives 0.0. Signature: verl's custom reward (registry.py).
"""

from __future__ import annotations

import re
from typing import Any

from omni_core.rewards.registry import register_reward

SOLUTION_CLIP_CHARS = 300
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_solution(solution_str: str) -> str | None:
    """The last `#### <number>` in the final 300 characters, without "," and "$"; None if absent."""
    matches = _ANSWER.findall(solution_str[-SOLUTION_CLIP_CHARS:])
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


@register_reward("gsm8k", data_sources=["openai/gsm8k"])
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = 0.0,
    score: float = 1.0,
    **kwargs: Any,
) -> float:
    """`score` if the extracted answer equals `ground_truth`, `format_score` if it differs, 0.0 if none.

    `data_source`, `extra_info` and other keyword arguments verl may pass are not used.
    """
    answer = extract_solution(solution_str)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
