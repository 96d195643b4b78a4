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

Speculative decoding (`speculate`; by default for greedy decoding): even written out, a step is mostly
per-kernel work that grows slower than the tokens a forward takes (tiny://lm at batch 64: ~1.05 ms for
one token per row, ~4.5 ms for nine). So each forward takes every row's last token and up to
`SPECULATE` draft tokens proposed by prompt lookup (vLLM's `ngram` method: the tokens that followed the
latest earlier occurrence of the row's last few tokens in its prompt and response), attending at each
row's own positions (per-row rotary angles, K/V columns and mask). A token is drawn at every position by the same rule, with the uniform of its
response position, so the drafts kept (those equal to the token drawn at their position, up to the
first that is not) and the token drawn after them are the tokens one step at a time would draw:
exact for greedy and sampling alike. The logits of a several-token forward may differ from one-token
steps by a float rounding (SDPA's kernel over several queries; the tests check the argmax and the
responses). Rows then advance by different amounts. The number of drafts adapts to how many are kept
(`_depth`): drafts that are never kept would make each forward several tokens' work for one. By
default only greedy decoding speculates: a random-weight model's greedy responses fall into repetition
(tiny://lm: every draft kept), its sampled ones do not (1.0003 tokens a forward at temperature 1), and
once rows stand at different positions a forward without drafts still costs more than a plain step.

`supports` says which models this covers (what `_State` assumes); others go through `ARengine`.
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


SPECULATE = 16  # the most draft tokens per row and forward (module docstring; 16 measured best of 8, 16, 32, 64 in bench/eval.py)
NGRAM = 3  # the longest n-gram matched for a draft (then shorter ones, down to one token)
PROBE = 8  # forwards without drafts before drafting again (`_depth`)


def decode(model: Any, prompts: Sequence[Sequence[int]], sampling: Any, seeds: Sequence[int],
           eos_ids: Sequence[int], pad_id: int, *, speculate: int | None = None,
           stats: dict[str, int] | None = None) -> list[list[int]]:
    return [tokens for tokens, _ in _run(model, prompts, sampling, seeds, eos_ids, pad_id, speculate, stats, False)]


def decode_with_logprobs(model: Any, prompts: Sequence[Sequence[int]], sampling: Any, seeds: Sequence[int],
                         eos_ids: Sequence[int], pad_id: int) -> list[tuple[list[int], list[float]]]:
    """`decode` one token a step (no drafts), each response with the log-prob of each of its tokens as
    `ARengine` records it (`log_softmax(logits / T)` of the drawn token): a GRPO rollout's tokens, the
    engine's, and its rollout log-probs, the engine's to float rounding once rows finish at different
    steps (the engine's batch drops a finished row at once; tests/test_rollout_lean_decode.py)."""
    return _run(model, prompts, sampling, seeds, eos_ids, pad_id, 0, None, True)


def _run(model: Any, prompts: Sequence[Sequence[int]], sampling: Any, seeds: Sequence[int], eos_ids: Sequence[int],
         pad_id: int, speculate: int | None, stats: dict[str, int] | None, logprobs: bool,
         ) -> list[tuple[list[int], list[float]]]:
    """The response token ids (each up to and including its first EOS) of each prompt, decoded together
    as one batch (left-padded), request i drawn with the generator seeded `seeds[i]` (unused for greedy).
    `speculate`: the most draft tokens per row and forward (0: one token a step; default SPECULATE for
    greedy, 0 when sampling: see the module docstring). `stats`, when given, receives
    `forwards` (decode forwards after the prefill), `row_steps` and `tokens` (summed over the rows still
    decoding at each forward): tokens / row_steps is the mean number of tokens a row gains per forward.
    `model` must pass `supports`."""
    check_sampling(sampling)
    if speculate is None:
        speculate = SPECULATE if sampling.greedy else 0
    was_training = model.training
    if was_training:  # train() / eval() walk every module: only when needed
        model.eval()
    try:
        with torch.inference_mode():
            tokens, logps = _decode(model, prompts, sampling, seeds, eos_ids, pad_id, speculate, stats, logprobs)
    finally:
        if was_training:
            model.train()
    out = []
    for i, row in enumerate(tokens.tolist()):
        end = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
        out.append((row[:end], logps[i, :end].tolist() if logps is not None else []))
    return out


def _decode(model: Any, prompts: Sequence[Sequence[int]], sampling: Any, seeds: Sequence[int],
            eos_ids: Sequence[int], pad_id: int, speculate: int, stats: dict[str, int] | None,
            logprobs: bool = False) -> tuple[Tensor, Tensor | None]:
    device = next(model.parameters()).device
    steps = sampling.max_new_tokens
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    # the k-th uniform of request i's generator draws its k-th token; a speculative forward draws up to
    # `speculate` tokens past the last one (cut), so zeros stand in for those
    uniforms = None if sampling.greedy else torch.stack([
        torch.cat([torch.rand(steps, generator=torch.Generator().manual_seed(int(s)), dtype=torch.float64),
                   torch.zeros(speculate + 1, dtype=torch.float64)]) for s in seeds
    ]).to(device)

    # the prefill, as ARengine's: left padding does not shift positions; no mask without padding
    cache = DynamicCache()
    out = model(input_ids=input_ids, attention_mask=None if bool(mask.all()) else mask,
                position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache, use_cache=True, logits_to_keep=1)
    state = _State(model, cache, mask.bool(), steps + speculate)
    logits = out.logits[:, -1].float()
    eos = torch.tensor(sorted(eos_ids), device=device)
    if speculate:
        prompt = input_ids.masked_fill(~mask.bool(), -1)  # padding never matches a token when drafting
        assert not logprobs, "log-probs are recorded one token a step"
        return _speculative(state, prompt, logits, sampling, uniforms, eos, steps, speculate, stats), None
    return _stepwise(state, logits, sampling, uniforms, eos, steps, pad_id, stats, logprobs)


def _stepwise(state: _State, logits: Tensor, sampling: Any, uniforms: Tensor | None, eos: Tensor, steps: int,
              pad_id: int, stats: dict[str, int] | None, logprobs: bool) -> tuple[Tensor, Tensor | None]:
    """One token per row and forward; with `logprobs`, each drawn token's log-prob too."""
    tokens = torch.full((logits.shape[0], steps), pad_id, dtype=torch.long, device=logits.device)
    picked = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device) if logprobs else None
    rows = torch.arange(logits.shape[0], device=logits.device)  # the prompt of each row still decoding
    done = torch.zeros(len(rows), dtype=torch.bool, device=logits.device)
    for k in range(steps):
        chosen, logp = draw_tokens(logits, sampling, None if uniforms is None else uniforms[rows, k],
                                   logprobs=logprobs)
        tokens[rows, k] = chosen
        if picked is not None:
            picked[rows, k] = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        if stats is not None and k:
            _count(stats, (~done).sum(), (~done).sum())
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
    return tokens, picked


def _speculative(state: _State, prompt: Tensor, logits: Tensor, sampling: Any, uniforms: Tensor | None,
                 eos: Tensor, steps: int, speculate: int, stats: dict[str, int] | None) -> Tensor:
    """Prompt-lookup speculative decoding (vLLM's `ngram` method): each forward feeds every row its last
    token and `speculate` drafts (`_propose`), draws a token at each of those positions by the same rule
    as one token a step (the k-th response token with the k-th uniform), keeps the drafts up to the
    first one that differs from the token drawn there, and that drawn token. Rows advance by different
    amounts: `known` counts each row's response tokens."""
    batch, width = prompt.shape
    device = prompt.device
    first, _ = draw_tokens(logits, sampling, None if uniforms is None else uniforms[:, 0], logprobs=False)
    # each row's prompt (-1 at padding), then its response; columns past a row's last known token hold
    # drafts or rejected draws, overwritten later
    seq = torch.cat([prompt, first[:, None], prompt.new_zeros(batch, steps + speculate)], dim=1)
    tokens = torch.empty(batch, steps, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # the prompt of each row still decoding
    known = torch.ones(batch, dtype=torch.long, device=device)
    done = torch.isin(first, eos) | (steps == 1)
    depth, idle = speculate, 0  # drafts per row in the next forward, forwards since the last draft
    while True:
        finished = int(done.sum())
        if finished == len(rows):
            break
        if 2 * finished >= len(rows):  # as `_stepwise`: finished rows leave once they are half the batch
            tokens[rows[done]] = seq[done, width:width + steps]
            keep = (~done).nonzero().squeeze(1)
            state.select(keep)
            rows, seq, known, done = rows[keep], seq[keep], known[keep], done[keep]
        least = int(known.min())
        count = min(depth, steps - 1 - least)  # no more drafts than the longest-running row can keep
        if count == 0 and least == int(known.max()):  # every row at the same position: a plain step
            logits = state.step(seq[:, width + least - 1], least - 1)
            chosen, _ = draw_tokens(logits.float(), sampling, None if uniforms is None else uniforms[rows, least],
                                    logprobs=False)
            seq[:, width + least] = chosen
            if stats is not None:
                _count(stats, (~done).sum(), (~done).sum())
            done |= torch.isin(chosen, eos)
            known += 1
            depth, idle = _depth(depth, idle, 0, 0.0, speculate)
        else:
            new, ended, kept = _verify(state, seq, width, known, count, sampling, uniforms, rows, eos, steps, done)
            if stats is not None:
                _count(stats, new[~done].sum(), (~done).sum())
            depth, idle = _depth(depth, idle, count, kept, speculate)
            done |= ended
            known += new
        done |= known >= steps
    tokens[rows] = seq[:, width:width + steps]
    return tokens


def _verify(state: _State, seq: Tensor, width: int, known: Tensor, count: int, sampling: Any,
            uniforms: Tensor | None, rows: Tensor, eos: Tensor, steps: int, done: Tensor,
            ) -> tuple[Tensor, Tensor, float]:
    """One speculative forward: `count` drafts per row written into `seq` after its `known` response
    tokens, verified, the tokens drawn written over them. (the tokens each row gains, whether one of them
    is an EOS, the mean number of drafts kept by the rows not `done`)."""
    last = width + known - 1  # the column of each row's last token
    columns = last[:, None] + torch.arange(count + 1, device=seq.device)
    drafts = _propose(seq, last, count) if count else seq.new_empty(len(rows), 0)
    seq.scatter_(1, columns[:, 1:], drafts)
    logits = state.verify(seq.gather(1, columns), known - 1)
    drawn, _ = draw_tokens(logits.flatten(0, 1).float(), sampling,
                           None if uniforms is None else uniforms[rows[:, None], columns + 1 - width].flatten(),
                           logprobs=False)
    drawn = drawn.view(len(rows), -1)
    seq.scatter_(1, columns + 1, drawn)
    accepted = (drawn[:, :-1] == drafts).cumprod(dim=1).sum(dim=1)
    new = (accepted + 1).clamp_(max=steps - known)  # none for a row that already has all its tokens
    ended = ((torch.arange(count + 1, device=seq.device) < new[:, None]) & torch.isin(drawn, eos)).any(dim=1)
    return new, ended, float(accepted[~done].float().mean())


def _depth(depth: int, idle: int, count: int, kept: float, speculate: int) -> tuple[int, int]:
    """The next forward's drafts per row (and forwards since the last with drafts), after a forward with
    `count` drafts per row of which the rows kept `kept` on average: doubled (up to `speculate`) while
    they keep at least half, else halved down to none (a forward then costs about what a step does,
    drafts that are never kept cost a forward over up to `speculate` + 1 tokens per row); after PROBE
    forwards without drafts, one draft again."""
    if count == 0:
        return (1, 0) if idle + 1 >= PROBE else (0, idle + 1)
    if 2 * kept >= count:
        return min(speculate, 2 * depth), 0
    return depth // 2, 0


def _count(stats: dict[str, int], tokens: Tensor, rows: Tensor) -> None:
    stats["forwards"] = stats.get("forwards", 0) + 1
    stats["tokens"] = stats.get("tokens", 0) + int(tokens)
    stats["row_steps"] = stats.get("row_steps", 0) + int(rows)


def _propose(seq: Tensor, last: Tensor, count: int) -> Tensor:
    """`count` draft tokens for each row of `seq` [B, C] whose last token is at column `last` [B]: the
    row's latest earlier occurrence of its last NGRAM tokens (else of fewer, down to its last token),
    then the tokens that followed it, repeated with its period (a match p tokens back continues the
    period-p cycle it implies, where vLLM's `ngram` would stop at the row's end). A row without any
    match repeats its last token. Drafts only cost time when wrong: every kept token is checked."""
    span = int(last.max())  # candidate match ends j < last
    window = seq[:, :span]
    columns = torch.arange(span, device=seq.device)
    tail = seq.gather(1, (last[:, None] - torch.arange(NGRAM, device=seq.device)).clamp(min=0))
    match = columns < last[:, None]
    best = last - 1
    for n in range(NGRAM):  # the (n+1)-gram ending at j: also the token at j - n equals the row's n-th last
        equal = torch.zeros_like(match)
        equal[:, n:] = window[:, :span - n] == tail[:, n, None]
        match &= equal
        found = torch.where(match, columns, -1).max(dim=1).values
        best = torch.where(found >= 0, found, best)
    period = (last - best)[:, None]
    return seq.gather(1, best[:, None] + 1 + torch.arange(count, device=seq.device) % period)


class _State:
    """The decode's weights and static KV cache; `step` is one token for every row, `verify` a few
    tokens per row at each row's own position."""

    def __init__(self, model: Any, cache: DynamicCache, mask: Tensor, steps: int):
        """`mask` [B, width]: the prompts' real tokens (left-padded), `cache` their K/V (the model's
        prefill); room for `steps` more tokens per row."""
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
        # the cache columns a row's tokens may attend to: its prompt's, then every response column
        self.real = torch.cat([mask, mask.new_ones(batch, steps)], dim=1)
        # for `step`, the same as the additive mask SDPA makes of a boolean one; None without padding, as
        # transformers' mask builder passes then
        self.mask = None
        if not bool(mask.all()):
            self.mask = torch.zeros(batch, 1, 1, length, dtype=self.keys[0].dtype, device=mask.device)
            self.mask[:, 0, 0, :width].masked_fill_(~mask, float("-inf"))
        # the rotary embedding's cos/sin of each row's k-th response token [B, steps, D], by the model's
        # own module (left padding does not shift positions: the k-th token fed is at prompt length + k)
        positions = mask.sum(-1, keepdim=True) + torch.arange(steps, device=mask.device)
        self.cos, sin = base.rotary_emb(self.keys[0], positions)
        # rotate_half(x) * sin = cat(-x2, x1) * sin = roll(x) * cat(-sin1, sin2): the same products
        self.sin = torch.cat([-sin[..., :self.head_dim // 2], sin[..., self.head_dim // 2:]], dim=-1)

    def _additive(self, seen: Tensor) -> Tensor:
        """The additive mask [B, 1, rows, keys] of `seen` [B, Q, keys], one row per packed query: the heads
        of a KV head, each with the Q tokens (see `_forward`)."""
        mask = torch.zeros(seen.shape, dtype=self.keys[0].dtype, device=seen.device).masked_fill_(~seen, float("-inf"))
        return mask[:, None].repeat(1, 1, self.heads // self.kv_heads, 1)

    def select(self, rows: Tensor) -> None:
        """Keep only `rows` (indices into the current rows), in this order."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.real = self.real[rows]
        self.mask = None if self.mask is None else self.mask[rows]
        self.cos, self.sin = self.cos[rows], self.sin[rows]

    def step(self, tokens: Tensor, k: int) -> Tensor:
        """Logits [B, V] of the token after `tokens` [B], the k-th drawn (from 0) of every row; their K/V
        are written at cache column width + k."""
        at = self.width + k
        mask = None if self.mask is None else self.mask[..., :at + 1]
        cos, sin = self.cos[:, k, None, None], self.sin[:, k, None, None]  # [B, 1, 1, D]
        return self._forward(tokens[:, None], cos, sin, mask, at)[:, -1]

    def verify(self, tokens: Tensor, first: Tensor) -> Tensor:
        """Logits [B, Q, V] after each of `tokens` [B, Q], row b's response tokens first[b], first[b] + 1,
        ...: each attends to its row's prompt, its earlier response tokens and itself. Their K/V are
        written at cache columns width + first[b] + q (overwriting rejected drafts' ones)."""
        batch, queries = tokens.shape
        index = first[:, None] + torch.arange(queries, device=tokens.device)  # [B, Q]
        columns = self.width + index
        length = int(columns.max()) + 1
        seen = self.real[:, None, :length] & (torch.arange(length, device=tokens.device) <= columns[..., None])
        at = torch.arange(batch, device=tokens.device)[:, None]
        cos, sin = self.cos[at, index][:, None], self.sin[at, index][:, None]  # [B, 1, Q, D]
        # the K/V rows [B, kv_heads, Q] in a cache viewed as [B * kv_heads * length, D]
        heads = at[..., None] * self.kv_heads + torch.arange(self.kv_heads, device=tokens.device)[:, None]
        rows = (heads * self.keys[0].shape[2] + columns[:, None]).flatten()
        return self._forward(tokens, cos, sin, self._additive(seen), rows, last=False)

    def _forward(self, tokens: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, at: int | Tensor,
                 last: bool = True) -> Tensor:
        """`Qwen3ForCausalLM`'s forward of `tokens` [B, Q] over the cache: logits [B, Q, V] (of the last
        token only [B, 1, V] with `last`, as `logits_to_keep=1`). Their K/V are written at column `at` on
        (the same for every row), or at the cache rows `at` (`_write`); the keys attended to are the
        columns up to the last written (`mask`'s width [B, 1, rows, length]), or None: all of them."""
        batch, queries = tokens.shape
        dim, heads, kv_heads, eps = self.head_dim, self.heads, self.kv_heads, self.eps
        length = at + queries if isinstance(at, int) else mask.shape[-1]  # a verify always has a mask
        x = F.embedding(tokens, self.embed)
        for i, w in enumerate(self.layers):
            qkv = F.linear(_rms(x, w.input_norm, eps), w.qkv).view(batch, queries, -1, dim)
            # q_norm and k_norm in one pass (their weights stacked per head), then RoPE on both
            qk = _rms(qkv[:, :, :heads + kv_heads], w.qk_norm, eps).transpose(1, 2)
            qk = qk * cos + qk.roll(dim // 2, dims=-1) * sin  # rotate_half(qk) * sin, with sin's sign folded in
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, :, heads + kv_heads:].transpose(1, 2)
            _write(self.keys[i], at, k)
            _write(self.values[i], at, v)
            keys, values = self.keys[i][:, :, :length], self.values[i][:, :, :length]
            if mask is None:  # transformers' sdpa_attention_forward, both of its single-query paths
                o = F.scaled_dot_product_attention(q, keys, values, scale=w.scaling, enable_gqa=heads != kv_heads)
            else:  # the query's heads packed per KV head (`pack_gqa`), the mask shared by all heads
                o = F.scaled_dot_product_attention(q.reshape(batch, kv_heads, -1, dim), keys, values,
                                                   attn_mask=mask, scale=w.scaling)
            # heads in order, as transformers lays them out
            x = x + F.linear(o.reshape(batch, heads, queries, dim).transpose(1, 2).reshape(batch, queries, -1),
                             w.o_proj)
            gate, up = F.linear(_rms(x, w.post_norm, eps), w.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down)
        return F.linear(_rms(x[:, -1:] if last else x, self.norm, eps), self.lm_head)


def _write(cache: Tensor, at: int | Tensor, new: Tensor) -> None:
    """`new` [B, H, Q, D] into `cache` [B, H, length, D] at column `at` on, or as rows `at` [B * H * Q] of
    the cache viewed as [B * H * length, D] (index_copy_: a third of scatter_'s time here)."""
    if isinstance(at, int):
        cache[:, :, at:at + new.shape[2]] = new
    else:
        cache.view(-1, new.shape[-1]).index_copy_(0, at, new.reshape(-1, new.shape[-1]))


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
