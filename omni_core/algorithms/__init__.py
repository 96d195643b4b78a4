"""Algorithms as pure tensor functions: advantages and policy, preference and diffusion losses.

`policy_loss` and `preference` import torch only when a loss is computed, and the names of
`flow_grpo` and `grpo` load on first use, so validating a config (which checks loss names against
these registries) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from omni_core.algorithms.policy_loss import (
    aggregate,
    get_policy_loss,
    grpo_policy_loss,
    gspo_policy_loss,
    k3_kl,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from omni_core.algorithms.preference import (
    dpo_loss,
    get_preference_loss,
    mpo_loss,
    preference_loss,
    preference_loss_names,
    preference_metrics,
    register_preference_loss,
    sequence_logps,
    sft_loss,
    token_logps,
)

_TORCH_EXPORTS = {
    "cfg_combine": "flow_grpo", "flow_grpo_advantages": "flow_grpo", "flow_grpo_loss": "flow_grpo",
    "flow_sde_step": "flow_grpo", "get_diffusion_loss": "flow_grpo", "register_diffusion_loss": "flow_grpo",
    "grpo_advantages": "grpo",
}

__all__ = [
    "aggregate",
    "cfg_combine",
    "dpo_loss",
    "flow_grpo_advantages",
    "flow_grpo_loss",
    "flow_sde_step",
    "get_diffusion_loss",
    "get_policy_loss",
    "get_preference_loss",
    "grpo_advantages",
    "grpo_policy_loss",
    "gspo_policy_loss",
    "k3_kl",
    "mpo_loss",
    "policy_loss",
    "policy_loss_names",
    "preference_loss",
    "preference_loss_names",
    "preference_metrics",
    "register_diffusion_loss",
    "register_policy_loss",
    "register_preference_loss",
    "sequence_logps",
    "sft_loss",
    "token_logps",
]


def __getattr__(name: str) -> Any:
    if name not in _TORCH_EXPORTS:
        raise AttributeError(f"module 'omni_core.algorithms' has no attribute {name!r}")
    return getattr(importlib.import_module(f"omni_core.algorithms.{_TORCH_EXPORTS[name]}"), name)
