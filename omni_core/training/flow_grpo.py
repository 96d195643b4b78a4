"""FlowGRPO on a text-to-image rectified-flow model (`SD3Model`): rollout, reward, advantages, update.

The components, each one thing on plain torch objects (formulas in `omni_core.algorithms.flow_grpo`):

    batch      = rollout(model, prompts, seeds, num_steps=10, noise_level=0.7, guidance_scale=4.5)
    rewards    = score_images(batch.images, rows, reward)
    advantages = flow_grpo_advantages(rewards, batch.group_ids, std="group", clip=5.0)
    metrics    = policy_update(model, optimizer, batch, advantages, config, generator=g, frozen_reference=None)

`FlowGRPOTrainer.step()` composes them (prompt rows and a seed in, verl-named metrics out).

- The rollout runs the SDE sampler and records, per denoising step j, the latent before it
  (`latents[:, j]`), after it (`latents[:, j + 1]`), the step's log-prob and mean. Those log-probs are
  the old (behaviour-policy) log-probs: the update recomputes each trained step's log-prob of the
  recorded `latents[:, j + 1]` under the current weights (flow_grpo's `train_sd3.py`).
- True-CFG (`guidance_scale` != 1): v = v_u + w (v_c - v_u), both branches in one transformer forward
  over [negative; prompt] embeddings, in the rollout and in the recomputation alike.
- KL (`kl_beta` > 0): mean((mu_theta - mu_ref)^2) / (2 std_t^2) against the reference policy, which
  is the same model with its LoRA adapter disabled, or a frozen copy of the starting transformer
  when the whole transformer is trained.
- Trained steps: the first int(num_steps * timestep_fraction) denoising steps. Gradients accumulate
  over them; one optimizer step per mini-batch; `ppo_epochs` passes over the rollout.
- Evaluation: the deterministic ODE sampler (noise_level 0) with `eval_num_steps` steps.
- Determinism: every sample draws its initial and per-step noise from its own generator, seeded by
  `sample_seed(seed, step, index)`; prompt order and mini-batch shuffles come from seeded
  generators. Same seed: same rewards and same weights.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import ConfigDict, Field
from torch import Tensor

from omni_core.algorithms.flow_grpo import flow_grpo_advantages, flow_grpo_loss, flow_sde_step
from omni_core.config.models import RLStage
from omni_core.errors import ConfigError, DataError, ModelError
from omni_core.models.diffusion import PromptEmbeds, SD3Model
from omni_core.rewards import resolve_reward, score_batch
from omni_core.rewards.registry import RewardFn
from omni_core.rollout.diffusion import DiffusionSampling, sample_trajectories
from omni_core.rollout.engine import RolloutResult
from omni_core.rollout.metrics import rollout_consistency
from omni_core.training.algorithms.flow_grpo import FlowGRPOOptions
from omni_core.training.components import PromptCursor, build_optimizer, make_reference
from omni_core.training.components import reference_policy as shared_reference
from omni_core.training.trainer import TrainerState

__all__ = [
    "DiffusionRollout",
    "FlowGRPOConfig",
    "FlowGRPOTrainer",
    "build_trainer",
    "policy_update",
    "prompt_text",
    "reference_policy",
    "rollout",
    "sample_seed",
    "derive_seed",
    "score_images",
    "step_log_prob",
]


class FlowGRPOConfig(FlowGRPOOptions):
    """A FlowGRPO trainer's settings: the stage's `algorithm:` options (`FlowGRPOOptions`, defined once,
    in omni_core.training.algorithms.flow_grpo) plus the stage's trainer, rollout and reward keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    set_elsewhere: ClassVar[dict[str, str]] = {}

    group_size: int = Field(4, ge=1, description="Images per prompt (rollout.n), the advantage group.")
    prompts_per_step: int = Field(2, ge=1, description="Prompts per step (trainer.batch_size).")
    eval_num_steps: int = Field(40, ge=1, description="Denoising steps of the ODE evaluation.")
    lr: float = Field(3e-4, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout.")
    reward: str = Field("jpeg_compressibility", description="Reward name, data_source or path.py:function.")


# ---- rollout ------------------------------------------------------------------------------------


@dataclass
class DiffusionRollout:
    """Trajectories of a batch of images, everything the update needs to recompute log-probs."""

    prompts: list[str]
    group_ids: Tensor  # [B]: which prompt each image answers
    seeds: list[int]  # [B]: the seed of each sample's noise
    cond: PromptEmbeds  # [B, ...]
    uncond: PromptEmbeds | None  # [B, ...] when guidance_scale != 1
    sigmas: Tensor  # [S + 1], from 1 down to 0
    latents: Tensor  # [B, S + 1, C, H, W]: before step j at [:, j], after it at [:, j + 1]
    log_probs: Tensor  # [B, S]: behaviour-policy log-prob of each step (nan for an ODE rollout)
    means: Tensor  # [B, S, C, H, W]: each step's mean
    guidance_scale: float
    noise_level: float
    sde_type: str

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def images(self) -> Tensor:
        """The final samples [B, C, H, W] in [-1, 1]."""
        return self.latents[:, -1].clamp(-1, 1)

    @classmethod
    def from_results(
        cls, results: Sequence[RolloutResult], prompts: Sequence[str], group_ids: Tensor | Sequence[int] | None = None
    ) -> DiffusionRollout:
        """The batch of `DiffusionEngine` results (of one sampling, built with prompt embeddings);
        `prompts[i]` is result i's prompt."""
        if len(results) != len(prompts) or not results:
            raise ValueError(f"{len(results)} results for {len(prompts)} prompts")
        samplings = {dataclasses.replace(r.extra["sampling"], negative_prompt="") for r in results}
        if len(samplings) != 1:
            raise ValueError(f"results of different samplings cannot form one batch: {samplings}")
        sampling = results[0].extra["sampling"]
        if "prompt_embeds" not in results[0].extra:
            raise ValueError("the results carry no prompt embeddings (engine built with return_prompt_embeds=False)")

        def stack(name: str) -> Tensor:
            return torch.stack([r.extra[name] for r in results])

        return cls(
            prompts=list(prompts),
            group_ids=torch.as_tensor(list(range(len(results)) if group_ids is None else group_ids), dtype=torch.long),
            seeds=[int(r.seed) for r in results],
            cond=PromptEmbeds(stack("prompt_embeds"), stack("pooled_prompt_embeds")),
            uncond=(PromptEmbeds(stack("negative_prompt_embeds"), stack("negative_pooled_prompt_embeds"))
                    if sampling.cfg else None),
            sigmas=results[0].extra["sigmas"],
            latents=stack("latents"),
            log_probs=torch.stack([r.logprobs for r in results]),
            means=stack("means"),
            guidance_scale=sampling.guidance_scale,
            noise_level=sampling.noise_level,
            sde_type=sampling.sde_type,
        )

    def select(self, index: Tensor) -> DiffusionRollout:
        """The samples `index` (a 1-D long tensor)."""
        rows = index.tolist()

        def pick(embeds: PromptEmbeds | None) -> PromptEmbeds | None:
            return None if embeds is None else PromptEmbeds(embeds.embeds[index], embeds.pooled[index])

        return dataclasses.replace(
            self,
            prompts=[self.prompts[i] for i in rows],
            group_ids=self.group_ids[index],
            seeds=[self.seeds[i] for i in rows],
            cond=pick(self.cond),
            uncond=pick(self.uncond),
            latents=self.latents[index],
            log_probs=self.log_probs[index],
            means=self.means[index],
        )


_NOISE, _PROMPTS, _SHUFFLE = 0, 1, 2  # independent seed streams


def derive_seed(seed: int, *keys: int) -> int:
    """A 32-bit seed hashed from `seed` and non-negative `keys` (distinct keys: unrelated streams)."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


def sample_seed(seed: int, step: int, index: int) -> int:
    """The noise seed of sample `index` at training step `step`."""
    return derive_seed(seed, _NOISE, step, index)


@torch.no_grad()
def rollout(
    model: SD3Model,
    prompts: Sequence[str],
    seeds: Sequence[int],
    *,
    num_steps: int = 10,
    noise_level: float = 0.7,
    guidance_scale: float = 1.0,
    negative_prompt: str = "",
    sde_type: str = "sde",
    group_ids: Tensor | Sequence[int] | None = None,
) -> DiffusionRollout:
    """Sample one image per (prompt, seed) and record its trajectory.

    noise_level > 0: the FlowGRPO SDE sampler, with each step's log-prob and mean. noise_level 0:
    the deterministic Euler (ODE) sampler; log-probs are then undefined (nan). The sampling math is
    the rollout engine's (`omni_core.rollout.diffusion.sample_trajectories`): the whole batch in one
    forward per step, as a `DiffusionEngine` request-level batch.
    """
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    sampling = DiffusionSampling(num_steps=num_steps, guidance_scale=guidance_scale, noise_level=noise_level,
                                 sde_type=sde_type, negative_prompt=negative_prompt)
    cond = model.encode_prompt(list(prompts))
    # the negative prompt encoded per row, as before the engine existed: the same numbers bit for bit
    # (one encoding broadcast differs by ~1e-7, enough to move the 40-step learning test's figures)
    uncond = model.negative_embeds(len(prompts), negative_prompt) if sampling.cfg else None
    traj = sample_trajectories(model, cond, uncond, seeds, sampling)
    if group_ids is None:
        group_ids = range(len(prompts))
    return DiffusionRollout(
        prompts=list(prompts),
        group_ids=torch.as_tensor(list(group_ids), dtype=torch.long),
        seeds=[int(s) for s in seeds],
        cond=cond,
        uncond=uncond,
        sigmas=traj.sigmas,
        latents=traj.latents,
        log_probs=traj.log_probs,
        means=traj.means,
        guidance_scale=guidance_scale,
        noise_level=noise_level,
        sde_type=sde_type,
    )


# ---- reward -------------------------------------------------------------------------------------


def prompt_text(row: dict[str, Any] | str) -> str:
    """The text an SD3 model encodes: a plain prompt, or the last user message of a chat prompt."""
    if isinstance(row, str):
        return row
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    return [m["content"] for m in prompt if m["role"] == "user"][-1]


def score_images(
    images: Tensor, rows: Sequence[dict[str, Any]], reward: str | RewardFn, workers: int = 1
) -> Tensor:
    """Rewards [B] (float32) of the images, scored by verl's `compute_score(data_source,
    solution_str=<uint8 image>, ground_truth, extra_info)`; `rows[i]` is image i's prompt row."""
    fn = resolve_reward(reward)
    items = [
        {
            "data_source": row.get("data_source", reward if isinstance(reward, str) else "image"),
            "solution_str": pixels,
            "ground_truth": (row.get("reward_model") or {}).get("ground_truth"),
            "extra_info": row.get("extra_info"),
        }
        for row, pixels in zip(rows, SD3Model.to_uint8(images), strict=True)
    ]
    return torch.tensor([s["score"] for s in score_batch(items, fn, workers)], dtype=torch.float32)


# ---- update -------------------------------------------------------------------------------------


def step_log_prob(model: SD3Model, batch: DiffusionRollout, j: int) -> tuple[Tensor, Tensor, Tensor]:
    """(log_prob [B], mean, std_t) of the recorded step j under `model`'s current weights, with the
    rollout's guidance, noise level and SDE type; gradient flows through the velocity."""
    x = batch.latents[:, j]
    v = model.velocity(x, batch.sigmas[j], batch.cond, uncond=batch.uncond, guidance_scale=batch.guidance_scale)
    _, log_prob, mean, std = flow_sde_step(
        x, v, batch.sigmas[j], batch.sigmas[j + 1], batch.noise_level,
        prev_sample=batch.latents[:, j + 1], sde_type=batch.sde_type,  # type: ignore[arg-type]
    )
    return log_prob, mean, std


@contextmanager
def reference_policy(model: SD3Model, frozen: torch.nn.Module | None = None) -> Iterator[SD3Model]:
    """The KL reference: `model` with its LoRA adapter disabled, or `model` with the `frozen`
    transformer (a copy of the starting weights) when the whole transformer is trained
    (`components.reference_policy` on the transformer)."""
    try:
        with shared_reference(model.transformer, frozen) as transformer:
            yield model if transformer is model.transformer else dataclasses.replace(model, transformer=transformer)
    except ModelError as exc:
        raise ValueError(f"a KL reference needs a LoRA model or a frozen copy of the transformer ({exc})") from None


def policy_update(
    model: SD3Model,
    optimizer: torch.optim.Optimizer,
    batch: DiffusionRollout,
    advantages: Tensor,
    config: FlowGRPOConfig,
    *,
    generator: torch.Generator,
    frozen_reference: torch.nn.Module | None = None,
) -> dict[str, float]:
    """`ppo_epochs` passes over the rollout in `mini_batches` shuffled mini-batches; per mini-batch the
    clipped loss (+ kl_beta * KL) of each trained step, accumulated, then one clipped optimizer step."""
    params = [p for p in model.parameters() if p.requires_grad]
    steps = range(config.num_train_steps)
    stats: dict[str, list[float]] = defaultdict(list)
    model.transformer.train()
    for _ in range(config.ppo_epochs):
        order = torch.randperm(len(batch), generator=generator)
        for index in order.chunk(config.mini_batches):
            sub, adv = batch.select(index), advantages[index]
            optimizer.zero_grad(set_to_none=True)
            for j in steps:
                log_prob, mean, std = step_log_prob(model, sub, j)
                ref_mean = None
                if config.kl_beta > 0:
                    with torch.no_grad(), reference_policy(model, frozen_reference) as reference:
                        ref_mean = step_log_prob(reference, sub, j)[1]
                loss, metrics = flow_grpo_loss(
                    log_prob, sub.log_probs[:, j], adv, config.clip_range,
                    mean=mean, ref_mean=ref_mean, std=std, beta=config.kl_beta,
                )
                (loss / len(steps)).backward()
                for name, value in metrics.items():
                    stats[name].append(value)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            stats["actor/grad_norm"].append(float(grad_norm))
    model.transformer.eval()
    return {name: float(np.mean(values)) for name, values in stats.items()}


# ---- the trainer --------------------------------------------------------------------------------


class FlowGRPOTrainer(TrainerState):
    """`step()` runs one FlowGRPO step on `model` (trained in place) and returns verl-named metrics;
    `evaluate()` scores ODE samples of fixed prompts and seeds.

    `rows`: prompt rows (verl RL Parquet rows, e.g. the `ocr` converter's, or `{"prompt": text}`).
    With LoRA only the adapter trains and the KL reference is the model with the adapter disabled;
    without it the trainable parameters train and the reference is a frozen copy of the start.
    """

    def __init__(self, config: FlowGRPOConfig, rows: Sequence[dict[str, Any]], seed: int, *, model: SD3Model,
                 text_io: Any = None):
        if not rows:
            raise DataError("FlowGRPO got no prompt rows; check the stage's dataset and split")
        self.config, self.model, self.rows, self.seed = config, model, list(rows), seed
        self.text_io = text_io  # what a checkpoint saves beside the weights (the SD3 tokenizer)
        self.reward = resolve_reward(config.reward)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no trainable parameters; load it with LoRA or unfrozen")
        self.optimizer = build_optimizer(model, config.lr, weight_decay=config.weight_decay)
        self.frozen_reference = make_reference(model.transformer) if config.kl_beta > 0 else None
        self.cursor = PromptCursor(len(self.rows), seed)
        self.global_step = 0

    def step(self) -> dict[str, float]:
        cfg, step = self.config, self.global_step
        start = time.perf_counter()
        picked = self.cursor.batch(step, cfg.prompts_per_step)
        rows = [self.rows[i] for i in picked for _ in range(cfg.group_size)]
        group_ids = [g for g in range(len(picked)) for _ in range(cfg.group_size)]
        seeds = [sample_seed(self.seed, step, i) for i in range(len(rows))]

        t = time.perf_counter()
        batch = rollout(
            self.model, [prompt_text(r) for r in rows], seeds, num_steps=cfg.num_steps,
            noise_level=cfg.noise_level, guidance_scale=cfg.guidance_scale,
            negative_prompt=cfg.negative_prompt, sde_type=cfg.sde_type, group_ids=group_ids,
        )
        gen_s, t = time.perf_counter() - t, time.perf_counter()
        rewards = score_images(batch.images, rows, self.reward)
        advantages = flow_grpo_advantages(rewards, batch.group_ids, std=cfg.adv_std, clip=cfg.adv_clip)
        reward_s, t = time.perf_counter() - t, time.perf_counter()
        with torch.no_grad():  # verl's training/rollout_*: rollout log-probs vs the trainer's, before updating
            recomputed = torch.stack([step_log_prob(self.model, batch, j)[0] for j in range(cfg.num_train_steps)], 1)
        consistency = rollout_consistency(batch.log_probs[:, : cfg.num_train_steps], recomputed)
        old_log_prob_s, t = time.perf_counter() - t, time.perf_counter()
        shuffle = torch.Generator().manual_seed(derive_seed(self.seed, _SHUFFLE, step))
        metrics = policy_update(
            self.model, self.optimizer, batch, advantages, cfg,
            generator=shuffle, frozen_reference=self.frozen_reference,
        )
        update_s = time.perf_counter() - t
        self.global_step += 1
        return {
            "training/global_step": float(self.global_step),
            "critic/score/mean": rewards.mean().item(),
            "critic/score/max": rewards.max().item(),
            "critic/score/min": rewards.min().item(),
            "critic/rewards/mean": rewards.mean().item(),
            "critic/advantages/mean": advantages.mean().item(),
            "critic/advantages/max": advantages.max().item(),
            "critic/advantages/min": advantages.min().item(),
            **metrics,
            **consistency,
            "actor/lr": self.optimizer.param_groups[0]["lr"],
            "timing_s/gen": gen_s,
            "timing_s/reward": reward_s,
            "timing_s/old_log_prob": old_log_prob_s,
            "timing_s/update_actor": update_s,
            "timing_s/step": time.perf_counter() - start,
        }

    def evaluate(self, rows: Sequence[dict[str, Any]], seeds: Sequence[int]) -> tuple[Tensor, Tensor]:
        """(rewards [N], images [N, C, H, W]) of ODE samples (noise_level 0, `eval_num_steps` steps,
        the training guidance) of `rows[i]` with noise seed `seeds[i]`; the weights are untouched."""
        cfg = self.config
        batch = rollout(
            self.model, [prompt_text(r) for r in rows], seeds, num_steps=cfg.eval_num_steps, noise_level=0.0,
            guidance_scale=cfg.guidance_scale, negative_prompt=cfg.negative_prompt,
        )
        return score_images(batch.images, rows, self.reward), batch.images


def build_trainer(stage: RLStage, rows: list[dict[str, Any]], seed: int, *, model: SD3Model, text_io: Any,
                  rollout: bool = True) -> FlowGRPOTrainer:
    """The flow_grpo record's trainer: the stage's `algorithm:` options plus its trainer, rollout and
    reward keys (the construction convention: omni_core.training.trainer)."""
    t = stage.trainer
    config = FlowGRPOConfig(**stage.algorithm.model_dump(), group_size=stage.rollout.n, prompts_per_step=t.batch_size,
                            lr=t.lr, max_grad_norm=t.max_grad_norm, ppo_epochs=t.ppo_epochs, reward=stage.reward.name)
    return FlowGRPOTrainer(config, rows, seed, model=model, text_io=text_io)
