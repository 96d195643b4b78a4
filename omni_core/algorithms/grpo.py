"""GRPO advantages: rewards normalised within each prompt's group of responses.

    A_i = (r_i - mean_{g(i)}(r)) / (std + eps)

- `scale="group"`: std is the unbiased (Bessel-corrected, as `torch.std`) std of the group g(i);
- `scale="batch"`: std is the unbiased std of all rewards in the batch;
- `scale="none"`:  no division, A_i = r_i - mean_{g(i)}(r) (Dr.GRPO).
A group of one response carries no comparison, so its advantage is 0. The result is per sequence,
shape [B]; the policy loss broadcasts it over the response tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from omni_core.errors import ConfigError

AdvantageScale = Literal["group", "batch", "none"]
SCALES = ("group", "batch", "none")


def group_index(group_ids: Tensor | Sequence) -> Tensor:
    """Map arbitrary group ids (ints, strings, uuids) to 0..G-1 in order of first appearance."""
    keys = group_ids.tolist() if isinstance(group_ids, Tensor) else list(group_ids)
    first: dict = {}
    return torch.tensor([first.setdefault(k, len(first)) for k in keys], dtype=torch.long)


@torch.no_grad()
def group_moments(rewards: Tensor, group_ids: Tensor | Sequence) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(rewards as float32 [B], group index [B], per-group count [G], rewards minus their group mean [B],
    per-group sum of squared deviations [G]): what every group-normalised advantage is built from."""
    r = rewards.detach().to(torch.float32).reshape(-1)
    idx = group_index(group_ids).to(r.device)
    if idx.numel() != r.numel():
        raise ValueError(f"rewards has {r.numel()} entries but group_ids has {idx.numel()}")
    if r.numel() == 0:
        empty = r.new_zeros(0)
        return r, idx, empty, empty, empty
    n_groups = int(idx.max()) + 1
    count = torch.zeros(n_groups, device=r.device).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(n_groups, device=r.device).index_add_(0, idx, r) / count
    centered = r - mean[idx]
    sum_sq = torch.zeros(n_groups, device=r.device).index_add_(0, idx, centered**2)
    return r, idx, count, centered, sum_sq


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence,
    scale: AdvantageScale = "group",
    eps: float = 1e-6,
) -> Tensor:
    """Per-sequence GRPO advantages [B] (float32) for `rewards` [B] grouped by `group_ids` [B]."""
    if scale not in SCALES:
        raise ConfigError(f"unknown advantage scale {scale!r}; use one of {', '.join(SCALES)}")
    r, idx, count, centered, sum_sq = group_moments(rewards, group_ids)
    if r.numel() == 0:
        return r.clone()
    if scale == "group":
        std = (sum_sq / (count - 1).clamp(min=1)).sqrt()[idx]
        adv = centered / (std + eps)
    elif scale == "batch":
        adv = centered / (r.std() + eps) if r.numel() > 1 else centered
    else:
        adv = centered
    return torch.where(count[idx] > 1, adv, torch.zeros_like(adv))
