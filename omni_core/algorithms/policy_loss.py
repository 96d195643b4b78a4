"""Clipped policy-gradient losses (PPO/GRPO token level, GSPO sequence level), registered by name.

Notation: `logp`, `old_logp`, `ref_logp` are per-token log-probs [B, T] of the response tokens under
the current, behaviour and reference policies; `m` is the response mask [B, T]; `A` the advantages,
per sequence [B] (broadcast over tokens) or per token [B, T].

- level="token" (PPO-clip, GRPO):  log_w = logp - old_logp            (clamped to [-20, 20], as verl)
- level="sequence" (GSPO):         s = sum_t(m * (logp - old_logp)) / sum_t(m)
                                   log_w = logp - sg(logp) + sg(s)     (clamped to <= 10)
  so every token's ratio equals the sequence ratio exp(s) while the gradient of token t is that of
  exp(s) with respect to logp_t (times sum_t(m)): d exp(log_w_t)/d logp_t = exp(s).
- w = exp(log_w);  L = max(-A * w, -A * clip(w, 1 - clip_low, 1 + clip_high))
  (= -min(w * A, clip(w) * A)).
- KL to the reference (k3, verl's "low_var_kl"): kl = exp(ref_logp - logp) - (ref_logp - logp) - 1,
  with ref_logp - logp clamped to [-20, 20] and kl to [-10, 10]; loss = agg(L) + beta * agg(kl).
- Aggregation `agg` over the masked [B, T] matrix X:
    token-mean:              sum(X * m) / sum(m)
    seq-mean-token-mean:     mean over sequences (with at least one token) of sum_t(X * m) / sum_t(m)
    seq-mean-token-sum-norm: sum(X * m) / (B * T), T = the padded length (Dr.GRPO)

Only `logp` carries gradient: `old_logp`, `ref_logp` and the advantages are detached.
Metrics (python floats, verl's names): actor/pg_loss, actor/pg_clipfrac (fraction of tokens where the
clipped term is the larger one), actor/ppo_kl (token mean of old_logp - logp), actor/kl_loss (when a
reference is given).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from omni_core.errors import ConfigError
from omni_core.registry import Registry

if TYPE_CHECKING:  # torch loads with the first loss computed: validating a config needs only the names
    from torch import Tensor

Agg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Level = Literal["token", "sequence"]
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LEVELS = ("token", "sequence")

PolicyLossFn = Callable[..., tuple["Tensor", dict[str, float]]]
_POLICY_LOSSES: Registry[PolicyLossFn] = Registry(
    "policy loss", hint="add one with @register_policy_loss(NAME) in omni_core/algorithms/policy_loss.py")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: make a policy loss selectable by `name` in the pipeline config."""
    return _POLICY_LOSSES.decorator(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; ConfigError listing the known names otherwise."""
    return _POLICY_LOSSES.get(name)


def policy_loss_names() -> list[str]:
    return _POLICY_LOSSES.names()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def aggregate(loss_mat: Tensor, mask: Tensor, agg: Agg = "token-mean") -> Tensor:
    """Reduce a [B, T] per-token matrix to a scalar over the masked tokens (see module docstring)."""
    mask = mask.to(loss_mat.dtype)
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    if agg == "seq-mean-token-mean":
        tokens = mask.sum(-1)
        seq = (loss_mat * mask).sum(-1) / tokens.clamp(min=1)
        return seq.sum() / (tokens > 0).sum().clamp(min=1)
    if agg == "seq-mean-token-sum-norm":
        return (loss_mat * mask).sum() / (mask.shape[0] * mask.shape[-1])
    raise ConfigError(f"unknown loss aggregation {agg!r}; use one of {', '.join(AGG_MODES)}")


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (clamped as verl)."""
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return (d.exp() - d - 1).clamp(-10.0, 10.0)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    level: Level = "token",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: Agg = "token-mean",
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped policy-gradient loss and its metrics; the formulas are in the module docstring."""
    if level not in LEVELS:
        raise ConfigError(f"unknown policy loss level {level!r}; use one of {', '.join(LEVELS)}")
    if agg not in AGG_MODES:
        raise ConfigError(f"unknown loss aggregation {agg!r}; use one of {', '.join(AGG_MODES)}")
    mask = mask.to(logp.dtype)
    old_logp = old_logp.detach()
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    log_ratio = logp - old_logp
    if level == "token":
        log_w = log_ratio.clamp(-20.0, 20.0)
    else:
        s = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        log_w = (logp - logp.detach() + s.detach()).clamp(max=10.0)
    w = log_w.exp()
    unclipped = -adv * w
    clipped = -adv * w.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_loss = aggregate(unclipped.maximum(clipped), mask, agg)
    metrics = {
        "actor/pg_loss": pg_loss.item(),
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).to(logp.dtype), mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio.detach(), mask).item(),
    }
    loss = pg_loss
    if ref_logp is not None:
        kl_loss = aggregate(k3_kl(logp, ref_logp.detach()), mask, agg)
        metrics["actor/kl_loss"] = kl_loss.item()
        loss = loss + beta * kl_loss
    return loss, metrics


@register_policy_loss("grpo")
def grpo_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **kwargs
) -> tuple[Tensor, dict[str, float]]:
    """Token-level PPO-clip (GRPO): defaults clip 0.2/0.2, token-mean."""
    return policy_loss(logp, old_logp, advantages, mask, **{**kwargs, "level": "token"})


@register_policy_loss("gspo")
def gspo_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **kwargs
) -> tuple[Tensor, dict[str, float]]:
    """Sequence-level ratio (GSPO): defaults clip 3e-4/4e-4, seq-mean-token-mean, beta 0."""
    defaults = {"clip_low": 3e-4, "clip_high": 4e-4, "agg": "seq-mean-token-mean"}
    return policy_loss(logp, old_logp, advantages, mask, **{**defaults, **kwargs, "level": "sequence"})
