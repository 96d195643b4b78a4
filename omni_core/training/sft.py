"""Supervised fine-tuning: cross-entropy on the response tokens of (prompt messages, response) pairs.

    loss = -sum(m * log p(token)) / sum(m)      m = 1 on the response tokens and the closing EOS

The prompt is rendered with the tokenizer's chat template and its generation prompt, exactly as the
RL rollout renders it, so an SFT warm start teaches the policy what RL will then sample. Data order
is `PromptCursor`'s (a seeded permutation per epoch), so the same seed gives the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from omni_core.algorithms import sft_loss
from omni_core.config.models import RLStage, TrainerConfig
from omni_core.errors import DataError
from omni_core.models import sequence_logprobs
from omni_core.training.components import (
    PromptCursor,
    build_optimizer,
    encode_prompts,
    left_pad,
    optimizer_step,
)
from omni_core.training.trainer import TrainerState


@dataclass(frozen=True)
class SFTExample:
    prompt: list[dict[str, str]]  # chat messages, as in a verl RL row's `prompt`
    response: str  # the assistant's answer (without the EOS token)


@dataclass
class SFTBatch:
    input_ids: Tensor  # [B, T], left-padded prompt + response + EOS
    attention_mask: Tensor  # [B, T]
    loss_mask: Tensor  # [B, T]: 1 on the response tokens and the EOS


def examples_from_rows(rows: Sequence[dict[str, Any]], response: Callable[[dict[str, Any]], str]) -> list[SFTExample]:
    """SFT pairs from verl RL rows: the row's prompt and `response(row)` as the target."""
    return [SFTExample(list(row["prompt"]), response(row)) for row in rows]


def row_response(row: dict[str, Any], pick: str = "auto") -> str:
    """The target response of a dataset row (`omni_core.training.algorithms.sft`): `chosen` (a
    preference pair's chosen message), `answer` (`extra_info.answer`, e.g. GSM8K's worked answer),
    `ground_truth` (`reward_model.ground_truth`); `auto` takes the first of those the row has."""
    found = {}
    chosen = row.get("chosen")
    if chosen:
        found["chosen"] = chosen["content"] if isinstance(chosen, dict) else str(chosen)
    answer = (row.get("extra_info") or {}).get("answer")
    if answer:
        found["answer"] = str(answer)
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if truth is not None:
        found["ground_truth"] = str(truth)
    if pick == "auto":
        if found:
            return next(iter(found.values()))
        raise DataError("sft: a row has no chosen response, extra_info.answer or reward_model.ground_truth to "
                        "train on; give the stage a dataset whose converter writes one")
    if pick not in found:
        raise DataError(f"sft: algorithm.response is {pick}, but a row has no {pick} (it has: "
                        f"{', '.join(found) or 'none'}); use response: auto or another dataset")
    return found[pick]


def encode_examples(tokenizer: Any, examples: Sequence[SFTExample], max_prompt_tokens: int) -> SFTBatch:
    prompts = encode_prompts(tokenizer, [{"prompt": e.prompt} for e in examples], max_prompt_tokens)
    responses = [tokenizer(e.response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                 for e in examples]
    input_ids, attention = left_pad([p + r for p, r in zip(prompts, responses, strict=True)], tokenizer.pad_token_id)
    width = input_ids.shape[1]
    loss_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in responses], dtype=torch.long)
    return SFTBatch(input_ids, attention, loss_mask)


def sft_step_loss(model: torch.nn.Module, batch: SFTBatch) -> Tensor:
    """Token-mean cross-entropy of the batch's response tokens (`omni_core.algorithms.sft_loss`)."""
    logp = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    return sft_loss(logp, batch.loss_mask)


class SFTTrainer(TrainerState):
    """`step()` trains on the next `trainer.batch_size` examples and returns verl's SFT metrics."""

    def __init__(self, trainer: TrainerConfig, examples: Sequence[SFTExample], seed: int, *,
                 model: torch.nn.Module, text_io: Any):
        self.model, self.tokenizer, self.examples, self.trainer = model, text_io, list(examples), trainer
        self.model.train()
        self.optimizer = build_optimizer(model, trainer.lr)
        self.cursor = PromptCursor(len(self.examples), seed)
        self.global_step = 0

    @property
    def text_io(self) -> Any:
        return self.tokenizer

    def step(self) -> dict[str, float]:
        chosen = [self.examples[i] for i in self.cursor.batch(self.global_step, self.trainer.batch_size)]
        batch = encode_examples(self.tokenizer, chosen, self.trainer.max_prompt_tokens)
        loss = sft_step_loss(self.model, batch)
        grad_norm = optimizer_step(self.model, self.optimizer, loss, self.trainer.max_grad_norm)
        self.global_step += 1
        return {"train/loss": loss.item(), "train/lr": self.trainer.lr, "train/grad_norm": grad_norm}

    def fit(self) -> list[dict[str, float]]:
        """`trainer.total_steps` steps; the metrics of each."""
        return [self.step() for _ in range(self.trainer.total_steps)]


def build_trainer(stage: RLStage, rows: list[dict[str, Any]], seed: int, *, model: torch.nn.Module, text_io: Any,
                  rollout: bool = True) -> SFTTrainer:
    """The sft record's trainer: each row's prompt and its `algorithm.response` (the construction
    convention: omni_core.training.trainer; no rollout)."""
    pick = stage.algorithm.response
    return SFTTrainer(stage.trainer, examples_from_rows(rows, lambda row: row_response(row, pick)), seed,
                      model=model, text_io=text_io)
