"""FlowGRPO: a stochastic reverse step of a rectified flow with its log-prob, advantages and loss.

Rectified flow: x_sigma = (1 - sigma) * x0 + sigma * x1 (x1 noise), velocity v = x1 - x0. A step goes
from the current noise level `sigma` to the next, smaller one `sigma_prev`; dt = sigma_prev - sigma < 0;
a = noise_level (0.7 by default). Everything is computed in float32 (bf16 overflows in the mean).

sde_type="sde" (FlowGRPO's SDE with the same marginals as the ODE):
    std_t    = a * sqrt(sigma / (1 - sigma'))        sigma' = sigma, or sigma_prev where sigma == 1
    mean     = x * (1 + std_t^2 / (2 sigma) * dt) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt
    x_prev   = mean + std_t * sqrt(-dt) * noise
    log_prob = -(x_prev - mean)^2 / (2 (std_t sqrt(-dt))^2) - log(std_t sqrt(-dt)) - log(sqrt(2 pi))
sde_type="cps" (coefficients-preserving sampling):
    x0_hat = x - sigma * v,  x1_hat = x + (1 - sigma) * v      (predicted data and noise)
    std_t    = sigma_prev * sin(a * pi / 2)
    mean     = x0_hat * (1 - sigma_prev) + x1_hat * sqrt(sigma_prev^2 - std_t^2)
    x_prev   = mean + std_t * noise
    log_prob = -(x_prev - mean)^2                            (no Gaussian normalisation, as upstream)
log_prob is then averaged over all non-batch dimensions: one number per sample and step.

Advantages, per prompt group g (population std, as flow_grpo's numpy stat tracker):
    A = clip((r - mean_g(r)) / (std + eps), -clip, clip),  std = std_g(r) ("group") or std(r) ("global")
Loss per trained denoising step, ratio = exp(log_prob - old_log_prob), c = clip_range (1e-4):
    L = mean(max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c))) + beta * mean((mu - mu_ref)^2) / (2 std_t^2)
True-CFG in training: eps = eps_u + w * (eps_c - eps_u).

Upstream notes: the KL divides by std_t^2, not by the step variance (std_t sqrt(-dt))^2, as in
flow_grpo's train_sd3.py and VeRL-Omni's KLLoss. flow_grpo's recipes set global_std=True, and
VeRL-Omni's advantage uses the Bessel-corrected torch.std; here the population std, per docs/reference/formulas.md#differences-from-upstream.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from omni_core.algorithms.grpo import group_moments
from omni_core.errors import ConfigError
from omni_core.registry import Registry

SdeType = Literal["sde", "cps"]
StdMode = Literal["group", "global"]
SDE_TYPES = ("sde", "cps")
STD_MODES = ("group", "global")

DiffusionLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
_DIFFUSION_LOSSES: Registry[DiffusionLossFn] = Registry(
    "diffusion loss", hint="add one with @register_diffusion_loss(NAME) in omni_core/algorithms/flow_grpo.py")


def register_diffusion_loss(name: str) -> Callable[[DiffusionLossFn], DiffusionLossFn]:
    """Decorator: make a diffusion policy loss selectable by `name` in the pipeline config."""
    return _DIFFUSION_LOSSES.decorator(name)


def get_diffusion_loss(name: str) -> DiffusionLossFn:
    """The diffusion loss registered as `name`; ConfigError listing the known names otherwise."""
    return _DIFFUSION_LOSSES.get(name)


def per_sample(value: float | Tensor, like: Tensor) -> Tensor:
    """A scalar or per-sample [B] value as float32 [B, 1, ..., 1], broadcastable against `like`."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device).reshape(-1)
    t = t.expand(like.shape[0]) if t.numel() == 1 else t
    return t.reshape(-1, *([1] * (like.dim() - 1)))


