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
    name: str = Field("grpo", description="The policy loss: grpo (token-level ratio), gspo (sequence-level), or "
                                          "any registered with @register_policy_loss.")
    clip_ratio_low: float = Field(0.2, ge=0, description="PPO clip below: the ratio is kept above 1 - clip_ratio_low.")
    clip_ratio_high: float = Field(0.2, ge=0, description="PPO clip above: the ratio is kept below 1 + clip_ratio_high "
                                                          "(DAPO's clip-higher when larger than clip_ratio_low).")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How token losses become the batch loss (verl's names; docs/reference/formulas.md#clipped-policy-losses).")
    adv_scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide the group-centred rewards by the group's std, the batch's std, or nothing.")
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
    metrics={
        "actor/pg_loss": "the policy-gradient loss (docs/reference/formulas.md#clipped-policy-losses)",
        "actor/pg_clipfrac": "share of tokens where the clipped term is the larger",
        "actor/ppo_kl": "mean of old_logp - logp",
        "actor/kl_loss": "the KL term to the reference, when kl_beta > 0",
        "actor/grad_norm": "gradient norm before clipping (mean over the optimizer steps of a step)",
        "actor/lr": "learning rate",
        "critic/score/mean": "mean reward of the batch",
        "critic/rewards/mean": "the same (verl logs both)",
        "critic/advantages/mean": "mean advantage of the batch",
        "response_length/mean": "response tokens per sample",
        "timing_s/gen": "seconds generating the batch",
        "timing_s/reward": "seconds scoring it",
        "timing_s/old_log_prob": "seconds of the old log-probs forward (0.0 when the update forward's are reused)",
        "timing_s/ref": "seconds of the reference forward, when kl_beta > 0",
        "timing_s/update_actor": "seconds of the policy update",
        "timing_s/update_weights": "seconds the rollout workers took to load pushed weights",
        "training/rollout_probs_diff_mean": "mean abs(p_actor - p_rollout) over the response tokens",
        "training/rollout_probs_diff_max": "its largest value",
        "training/rollout_probs_diff_std": "its standard deviation",
        "training/rollout_probs_diff_valid": "1 when the rollout returned log-probs to compare",
        "training/rollout_actor_probs_pearson_corr": "Pearson correlation of p_actor and p_rollout (healthy: > 0.995)",
        "training/off_policy/staleness_mean": "trainer step - the policy version the batch was generated with",
        "training/off_policy/dropped_samples": "samples of a batch dropped as too stale (staleness_policy: drop)",
        "training/policy_version": "the policy version the batch was generated with",
    },
), "gspo")
