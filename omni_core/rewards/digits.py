"""Digit-task reward (data_source `digits_rotate`, `omni_core.data.digits`): partial credit.

The answer is the stripped response; it must be digits only (else 0.0, a format failure). The score
is the share of positions where it agrees with the ground truth, over the longer of the two:

    score = #{i : answer[i] == truth[i]} / max(len(answer), len(truth))

so `9174` for truth `9174` scores 1.0, `9170` 0.75, `91` 0.5, `91745` 0.8. Returns
{score, acc (exact match)}. Signature: verl's custom reward (registry.py). The scorer itself is in
digits_score.py (standard library only): verl's interpreter loads that file by path as its
`reward.custom_reward_function` (backend verl).
"""

from __future__ import annotations

from omni_core.rewards.digits_score import compute_score as _score
from omni_core.rewards.registry import register_reward

compute_score = register_reward("digits", data_sources=["digits_rotate"])(_score)
