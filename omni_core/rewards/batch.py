"""Batch scoring with a worker pool, results in input order.

Each item is a mapping of keyword arguments for the reward function, verl's names:
`{"data_source", "solution_str", "ground_truth", "extra_info"}` (more keys are passed on as extra
keyword arguments). The pool is of threads: the heavy parts already run outside the interpreter
(Math-Verify in its process pool, tesseract as a subprocess, JPEG encoding in C without the GIL),
and a thread can call any reward, including a custom one loaded from a file (which a process pool
could not pickle).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omni_core.rewards.registry import RewardFn, as_score_dict, default_compute_score, get_reward


def resolve_reward(reward: str | RewardFn | None) -> RewardFn:
    """A reward spec (name, data_source or `path.py:function`), a function, or None (by data_source)."""
    if reward is None:
        return default_compute_score
    return get_reward(reward) if isinstance(reward, str) else reward


def score_batch(
    items: Iterable[Mapping[str, Any]],
    reward: str | RewardFn | None = None,
    workers: int = 1,
) -> list[dict[str, Any]]:
    """`as_score_dict(reward(**item))` for each item, in order; `workers` > 1 scores in parallel.

    With `reward=None` each item is scored by the reward registered for its `data_source`.
    An exception from a reward function propagates (the rewards that define a failure score, like
    `ocr` and math_verify, return it themselves).
    """
    fn = resolve_reward(reward)
    items = list(items)

    def score(item: Mapping[str, Any]) -> dict[str, Any]:
        return as_score_dict(fn(**item))

    if workers <= 1 or len(items) <= 1:
        return [score(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="reward") as pool:
        return list(pool.map(score, items))
