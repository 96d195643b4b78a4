"""A synchronous GRPO/GSPO step on a causal LM: generate, reward, advantages, old log-probs, update.

The policy is a text-only causal LM with its tokenizer, or a multimodal model with its processor
(Qwen3-Omni's thinker): then each row's images and audio go with its prompt into the rollout, and the
old, reference and updated log-probs condition on them (see `omni_core.training.components`).

Plain torch + transformers, no Ray: the Ray actor in `ray_stage` drives it. Each part is a component
from `omni_core.training.components`; `step` reads top to bottom as the algorithm:

1. rollout: `rollout.n` sampled responses for each of `trainer.batch_size` prompts, from an `ARengine`
   (`omni_core.rollout`) on the policy model itself, one seed per response (`rollout_seed` of the
   run's seed, the step, the prompt's position in the batch and the response's index), so a response
   does not depend on the other prompts of the batch; `rollout.max_num_seqs` and
   `rollout.step_execution` set its batching. The engine records each token's log-prob, so every step
   reports verl's `training/rollout_probs_diff_*` and `training/rollout_actor_probs_pearson_corr`
   (rollout vs the old log-probs, recomputed or the update forward's own: step 4);
2. reward: verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` per response;
3. advantages: GRPO group normalisation (`algorithm.adv_scale`);
4. old log-probs under the behaviour policy, and reference log-probs when `algorithm.kl_beta > 0`
   (the reference is a frozen copy of the starting policy, or with LoRA the policy with its adapter
   disabled: `components.make_reference`; k3 KL added as `kl_beta * kl`). When the current weights
   generated the batch and it gets a single optimizer step (`trainer.ppo_epochs == 1`,
   `trainer.ppo_mini_batch_size` unset or >= `trainer.batch_size`) and the model draws no dropout,
   the old log-probs are the update forward's own, detached (ratio exactly 1), and no separate
   forward runs (`components.reuses_update_logp`): `timing_s/old_log_prob` is then 0.0. Several
   epochs or mini-batches, or a batch from an older policy version (separate_async), recompute them;
   so does `recompute_old_logp = True` on the trainer. `timing_s/ref` is the reference forward's time
   (when `kl_beta > 0`);
5. update: `trainer.ppo_epochs` passes in mini-batches of `trainer.ppo_mini_batch_size` prompts,
   one AdamW step each, with the policy loss registered as `algorithm.name` ("grpo", "gspo").

The engine shares the policy model object (no weight copy: it always samples with the current
weights) and runs it on its scheduler thread while `generate` waits for the results; the trainer must
not run the model concurrently with a rollout, which holds in this synchronous loop (generate, then
score, then the log-prob forwards and the update). `close()` stops the engine's thread (also done when
the trainer is garbage-collected).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from omni_core.algorithms import get_policy_loss, grpo_advantages
from omni_core.config.models import RLStage
from omni_core.models import load_model
from omni_core.rollout.autoregressive import ARengine
from omni_core.rollout.engine import EngineConfig
from omni_core.training.components import (
    PromptCursor,
    RolloutBatch,
    Sampling,
    build_optimizer,
    encode_prompt_inputs,
    engine_rollouts,
    make_reference,
    policy_update,
    reference_policy,
    reuses_update_logp,
    rollout_logprobs,
    rollout_seed,
    score_rollouts,
)
from omni_core.training.trainer import TrainerState

Batch = RolloutBatch  # the name this module used before the components were split out

__all__ = ["Batch", "GRPOTrainer", "PromptCursor", "build_trainer"]


class GRPOTrainer(TrainerState):
    """`step()` runs one GRPO/GSPO step and returns verl-named metrics.

    The policy is `stage.model` loaded with `seed`, unless a warm-started `model` and its
    `text_io` (tokenizer) are given (e.g. after SFT); they are trained in place. `text_io` may be a multimodal
    processor (what `load_model` returns for Qwen3-Omni): the rows' images and audio then reach the model.
    """

    # True: always recompute the old log-probs with a separate no-grad forward (module docstring, step 4),
    # even where the update forward's own would do; the results agree to float rounding (bench/old_logprobs.py)
    recompute_old_logp = False

    def __init__(self, stage: RLStage, rows: list[dict[str, Any]], seed: int, *,
                 model: torch.nn.Module | None = None, text_io: Any = None, rollout: bool = True):
        self.stage, self.rows, self.seed = stage, rows, seed
        torch.manual_seed(seed)
        if model is None:
            model, text_io = load_model(stage.model, seed=seed)
        self.model, self.tokenizer = model, text_io
        self.model.train()
        self.reference = make_reference(self.model) if stage.algorithm.kl_beta > 0 else None
        self.optimizer = build_optimizer(self.model, stage.trainer.lr)
        self.loss_fn = get_policy_loss(stage.algorithm.name)
        self.cursor = PromptCursor(len(rows), seed)
        self.global_step = 0
        self.engine: ARengine | None = None
        if rollout:  # else batches come from rollout workers (omni_core.training.runner): `learn` only
            cfg = stage.rollout
            # the rollout engine samples with self.model itself (module docstring: never run concurrently)
            self.engine = ARengine(self.model, self.tokenizer, EngineConfig(max_num_seqs=cfg.max_num_seqs,
                                                                            step_execution=cfg.step_execution))
            self._close_engine = weakref.finalize(self, self.engine.close)

    @property
    def text_io(self) -> Any:
        return self.tokenizer

    def close(self) -> None:
        """Stop the rollout engine's scheduler thread (idempotent); `generate` fails afterwards."""
        if self.engine is not None:
            self._close_engine()

    @property
    def sampling(self) -> Sampling:
        cfg = self.stage.rollout
        return Sampling(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)

    def generate(self, rows: list[dict[str, Any]], step: int) -> RolloutBatch:
        """`rollout.n` responses to each row from the engine, with the rollout log-probs. Response j of
        row i is sampled with `rollout_seed(seed, step, i, j)`: it depends on its own prompt, not on the
        other rows."""
        if self.engine is None:
            raise RuntimeError("this GRPOTrainer was built with rollout=False: its batches come from rollout workers")
        prompts, media = encode_prompt_inputs(self.tokenizer, rows, self.stage.trainer.max_prompt_tokens)
        n = self.stage.rollout.n
        seeds = [rollout_seed(self.seed, step, i, j) for i in range(len(prompts)) for j in range(n)]
        return engine_rollouts(self.engine, prompts, media=media, n=n, sampling=self.sampling, seeds=seeds)

    def step_rows(self, step: int) -> list[dict[str, Any]]:
        """The prompts of step `step` (the data order depends on the seed and the step only)."""
        return [self.rows[i] for i in self.cursor.batch(step, self.stage.trainer.batch_size)]

    def score(self, rows: list[dict[str, Any]], batch: RolloutBatch) -> torch.Tensor:
        results = score_rollouts(rows, batch.responses, self.stage.reward.name, self.stage.rollout.n)
        return torch.tensor([r["score"] for r in results], dtype=torch.float32)

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        return rollout_logprobs(self.model, batch, self.stage.rollout.temperature)

    def step(self) -> dict[str, float]:
        """One training step (generate, reward, learn); returns verl-named metrics."""
        t_step = time.perf_counter()
        rows = self.step_rows(self.global_step)
        t = time.perf_counter()
        batch = self.generate(rows, self.global_step)
        t_gen = time.perf_counter() - t
        t = time.perf_counter()
        rewards = self.score(rows, batch)
        t_reward = time.perf_counter() - t
        metrics = self.learn(batch, rewards)
        return {**metrics, "timing_s/gen": t_gen, "timing_s/reward": t_reward,
                "timing_s/step": time.perf_counter() - t_step}

    def learn(self, batch: RolloutBatch, rewards: torch.Tensor, *, on_policy: bool = True) -> dict[str, float]:
        """Advantages, old (and reference) log-probs, the policy update on a scored batch; advances
        `global_step`. `on_policy`: the current weights generated the batch (False for a batch from an
        older policy version: the old log-probs are then always recomputed). Returns the metrics of
        those parts (no gen/reward/step timings)."""
        algo, trainer = self.stage.algorithm, self.stage.trainer
        temperature = self.stage.rollout.temperature
        advantages = grpo_advantages(rewards, batch.group_ids, scale=algo.adv_scale)
        reuse = not self.recompute_old_logp and reuses_update_logp(
            self.model, batch.group_ids, ppo_epochs=trainer.ppo_epochs,
            groups_per_minibatch=trainer.ppo_mini_batch_size, on_policy=on_policy)

        t = time.perf_counter()
        old_logp = None
        if not reuse:
            with torch.no_grad():
                old_logp = self.logprobs(batch)
        t_old = 0.0 if reuse else time.perf_counter() - t
        t = time.perf_counter()
        ref_logp = None
        if algo.kl_beta > 0:
            with torch.no_grad(), reference_policy(self.model, self.reference) as reference:
                ref_logp = rollout_logprobs(reference, batch, temperature)
        t_ref = time.perf_counter() - t

        t = time.perf_counter()
        # verl's training/rollout_* metrics (engine log-probs vs the old ones) come with the update's
        # metrics: every step, absent only if a subclass's `generate` returns a batch without rollout_logp
        metrics = policy_update(
            self.model, self.optimizer, batch, old_logp=old_logp, advantages=advantages, loss_fn=self.loss_fn,
            loss_kwargs={"clip_low": algo.clip_ratio_low, "clip_high": algo.clip_ratio_high,
                         "agg": algo.loss_agg_mode},
            ref_logp=ref_logp, kl_beta=algo.kl_beta, temperature=temperature, ppo_epochs=trainer.ppo_epochs,
            groups_per_minibatch=trainer.ppo_mini_batch_size, max_grad_norm=trainer.max_grad_norm,
            seed=self.seed * 7919 + self.global_step, rollout_logp=batch.rollout_logp,
        )
        t_update = time.perf_counter() - t

        self.global_step += 1
        lengths = batch.response_mask.sum(dim=1).float()
        return {
            **metrics,
            "critic/score/mean": rewards.mean().item(),
            "critic/rewards/mean": rewards.mean().item(),
            "critic/advantages/mean": advantages.mean().item(),
            "actor/lr": trainer.lr,
            "response_length/mean": lengths.mean().item(),
            "timing_s/old_log_prob": t_old,
            **({"timing_s/ref": t_ref} if algo.kl_beta > 0 else {}),
            "timing_s/update_actor": t_update,
        }


def build_trainer(stage: RLStage, rows: list[dict[str, Any]], seed: int, *, model: torch.nn.Module, text_io: Any,
                  rollout: bool = True) -> GRPOTrainer:
    """The grpo/gspo record's trainer (the construction convention: omni_core.training.trainer)."""
    return GRPOTrainer(stage, rows, seed, model=model, text_io=text_io, rollout=rollout)
