"""Which dataset rows a step reads and how its responses are scored: torch and the rewards only.

Kept apart from `omni_core.training.components` (which re-exports both) because a Ray reward worker
needs nothing else: importing `components` pulls in the model and multimodal-processor stack of
transformers (~5 CPU s with bytecode caches, ~11 without, measured on the 2-core CI machine), which a
reward worker would pay on its first `score`, on the critical path of every stage (re)start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_core.rewards import score_batch


class PromptCursor:
    """Deterministic data order: a fresh seeded permutation per epoch; batch k depends only on k."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed = num_rows, seed

    def batch(self, step: int, batch_size: int) -> list[int]:
        out = []
        for position in range(step * batch_size, (step + 1) * batch_size):
            epoch, offset = divmod(position, self.num_rows)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            out.append(int(torch.randperm(self.num_rows, generator=generator)[offset]))
        return out


def score_rollouts(rows: Sequence[dict[str, Any]], responses: Sequence[str], reward: str | None, n: int,
                   ) -> list[dict[str, Any]]:
    """verl's reward call per response (keyword arguments data_source, solution_str, ground_truth,
    extra_info); response i answers row i // n. `reward=None` dispatches by each row's data_source."""
    items = [{"data_source": rows[i // n].get("data_source", ""), "solution_str": text,
              "ground_truth": rows[i // n]["reward_model"]["ground_truth"],
              "extra_info": rows[i // n].get("extra_info")}
             for i, text in enumerate(responses)]
    return score_batch(items, reward)