def flow_sde_step(
    x: Tensor,
    v: Tensor,
    sigma: float | Tensor,
    sigma_prev: float | Tensor,
    noise_level: float = 0.7,
    noise: Tensor | None = None,
    prev_sample: Tensor | None = None,
    sde_type: SdeType = "sde",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One reverse step x_sigma -> x_sigma_prev; returns (prev_sample, log_prob [B], mean, std_t).

    `prev_sample` given: its log-prob under the step (the training recomputation); otherwise it is
    drawn as mean + scale * noise, with `noise` if given, else standard normal from `generator`.
    `std_t` is returned as [B, 1, ..., 1] (for "sde" without the sqrt(-dt) factor, as upstream).
    Gradient flows into log_prob and mean through `v` (and `x`); the sample itself is detached
    inside log_prob. With noise_level 0 ("sde") the step is the deterministic Euler (ODE) step and
    log_prob is undefined (nan/inf): use it for sampling only.
    """
    if sde_type not in SDE_TYPES:
        raise ConfigError(f"unknown sde_type {sde_type!r}; use one of {', '.join(SDE_TYPES)}")
    x, v = x.float(), v.float()
    sigma, sigma_prev = per_sample(sigma, x), per_sample(sigma_prev, x)
    dt = sigma_prev - sigma
    if sde_type == "sde":
        # At sigma == 1 upstream (flow_grpo, VeRL-Omni) swaps only the denominator's sigma, for
        # scheduler.sigmas[1] (= sigma_prev of the first step): std_t = a * sqrt(1 / (1 - sigma_prev)),
        # not a * sqrt(sigma_prev / (1 - sigma_prev)).
        std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_prev, sigma)))
        mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        scale = std_t * torch.sqrt(-dt)
    else:
        std_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0_hat = x - sigma * v
        x1_hat = x + (1 - sigma) * v
        mean = x0_hat * (1 - sigma_prev) + x1_hat * torch.sqrt(sigma_prev**2 - std_t**2)
        scale = std_t
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        prev_sample = mean + scale * noise.float()
    else:
        prev_sample = prev_sample.float()
    sq = (prev_sample.detach() - mean) ** 2
    if sde_type == "sde":
        log_prob = -sq / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
    else:
        # Upstream drops every constant here, including the 1 / (2 std_t^2) factor, so cps ratios
        # are exp(-(d^2 - d_old^2)) rather than true Gaussian density ratios.
        log_prob = -sq
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.dim()))), mean, std_t


@torch.no_grad()
def flow_grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence,
    std: StdMode = "group",
    eps: float = 1e-4,
    clip: float | None = 5.0,
) -> Tensor:
    """Per-sample FlowGRPO advantages [B] (float32); a group of one gets 0 (formula in module doc)."""
    if std not in STD_MODES:
        raise ConfigError(f"unknown advantage std {std!r}; use one of {', '.join(STD_MODES)}")
    r, idx, count, centered, sum_sq = group_moments(rewards, group_ids)
    if r.numel() == 0:
        return r.clone()
    scale = (sum_sq / count).sqrt()[idx] if std == "group" else r.std(correction=0)  # population std
    adv = centered / (scale + eps)
    return adv.clamp(-clip, clip) if clip is not None else adv


@register_diffusion_loss("flow_grpo")
def flow_grpo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    clip_range: float = 1e-4,
    mean: Tensor | None = None,
    ref_mean: Tensor | None = None,
    std: Tensor | float | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped FlowGRPO loss for one (or a stack of) denoising step(s), and its metrics.

    `log_prob`, `old_log_prob`, `advantages`: [B] (or [B, S] for S steps). The KL term needs `mean`
    (policy, with gradient), `ref_mean` and `std` (std_t from flow_sde_step); it is reported as
    actor/kl_loss whenever `ref_mean` is given and added to the loss as beta * kl.
    Only `log_prob` and `mean` carry gradient.
    """
    old_log_prob = old_log_prob.detach()
    adv = advantages.detach().to(log_prob.dtype)
    adv = adv.reshape(*adv.shape, *([1] * (log_prob.dim() - adv.dim())))  # [B] against [B, S]
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    pg_loss = torch.maximum(unclipped, clipped).mean()
    metrics = {
        "actor/pg_loss": pg_loss.item(),
        "actor/pg_clipfrac": ((ratio.detach() - 1).abs() > clip_range).float().mean().item(),
        "actor/ppo_kl": (-log_ratio.detach()).mean().item(),
    }
    loss = pg_loss
    if ref_mean is not None:
        if mean is None or std is None:
            raise ValueError("the KL term needs mean, ref_mean and std")
        std_t = per_sample(torch.as_tensor(std).detach(), mean)
        kl = ((mean.float() - ref_mean.detach().float()) ** 2 / (2 * std_t**2)).mean()
        metrics["actor/kl_loss"] = kl.item()
        loss = loss + beta * kl
    return loss, metrics


def cfg_combine(eps_u: Tensor, eps_c: Tensor, w: float) -> Tensor:
    """Classifier-free guidance: eps_u + w * (eps_c - eps_u) (w = 4.5 in FlowGRPO's SD3 recipes).

    flow_grpo's training step detaches the unconditional branch: pass `eps_u.detach()` to match.
    """
    return eps_u + w * (eps_c - eps_u)
