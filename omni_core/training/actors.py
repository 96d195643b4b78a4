"""The Ray actors of a training stage: rollout workers, reward workers and the trainer.

Everything they exchange is plain data (tensors, lists, dicts), so they can run on any node; the
driver (`omni_core.training.runner`) decides what runs when. A batch is split between rollout (and
reward) workers by prompt: worker w of W generates the `rollout.n` responses of prompts
[w * B / W, (w + 1) * B / W) of the step's B prompts. Response j of prompt i is sampled with
`rollout_seed(seed, step, i, j)`, so which worker draws it does not change it.

The actors build their models the way `build_stage_trainer` does (same URI, seed, adapter, LoRA), so
version 0 of the rollout policy is the trainer's starting policy; later versions arrive as the
trainer's trainable parameters (only the LoRA adapter with LoRA).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import ray

from omni_core.config.models import RLStage

if TYPE_CHECKING:
    import torch

# torch is imported where an actor uses it, not here: the driver (`omni run`'s flow process) imports this
# module for the actor classes only, and never needs torch on a run that does not resume (~1.2 CPU s)


def trainable_module(model: Any) -> torch.nn.Module:
    """The module whose parameters train: the SD3 transformer, else the model itself."""
    return model.transformer if hasattr(model, "transformer") and hasattr(model, "scheduler") else model


def trainable_weights(model: Any) -> dict[str, torch.Tensor]:
    """Copies of the trainable parameters by `state_dict` name (the LoRA adapter's only, with LoRA)."""
    return {name: p.detach().clone() for name, p in trainable_module(model).named_parameters() if p.requires_grad}


def prompt_range(batch_size: int, workers: int, worker: int) -> tuple[int, int]:
    """Prompts [lo, hi) of a step's `batch_size` that worker `worker` of `workers` handles."""
    return batch_size * worker // workers, batch_size * (worker + 1) // workers


class _StageActor:
    def __init__(self, stage_json: dict[str, Any], seed: int, rows: list[dict[str, Any]]):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.stage = RLStage.model_validate(stage_json)
        self.seed, self.rows = seed, rows

    def pid(self) -> int:
        return os.getpid()

    def rng(self) -> dict[str, Any]:
        from omni_core.training.trainer import rng_state

        return rng_state()

    def set_rng(self, torch_state: torch.Tensor, python_state: list[Any] | None) -> None:
        from omni_core.training.trainer import set_rng_state

        set_rng_state(torch_state, python_state)

    def step_rows(self, step: int) -> list[dict[str, Any]]:
        from omni_core.training.rows import PromptCursor  # light: see omni_core.training.rows

        return [self.rows[i] for i in PromptCursor(len(self.rows), self.seed).batch(step, self.stage.trainer.batch_size)]


class RolloutWorker(_StageActor):
    """Generates its share of each batch with an `ARengine` on its own copy of the policy: a Ray actor
    (`RolloutActor`), or, in sync mode with one rollout worker, an object inside the trainer actor
    (`TrainerWorker(rollout_here=True)`), where it does the same work with the same numbers. A text-only
    Qwen3 policy decodes its request-level batches by `lean_decode` (the engine's tokens and rollout
    log-probs, without transformers' per-token forward: `omni_core.rollout.lean_decode`)."""

    def __init__(self, stage_json: dict[str, Any], seed: int, rows: list[dict[str, Any]], worker: int, workers: int):
        super().__init__(stage_json, seed, rows)
        from omni_core.rollout.autoregressive import ARengine
        from omni_core.rollout.engine import EngineConfig
        from omni_core.training.stage_trainers import load_stage_model

        stage = self.stage
        self.worker, self.workers = worker, workers
        self.model, self.text_io = load_stage_model(stage, seed)
        self.engine = ARengine(self.model, self.text_io, EngineConfig(max_num_seqs=stage.rollout.max_num_seqs,
                                                                      step_execution=stage.rollout.step_execution))
        self.version = 0
        from omni_core.rollout import lean_decode

        self.lean = lean_decode.supports(self.model, self.text_io)

    def generate(self, step: int, version: int, weights: dict[str, torch.Tensor] | None, score: bool) -> dict[str, Any]:
        """This worker's prompts of `step`, generated with policy `version` (`weights` when the worker
        holds another version), scored too when `score` (no reward workers)."""
        from omni_core.training.components import (
            Sampling,
            encode_prompt_inputs,
            rollout_requests,
            rollout_seed,
        )

        t = time.perf_counter()
        if version != self.version:
            if weights is None:
                raise RuntimeError(f"rollout worker {self.worker} holds policy version {self.version}, asked for "
                                   f"{version} without its weights")
            self.engine.update_weights(weights, version)
            self.version = version
        t_weights = time.perf_counter() - t
        stage = self.stage
        lo, hi = prompt_range(stage.trainer.batch_size, self.workers, self.worker)
        rows = self.step_rows(step)[lo:hi]
        n = stage.rollout.n
        t = time.perf_counter()
        prompts, media = encode_prompt_inputs(self.text_io, rows, stage.trainer.max_prompt_tokens)
        cfg = stage.rollout
        sampling = Sampling(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens)
        seeds = [rollout_seed(self.seed, step, lo + i, j) for i in range(len(prompts)) for j in range(n)]
        requests = rollout_requests(prompts, n=n, sampling=sampling, seeds=seeds, media=media)
        results = self._run(requests)
        part: dict[str, Any] = {
            "lo": lo, "prompts": prompts, "media": media, "version": version,
            "results": [{"output": list(r.output), "logprobs": r.logprobs, "text": r.text} for r in results],
            "samples": len(results),
            "gen_s": time.perf_counter() - t, "update_weights_s": t_weights}
        if score:
            part.update(score_part(stage, rows, part))
        return part

    def _run(self, requests: list[Any]) -> list[Any]:
        """Request-level: the batch in order, max_num_seqs requests at a time, so each forward's
        composition (and with it every float) is the same on every run, resumed or not. The engine's
        scheduler would batch whatever had been queued when it woke. Step-level continuous batching
        goes through the scheduler (results equal within 1e-5, not bit for bit)."""
        if self.stage.rollout.step_execution:
            return self.engine.generate(requests)
        size = self.stage.rollout.max_num_seqs
        out = []
        with self.engine._lock:  # the scheduler thread stays idle: nothing was submitted to it
            for start in range(0, len(requests), size):
                chunk = requests[start:start + size]
                out += self._lean(chunk) if self.lean else self.engine.run_requests(chunk)
        return out

    def _lean(self, requests: list[Any]) -> list[Any]:
        """`engine.run_requests(requests)` by `lean_decode` (one sampling for all: a stage's rollout)."""
        import torch

        from omni_core.rollout import lean_decode

        engine = self.engine
        decoded = lean_decode.decode_with_logprobs(
            self.model, [r.prompt.token_ids for r in requests], requests[0].sampling, [r.seed for r in requests],
            sorted(engine.eos_ids), engine.pad_id)
        return [_Result(tokens, torch.tensor(logprobs, dtype=torch.float32),
                        engine.tokenizer.decode(tokens, skip_special_tokens=True)) for tokens, logprobs in decoded]


RolloutActor = ray.remote(RolloutWorker)  # Ray's class name stays RolloutWorker


def score_part(stage: RLStage, rows: list[dict[str, Any]], part: dict[str, Any]) -> dict[str, Any]:
    from omni_core.training.rows import score_rollouts

    t = time.perf_counter()
    texts = [r["text"] for r in part["results"]]
    scores = [float(r["score"]) for r in score_rollouts(rows, texts, stage.reward.name, stage.rollout.n)]
    return {"scores": scores, "reward_s": time.perf_counter() - t}


@ray.remote
class RewardWorker(_StageActor):
    """Scores one rollout worker's part of a batch (verl's `compute_score` per response)."""

    def score(self, step: int, part: dict[str, Any]) -> dict[str, Any]:
        n_prompts = len(part["prompts"])
        rows = self.step_rows(step)[part["lo"]:part["lo"] + n_prompts]
        return score_part(self.stage, rows, part)


@ray.remote
class TrainerWorker(_StageActor):
    """Holds the trainer (`omni_core.training.trainer.Trainer`: policy, reference, optimizer). An
    algorithm with `separate_async` learns from batches the rollout workers made (`learn`), or, with
    `rollout_here` (sync mode, one rollout worker), from its own `RolloutWorker` object (`rollout_step`);
    the others run their whole step here (`step_colocated`)."""

    def __init__(self, stage_json: dict[str, Any], seed: int, rows: list[dict[str, Any]], rollout_here: bool = False):
        super().__init__(stage_json, seed, rows)
        from omni_core.training.stage_trainers import build_stage_trainer

        self.trainer = build_stage_trainer(self.stage, rows, seed, rollout=False)
        # a policy copy of its own, as a rollout actor holds (the trainer's RNG untouched: load_model forks it)
        self.rollout = RolloutWorker(stage_json, seed, rows, 0, 1) if rollout_here else None

    def global_step(self) -> int:
        return self.trainer.global_step

    def weights(self) -> dict[str, torch.Tensor]:
        return trainable_weights(self.trainer.model)

    def learn(self, step: int, drop: bool, workers: int, *parts_and_scores: dict[str, Any]) -> dict[str, float]:
        """Train on batch `step` from the rollout workers' parts (the first `workers` arguments, in
        worker order) and their scores (the rest: one per part); a dropped batch only advances the step."""
        import torch

        from omni_core.training.components import assemble_rollouts

        parts, scores = parts_and_scores[:workers], parts_and_scores[workers:]
        if self.trainer.global_step != step:
            raise RuntimeError(f"trainer is at step {self.trainer.global_step}, was given batch {step}")
        if drop:
            self.trainer.global_step += 1
            return {}
        prompts = [p for part in parts for p in part["prompts"]]
        media = None if parts[0]["media"] is None else [m for part in parts for m in part["media"]]
        results = [_Result(**r) for part in parts for r in part["results"]]
        batch = assemble_rollouts(prompts, results, n=self.stage.rollout.n, pad_id=_pad_id(self.trainer.text_io),
                                  media=media)
        rewards = torch.tensor([s for part in scores for s in part["scores"]], dtype=torch.float32)
        # a batch from an older policy version (separate_async staleness) gets its old log-probs recomputed
        on_policy = all(part["version"] == step for part in parts)
        return self.trainer.learn(batch, rewards, on_policy=on_policy)  # type: ignore[attr-defined]

    def rollout_step(self, step: int) -> tuple[dict[str, float], dict[str, Any]]:
        """Sync mode with the rollout here: batch `step` generated by this process's `RolloutWorker` with
        the current policy (version `step`, pushed to its copy as to a rollout actor), scored, learnt.
        Returns the update's metrics and the part without its rollouts (timings, version)."""
        assert self.rollout is not None, "built without rollout_here"
        weights = trainable_weights(self.trainer.model) if self.rollout.version != step else None
        part = self.rollout.generate(step, step, weights, True)
        metrics = self.learn(step, False, 1, part, part)
        return metrics, {k: v for k, v in part.items() if k not in ("prompts", "media", "results")}

    def step_colocated(self, step: int) -> dict[str, float]:
        if self.trainer.global_step != step:
            raise RuntimeError(f"trainer is at step {self.trainer.global_step}, asked for step {step}")
        started = time.perf_counter()
        metrics = self.trainer.step()
        return {**metrics, "timing_s/actor_step": time.perf_counter() - started}

    def save(self, store_root: str, stage_root: str, metadata: dict[str, Any], info: dict[str, Any],
             rngs: dict[str, Any], keep: int | None, versions: list[int], *version_weights: dict[str, Any],
             ) -> dict[str, Any]:
        """Write checkpoint global_step_{N} (N = the trainer's step) with the full training state."""
        from omni_core.storage import Store
        from omni_core.training.checkpoint import TrainingState, save_checkpoint

        own = self.trainer.state_dict()
        rngs = {**rngs, "trainer": own["rng"]}
        state = TrainingState(
            policy=trainable_weights(self.trainer.model), optimizer=own["optimizer"],
            rng={name: r["torch"] for name, r in rngs.items()},
            info={**info, "global_step": self.trainer.global_step,
                  "python_rng": {name: list(r["python"]) for name, r in rngs.items()}},
            rollout_versions=dict(zip(versions, version_weights, strict=True)))
        t = time.perf_counter()
        manifest = save_checkpoint(Store(store_root), stage_root, self.trainer.global_step, self.trainer.model,
                                   self.trainer.text_io, metadata, state=state, keep=keep)
        return {**manifest, "save_s": time.perf_counter() - t}

    def restore(self, policy: dict[str, torch.Tensor], optimizer: dict[str, Any], global_step: int,
                torch_rng: torch.Tensor, python_rng: list[Any] | None) -> None:
        import torch

        module = trainable_module(self.trainer.model)
        missing = set(policy) ^ {n for n, p in module.named_parameters() if p.requires_grad}
        if missing:
            raise RuntimeError(f"checkpoint parameters differ from the model's trainable ones, e.g. {sorted(missing)[:3]}")
        with torch.no_grad():
            module.load_state_dict(policy, strict=False)
        self.trainer.load_state_dict({"optimizer": optimizer, "global_step": global_step,
                                      "rng": {"torch": torch_rng, "python": python_rng}})


class _Result:
    def __init__(self, output: list[int], logprobs: torch.Tensor, text: str):
        self.output, self.logprobs, self.text = output, logprobs, text


def _pad_id(text_io: Any) -> int:
    tokenizer = getattr(text_io, "tokenizer", text_io)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
