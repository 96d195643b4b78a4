"""Reusable pieces of an autoregressive RL step: rollout, reward, reference/old log-probs, update.

Each function does one thing on plain torch + transformers objects, so a trainer (the GRPO loop,
the SFT loop, a Ray actor, a notebook) reads as a short composition of them:

    prompts, media = encode_prompt_inputs(text_io, rows, max_prompt_tokens)
    batch      = engine_rollouts(engine, prompts, media=media, n=..., sampling=..., seeds=...)  # ARengine
    # or, with HF `generate` and one seed for the whole batch (what `evaluate` uses):
    batch      = generate_rollouts(model, text_io, prompts, media=media, n=..., sampling=..., seed=...)
    rewards    = score_rollouts(rows, batch, reward, n)
    advantages = grpo_advantages(rewards, batch.group_ids, scale=...)
    old_logp   = rollout_logprobs(model, batch, temperature)           # behaviour policy, no grad
    ref_logp   = rollout_logprobs(reference, batch, temperature)       # frozen reference (k3 KL)
    metrics    = policy_update(model, optimizer, batch, old_logp, advantages, ref_logp, loss_fn, ...)
    # or, when the current weights made the batch and it gets one optimizer step (`reuses_update_logp`):
    metrics    = policy_update(model, optimizer, batch, None, advantages, ref_logp, loss_fn, ...)

`policy_update` runs `ppo_epochs` passes over the batch in shuffled mini-batches of whole prompt
groups, one optimizer step each, so after the first step the ratio logp/old_logp moves away from 1
and the clip acts (as verl's `ppo_epochs` / `ppo_mini_batch_size`). With one epoch of one
mini-batch on a batch the current weights generated, the old log-probs are the update forward's own,
detached (the ratio is exactly 1): `old_logp=None` takes them from it and saves the extra no-grad
forward (`reuses_update_logp` says when that holds). Randomness comes only from the
seeds passed in: same seed, same numbers. `engine_rollouts` takes one seed per response
(`rollout_seed`), so a response does not depend on what else is in the batch, and always keeps the
engine's rollout log-probs (`RolloutBatch.rollout_logp`, for verl's rollout-vs-actor metrics).

`text_io` is a tokenizer (text-only causal LM) or a multimodal processor (Qwen3-Omni's thinker): then
each row's images and audio go through the processor with its prompt, every response row of the batch
carries its prompt's media tensors (`RolloutBatch.media`), and generation and every log-prob forward
(old, reference, update) pass them to the model, so the update conditions on the media the rollout saw.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from omni_core.errors import ModelError
from omni_core.models import sequence_logprobs
from omni_core.rollout.autoregressive import ARengine, ARPrompt
from omni_core.rollout.engine import RolloutRequest
from omni_core.rollout.metrics import rollout_consistency
from omni_core.training.multimodal import (
    collate_media,
    encode_media_prompts,
    is_processor,
    media_token_ids,
    tokenizer_of,
)
from omni_core.training.rows import PromptCursor, score_rollouts  # noqa: F401  (re-exported)

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]


@dataclass
class RolloutBatch:
    input_ids: Tensor  # [B, P + R], prompts left-padded, responses right-padded
    attention_mask: Tensor  # [B, P + R]
    response_mask: Tensor  # [B, P + R]: 1 on response tokens up to and including EOS
    responses: list[str]
    group_ids: Tensor  # [B]: which prompt each response answers
    # Per row, its prompt's media tensors from a multimodal processor (pixel_values, image_grid_thw,
    # input_features, feature_attention_mask, ...; {} for a text-only prompt); None without a processor.
    media: list[dict[str, Tensor]] | None = None
    # [B, P + R] log-probs of the response tokens from the logits they were sampled from (verl's
    # rollout_log_probs), 0 elsewhere: always from `engine_rollouts`, from `generate_rollouts` with
    # keep_logprobs=True; None otherwise.
    rollout_logp: Tensor | None = None

    def select(self, index: Tensor) -> RolloutBatch:
        """The rows `index` (a 1-D long tensor) of the batch, with their own media."""
        rows = index.tolist()
        return RolloutBatch(self.input_ids[index], self.attention_mask[index], self.response_mask[index],
                            [self.responses[i] for i in rows], self.group_ids[index],
                            None if self.media is None else [self.media[i] for i in rows],
                            None if self.rollout_logp is None else self.rollout_logp[index])

    def media_inputs(self) -> dict[str, Tensor]:
        """The rows' media collated for one forward (`collate_media`); {} without media."""
        return {} if self.media is None else collate_media(self.media)


