"""The autoregressive rollout engine: a causal LM (or Qwen3-Omni's thinker) behind `RolloutEngine`.

`ARengine(model, tokenizer_or_processor, config)` generates responses to token-id prompts (with, for
the thinker, each prompt's own image/audio tensors) in either scheduling mode of the base class:

- request-level (`run_requests`): up to `max_num_seqs` compatible requests are prefilled together
  (left padding, one KV cache) and decoded together; a sequence that finishes leaves the batch at once
  (its cache rows are dropped), so the batch shrinks instead of decoding padding;
- step-level (`start` / `step` / `finish`): continuous batching. The running sequences of a sampling
  setting share one KV cache; every `step` decodes one token for each of them; sequences that finished
  (EOS or `max_new_tokens`) leave at the step boundary, and requests admitted since the last step are
  prefilled together and merged into the running batch (caches left-padded to a common length, then
  concatenated on the batch dimension), their prefill giving their first token.

Exactness (what the tests check): a request's sampling noise comes only from its own CPU
`torch.Generator` seeded with `request.seed`: when it starts, it draws `max_new_tokens` uniforms
(float64), and its k-th token is drawn by inverse CDF with the k-th one (the first token whose
cumulative probability, in vocabulary order, exceeds u). So its tokens do not depend on what it was
batched with (and the uniforms, drawn on the CPU, are the same on every device); the only batch effect
left is float rounding in the forward (padding changes reduction orders), about 1e-7 on log-probs,
which flips a token only if u falls that close to a CDF step. One uniform a token, not V noise
variates: an exponential race / Gumbel-max drawing V of them per row and token from each row's
generator took about a fifth of a batched tiny-model step.

Recorded log-probs (`RolloutResult.logprobs`, [T] float32): `log_softmax(logits / temperature)` at the
sampled token, computed from the raw logits of the forward that sampled it — the same definition as
`omni_core.models.sequence_logprobs(..., temperature=temperature)`, so they are what the trainer
recomputes on prompt + response (temperature 1 for greedy). They are NOT the log-probs of the
distribution the token was drawn from when `top_p < 1` (the nucleus renormalised) or when media tokens
are suppressed: like `generate_rollouts(keep_logprobs=True)`, they are the full tempered policy's,
the quantity the PPO ratio and the rollout-vs-actor metrics compare.

Why not transformers' own generation loops (checked in the installed transformers 5.x):
- `model.generate` samples with the global RNG (one seed for the whole batch: a sample depends on its
  batch) and cannot admit or retire requests mid-generation;
- continuous batching (`generate_batch` / `ContinuousBatchingManager`) does return per-token log-probs
  (`return_logprobs`, of the processed scores), but samples with `torch.multinomial` on the global RNG
  seeded once per manager (no per-request seed), switches the model to paged attention, runs its own
  scheduler thread, and has no path for the thinker's media inputs and 3-D M-RoPE positions.
So the loop here is our own, built from transformers' `DynamicCache` and its logits processors
(`TopPLogitsWarper`, `SuppressTokensLogitsProcessor`: the same top-p rule as `generate`, row by row).

Weights pushed with `update_weights` between steps apply to the next forward; sequences already in
flight keep the KV cache computed under the previous weights (as vLLM's in-flight updates) and their
results carry the version they started with.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TopPLogitsWarper,
)

from omni_core.errors import ConfigError, ModelError
from omni_core.models.logprobs import takes_logits_to_keep
from omni_core.rollout.engine import EngineConfig, RolloutEngine, RolloutRequest, RolloutResult


@dataclass(frozen=True)
class ARSampling:
    """How a response is drawn (the compat key: requests with equal sampling share forwards).

    `greedy` ignores temperature and top_p (log-probs then at temperature 1). The trainer's
    `omni_core.training.components.Sampling` has the same fields and works as a request's sampling too.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    greedy: bool = False

    def __post_init__(self) -> None:
        check_sampling(self)


def check_sampling(s: Any) -> None:
    if s.max_new_tokens < 1:
        raise ConfigError(f"rollout max_new_tokens={s.max_new_tokens}: must be at least 1")
    if not s.greedy and not s.temperature > 0:
        raise ConfigError(f"rollout temperature={s.temperature}: must be > 0 (or set greedy=true)")
    if not 0 < s.top_p <= 1:
        raise ConfigError(f"rollout top_p={s.top_p}: must be in (0, 1]")


@dataclass
class ARPrompt:
    """A prompt: token ids (chat template applied, generation prompt included) and, for a multimodal
    processor, the prompt's own media tensors (`pixel_values`, `image_grid_thw`, `input_features`,
    `feature_attention_mask`, ... as `omni_core.models.multimodal_inputs.encode_media_prompts` returns them
    per row; empty for text-only). A plain list of ids is accepted as a request's prompt too."""

    token_ids: list[int]
    media: dict[str, Tensor] = field(default_factory=dict)


