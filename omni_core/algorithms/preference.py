"""Preference losses (DPO, IPO, BCO-pair, MPO) and the SFT term, as pure tensor functions.

Notation: `logp_c`, `logp_r` are sequence log-probs of the chosen / rejected responses under the
policy, summed over the response tokens (`sequence_logps`); `ref_c`, `ref_r` the same under the frozen
reference; beta = 0.1 by default; ls = label smoothing.

    delta    = (logp_c - ref_c) - (logp_r - ref_r)
    sigmoid  = -(1 - ls) * logsigmoid(beta * delta) - ls * logsigmoid(-beta * delta)
    ipo      = (delta - 1 / (2 * beta))^2
    bco_pair = -logsigmoid(beta * (logp_c - ref_c)) - logsigmoid(-beta * (logp_r - ref_r))
               (current TRL form, without the older running-mean reward shift)
    sft      = cross-entropy on the chosen response tokens: -sum(m * logp_tok) / sum(m)

Each pair term is averaged over the batch; a loss is a weighted sum of terms (loss_types with
loss_weights): DPO is one term, MPO defaults to 0.8 * sigmoid + 0.2 * bco_pair + 1.0 * sft.

Metrics (python floats, VeRL-Omni's names; the caller adds a `actor/` or `val/` prefix):
    chosen_rewards   = mean(beta * (logp_c - ref_c))
    rejected_rewards = mean(beta * (logp_r - ref_r))
    reward_accuracy  = mean(chosen reward > rejected reward)
    reward_margin    = mean(chosen reward - rejected reward)
plus the total (`dpo_loss` / `mpo_loss`) and, for more than one term, each `{type}_loss`.

Only the policy log-probs carry gradient: reference log-probs are detached.

Upstream notes: these are VeRL-Omni's OmniDPOLoss formulas. Current TRL differs in two places: its
`sigmoid` ignores label smoothing (cDPO lives under `robust`/`exo_pair`), and its `ipo` divides each
log-ratio by the completion length; for that, pass `sequence_logps(..., average=True)` (VeRL-Omni's
`average_log_prob`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from omni_core.errors import ConfigError
from omni_core.registry import Registry

if TYPE_CHECKING:  # torch loads with the first loss computed: validating a config needs only the names
    from torch import Tensor

# (chosen_logratios, rejected_logratios, beta, label_smoothing) -> per-pair loss [B]
PairLossFn = Callable[["Tensor", "Tensor", float, float], "Tensor"]
_PAIR_LOSSES: Registry[PairLossFn] = Registry(
    "preference loss type", hint="add one with @register_preference_loss(NAME) in omni_core/algorithms/preference.py")
SFT = "sft"  # the one loss type that is not a function of the log-ratios

MPO_LOSS_TYPES = ("sigmoid", "bco_pair", "sft")
MPO_LOSS_WEIGHTS = (0.8, 0.2, 1.0)


def register_preference_loss(name: str) -> Callable[[PairLossFn], PairLossFn]:
    """Decorator: make a pairwise preference loss selectable as `loss_type=name`."""

    return _PAIR_LOSSES.decorator(name)


def get_preference_loss(name: str) -> PairLossFn:
    """The pairwise loss registered as `name`; ConfigError listing the known loss types otherwise."""
    if name not in _PAIR_LOSSES:
        raise ConfigError(
            f"unknown preference loss type {name!r}; known loss types: {', '.join(preference_loss_names())}"
        )
    return _PAIR_LOSSES.get(name)


def preference_loss_names() -> list[str]:
    return sorted([*_PAIR_LOSSES.names(), SFT])


@register_preference_loss("sigmoid")
def sigmoid_loss(chosen: Tensor, rejected: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """DPO (Bradley-Terry) with conservative label smoothing (cDPO)."""
    from torch.nn.functional import logsigmoid

    logits = beta * (chosen - rejected)
    return -(1 - label_smoothing) * logsigmoid(logits) - label_smoothing * logsigmoid(-logits)


@register_preference_loss("ipo")
def ipo_loss(chosen: Tensor, rejected: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """IPO: squared distance of the log-ratio margin from 1 / (2 beta); label smoothing unused."""
    return (chosen - rejected - 1 / (2 * beta)) ** 2


@register_preference_loss("bco_pair")
def bco_pair_loss(chosen: Tensor, rejected: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """BCO on pairs: chosen classified as good, rejected as bad, each on its own log-ratio."""
    from torch.nn.functional import logsigmoid

    return -logsigmoid(beta * chosen) - logsigmoid(-beta * rejected)


def sequence_logps(token_logp: Tensor, mask: Tensor, average: bool = False) -> Tensor:
    """Sequence log-probs [B]: sum_t(m * logp_t), or that divided by sum_t(m) when `average`."""
    mask = mask.to(token_logp.dtype)
    total = (token_logp * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def token_logps(logits: Tensor, labels: Tensor) -> Tensor:
    """Per-token log-probs [B, T] of `labels` [B, T] under `logits` [B, T, V] (already aligned)."""
    return logits.float().log_softmax(dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def sft_loss(x: Tensor, mask: Tensor, labels: Tensor | None = None) -> Tensor:
    """Token-mean cross-entropy on the chosen response tokens.

    `x` is either the per-token log-probs [B, T] of the chosen tokens, or, when `labels` [B, T] is
    given, the logits [B, T, V] aligned with them (logits[:, t] predicts labels[:, t]).
    """
    token_logp = token_logps(x, labels) if labels is not None else x
    mask = mask.to(token_logp.dtype)
    return -(token_logp * mask).sum() / mask.sum().clamp(min=1)


def preference_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    loss_types: Sequence[str],
    loss_weights: Sequence[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    nll: Tensor | None = None,
    name: str = "loss",
) -> tuple[Tensor, dict[str, float]]:
    """sum_k w_k * loss_k, each pair term averaged over the batch; `nll` is the `sft` term (sft_loss)."""
    weights = [1.0] * len(loss_types) if loss_weights is None else list(loss_weights)
    if len(weights) != len(loss_types):
        raise ConfigError(
            f"{len(loss_types)} loss types but {len(weights)} loss weights; give one weight each"
        )
    if SFT in loss_types and nll is None:
        raise ValueError("loss type 'sft' needs the chosen-token cross-entropy: pass nll=sft_loss(...)")
    chosen = chosen_logps - ref_chosen_logps.detach()
    rejected = rejected_logps - ref_rejected_logps.detach()
    loss = chosen.new_zeros(())
    terms: dict[str, float] = {}
    for loss_type, weight in zip(loss_types, weights, strict=True):
        if loss_type == SFT:
            term = nll
        else:
            term = get_preference_loss(loss_type)(chosen, rejected, beta, label_smoothing).mean()
        terms[f"{loss_type}_loss"] = term.item()
        loss = loss + weight * term
    metrics = {name: loss.item(), **preference_metrics(chosen, rejected, beta)}
    if len(loss_types) > 1:
        metrics.update(terms)
    return loss, metrics


def preference_metrics(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> dict[str, float]:
    """Implicit rewards beta * (logp - ref) and how well they rank chosen over rejected."""
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return {
        "chosen_rewards": chosen_rewards.mean().item(),
        "rejected_rewards": rejected_rewards.mean().item(),
        "reward_accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
        "reward_margin": (chosen_rewards - rejected_rewards).mean().item(),
    }


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """DPO with one pairwise loss type (sigmoid, ipo, bco_pair); metrics `dpo_loss` and the rewards."""
    return preference_loss(
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        loss_types=[loss_type],
        beta=beta,
        label_smoothing=label_smoothing,
        name="dpo_loss",
    )


def mpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    nll: Tensor | None = None,
    loss_types: Sequence[str] = MPO_LOSS_TYPES,
    loss_weights: Sequence[float] = MPO_LOSS_WEIGHTS,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """MPO: 0.8 * sigmoid + 0.2 * bco_pair + 1.0 * sft by default; `nll` = sft_loss on the chosen tokens."""
    return preference_loss(
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        loss_types=loss_types,
        loss_weights=loss_weights,
        beta=beta,
        label_smoothing=label_smoothing,
        nll=nll,
        name="mpo_loss",
    )
