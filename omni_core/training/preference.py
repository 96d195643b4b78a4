"""Preference training (DPO, MPO) on verl preference rows: components and a small trainer.

A step, composed from the pieces below (formulas in `omni_core.algorithms.preference`):

    index   = sampler.batch(step)                                    # one modality per batch
    rows    = [train_rows[i] for i in index]
    batch   = encode_pairs(text_io, rows, cache, index)              # chosen rows, then rejected rows
    ref     = reference_logps(model, reference, batch, average)      # frozen copy, or LoRA disabled
              # (or ReferenceCache.logps: each pair's once, when the run sees every pair)
    policy  = pair_logps(model, batch, average)
    loss, m = preference_step_loss(policy, ref, config)              # dpo: one loss_type; mpo: a list
    m["actor/grad_norm"] = optimizer_step(model, optimizer, loss, max_grad_norm)

`text_io` is a tokenizer (text-only: the `<image>`-style markers are dropped from the prompt) or a
Qwen3-Omni processor (the row's images and audio go through it beside the text). Chosen and
rejected responses share one forward: rows `[c_0..c_{B-1}, r_0..r_{B-1}]`.

Metric names are VeRL-Omni's: `actor/dpo_loss` (or `actor/mpo_loss` with `actor/{type}_loss` per
term), `actor/reward_accuracy`, `actor/chosen_rewards`, `actor/rejected_rewards`,
`actor/reward_margin`; validation `val/{name}` over all held-out pairs and `val/{modality}/{name}`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from omni_core.algorithms.preference import (
    SFT,
    preference_loss,
    sequence_logps,
    sft_loss,
)
from omni_core.config.models import RLStage
from omni_core.models import response_logits, token_logprobs
from omni_core.training.algorithms.preference import PreferenceOptions
from omni_core.training.components import (
    build_optimizer,
    make_reference,
    optimizer_step,
    reference_policy,
)
from omni_core.training.multimodal import is_processor, prompt_messages, row_media, tokenizer_of
from omni_core.training.sampler import ModalityGroupedSampler, row_modality, validation_batches
from omni_core.training.trainer import TrainerState

Row = Mapping[str, Any]
VAL_METRICS = ("reward_accuracy", "reward_margin", "chosen_rewards", "rejected_rewards")


class PreferenceConfig(PreferenceOptions):
    """A DPO/MPO trainer's settings: the stage's `algorithm:` options (`PreferenceOptions`, defined once,
    in omni_core.training.algorithms.preference) plus the stage's trainer keys. `loss_mode` is the
    options' `name` (dpo or mpo), as VeRL-Omni spells it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    set_elsewhere: ClassVar[dict[str, str]] = {}

    lr: float = Field(1e-3, gt=0)
    batch_size: int = Field(8, ge=1, description="Preference pairs per step.")
    total_steps: int = Field(100, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)
    val_batch_size: int = Field(32, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _loss_mode_is_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "loss_mode" in data:
            data = {**data, "name": data["loss_mode"]}
            del data["loss_mode"]
        return data

    @property
    def loss_mode(self) -> str:
        return self.name


# ---- encoding ------------------------------------------------------------------------------------


@dataclass
class PairBatch:
    """Chosen and rejected sequences of B pairs: rows 0..B-1 chosen, B..2B-1 rejected."""

    inputs: dict[str, Tensor]  # model forward kwargs: input_ids, attention_mask (+ position_ids or media)
    response_mask: Tensor  # [2B, T]: 1 on the response tokens and the closing EOS
    modalities: list[str]  # per pair

    @property
    def num_pairs(self) -> int:
        return len(self.modalities)


def encode_pairs(text_io: Any, rows: Sequence[Row], cache: dict[int, PairIds] | None = None,
                 keys: Sequence[int] | None = None) -> PairBatch:
    """Chat-template prompt + response + EOS for the chosen and the rejected answer of each row.

    `text_io` is a tokenizer (prompts without media markers) or a multimodal processor (media
    markers become the model's media tokens and the row's images/audio are processed with them).
    With a tokenizer, `cache` (with each row's key in `keys`) keeps each row's token ids, so a row
    that comes back in a later pass is not tokenized again.
    """
    if is_processor(text_io):
        return _encode_media_pairs(text_io, rows)
    tokenizer = tokenizer_of(text_io)
    if cache is None or keys is None:
        encoded = [pair_ids(tokenizer, row) for row in rows]
    else:
        for key, row in zip(keys, rows, strict=True):
            if key not in cache:
                cache[key] = pair_ids(tokenizer, row)
        encoded = [cache[key] for key in keys]
    sequences = [e.chosen for e in encoded] + [e.rejected for e in encoded]
    inputs = dict(tokenizer.pad({"input_ids": sequences}, padding=True, return_tensors="pt"))
    inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding
    lengths = [e.chosen_answer for e in encoded] + [e.rejected_answer for e in encoded]
    return PairBatch(inputs, _response_mask(inputs["attention_mask"], lengths), [row_modality(row) for row in rows])


@dataclass(frozen=True)
class PairIds:
    """One row's token ids (prompt + answer + EOS) for its chosen and its rejected answer, and the
    number of answer tokens (EOS included) at the end of each."""

    chosen: list[int]
    rejected: list[int]
    chosen_answer: int
    rejected_answer: int


def pair_ids(tokenizer: Any, row: Row) -> PairIds:
    prompt = tokenizer.apply_chat_template(prompt_messages(row, False), add_generation_prompt=True, tokenize=False)
    encoded = []
    for answer in (row["chosen"]["content"], row["rejected"]["content"]):
        ids = tokenizer(prompt + answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        if ids[len(ids) - len(answer_ids):] != answer_ids:  # the response must tokenize the same after its prompt
            raise ValueError(f"response {answer!r} tokenizes differently after its prompt")
        encoded.append((ids, len(answer_ids)))
    (chosen, chosen_answer), (rejected, rejected_answer) = encoded
    return PairIds(chosen, rejected, chosen_answer, rejected_answer)


def _response_mask(attention: Tensor, answer_lengths: Sequence[int]) -> Tensor:
    """1 on the last `answer_lengths[row]` attended tokens of each row (the padding is on the left)."""
    lengths = torch.tensor(list(answer_lengths)).unsqueeze(-1)
    remaining = attention.sum(-1, keepdim=True) - attention.cumsum(-1)  # attended tokens after each position
    return (attention.bool() & (remaining < lengths)).long()


def _encode_media_pairs(processor: Any, rows: Sequence[Row]) -> PairBatch:
    """encode_pairs with a multimodal processor: the rows' images and audio go with their text."""
    tokenizer = tokenizer_of(processor)
    prompts = [processor.apply_chat_template(prompt_messages(row, True), add_generation_prompt=True,
                                             tokenize=False) for row in rows]
    answers = [row["chosen"]["content"] for row in rows] + [row["rejected"]["content"] for row in rows]
    texts = [p + a + tokenizer.eos_token for p, a in zip(prompts + prompts, answers, strict=True)]
    inputs = dict(processor(text=texts, padding=True, return_tensors="pt", **row_media(list(rows) * 2)))
    ids = inputs["input_ids"]
    answer_ids = [tokenizer(a + tokenizer.eos_token, add_special_tokens=False)["input_ids"] for a in answers]
    response_mask = _response_mask(inputs["attention_mask"], [len(a) for a in answer_ids])
    for row, expected in enumerate(answer_ids):  # the response must tokenize the same after its prompt
        if ids[row][response_mask[row].bool()].tolist() != expected:
            raise ValueError(f"response {answers[row]!r} tokenizes differently after its prompt")
    return PairBatch(inputs, response_mask, [row_modality(row) for row in rows])


# ---- log-probs -----------------------------------------------------------------------------------


@dataclass
class PairLogps:
    chosen: Tensor  # [B] sequence log-probs (sum, or mean with average_log_prob)
    rejected: Tensor  # [B]
    chosen_tokens: Tensor  # [B, T] per-token log-probs of the chosen responses (0 off the mask)
    chosen_mask: Tensor  # [B, T]


def pair_logps(model: torch.nn.Module, batch: PairBatch, average: bool = False) -> PairLogps:
    """Log-probs of the chosen and rejected responses given their prompts (with gradient)."""
    logits = response_logits(model, batch.response_mask, **batch.inputs)
    tokens = token_logprobs(logits, batch.inputs["input_ids"]) * batch.response_mask
    seq = sequence_logps(tokens, batch.response_mask, average=average)
    b = batch.num_pairs
    return PairLogps(seq[:b], seq[b:], tokens[:b], batch.response_mask[:b])


@torch.no_grad()
def reference_logps(model: torch.nn.Module, reference: torch.nn.Module | None, batch: PairBatch,
                    average: bool = False) -> PairLogps:
    """Log-probs under the frozen reference: `reference` itself, or (None) the policy with its LoRA
    adapter disabled, i.e. the base weights. Eval mode; the policy's train/eval mode is restored."""
    target = model if reference is None else reference
    was_training = target.training
    if was_training:  # a frozen copy stays in eval mode: no walk over its modules each step
        target.eval()
    try:
        with reference_policy(model, reference) as ref:
            return pair_logps(ref, batch, average)
    finally:
        if was_training:
            target.train()


class ReferenceCache:
    """The frozen reference's log-probs of each training pair, computed once, for a run that sees every
    pair at least once (TRL's `precompute_ref_log_probs`, done lazily): a step's pairs are looked up, and
    the first step that needs a pair computes the fixed chunk it belongs to (`validation_batches` of the
    training rows: single-modality, in row order). A value depends on its chunk only, never on the step
    that asked first, so a resumed run reads the same numbers as an uninterrupted one."""

    def __init__(self, modalities: Sequence[str], chunk_size: int):
        self.chunks = validation_batches(modalities, chunk_size)
        self.chunk_of = {row: c for c, rows in enumerate(self.chunks) for row in rows}
        self.chosen: dict[int, Tensor] = {}
        self.rejected: dict[int, Tensor] = {}

    def logps(self, index: Sequence[int], compute: Callable[[list[int]], PairLogps]) -> PairLogps:
        """Reference log-probs of rows `index` (`chosen`, `rejected`: [B]); `compute(rows)` runs the
        reference on a chunk's rows."""
        for chunk in sorted({self.chunk_of[i] for i in index if i not in self.chosen}):
            rows = self.chunks[chunk]
            computed = compute(rows)
            for k, row in enumerate(rows):
                self.chosen[row], self.rejected[row] = computed.chosen[k], computed.rejected[k]
        chosen = torch.stack([self.chosen[i] for i in index])
        rejected = torch.stack([self.rejected[i] for i in index])
        return PairLogps(chosen, rejected, chosen.new_zeros(0), chosen.new_zeros(0))


# ---- loss and metrics ----------------------------------------------------------------------------


def preference_step_loss(policy: PairLogps, ref: PairLogps, config: PreferenceConfig,
                         prefix: str = "actor/") -> tuple[Tensor, dict[str, float]]:
    """The loss `config` asks for and its metrics, keys prefixed (`actor/dpo_loss`, ...)."""
    types = config.loss_types
    nll = sft_loss(policy.chosen_tokens, policy.chosen_mask) if SFT in types else None
    loss, metrics = preference_loss(
        policy.chosen, policy.rejected, ref.chosen, ref.rejected, loss_types=types, loss_weights=config.weights,
        beta=config.beta, label_smoothing=config.label_smoothing, nll=nll, name=f"{config.loss_mode}_loss")
    return loss, {prefix + k: v for k, v in metrics.items()}


class WeightedMeans:
    """Pair-weighted means of batch metrics, overall and per modality (VeRL-Omni's GroupedMetricMean)."""

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.sums: dict[str, dict[str, float]] = {}
        self.counts: dict[str, int] = {}

    def update(self, metrics: Mapping[str, float], weight: int, group: str) -> None:
        for name in ("", group):
            sums = self.sums.setdefault(name, dict.fromkeys(self.keys, 0.0))
            for key in self.keys:
                sums[key] += metrics[key] * weight
            self.counts[name] = self.counts.get(name, 0) + weight

    def result(self, prefix: str) -> dict[str, float]:
        out = {}
        for name in sorted(self.sums):
            scope = f"{prefix}/{name}" if name else prefix
            out.update({f"{scope}/{k}": v / self.counts[name] for k, v in self.sums[name].items()})
        return out


# ---- data ---------------------------------------------------------------------------------------


def read_split(store: Any, version: Any, split: str) -> list[dict[str, Any]]:
    """Every row of one split of an ingested dataset version (`DatasetVersion.rows`)."""
    return version.rows(store, split)


# ---- trainer -------------------------------------------------------------------------------------


class PreferenceTrainer(TrainerState):
    """DPO/MPO on preference rows: `step()` trains on one single-modality batch; `validate()` scores
    every held-out pair. With `reference=None` the reference is `make_reference(model)`."""

    def __init__(self, config: PreferenceConfig, train_rows: Sequence[Row], seed: int, *, model: torch.nn.Module,
                 text_io: Any, reference: torch.nn.Module | None = None):
        self.model, self.text_io, self.config = model, text_io, config
        self.train_rows = list(train_rows)
        self.reference = reference if reference is not None else make_reference(model)
        self.model.train()
        self.optimizer = build_optimizer(model, config.lr, weight_decay=config.weight_decay)
        self.sampler = ModalityGroupedSampler([row_modality(r) for r in self.train_rows], config.batch_size,
                                              seed=seed, weights=config.modality_weights)
        self.global_step = 0
        self._encoded: dict[int, PairIds] = {}  # train row index -> its token ids (encode_pairs' cache)
        # every pair seen at least once: its reference log-probs are computed once, not once a visit
        sees_every_pair = config.total_steps * config.batch_size >= len(self.train_rows)
        self._reference_cache = ReferenceCache([row_modality(r) for r in self.train_rows], config.val_batch_size) \
            if sees_every_pair else None

    def _encode(self, index: Sequence[int]) -> PairBatch:
        return encode_pairs(self.text_io, [self.train_rows[i] for i in index], self._encoded, index)

    def step(self) -> dict[str, float]:
        index = self.sampler.batch(self.global_step)
        batch = self._encode(index)
        average = self.config.average_log_prob
        t = time.perf_counter()
        if self._reference_cache is None:
            ref = reference_logps(self.model, self.reference, batch, average)
        else:
            ref = self._reference_cache.logps(
                index, lambda rows: reference_logps(self.model, self.reference, self._encode(rows), average))
        t_ref = time.perf_counter() - t
        loss, metrics = preference_step_loss(pair_logps(self.model, batch, average), ref, self.config)
        metrics["actor/grad_norm"] = optimizer_step(self.model, self.optimizer, loss, self.config.max_grad_norm)
        metrics["actor/lr"] = self.config.lr
        metrics["timing_s/ref"] = t_ref
        self.global_step += 1
        return metrics

    @torch.no_grad()
    def validate(self, rows: Sequence[Row]) -> dict[str, float]:
        """`val/{metric}` over all pairs and `val/{modality}/{metric}`, the loss included."""
        loss_key = f"{self.config.loss_mode}_loss"
        means = WeightedMeans([loss_key, *VAL_METRICS])
        was_training = self.model.training
        self.model.eval()
        try:
            for index in validation_batches([row_modality(r) for r in rows], self.config.val_batch_size):
                batch = encode_pairs(self.text_io, [rows[i] for i in index])
                average = self.config.average_log_prob
                ref = reference_logps(self.model, self.reference, batch, average)
                _, metrics = preference_step_loss(pair_logps(self.model, batch, average), ref, self.config, "")
                means.update(metrics, batch.num_pairs, batch.modalities[0])
        finally:
            self.model.train(was_training)
        return means.result("val")


def build_trainer(stage: RLStage, rows: list[dict[str, Any]], seed: int, *, model: torch.nn.Module, text_io: Any,
                  rollout: bool = True) -> PreferenceTrainer:
    """The dpo/mpo record's trainer: the stage's `algorithm:` options plus its trainer keys (the
    construction convention: omni_core.training.trainer; no rollout)."""
    t = stage.trainer
    config = PreferenceConfig(**stage.algorithm.model_dump(), lr=t.lr, batch_size=t.batch_size,
                              total_steps=t.total_steps, max_grad_norm=t.max_grad_norm)
    return PreferenceTrainer(config, rows, seed, model=model, text_io=text_io)
