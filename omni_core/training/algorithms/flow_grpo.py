"""FlowGRPO on a text-to-image flow-matching model (`omni_core.training.flow_grpo.FlowGRPOTrainer`):
SDE rollouts of `rollout.n` images per prompt, rewards, group advantages, a clipped loss per
denoising step (defaults: flow_grpo's SD3 OCR recipe where it has one)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_core.training.algorithms import (
    DIFFUSION_MODEL,
    DIFFUSION_PROMPTS,
    Algorithm,
    AlgorithmOptions,
    register_algorithm,
)


class FlowGRPOOptions(AlgorithmOptions):
    name: Literal["flow_grpo"] = Field("flow_grpo", description="FlowGRPO on a flow-matching diffusion model.")
    num_steps: int = Field(10, ge=1, description="Denoising steps of a training rollout (SDE).")
    noise_level: float = Field(0.7, gt=0, description="SDE noise level of the rollout.")
    sde_type: Literal["sde", "cps"] = Field("sde", description="The rollout's stochastic sampler: sde (FlowGRPO's) "
                                                              "or cps (coefficients-preserving sampling).")
    guidance_scale: float = Field(4.5, ge=1.0, description="True-CFG weight; 1.0 turns CFG off.")
    negative_prompt: str = Field("", description="Prompt of the unconditional CFG branch.")
    adv_std: Literal["group", "global"] = Field("group", description="Normalise rewards by the group's std or the "
                                                                     "whole batch's.")
    adv_clip: float = Field(5.0, gt=0, description="Advantages are clipped to [-adv_clip, adv_clip].")
    clip_range: float = Field(1e-4, gt=0, description="PPO clip of the per-step probability ratio.")
    kl_beta: float = Field(0.0, ge=0, description="Weight of the KL to the reference (0.04 for OCR).")
    timestep_fraction: float = Field(1.0, gt=0, le=1, description="Share of the denoising steps trained (the first).")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per pass over the rollout.")

    @property
    def num_train_steps(self) -> int:
        return max(1, int(self.num_steps * self.timestep_fraction))


# the trainer module imports this one (for the options), never the reverse: named, resolved when a stage runs


register_algorithm(Algorithm(
    name="flow_grpo", options=FlowGRPOOptions, trainer="omni_core.training.flow_grpo:build_trainer",
    data=DIFFUSION_PROMPTS, model_kind=DIFFUSION_MODEL,
    stage_keys={"trainer": ("total_steps", "batch_size", "lr", "max_grad_norm", "ppo_epochs"), "rollout": ("n",),
                "reward": ("name",)},
    defaults={"trainer.lr": 3e-4, "trainer.batch_size": 2, "reward.name": "jpeg_compressibility"},
    progress=(("critic/score/mean", "score"), ("actor/pg_loss", "pg_loss"), ("actor/grad_norm", "grad_norm")),
    metrics={
        "actor/pg_loss": "the clipped per-denoising-step loss (docs/reference/formulas.md#flowgrpo)",
        "actor/pg_clipfrac": "share of steps where abs(ratio - 1) > clip_range",
        "actor/ppo_kl": "mean of old_logp - logp",
        "actor/kl_loss": "the KL term to the reference, when kl_beta > 0",
        "actor/grad_norm": "gradient norm before clipping",
        "actor/lr": "learning rate",
        "critic/score/mean": "mean reward of the batch's images",
        "critic/score/max": "the largest",
        "critic/score/min": "the smallest",
        "critic/rewards/mean": "the same mean (verl logs both)",
        "critic/advantages/mean": "mean advantage",
        "critic/advantages/max": "the largest",
        "critic/advantages/min": "the smallest",
        "timing_s/gen": "seconds generating the images",
        "timing_s/reward": "seconds scoring them",
        "timing_s/old_log_prob": "seconds of the old log-probs",
        "timing_s/update_actor": "seconds of the policy update",
        "training/global_step": "the step",
        "training/rollout_probs_diff_mean": "mean abs(p_actor - p_rollout), p a Gaussian density (its own units)",
        "training/rollout_probs_diff_max": "its largest value",
        "training/rollout_probs_diff_std": "its standard deviation",
        "training/rollout_probs_diff_valid": "1 when the rollout returned log-probs to compare",
        "training/rollout_actor_probs_pearson_corr": "Pearson correlation of p_actor and p_rollout (scale-free: the "
                                                     "number to watch)",
    },
))
