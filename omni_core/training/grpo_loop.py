"""A synchronous GRPO/GSPO step on a causal LM: generate, reward, advantages, old log-probs, update.

Plain torch + transformers, no Ray: the Ray actor in `ray_stage` drives it. Read top to bottom.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from omni_core.algorithms import get_policy_loss, grpo_advantages
from omni_core.config.models import RLStage
from omni_core.models import load_model, sequence_logprobs
from omni_core.rewards import score_batch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, P + R], prompts left-padded, responses right-padded
    attention_mask: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, P + R]: 1 on response tokens up to and including EOS
    responses: list[str]
    group_ids: torch.Tensor  # [B]: which prompt each response answers


class PromptCursor:
    """Deterministic data order: a fresh seeded permutation per epoch; batch k depends only on k."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed = num_rows, seed

    def batch(self, step: int, batch_size: int) -> list[int]:
        out = []
        for position in range(step * batch_size, (step + 1) * batch_size):
            epoch, offset = divmod(position, self.num_rows)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            out.append(int(torch.randperm(self.num_rows, generator=generator)[offset]))
        return out


class GRPOTrainer:
    def __init__(self, stage: RLStage, rows: list[dict[str, Any]], seed: int):
        self.stage, self.rows, self.seed = stage, rows, seed
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_model(stage.model, seed=seed)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=stage.trainer.lr)
        self.loss_fn = get_policy_loss(stage.algorithm.name)
        self.cursor = PromptCursor(len(rows), seed)
        self.global_step = 0

    def _encode_prompts(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        limit = self.stage.trainer.max_prompt_tokens
        encoded = []
        for row in rows:
            ids = self.tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
                ids = ids["input_ids"]
            encoded.append(list(ids)[-limit:])  # keep the end: the question's tail and the generation prompt
        return encoded

    @torch.no_grad()
    def generate(self, rows: list[dict[str, Any]], step: int) -> Batch:
        cfg = self.stage.rollout
        pad = self.tokenizer.pad_token_id
        prompts = [ids for ids in self._encode_prompts(rows) for _ in range(cfg.n)]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(self.seed * 7919 + step)  # sampling noise depends on (seed, step) only
        self.model.eval()
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=cfg.temperature,
            top_p=cfg.top_p, top_k=0, max_new_tokens=cfg.max_new_tokens, pad_token_id=pad,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        self.model.train()
        response = out[:, width:]
        is_eos = response == self.tokenizer.eos_token_id
        # Mask: every token up to and including the first EOS (generate pads after it).
        after_eos = (torch.cumsum(is_eos.int(), dim=1) - is_eos.int()) > 0
        response_mask = (~after_eos).long()
        texts = self.tokenizer.batch_decode(response * response_mask + pad * (1 - response_mask),
                                            skip_special_tokens=True)
        return Batch(
            input_ids=out,
            attention_mask=torch.cat([attention, response_mask], dim=1),
            response_mask=torch.cat([torch.zeros_like(attention), response_mask], dim=1),
            responses=texts,
            group_ids=torch.arange(len(rows)).repeat_interleave(cfg.n),
        )

    def score(self, rows: list[dict[str, Any]], batch: Batch) -> torch.Tensor:
        """verl's reward call: keyword arguments data_source, solution_str, ground_truth, extra_info."""
        n = self.stage.rollout.n
        items = [{"data_source": rows[i // n].get("data_source", ""), "solution_str": text,
                  "ground_truth": rows[i // n]["reward_model"]["ground_truth"],
                  "extra_info": rows[i // n].get("extra_info")}
                 for i, text in enumerate(batch.responses)]
        scores = [result["score"] for result in score_batch(items, self.stage.reward.name)]
        return torch.tensor(scores, dtype=torch.float32)

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return sequence_logprobs(self.model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                 temperature=self.stage.rollout.temperature)

    def step(self) -> dict[str, float]:
        """One training step; returns verl-named metrics."""
        algo, trainer = self.stage.algorithm, self.stage.trainer
        t_step = time.perf_counter()
        rows = [self.rows[i] for i in self.cursor.batch(self.global_step, trainer.batch_size)]

        t = time.perf_counter()
        batch = self.generate(rows, self.global_step)
        t_gen = time.perf_counter() - t

        t = time.perf_counter()
        rewards = self.score(rows, batch)
        advantages = grpo_advantages(rewards, batch.group_ids, scale=algo.adv_scale)
        t_reward = time.perf_counter() - t

        t = time.perf_counter()
        with torch.no_grad():
            old_logp = self.logprobs(batch)
        t_old = time.perf_counter() - t

        t = time.perf_counter()
        logp = self.logprobs(batch)
        loss, loss_metrics = self.loss_fn(
            logp, old_logp, advantages, batch.response_mask.float(), clip_low=algo.clip_ratio_low,
            clip_high=algo.clip_ratio_high, agg=algo.loss_agg_mode,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), trainer.max_grad_norm)
        self.optimizer.step()
        t_update = time.perf_counter() - t

        self.global_step += 1
        lengths = batch.response_mask.sum(dim=1).float()
        return {
            **loss_metrics,
            "critic/score/mean": rewards.mean().item(),
            "critic/rewards/mean": rewards.mean().item(),
            "critic/advantages/mean": advantages.mean().item(),
            "actor/grad_norm": float(grad_norm),
            "actor/lr": trainer.lr,
            "response_length/mean": lengths.mean().item(),
            "timing_s/gen": t_gen,
            "timing_s/reward": t_reward,
            "timing_s/old_log_prob": t_old,
            "timing_s/update_actor": t_update,
            "timing_s/step": time.perf_counter() - t_step,
        }
