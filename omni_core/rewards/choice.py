"""Multiple-choice reward (AVQA-R1-6K, data_source "avqa_r1_6k"), as VeRL-Omni's `choice_reward`.

The first `<answer>...</answer>` payload of the response (whitespace stripped) must equal that of the
ground truth (`"<answer>B</answer>"`); a response without the tag scores 0. A ground truth without
the tag is taken whole (stripped), so a bare letter works too. Exact match: case and text count.
"""

from __future__ import annotations

import re
from typing import Any

from omni_core.rewards.registry import register_reward

_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The stripped payload of the first `<answer>...</answer>` in `text`, or None."""
    match = _ANSWER.search(text or "")
    return match.group(1).strip() if match else None


@register_reward("choice", data_sources=["avqa_r1_6k"])
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, float]:
    """{"score", "accuracy"}: both 1.0 if the answer payloads match exactly, else 0.0."""
    prediction = extract_answer(solution_str)
    target = extract_answer(ground_truth)
    if target is None:
        target = (ground_truth or "").strip()
    accuracy = float(prediction is not None and prediction == target)
    return {"score": accuracy, "accuracy": accuracy}
