"""Per-token log-probabilities of response tokens under a causal LM (text-only or multimodal)."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """`out[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]` for t >= 1; `out[:, 0] = 0`.

    Logits at position t-1 predict the token at t, hence the shift. Shape [B, T], float32. `logits` may
    hold only the last K positions (a forward with `logits_to_keep=K`): `out[:, :T-K+1]` is then 0.
    """
    width, kept = input_ids.shape[1], logits.shape[1]
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = logp.gather(-1, input_ids[:, width - kept + 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([picked.new_zeros(picked.shape[0], width - kept + 1), picked], dim=1)


def takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (transformers' causal LMs do)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def response_logits(model: torch.nn.Module, response_mask: Tensor, **inputs: Tensor) -> Tensor:
    """`model(**inputs).logits`, computed only from the position before the first response token on
    (`logits_to_keep`, where the model's forward takes it): the LM head and the log-softmax over the
    vocabulary are most of a small model's work per token, and prompt positions predict nothing that
    is scored. The logits cover the last K positions; `token_logprobs` aligns them."""
    target = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # peft
    columns = response_mask.bool().any(0).nonzero()
    if not len(columns) or not takes_logits_to_keep(target):
        return model(**inputs).logits
    keep = response_mask.shape[1] - int(columns[0]) + 1
    return model(**inputs, logits_to_keep=keep).logits


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    **model_inputs: Tensor,
) -> Tensor:
    """Log-probs of the response tokens, aligned with `input_ids`: a [B, T] float32 tensor.

    `out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])` where `response_mask[b, t]` is set, else 0
    (the first position has no prediction, so it is always 0).

    `model_inputs` are further forward arguments: a multimodal processor's media tensors
    (`pixel_values`, `image_grid_thw`, `input_features`, `feature_attention_mask`, ...). Without them,
    position ids follow the attention mask (`cumsum - 1`), so left-padded prompts get the same positions
    as unpadded ones. With them no position ids are passed: such models (Qwen-VL/Qwen3-Omni's 3-D mrope)
    compute their own from the ids, the attention mask (left padding included) and the media sizes,
    as `generate` does; `cumsum - 1` would be wrong for every token from the first image on.
    """
    if not model_inputs:
        model_inputs = {"position_ids": (attention_mask.long().cumsum(-1) - 1).clamp(min=0)}
    logits = response_logits(model, response_mask, input_ids=input_ids, attention_mask=attention_mask,
                             **model_inputs)
    logp = token_logprobs(logits, input_ids, temperature)
    return torch.where(response_mask.bool(), logp, torch.zeros_like(logp))
