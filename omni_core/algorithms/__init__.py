"""Algorithms as pure tensor functions: advantages and policy, preference and diffusion losses."""

from omni_core.algorithms.flow_grpo import (
    cfg_combine,
    flow_grpo_advantages,
    flow_grpo_loss,
    flow_sde_step,
    get_diffusion_loss,
    register_diffusion_loss,
)
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
