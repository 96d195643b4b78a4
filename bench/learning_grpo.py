"""Learning curves: an SFT warm start, then GRPO or GSPO, with held-out evaluation along the way.

The recipe behind `tests/test_learning_grpo.py`, `bench/learning.py --algo grpo,gspo` and
`bench/old_logprobs.py`, read top to bottom:

1. rows: the `digits` fixture (rotate a 4-digit number, `omni_core.data.digits`), converted to
   verl RL rows; the train split trains, the test split (numbers never seen in training) evaluates;
2. warm start: `sft_steps` of SFT on the train answers, deliberately short, so the policy has the
   format and only part of the answers (as a real recipe's SFT stage, before RL);
3. RL: `GRPOTrainer` on a copy of the warm-started policy, with the `digits` reward (partial credit);
   every `eval_every` steps the held-out mean reward is measured twice: sampled as in training
   (temperature 1, `eval_samples` responses per prompt, fixed evaluation seed) and greedy.

All hyper-parameters are in `LearningSetup`. Everything is seeded: the same setup gives the same
curves and the same weights.
"""

from __future__ import annotations

import copy
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_core.config.models import RLStage, TrainerConfig
from omni_core.data.converter import get_converter
from omni_core.data.sources import resolve_source
from omni_core.models import load_model
from omni_core.training.components import Sampling, evaluate
from omni_core.training.grpo_loop import GRPOTrainer
from omni_core.training.sft import SFTTrainer, examples_from_rows


@dataclass(frozen=True)
class LearningSetup:
    seed: int = 0
    model: str = "tiny://lm"
    source: str = "fixtures://digits?rows=1000"  # 1000 train, 250 test numbers
    converter: str = "digits"
    reward: str = "digits"
    val_rows: int = 128  # held-out prompts (the first of the test split)
    # SFT warm start
    sft_steps: int = 60  # format learnt, ~1/4 of the digits right (greedy); the copy pattern not yet
    sft_lr: float = 3e-3
    sft_batch_size: int = 32
    # RL
    rl_steps: int = 150
    lr: float = 1e-3
    batch_size: int = 16  # prompts per step
    n: int = 8  # responses per prompt
    ppo_epochs: int = 2
    ppo_mini_batch_size: int = 8  # prompts per optimizer step: 2 passes x 2 mini-batches = 4 steps
    max_new_tokens: int = 8
    # evaluation
    eval_every: int = 10
    eval_samples: int = 4
    eval_seed: int = 1234

    @classmethod
    def quick(cls, **overrides: Any) -> LearningSetup:
        """The short version (tests, `bench/learning.py --quick`)."""
        return cls(**{"rl_steps": 40, **overrides})

    def stage(self, algorithm: str) -> RLStage:
        """The RL stage config: GSPO with the paper's clip range and aggregation, GRPO with verl's."""
        algo: dict[str, Any] = {"name": algorithm}
        if algorithm == "gspo":
            algo.update(clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="seq-mean-token-mean")
        return RLStage(
            name=algorithm, model=self.model, data=self.converter, algorithm=algo, reward={"name": self.reward},
            rollout={"n": self.n, "temperature": 1.0, "max_new_tokens": self.max_new_tokens},
            trainer={"total_steps": self.rl_steps, "batch_size": self.batch_size, "lr": self.lr,
                     "ppo_epochs": self.ppo_epochs, "ppo_mini_batch_size": self.ppo_mini_batch_size},
        )


@dataclass
class LearningCurve:
    algorithm: str
    steps: list[int] = field(default_factory=list)  # steps at which the held-out reward was measured
    val_sampled: list[float] = field(default_factory=list)  # held-out mean reward, sampled (mean@k)
    val_greedy: list[float] = field(default_factory=list)  # held-out mean reward, greedy (mean@1)
    train_score: list[float] = field(default_factory=list)  # critic/score/mean of every step
    clipfrac: list[float] = field(default_factory=list)  # actor/pg_clipfrac of every step
    cpu_s: float = 0.0
    wall_s: float = 0.0

    @property
    def start(self) -> float:
        return self.val_sampled[0]

    @property
    def end(self) -> float:
        return self.val_sampled[-1]

    @property
    def gain(self) -> float:
        return self.end - self.start


def load_rows(setup: LearningSetup) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, held-out rows) of the fixture, converted as ingestion would."""
    raw = resolve_source(setup.source)
    converter = get_converter(setup.converter)
    splits = {}
    for split in ("train", "test"):
        splits[split] = [converter.convert(record, split, i, raw)
                         for i, (_, _, record) in enumerate(converter.records(raw, split))]
    return splits["train"], splits["test"][:setup.val_rows]


def warm_start(setup: LearningSetup, train_rows: list[dict[str, Any]]) -> tuple[Any, Any, list[dict[str, float]]]:
    """(model, tokenizer, SFT metrics per step) after `sft_steps` of SFT on the train answers."""
    model, tokenizer = load_model(setup.model, seed=setup.seed)
    examples = examples_from_rows(train_rows, lambda row: row["reward_model"]["ground_truth"])
    cfg = TrainerConfig(total_steps=setup.sft_steps, batch_size=setup.sft_batch_size, lr=setup.sft_lr)
    metrics = SFTTrainer(cfg, examples, setup.seed, model=model, text_io=tokenizer).fit()
    return model, tokenizer, metrics


def held_out_reward(setup: LearningSetup, model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(sampled mean reward over `eval_samples` responses per row, greedy mean reward)."""
    sampled = evaluate(model, tokenizer, rows, reward=setup.reward, n=setup.eval_samples, seed=setup.eval_seed,
                       sampling=Sampling(temperature=1.0, max_new_tokens=setup.max_new_tokens))
    greedy = evaluate(model, tokenizer, rows, reward=setup.reward,
                      sampling=Sampling(greedy=True, max_new_tokens=setup.max_new_tokens))
    return sampled["val/reward_mean"], greedy["val/reward_mean"]


def learning_curve(algorithm: str, setup: LearningSetup, model: Any, tokenizer: Any, train_rows: list[dict[str, Any]],
                   val_rows: list[dict[str, Any]]) -> tuple[LearningCurve, GRPOTrainer]:
    """Train a copy of `model` with `algorithm` for `rl_steps`, measuring held-out reward every
    `eval_every` steps (and before the first); returns the curve and the trainer (its `.model`)."""
    curve = LearningCurve(algorithm)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer = GRPOTrainer(setup.stage(algorithm), train_rows, setup.seed, model=copy.deepcopy(model),
                          text_io=tokenizer)

    def measure() -> None:
        sampled, greedy = held_out_reward(setup, trainer.model, tokenizer, val_rows)
        curve.steps.append(trainer.global_step)
        curve.val_sampled.append(sampled)
        curve.val_greedy.append(greedy)

    measure()
    for _ in range(setup.rl_steps):
        metrics = trainer.step()
        curve.train_score.append(metrics["critic/score/mean"])
        curve.clipfrac.append(metrics["actor/pg_clipfrac"])
        if trainer.global_step % setup.eval_every == 0 or trainer.global_step == setup.rl_steps:
            measure()
    curve.cpu_s, curve.wall_s = time.process_time() - cpu, time.perf_counter() - wall
    return curve, trainer


def state_digest(model: torch.nn.Module) -> str:
    """A digest of the weights, to compare runs."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
