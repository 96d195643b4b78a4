"""GRPO and GSPO (and any registered policy loss): sample `rollout.n` responses per prompt, reward
them, group-normalise the advantages, PPO-clip update (`omni_core.training.grpo_loop.GRPOTrainer`).

`name` picks the policy loss from `omni_core.algorithms.policy_loss`'s registry ("grpo" token level,
"gspo" sequence level, or any `@register_policy_loss(NAME)`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from omni_core.training.algorithms import (
    ALL,
    LANGUAGE_MODEL,
    PROMPTS,
    Algorithm,
    AlgorithmOptions,
    register_algorithm,
)


class PolicyGradientOptions(AlgorithmOptions):
    name: str = "grpo"
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    adv_scale: Literal["group", "batch", "none"] = "group"
    kl_beta: float = Field(0.0, ge=0, description="Weight of the KL to the reference policy.")

    @field_validator("name")
    @classmethod
    def _a_policy_loss(cls, name: str) -> str:
        from omni_core.algorithms.policy_loss import get_policy_loss
        from omni_core.errors import ConfigError

        try:
            get_policy_loss(name)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return name


# the trainer module imports this one (for the options), never the reverse: named, resolved when a stage runs


GRPO = register_algorithm(Algorithm(
    name="grpo", options=PolicyGradientOptions, trainer="omni_core.training.grpo_loop:build_trainer", data=PROMPTS,
    model_kind=LANGUAGE_MODEL, more_names="omni_core.algorithms.policy_loss:policy_loss_names",
    separate_async=True, stage_keys={"trainer": ALL, "rollout": ALL, "reward": ALL},
    progress=(("critic/score/mean", "score"), ("actor/pg_loss", "pg_loss"), ("response_length/mean", "len")),
), "gspo")
