"""The digits reward's scorer (digits.py registers it as `digits`), standard library only: backend verl
hands this file to verl as `reward.custom_reward_function.path` (verl loads it by path, without omni_core)."""

from __future__ import annotations

import re
from typing import Any

_DIGITS = re.compile(r"[0-9]+")


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
