"""A lean batched decode for text-only Qwen3 causal LMs: the eval's fast path
(`omni_core.evaluation.text`), with the responses of `ARengine.run_requests` on the same batch.

Why not the engine, or the model's own forward for every token: on a small model a decode step is
mostly overhead, not arithmetic. transformers' forward walks ~40 modules, builds the attention mask,
recomputes the rotary angles and concatenates the KV cache on every token (HF `generate` adds its own
per-step work); the engine adds per-sequence bookkeeping and a log-softmax over the vocabulary for
rollout log-probs an eval does not keep. Here the prompts are prefilled by the model itself (the
engine's call, so the same prompt cache), and each later token runs `Qwen3ForCausalLM`'s decode
arithmetic written out over its weights: a static KV cache written in place, the padding mask made
once, the rotary cos/sin of every step computed up front by the model's own rotary module, and
tokens kept in tensors. The arithmetic is the model's, down to the SDPA call transformers makes for
one query token; only the grouping differs (q/k/v and gate/up projections as one matmul each, q_norm
and k_norm as one norm, rotate_half as a roll), and on CPU the logits are the model's bit for bit
(the tests check it). A token is drawn by `draw_tokens`, the engine's rule (argmax; or inverse CDF at
the k-th uniform of the request's own generator), so a response depends on its prompt, seed and the
weights as with the engine. Finished responses stay in the batch until they are half of it, then
leave it (the engine drops each at once; HF `generate` keeps them to the end).

`supports` says which models this covers (what `_State.step` assumes); others go through `ARengine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from omni_core.rollout.autoregressive import check_sampling, draw_tokens


def supports(model: Any, text_io: Any) -> bool:
    """A transformers `Qwen3ForCausalLM` with SDPA attention, default RoPE, full attention on every layer,
    and a plain tokenizer (not a multimodal processor) with an EOS token."""
    if (type(model).__name__ != "Qwen3ForCausalLM" or hasattr(text_io, "tokenizer")
            or getattr(text_io, "eos_token_id", None) is None):
        return False
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    return (config._attn_implementation == "sdpa" and rope.get("rope_type", "default") == "default"
            and getattr(model.model.rotary_emb, "attention_scaling", None) == 1.0
            and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
            and config.hidden_act == "silu" and not config.attention_bias)


def decode(model: Any, prompts: Sequence[Sequence[int]], sampling: Any, seeds: Sequence[int],
           eos_ids: Sequence[int], pad_id: int) -> list[list[int]]:
    """The response token ids (each up to and including its first EOS) of each prompt, decoded together
    as one batch (left-padded), request i drawn with the generator seeded `seeds[i]` (unused for greedy).
    `model` must pass `supports`."""
    check_sampling(sampling)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            tokens = _decode(model, prompts, sampling, seeds, eos_ids, pad_id)
    finally:
        model.train(was_training)
    out = []
    for row in tokens.tolist():
        end = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:end])
    return out


def _decode(model: Any, prompts: Sequence[Sequence[int]], sampling: Any, seeds: Sequence[int],
            eos_ids: Sequence[int], pad_id: int) -> Tensor:
    device = next(model.parameters()).device
    steps = sampling.max_new_tokens
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    uniforms = None if sampling.greedy else torch.stack([
        torch.rand(steps, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64) for s in seeds
    ]).to(device)

    # the prefill, as ARengine's: left padding does not shift positions; no mask without padding
    cache = DynamicCache()
    out = model(input_ids=input_ids, attention_mask=None if bool(mask.all()) else mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache, use_cache=True, logits_to_keep=1)
    state = _State(model, cache, mask.bool(), steps)
    tokens = torch.full((len(prompts), steps), pad_id, dtype=torch.long, device=device)
    eos = torch.tensor(sorted(eos_ids), device=device)
    rows = torch.arange(len(prompts), device=device)  # the prompt of each row still decoding
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    logits = out.logits[:, -1].float()
    for k in range(steps):
        chosen, _ = draw_tokens(logits, sampling, None if uniforms is None else uniforms[rows, k], logprobs=False)
        tokens[rows, k] = chosen
        done |= torch.isin(chosen, eos)
        finished = int(done.sum())
        if k + 1 == steps or finished == len(rows):
            break
        # finished rows keep decoding (their later tokens are cut at EOS) until they are half the batch,
        # then leave it: one copy of the cache per halving instead of one per finished row
        if 2 * finished >= len(rows):
            keep = (~done).nonzero().squeeze(1)
            state.select(keep)
            rows, chosen, done = rows[keep], chosen[keep], done[keep]
        logits = state.step(chosen, k).float()
    return tokens


class _State:
    """The decode's weights and static KV cache; `step` is one token for every row."""

    def __init__(self, model: Any, cache: DynamicCache, mask: Tensor, steps: int):
        config, base = model.config, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.embed, self.norm, self.lm_head = base.embed_tokens.weight, base.norm.weight, model.lm_head.weight
        self.layers = [_weights(layer) for layer in base.layers]
        batch, width = mask.shape
        self.width, length = width, width + steps
        self.keys, self.values = [], []
        for layer in cache.layers:
            k = layer.keys.new_zeros(batch, self.kv_heads, length, self.head_dim)
            v = torch.zeros_like(k)
            k[:, :, :width], v[:, :, :width] = layer.keys, layer.values
            self.keys.append(k)
            self.values.append(v)
        # the rows' real tokens (the prompt's mask, then every decoded token) as the additive mask SDPA makes
        # of a boolean one; None without padding, as transformers' mask builder passes then
        self.mask = None
        if not bool(mask.all()):
            self.mask = torch.zeros(batch, 1, 1, length, dtype=self.keys[0].dtype, device=mask.device)
            self.mask[:, 0, 0, :width].masked_fill_(~mask, float("-inf"))
        # the rotary embedding's cos/sin of each row's token at each step [B, steps, D], by the model's own
        # module (left padding does not shift positions: the k-th token fed is at prompt length + k)
        positions = mask.sum(-1, keepdim=True) + torch.arange(steps, device=mask.device)
        self.cos, sin = base.rotary_emb(self.keys[0], positions)
        # rotate_half(x) * sin = cat(-x2, x1) * sin = roll(x) * cat(-sin1, sin2): the same products
        self.sin = torch.cat([-sin[..., :self.head_dim // 2], sin[..., self.head_dim // 2:]], dim=-1)

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (indices into the current rows), in this order."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.mask = None if self.mask is None else self.mask[rows]
        self.cos, self.sin = self.cos[rows], self.sin[rows]

    def step(self, tokens: Tensor, k: int) -> Tensor:
        """Logits [B, V] of the token after `tokens` [B], the k-th drawn (from 0); their K/V are written at
        cache column width + k."""
        batch, dim, heads, kv_heads = tokens.shape[0], self.head_dim, self.heads, self.kv_heads
        eps, at = self.eps, self.width + k
        x = F.embedding(tokens[:, None], self.embed)
        cos, sin = self.cos[:, k, None, None], self.sin[:, k, None, None]  # [B, 1, 1, D]
        mask = None if self.mask is None else self.mask[..., :at + 1]
        for i, w in enumerate(self.layers):
            qkv = F.linear(_rms(x, w.input_norm, eps), w.qkv).view(batch, 1, -1, dim)
            # q_norm and k_norm in one pass (their weights stacked per head), then RoPE on both
            qk = _rms(qkv[:, :, :heads + kv_heads], w.qk_norm, eps).transpose(1, 2)
            qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin  # rotate_half(qk) * sin, with sin's sign folded in
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, :, heads + kv_heads:].transpose(1, 2)
            self.keys[i][:, :, at:at + 1] = k
            self.values[i][:, :, at:at + 1] = v
            keys, values = self.keys[i][:, :, :at + 1], self.values[i][:, :, :at + 1]
            if mask is None:  # transformers' sdpa_attention_forward, both of its single-query paths
                o = F.scaled_dot_product_attention(q, keys, values, scale=w.scaling, enable_gqa=heads != kv_heads)
            else:  # the query's heads packed per KV head (`pack_gqa`), the mask shared by all heads
                o = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, -1, dim), keys, values,
                                                   attn_mask=mask, scale=w.scaling)
            x = x + F.linear(o.reshape(batch, 1, -1), w.o_proj)  # heads in order, as transformers lays them out
            gate, up = F.linear(_rms(x, w.post_norm, eps), w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down)
        return F.linear(_rms(x, self.norm, eps), self.lm_head)[:, -1]


@dataclass
class _Layer:
    input_norm: Tensor
    qkv: Tensor  # q_proj, k_proj, v_proj stacked: one matmul (the same numbers, checked by the tests)
    qk_norm: Tensor  # [heads + kv_heads, head_dim]
    o_proj: Tensor
    post_norm: Tensor
    gate_up: Tensor
    down: Tensor
    scaling: float


def _weights(layer: Any) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    heads = attn.q_proj.weight.shape[0] // attn.head_dim
    kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
    return _Layer(
        input_norm=layer.input_layernorm.weight,
        qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        qk_norm=torch.cat([attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)]),
        o_proj=attn.o_proj.weight, post_norm=layer.post_attention_layernorm.weight,
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), down=mlp.down_proj.weight,
        scaling=attn.scaling)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`Qwen3RMSNorm.forward`: torch's rms_norm computes `x * rsqrt(mean(x^2) + eps)` in float32 and casts
    back, as it does (one call instead of six); the weight is applied after the cast, as there."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


__all__ = ["decode", "supports"]
