"""Rollout-vs-trainer consistency metrics, as verl logs them (docs/reference/metrics-computed.md#training-metrics).

The rollout engine records the log-prob of each token (or denoising step) it sampled; the trainer
recomputes the same log-probs with its own forward (the behaviour-policy `old_logp`). If the two
disagree, the importance ratios of the update are off before it starts (a kernel, precision or
sampling-parameter mismatch). verl reports the agreement on probabilities, exp(logp):

    training/rollout_probs_diff_mean          mean |p_actor - p_rollout| over the masked tokens
    training/rollout_actor_probs_pearson_corr Pearson correlation of p_actor and p_rollout (masked)

plus `training/rollout_probs_diff_{valid,max,std}`. Healthy runs show a Pearson correlation close to
1 (docs/reference/published-figures.md: 0.998 on the MMK12 recipe, > 0.995 is healthy).

Source matched: verl `verl/utils/debug/metrics.py` (verl-project/verl, `calculate_debug_metrics`,
called by `RayPPOTrainer` when the batch has `rollout_log_probs`):

- p_actor = exp(old_log_probs), p_rollout = exp(rollout_log_probs), both selected by the response
  mask (`torch.masked_select`);
- diff = |p_actor - p_rollout|; max, mean and std (`torch.std`, Bessel-corrected) of diff;
- pearson = `torch.corrcoef(stack([p_actor, p_rollout]))[0][1]` over the selected values;
- no masked token: valid = 0 and every other metric NaN.

Stated choices where verl leaves it to torch: the values are computed in float64 (verl uses the
input dtype, float32 in practice; the two agree to float32 rounding); a zero-variance side makes the
Pearson correlation 0/0 = NaN, as `torch.corrcoef` gives it (verl logs that NaN), and a single masked
token gives NaN for the std and the correlation, without torch's degrees-of-freedom warning. Shapes
that differ raise ValueError (verl returns a Pearson of 0 and warns).

For a diffusion policy the "log-probs" are per-step Gaussian log-densities (FlowGRPO's, averaged
over the latent's elements), so exp(logp) is a density, not bounded by 1: the difference is in those
units and the Pearson correlation, which is scale-free, is the number to watch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

PROBS_DIFF_VALID = "training/rollout_probs_diff_valid"
PROBS_DIFF_MAX = "training/rollout_probs_diff_max"
PROBS_DIFF_MEAN = "training/rollout_probs_diff_mean"
PROBS_DIFF_STD = "training/rollout_probs_diff_std"
PROBS_PEARSON = "training/rollout_actor_probs_pearson_corr"

__all__ = [
    "PROBS_DIFF_MAX",
    "PROBS_DIFF_MEAN",
    "PROBS_DIFF_STD",
    "PROBS_DIFF_VALID",
    "PROBS_PEARSON",
    "rollout_consistency",
]


def rollout_consistency(rollout_logp: Tensor, actor_logp: Tensor, mask: Tensor | None = None) -> dict[str, float]:
    """verl's rollout-vs-actor metrics of two log-prob tensors of the same shape ([B, T] per token,
    or [B, S] per denoising step); `mask` (same shape, bool or 0/1) selects the positions that count,
    all of them when None. Returns the five `training/rollout_*` metrics as floats."""
    if rollout_logp.shape != actor_logp.shape:
        raise ValueError(f"rollout log-probs {tuple(rollout_logp.shape)} and actor log-probs "
                         f"{tuple(actor_logp.shape)} must have the same shape")
    if mask is None:
        selected = torch.ones(rollout_logp.shape, dtype=torch.bool, device=rollout_logp.device)
    elif mask.shape != rollout_logp.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the log-probs' shape {tuple(rollout_logp.shape)}")
    else:
        selected = mask.to(device=rollout_logp.device).bool()
    if not bool(selected.any()):
        nan = float("nan")
        return {PROBS_DIFF_VALID: 0.0, PROBS_DIFF_MAX: nan, PROBS_DIFF_MEAN: nan, PROBS_DIFF_STD: nan,
                PROBS_PEARSON: nan}

    with torch.no_grad():
        actor_p = torch.exp(actor_logp.detach().to(device=selected.device, dtype=torch.float64))[selected]
        rollout_p = torch.exp(rollout_logp.detach().to(dtype=torch.float64))[selected]
        diff = (actor_p - rollout_p).abs()
        n = diff.numel()
        return {
            PROBS_DIFF_VALID: 1.0,
            PROBS_DIFF_MAX: diff.max().item(),
            PROBS_DIFF_MEAN: diff.mean().item(),
            PROBS_DIFF_STD: diff.std().item() if n > 1 else float("nan"),
            PROBS_PEARSON: _pearson(actor_p, rollout_p),
        }


def _pearson(x: Tensor, y: Tensor) -> float:
    """torch.corrcoef's off-diagonal entry (the normalisation cancels, so no Bessel factor), clipped
    to [-1, 1] as torch clips it; NaN when either side has zero variance."""
    cx, cy = x - x.mean(), y - y.mean()
    denominator = math.sqrt((cx * cx).sum().item() * (cy * cy).sum().item())
    if denominator == 0.0:
        return float("nan")
    return max(-1.0, min(1.0, (cx * cy).sum().item() / denominator))
