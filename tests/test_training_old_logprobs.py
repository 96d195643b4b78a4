"""The old log-probs of a single-update on-policy step come from the update forward (no extra forward),
with the same weights as the recomputing path; other schedules still recompute them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from omni_core.config import RLStage
from omni_core.data.gsm8k import GSM8KConverter
from omni_core.data.sources import resolve_source
from omni_core.training.components import has_active_dropout, policy_update
from omni_core.training.grpo_loop import GRPOTrainer

pytestmark = pytest.mark.usefixtures("tiny_model_env")

BY_LENGTH = str(Path(__file__).parent / "data" / "rewards.py") + ":by_length"
CONSISTENCY = ("training/rollout_probs_diff_valid", "training/rollout_probs_diff_max",
               "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
               "training/rollout_actor_probs_pearson_corr")


@pytest.fixture(scope="module")
def rows(tiny_model_env: Path) -> list[dict]:
    raw = resolve_source("fixtures://gsm8k?rows=16&seed=0")
    converter = GSM8KConverter()
    return [converter.convert(record, "train", i, raw)
            for i, (_, _, record) in enumerate(converter.records(raw, "train"))]


def make_stage(algorithm: str = "grpo", kl_beta: float = 0.0, **trainer) -> RLStage:
    return RLStage(name="rl", data="gsm8k", reward={"name": BY_LENGTH}, rollout={"n": 4, "max_new_tokens": 8},
                   algorithm={"name": algorithm, "kl_beta": kl_beta},
                   trainer={"total_steps": 3, "batch_size": 2, "lr": 1e-2, **trainer})


@contextmanager
def counting_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the calls of `model`'s own forward (a torch forward hook) inside the block."""
    calls = [0]
    handle = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


def learn_steps(trainer: GRPOTrainer, steps: int, *, on_policy: bool = True) -> tuple[list[int], list[dict]]:
    """`steps` steps (generate, score, learn); the policy's forward calls during each `learn`, and its metrics."""
    counts, metrics = [], []
    for step in range(steps):
        rows = trainer.step_rows(step)
        batch = trainer.generate(rows, step)
        rewards = trainer.score(rows, batch)
        with counting_forwards(trainer.model) as calls:
            metrics.append(trainer.learn(batch, rewards, on_policy=on_policy))
        counts.append(calls[0])
    return counts, metrics


def weights(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize(("algorithm", "kl_beta"), [("grpo", 0.0), ("gspo", 0.0), ("grpo", 0.05)])
def test_single_update_reuses_the_update_forward_with_the_same_weights(rows: list[dict], algorithm: str,
                                                                       kl_beta: float) -> None:
    reused = GRPOTrainer(make_stage(algorithm, kl_beta), rows, seed=0)
    recomputed = GRPOTrainer(make_stage(algorithm, kl_beta), rows, seed=0)
    recomputed.recompute_old_logp = True
    assert not has_active_dropout(reused.model)

    counts, metrics = learn_steps(reused, 3)
    counts_re, metrics_re = learn_steps(recomputed, 3)
    assert counts == [1, 1, 1]  # the update forward only (the KL reference is a separate frozen copy)
    assert counts_re == [2, 2, 2]  # old log-probs, then the update
    assert any(m["actor/grad_norm"] > 0 for m in metrics)

    a, b = weights(reused), weights(recomputed)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    for got, want in zip(metrics, metrics_re, strict=True):
        assert got["timing_s/old_log_prob"] == 0.0 and want["timing_s/old_log_prob"] > 0
        assert ("timing_s/ref" in got) == (kl_beta > 0)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", *CONSISTENCY):
            assert got[key] == pytest.approx(want[key], abs=1e-6), key
        assert got["training/rollout_probs_diff_valid"] > 0


@pytest.mark.parametrize("schedule", [{"ppo_epochs": 2}, {"ppo_mini_batch_size": 1}])
def test_several_optimizer_steps_recompute_the_old_logprobs(rows: list[dict], schedule: dict) -> None:
    trainer = GRPOTrainer(make_stage(**schedule), rows, seed=0)
    counts, metrics = learn_steps(trainer, 1)
    assert counts == [1 + 2]  # one old-log-prob forward, then two optimizer steps' forwards
    assert metrics[0]["timing_s/old_log_prob"] > 0
    assert all(key in metrics[0] for key in CONSISTENCY)


def test_a_batch_from_an_older_policy_recomputes_the_old_logprobs(rows: list[dict]) -> None:
    trainer = GRPOTrainer(make_stage(), rows, seed=0)
    counts, _ = learn_steps(trainer, 1, on_policy=False)
    assert counts == [2]


def test_active_dropout_keeps_the_recomputation(rows: list[dict]) -> None:
    trainer = GRPOTrainer(make_stage(), rows, seed=0)
    trainer.model.config.attention_dropout = 0.1
    assert has_active_dropout(trainer.model)
    counts, _ = learn_steps(trainer, 1)
    assert counts == [2]
    trainer.model.eval()
    assert not has_active_dropout(trainer.model)


def test_policy_update_without_old_logprobs_needs_a_single_step(rows: list[dict]) -> None:
    trainer = GRPOTrainer(make_stage(), rows, seed=0)
    batch = trainer.generate(trainer.step_rows(0), 0)
    with pytest.raises(ValueError, match="single optimizer step"):
        policy_update(trainer.model, trainer.optimizer, batch, old_logp=None, advantages=torch.zeros(len(batch.responses)),
                      loss_fn=trainer.loss_fn, loss_kwargs={}, ppo_epochs=2)