@dataclass(eq=False)  # identity equality: states are matched to cache rows by identity
class _Sequence:
    """The state of one request: its prompt, its own random numbers, what it has produced so far."""

    request: RolloutRequest
    prompt_ids: list[int]
    media: dict[str, Tensor]
    sampling: Any
    uniforms: list[float]  # the k-th token's uniform, from the request's own generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    position: int = 0  # the (text) position of the next token fed to the model: tokens[-1]'s
    prefilled: bool = False
    done: bool = False
    finish_reason: str | None = None


@dataclass
class _Batch:
    """Running sequences sharing one KV cache: row i of the cache and of `mask` is `seqs[i]`."""

    seqs: list[_Sequence] = field(default_factory=list)
    cache: DynamicCache | None = None
    mask: Tensor | None = None  # [B, L]: 1 where the cache holds a real token, 0 on left padding

    def select(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order); drop cache columns that are padding for every kept row."""
        if len(rows) == len(self.seqs):
            return
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(rows, device=self.mask.device)
        self.mask = self.mask[index]
        self.cache.batch_select_indices(index)
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else 0
        if start > 0:
            self.mask = self.mask[:, start:]
            for layer in _layers(self.cache):
                layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]

    def merge(self, seqs: list[_Sequence], cache: DynamicCache, mask: Tensor) -> None:
        """Append freshly prefilled rows: both caches left-padded to a common length, then stacked."""
        if not self.seqs:
            self.seqs, self.cache, self.mask = list(seqs), cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(_layers(self.cache), _layers(cache), strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, -2), _left_pad(new.keys, width, -2)])
            old.values = torch.cat([_left_pad(old.values, width, -2), _left_pad(new.values, width, -2)])
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
        self.seqs += seqs

    def finished_out(self) -> None:
        self.select([i for i, s in enumerate(self.seqs) if not s.done])


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = cache.layers
    for layer in layers:
        if type(layer) is not DynamicLayer:  # sliding-window, quantized, linear-attention layers
            raise ModelError(f"ARengine merges and slices plain full-attention KV caches; this model's cache has "
                             f"{type(layer).__name__} layers")
    return layers


def _padding_only(mask: Tensor) -> Tensor | None:
    """The attention mask when it masks something, else None: without padding the model takes its
    plain causal path instead of building a mask (a quarter of a tiny model's decode step)."""
    return None if bool(mask.all()) else mask


def _left_pad(t: Tensor, width: int, dim: int) -> Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _prompt_parts(prompt: Any) -> tuple[list[int], dict[str, Tensor]]:
    if isinstance(prompt, ARPrompt):
        ids, media = prompt.token_ids, dict(prompt.media or {})
    elif isinstance(prompt, Tensor):
        ids, media = prompt.tolist(), {}
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
        ids, media = prompt, {}
    else:
        raise ModelError(f"ARengine prompts are token ids (a list of ints, or an ARPrompt with media), got "
                         f"{type(prompt).__name__}; tokenize first (encode_prompt_inputs)")
    ids = [int(i) for i in ids]
    if not ids:
        raise ModelError("ARengine got an empty prompt: a prompt needs at least one token")
    return ids, media


def draw_tokens(raw: Tensor, sampling: Any, uniforms: Tensor | None, suppress: Sequence[int] = (),
                logprobs: bool = True) -> tuple[Tensor, Tensor | None]:
    """(the next token of each row of `raw` [B, V] float32 logits, `log_softmax(raw / T)` [B, V] or None
    without `logprobs`): argmax for greedy, else inverse CDF at the row's uniform (`uniforms` [B] float64,
    module docstring). `suppress`: token ids never drawn. Shared with the eval's `lean_decode`, so both
    draw a token by the same rule."""
    warpers = LogitsProcessorList()
    if not sampling.greedy and sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    if suppress:
        warpers.append(SuppressTokensLogitsProcessor(list(suppress), device=raw.device))
    if sampling.greedy:
        logp = torch.log_softmax(raw, dim=-1) if logprobs else None  # at temperature 1
        # max(dim) rather than argmax: the same index (the first maximum), a third of argmax's time on CPU
        chosen = (warpers(None, raw.clone()) if warpers else raw).max(dim=-1).indices
    else:
        scores = raw / float(sampling.temperature)
        logp = torch.log_softmax(scores, dim=-1) if logprobs or not warpers else None  # the full tempered one
        probs = torch.softmax(warpers(None, scores.clone()), dim=-1) if warpers else logp.exp()
        cdf = probs.double().cumsum(dim=-1)  # filtered tokens: zero-width steps, never chosen
        chosen = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        chosen = chosen.clamp_(max=cdf.shape[-1] - 1)
    return chosen, logp


class ARengine(RolloutEngine):
    """Autoregressive generation with per-request seeds and rollout log-probs (module docstring).

    `model`: a transformers causal LM (`Qwen3ForCausalLM`, ...) or Qwen3-Omni's thinker;
    `tokenizer_or_processor`: its tokenizer, or a multimodal processor (its tokenizer decodes; with a
    processor the model's media tokens are never sampled, as in `generate_rollouts`).
    `eos_token_ids`: the tokens that end a response (kept in it); default the tokenizer's EOS, as the
    trainer's response mask.

    The scheduler thread runs the model while holding `self._lock` (`update_weights` takes it too): a
    trainer sharing the model object must not run it concurrently.
    """

    def __init__(self, model: torch.nn.Module, tokenizer_or_processor: Any, config: EngineConfig | None = None, *,
                 eos_token_ids: Sequence[int] | None = None):
        self.model = model
        self.text_io = tokenizer_or_processor
        self.tokenizer = getattr(tokenizer_or_processor, "tokenizer", tokenizer_or_processor)
        eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset(int(i) for i in eos_token_ids) if eos_token_ids is not None else frozenset(
            [] if eos is None else [eos])
        if not self.eos_ids:
            raise ModelError("ARengine needs a tokenizer with an eos_token_id, or eos_token_ids (they end responses)")
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.device = next(model.parameters()).device
        # Qwen-VL/Omni thinkers: 3-D M-RoPE positions from the ids and media sizes, by the model's own rule
        # (the thinker adapter keeps the thinker under `.thinker` and forwards `forward` to it)
        self._rope_index = next((fn for m in (model, getattr(model, "thinker", None))
                                 if callable(fn := getattr(m, "get_rope_index", None))), None)
        self._mrope = self._rope_index is not None
        self._logits_to_keep = takes_logits_to_keep(model)
        self._suppress: list[int] = []
        if self.tokenizer is not tokenizer_or_processor:
            from omni_core.models.multimodal_inputs import media_token_ids

            self._suppress = media_token_ids(self.tokenizer)
        self._batches: dict[Hashable, _Batch] = {}  # step-level: the running batch of each compat key
        super().__init__(config)  # starts the scheduler thread: everything it uses is set above

    # ---- request-level -----------------------------------------------------------------------

    def run_requests(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        seqs = [self.start(r) for r in requests]
        batch = _Batch()
        with self._inference():
            self._join(batch, seqs)
            while batch.seqs:
                self._decode(batch)
        return [self.finish(r, s) for r, s in zip(requests, seqs, strict=True)]

    # ---- step-level --------------------------------------------------------------------------

    def start(self, request: RolloutRequest) -> _Sequence:
        check_sampling(request.sampling)
        ids, media = _prompt_parts(request.prompt)
        if media and not self._mrope:
            raise ModelError(f"request {request.request_id} has media inputs ({', '.join(media)}) but the model "
                             f"{type(self.model).__name__} takes token ids only")
        generator = torch.Generator().manual_seed(int(request.seed))
        uniforms = [] if request.sampling.greedy else torch.rand(
            request.sampling.max_new_tokens, generator=generator, dtype=torch.float64).tolist()
        return _Sequence(request, ids, media, request.sampling, uniforms)

    def step(self, requests: list[RolloutRequest], states: list[_Sequence]) -> None:
        key = self.compat_key(requests[0])
        batch = self._batches.setdefault(key, _Batch())
        running = {id(s) for s in states}
        batch.select([i for i, s in enumerate(batch.seqs) if id(s) in running])  # rows the scheduler dropped
        new = [s for s in states if not s.prefilled]
        try:
            with self._inference():
                if batch.seqs:
                    self._decode(batch)  # one token for every running sequence
                if new:
                    self._join(batch, new)  # newcomers: their prefill gives their first token
        except BaseException:
            self._batches.pop(key, None)  # the scheduler fails the whole group: nothing of it survives
            raise
        if not batch.seqs:
            self._batches.pop(key, None)

    def is_done(self, state: _Sequence) -> bool:
        return state.done

    def finish(self, request: RolloutRequest, state: _Sequence) -> RolloutResult:
        extra: dict[str, Any] = {"prompt_ids": state.prompt_ids, "finish_reason": state.finish_reason}
        if state.media:
            extra["media"] = state.media
        return RolloutResult(
            request_id=request.request_id,
            seed=request.seed,
            policy_version=0,  # set by the scheduler
            output=list(state.tokens),
            logprobs=torch.tensor(state.logprobs, dtype=torch.float32),
            extra=extra,
            text=self.tokenizer.decode(state.tokens, skip_special_tokens=True),
        )

    # ---- weights -----------------------------------------------------------------------------

    def load_weights(self, weights: dict[str, Any]) -> None:
        """A full state dict or a subset of it (a LoRA adapter's weights, named as in the model's
        `state_dict()`); names the model does not have are an error."""
        known = self.model.state_dict().keys()
        unknown = [k for k in weights if k not in known]
        if unknown:
            raise ModelError(f"weights for {len(unknown)} tensors the rollout model does not have, e.g. "
                             f"{unknown[:3]}; push the trainer model's state_dict() (or its LoRA subset)")
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=False)

    # ---- the loop ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """No autograd, eval mode (dropout off); a model in train mode (shared with a trainer) is put
        back after. Toggled only when needed: `train()` walks every module, a fifth of a tiny model's
        decode step."""
        was_training = self.model.training
        if was_training:
            self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            if was_training:
                self.model.train()

    def _join(self, batch: _Batch, seqs: list[_Sequence]) -> None:
        """Prefill `seqs` together (left-padded), sample their first token, merge the unfinished ones."""
        ids = [s.prompt_ids for s in seqs]
        width = max(len(i) for i in ids)
        input_ids = torch.tensor([[self.pad_id] * (width - len(i)) + i for i in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids], device=self.device)
        media: dict[str, Tensor] = {}
        if any(s.media for s in seqs):
            from omni_core.models.multimodal_inputs import collate_media

            media = {k: v.to(self.device) for k, v in collate_media([s.media for s in seqs]).items()}
        if self._mrope:
            lengths = media.get("feature_attention_mask")
            positions, _ = self._rope_index(
                input_ids, image_grid_thw=media.get("image_grid_thw"), video_grid_thw=media.get("video_grid_thw"),
                attention_mask=mask, audio_seqlens=None if lengths is None else lengths.sum(-1))
            # the response continues after the prompt's largest position (an image spans fewer positions
            # than tokens); taken over the real tokens only (the model's rope delta counts padding filler)
            following = positions.masked_fill(mask == 0, -1).amax(dim=(0, 2)).long() + 1
        else:  # as sequence_logprobs: left padding does not shift the positions
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            following = mask.sum(-1)
        cache = DynamicCache()
        extra = {"logits_to_keep": 1} if self._logits_to_keep else {}
        self.stats["forwards"] += 1
        out = self.model(input_ids=input_ids, attention_mask=_padding_only(mask), position_ids=positions,
                         cache=cache, use_cache=True, **media, **extra)
        for s, p in zip(seqs, following.tolist(), strict=True):
            s.position, s.prefilled = int(p), True
        self._sample(seqs, out.logits[:, -1])
        incoming = _Batch(list(seqs), cache, mask)
        incoming.finished_out()
        if incoming.seqs:
            batch.merge(incoming.seqs, incoming.cache, incoming.mask)

    def _decode(self, batch: _Batch) -> None:
        """One token for every sequence of `batch`; finished ones leave it."""
        n = len(batch.seqs)
        input_ids = torch.tensor([[s.tokens[-1]] for s in batch.seqs], device=self.device)
        positions = torch.tensor([[s.position] for s in batch.seqs], device=self.device)
        if self._mrope:
            positions = positions.unsqueeze(0).expand(3, n, 1)  # text tokens: the same on every axis
        mask = torch.cat([batch.mask, batch.mask.new_ones(n, 1)], dim=1)
        self.stats["forwards"] += 1
        out = self.model(input_ids=input_ids, attention_mask=_padding_only(mask), position_ids=positions,
                         cache=batch.cache, use_cache=True)
        batch.mask = mask
        for s in batch.seqs:
            s.position += 1
        self._sample(batch.seqs, out.logits[:, -1])
        batch.finished_out()

    def _sample(self, seqs: list[_Sequence], logits: Tensor) -> None:
        """Draw the next token of each row with its own uniforms; record its log-prob (module docstring)."""
        logits = logits.float()
        by_sampling: dict[Any, list[int]] = {}
        for i, s in enumerate(seqs):
            by_sampling.setdefault(s.sampling, []).append(i)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        picked = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        for sampling, rows in by_sampling.items():
            index = torch.tensor(rows, device=logits.device)
            raw = logits[index] if len(rows) < len(seqs) else logits
            u = None if sampling.greedy else torch.tensor(
                [seqs[i].uniforms[len(seqs[i].tokens)] for i in rows], dtype=torch.float64, device=logits.device)
            chosen, logp = draw_tokens(raw, sampling, u, self._suppress)
            tokens[index] = chosen
            picked[index] = logp.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        for s, token, lp in zip(seqs, tokens.tolist(), picked.tolist(), strict=True):
            s.tokens.append(token)
            s.logprobs.append(lp)
            if token in self.eos_ids:
                s.done, s.finish_reason = True, "eos"
            elif len(s.tokens) >= s.sampling.max_new_tokens:
                s.done, s.finish_reason = True, "length"


__all__ = ["ARPrompt", "ARSampling", "ARengine", "check_sampling", "draw_tokens"]