@dataclass(frozen=True)
class Sampling:
    """How responses are drawn: `greedy` ignores temperature and top_p."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    greedy: bool = False


def encode_prompts(tokenizer: Any, rows: Sequence[dict[str, Any]], max_prompt_tokens: int) -> list[list[int]]:
    """Chat-template token ids of each row's `prompt` messages, with the generation prompt.

    Longer prompts keep their last `max_prompt_tokens` tokens: the question's tail and the
    assistant header.
    """
    encoded = []
    for row in rows:
        ids = tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
            ids = ids["input_ids"]
        encoded.append(list(ids)[-max_prompt_tokens:])
    return encoded


def encode_prompt_inputs(text_io: Any, rows: Sequence[dict[str, Any]], max_prompt_tokens: int,
                         ) -> tuple[list[list[int]], list[dict[str, Tensor]] | None]:
    """(prompt token ids, per-prompt media tensors) for `generate_rollouts`: with a tokenizer,
    `encode_prompts` and None; with a multimodal processor, each row's prompt and its own images and
    audio through the processor (`omni_core.training.multimodal.encode_media_prompts`)."""
    if is_processor(text_io):
        return encode_media_prompts(text_io, rows, max_prompt_tokens)
    return encode_prompts(text_io, rows, max_prompt_tokens), None


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(ids [B, W], attention mask [B, W]) with every sequence right-aligned."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([[pad_id] * (width - len(s)) + list(s) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], dtype=torch.long)
    return ids, mask


@torch.no_grad()
def generate_rollouts(model: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[Sequence[int]], *, n: int,
                      sampling: Sampling, seed: int, media: Sequence[dict[str, Tensor]] | None = None,
                      keep_logprobs: bool = False) -> RolloutBatch:
    """`n` responses per prompt with HF `generate`; sampling noise depends on `seed` only.

    `tokenizer` may be a multimodal processor (its tokenizer is used here). `media` (from
    `encode_prompt_inputs`) holds each prompt's media tensors: they are repeated with the prompt,
    collated into `generate`, and kept per row in the batch. With media the model's media tokens
    (placeholders, start/end markers) are never sampled: a response holding one would ask the model
    for media it was not given. `keep_logprobs` records `RolloutBatch.rollout_logp` from generate's
    raw logits (it keeps [B, new tokens, vocab] logits for the call: meant for checks and small vocabs).

    The response mask covers every token up to and including the first EOS (generate pads after it).
    The model is put back in the train/eval mode it had.
    """
    tokenizer = tokenizer_of(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    repeated = [ids for ids in prompt_ids for _ in range(n)]
    input_ids, attention = left_pad(repeated, pad)
    width = input_ids.shape[1]
    options: dict[str, Any] = ({"do_sample": False} if sampling.greedy else
                               {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                                "top_k": 0})
    row_media = None if media is None else [m for m in media for _ in range(n)]
    if row_media is not None:
        options.update(collate_media(row_media))
        options["suppress_tokens"] = media_token_ids(tokenizer)
    if keep_logprobs:
        options.update(return_dict_in_generate=True, output_logits=True)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG as it was
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=sampling.max_new_tokens,
                             pad_token_id=pad, eos_token_id=eos, **options)
    model.train(was_training)
    sequences = out.sequences if keep_logprobs else out
    response = sequences[:, width:]
    is_eos = (response == eos).int()
    after_eos = (torch.cumsum(is_eos, dim=1) - is_eos) > 0
    response_mask = (~after_eos).long()
    texts = tokenizer.batch_decode(response * response_mask + pad * (1 - response_mask), skip_special_tokens=True)
    rollout_logp = None
    if keep_logprobs:
        temperature = 1.0 if sampling.greedy else sampling.temperature
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [B, R, V], before any processor
        picked = torch.log_softmax(logits, dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1) * response_mask
        rollout_logp = torch.cat([torch.zeros_like(attention, dtype=picked.dtype), picked], dim=1)
    return RolloutBatch(
        input_ids=sequences,
        attention_mask=torch.cat([attention, response_mask], dim=1),
        response_mask=torch.cat([torch.zeros_like(attention), response_mask], dim=1),
        responses=texts,
        group_ids=torch.arange(len(prompt_ids)).repeat_interleave(n),
        media=row_media,
        rollout_logp=rollout_logp,
    )


def rollout_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The sampling seed of response `sample` of prompt `prompt` (its position in the step's batch) at
    `step` of a run seeded `seed`: a 63-bit digest of the four, so distinct tuples get unrelated seeds."""
    digest = hashlib.blake2b(f"{seed}/{step}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def engine_rollouts(engine: ARengine, prompt_ids: Sequence[Sequence[int]], *, n: int, sampling: Sampling,
                    seeds: Sequence[int], media: Sequence[dict[str, Tensor]] | None = None) -> RolloutBatch:
    """`n` responses per prompt from a rollout engine (`ARengine`), one request per response with its
    own seed (`seeds[i * n + j]`: response j of prompt i, e.g. from `rollout_seed`), as a RolloutBatch.

    Same layout as `generate_rollouts`: prompts left-padded, responses right-padded, the response mask
    on every token up to and including EOS (the engine stops a response at its EOS), each row with its
    prompt's media (`media` from `encode_prompt_inputs`; None for a tokenizer), and `rollout_logp` the
    engine's log-probs (log_softmax(logits / T) of the sampled tokens) at the response positions. A
    response depends only on its prompt, media, sampling, seed and the weights, not on its batch.

    The engine runs the model on its scheduler thread while this call waits: the caller must not run
    the same model object concurrently.
    """
    results = engine.generate(rollout_requests(prompt_ids, n=n, sampling=sampling, seeds=seeds, media=media))
    return assemble_rollouts(prompt_ids, results, n=n, pad_id=engine.pad_id, media=media)


