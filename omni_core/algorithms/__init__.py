"""Algorithms as pure tensor functions: advantages and policy losses, chosen by config name."""

from omni_core.algorithms.grpo import grpo_advantages
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

__all__ = [
    "aggregate",
    "get_policy_loss",
    "grpo_advantages",
    "grpo_policy_loss",
    "gspo_policy_loss",
    "k3_kl",
    "policy_loss",
    "policy_loss_names",
    "register_policy_loss",
]
