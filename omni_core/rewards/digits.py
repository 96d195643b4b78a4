"""Digit-task reward (data_source `digits_rotate`, `omni_core.data.digits`): partial credit.

The answer is the stripped response; it must be digits only (else 0.0, a format failure). The score
is the share of positions where it agrees with the ground truth, over the longer of the two:

    score = #{i : answer[i] == truth[i]} / max(len(answer), len(truth))

so `9174` for truth `9174` scores 1.0, `9170` 0.75, `91` 0.5, `91745` 0.8. Returns
{score, acc (exact match)}. Signature: verl's custom reward (registry.py).
"""

from __future__ import annotations

import re
from typing import Any

from omni_core.rewards.registry import register_reward

_DIGITS = re.compile(r"[0-9]+")


@register_reward("digits", data_sources=["digits_rotate"])
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    answer = solution_str.strip()
    if not _DIGITS.fullmatch(answer):
        return {"score": 0.0, "acc": 0.0}
    matches = sum(a == b for a, b in zip(answer, ground_truth, strict=False))
    return {"score": matches / max(len(answer), len(ground_truth)), "acc": float(answer == ground_truth)}