def rollout_requests(prompt_ids: Sequence[Sequence[int]], *, n: int, sampling: Sampling, seeds: Sequence[int],
                     media: Sequence[dict[str, Tensor]] | None = None) -> list[RolloutRequest]:
    """One `ARengine` request per response: response j of prompt i is request i * n + j, seeded
    `seeds[i * n + j]`, with its prompt's media."""
    if len(seeds) != len(prompt_ids) * n:
        raise ValueError(f"{len(seeds)} seeds for {len(prompt_ids)} prompts x {n} responses: give one per response")
    return [RolloutRequest(ARPrompt(list(prompt_ids[row // n]), {} if media is None else media[row // n]),
                           sampling, seed=int(seed)) for row, seed in enumerate(seeds)]


def assemble_rollouts(prompt_ids: Sequence[Sequence[int]], results: Sequence[Any], *, n: int, pad_id: int,
                      media: Sequence[dict[str, Tensor]] | None = None) -> RolloutBatch:
    """The RolloutBatch of the engine results of `rollout_requests` (in request order): each result has
    `output` (token ids), `logprobs` and `text`. The layout depends only on the results, not on which
    engine or worker produced them."""
    row_media = None if media is None else [m for m in media for _ in range(n)]
    prompt_ids_t, prompt_mask = left_pad([prompt_ids[row // n] for row in range(len(results))], pad_id)
    width = max(len(r.output) for r in results)
    response = torch.full((len(results), width), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(results), width), dtype=torch.long)
    picked = torch.zeros((len(results), width), dtype=torch.float32)
    for row, result in enumerate(results):
        length = len(result.output)
        response[row, :length] = torch.tensor(result.output, dtype=torch.long)
        response_mask[row, :length] = 1
        picked[row, :length] = torch.as_tensor(result.logprobs, dtype=torch.float32)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids_t, response], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1),
        response_mask=torch.cat([torch.zeros_like(prompt_mask), response_mask], dim=1),
        responses=[r.text for r in results],
        group_ids=torch.arange(len(prompt_ids)).repeat_interleave(n),
        media=row_media,
        rollout_logp=torch.cat([torch.zeros_like(prompt_mask, dtype=torch.float32), picked], dim=1),
    )


def rollout_logprobs(model: torch.nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> Tensor:
    """Per-token log-probs [B, T] of the batch's response tokens under `model` (0 elsewhere), given
    each row's prompt and media."""
    return sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                             temperature=temperature, **batch.media_inputs())


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A reference policy: a deep copy in eval mode with no trainable parameters."""
    reference = copy.deepcopy(model).eval()
    reference.requires_grad_(False)
    return reference


def make_reference(model: torch.nn.Module) -> torch.nn.Module | None:
    """The frozen reference an algorithm keeps: None for a LoRA (peft) policy, whose reference is the
    policy with its adapter disabled (the base weights), else a frozen copy of the starting policy."""
    return None if hasattr(model, "disable_adapter") else frozen_copy(model)


@contextlib.contextmanager
def reference_policy(model: torch.nn.Module, frozen: torch.nn.Module | None) -> Iterator[torch.nn.Module]:
    """The reference to run: `frozen` (from `make_reference`), or the LoRA policy with its adapter disabled."""
    if frozen is not None:
        yield frozen
        return
    if not hasattr(model, "disable_adapter"):
        raise ModelError("no reference model given and the policy has no LoRA adapter to disable; "
                         "pass reference=frozen_copy(model) (what make_reference(model) returns) for full fine-tuning")
    with model.disable_adapter():
        yield model


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (torch's defaults otherwise)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Tensor,
                   max_grad_norm: float) -> float:
    """zero_grad, backward, clip the global grad norm to `max_grad_norm`, step; returns the norm before
    clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    return float(grad_norm)


def minibatches(group_ids: Tensor, groups_per_minibatch: int | None, generator: torch.Generator) -> list[Tensor]:
    """Row indices of each mini-batch: whole groups (prompts), shuffled by `generator`.

    `groups_per_minibatch=None` (or >= the number of groups) gives one mini-batch of every row, in
    order.
    """
    groups = torch.unique(group_ids)
    if groups_per_minibatch is None or groups_per_minibatch >= len(groups):
        return [torch.arange(len(group_ids))]
    order = groups[torch.randperm(len(groups), generator=generator)]
    out = []
    for start in range(0, len(order), groups_per_minibatch):
        chosen = order[start:start + groups_per_minibatch]
        out.append(torch.nonzero(torch.isin(group_ids, chosen)).squeeze(-1))
    return out


def has_active_dropout(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` in its current mode draws dropout masks: in train mode, a dropout
    module with p > 0, or a positive `*dropout*` / `*pdrop*` setting in a module's config (HF
    attention applies `config.attention_dropout` functionally). Errs towards True."""
    if not model.training:
        return False
    configs = {}
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.training and module.p > 0:
            return True
        config = getattr(module, "config", None)
        if hasattr(config, "to_dict"):
            configs[id(config)] = config
    return any(_positive_dropout(key, value) for config in configs.values() for key, value in _flatten(config.to_dict()))


def _flatten(settings: dict[Any, Any]) -> Iterator[tuple[Any, Any]]:
    for key, value in settings.items():
        if isinstance(value, dict):
            yield from _flatten(value)
        else:
            yield key, value


def _positive_dropout(key: Any, value: Any) -> bool:
    return (isinstance(key, str) and ("dropout" in key or "pdrop" in key) and isinstance(value, int | float)
            and not isinstance(value, bool) and value > 0)


def reuses_update_logp(model: torch.nn.Module, group_ids: Tensor, *, ppo_epochs: int,
                       groups_per_minibatch: int | None, on_policy: bool) -> bool:
    """Whether the old log-probs of a batch may come from the update forward (`policy_update` with
    `old_logp=None`) instead of a recomputation: the current weights generated the batch (`on_policy`),
    it gets a single optimizer step (one epoch, one mini-batch of every group), and the forward draws
    no dropout masks (then the update forward's log-probs, detached, are what the recomputation
    would give, and skipping it leaves the RNG stream as it was)."""
    one_minibatch = groups_per_minibatch is None or groups_per_minibatch >= len(torch.unique(group_ids))
    return on_policy and ppo_epochs == 1 and one_minibatch and not has_active_dropout(model)


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, *,
                  old_logp: Tensor | None, advantages: Tensor, loss_fn: PolicyLossFn, loss_kwargs: dict[str, Any],
                  ref_logp: Tensor | None = None, kl_beta: float = 0.0, temperature: float = 1.0,
                  ppo_epochs: int = 1, groups_per_minibatch: int | None = None, max_grad_norm: float = 1.0,
                  seed: int = 0, rollout_logp: Tensor | None = None) -> dict[str, float]:
    """`ppo_epochs` passes over the batch in mini-batches of whole groups, one optimizer step each.

    `old_logp=None`: the old log-probs are the update forward's own, detached (ratio exactly 1); only
    for a single optimizer step (one epoch, one mini-batch), else ValueError; the caller checks the
    rest of `reuses_update_logp`. With `rollout_logp` (the engine's log-probs of the batch) the
    metrics include verl's `training/rollout_*` consistency of it against the old log-probs.

    Returns the loss metrics (verl names) and `actor/grad_norm` averaged over the optimizer steps.
    """
    generator = torch.Generator().manual_seed(seed)
    mask = batch.response_mask.float()
    history: dict[str, list[float]] = {}
    schedule = [minibatches(batch.group_ids, groups_per_minibatch, generator) for _ in range(ppo_epochs)]
    if old_logp is None and (ppo_epochs != 1 or len(schedule[0]) != 1):
        raise ValueError(f"old_logp=None needs a single optimizer step, got ppo_epochs={ppo_epochs} with "
                         f"{len(schedule[0])} mini-batches: pass the recomputed old log-probs")
    consistency: dict[str, float] = {}
    for epoch_batches in schedule:
        for index in epoch_batches:
            mb = batch.select(index)
            logp = rollout_logprobs(model, mb, temperature)
            old = logp.detach() if old_logp is None else old_logp[index]
            if rollout_logp is not None and not consistency:
                full = old if old_logp is None else old_logp
                consistency = rollout_consistency(rollout_logp, full, batch.response_mask)
            extra = {} if ref_logp is None else {"ref_logp": ref_logp[index], "beta": kl_beta}
            loss, metrics = loss_fn(logp, old, advantages[index], mask[index], **loss_kwargs, **extra)
            metrics["actor/grad_norm"] = optimizer_step(model, optimizer, loss, max_grad_norm)
            for key, value in metrics.items():
                history.setdefault(key, []).append(value)
    return {**{key: sum(values) / len(values) for key, values in history.items()}, **consistency}


@torch.no_grad()
def score_records(model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], *,
                  reward: str | None = None, sampling: Sampling | None = None, n: int = 1,
                  max_prompt_tokens: int = 256, batch_size: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """`n` responses per row (greedy unless `sampling` says otherwise), scored: one record per response
    (`row`, `response`, `score`; response j of row i is record i * n + j). `tokenizer` may be a
    multimodal processor. The sampling noise depends on `seed` only, so two checkpoints scored with the
    same seed are compared on the same random numbers."""
    sampling = sampling or Sampling(greedy=True)
    records: list[dict[str, Any]] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts, media = encode_prompt_inputs(tokenizer, chunk, max_prompt_tokens)
        batch = generate_rollouts(model, tokenizer, prompts, media=media, n=n, sampling=sampling, seed=seed + start)
        scored = score_rollouts(chunk, batch.responses, reward, n)
        records += [{"row": chunk[i // n], "response": text, "score": float(s["score"])}
                    for i, (text, s) in enumerate(zip(batch.responses, scored, strict=True))]
    return records


def val_metrics(records: Sequence[dict[str, Any]], n: int) -> dict[str, float]:
    """verl's validation names: `val/reward_mean` and `val-core/{data_source}/reward/mean@{n}`."""
    scores = [r["score"] for r in records]
    metrics = {"val/reward_mean": sum(scores) / max(len(scores), 1)}
    by_source: dict[str, list[float]] = {}
    for r in records:
        by_source.setdefault(r["row"].get("data_source", ""), []).append(r["score"])
    for source, values in by_source.items():
        metrics[f"val-core/{source}/reward/mean@{n}"] = sum(values) / len(values)
    return metrics


def evaluate(model: torch.nn.Module, tokenizer: Any, rows: Sequence[dict[str, Any]], *, reward: str | None = None,
             sampling: Sampling | None = None, n: int = 1, max_prompt_tokens: int = 256, batch_size: int = 64,
             seed: int = 0) -> dict[str, float]:
    """Mean reward of `n` responses per row, verl's val names (`score_records`, `val_metrics`)."""
    records = score_records(model, tokenizer, rows, reward=reward, sampling=sampling, n=n,
                            max_prompt_tokens=max_prompt_tokens, batch_size=batch_size, seed=seed)
    return val_metrics(records, n)
