"""Per-token log-probabilities of response tokens under a causal LM."""

from __future__ import annotations

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """`out[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]` for t >= 1; `out[:, 0] = 0`.

    Logits at position t-1 predict the token at t, hence the shift. Shape [B, T], float32.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
) -> Tensor:
    """Log-probs of the response tokens, aligned with `input_ids`: a [B, T] float32 tensor.

    `out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])` where `response_mask[b, t]` is set, else 0
    (the first position has no prediction, so it is always 0). Position ids follow the attention
    mask (`cumsum - 1`), so left-padded prompts get the same positions as unpadded ones.
    """
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = token_logprobs(logits, input_ids, temperature)
    return torch.where(response_mask.bool(), logp, torch.zeros_like(logp))
