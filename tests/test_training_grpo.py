"""The GRPO loop itself (no Ray): data order, determinism, and that rewards drive the gradient."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_core.config import RLStage
from omni_core.data.gsm8k import GSM8KConverter
from omni_core.data.sources import resolve_source
from omni_core.training.grpo_loop import GRPOTrainer, PromptCursor

# $OMNI_CACHE_DIR (tiny models, fixtures) is conftest's shared cache for this module only, restored after it
pytestmark = pytest.mark.usefixtures("tiny_model_env")


@pytest.fixture(scope="module")
def rows(tiny_model_env: Path) -> list[dict]:
    raw = resolve_source("fixtures://gsm8k?rows=16&seed=0")
    converter = GSM8KConverter()
    return [converter.convert(record, "train", i, raw)
            for i, (_, _, record) in enumerate(converter.records(raw, "train"))]


def make_stage(reward: str = "gsm8k", **trainer) -> RLStage:
    return RLStage(name="rl", data="gsm8k", reward={"name": reward}, rollout={"n": 4, "max_new_tokens": 8},
                   trainer={"total_steps": 2, "batch_size": 2, "lr": 1e-2, **trainer})


def state(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_cursor_is_a_permutation_per_epoch_and_depends_only_on_the_step() -> None:
    cursor = PromptCursor(10, seed=3)
    epoch = [i for step in range(5) for i in cursor.batch(step, 2)]
    assert sorted(epoch) == list(range(10))
    assert cursor.batch(7, 2) == PromptCursor(10, seed=3).batch(7, 2)
    assert cursor.batch(0, 10) != PromptCursor(10, seed=4).batch(0, 10)


def test_same_seed_gives_identical_weights(rows: list[dict]) -> None:
    runs = []
    for seed in (0, 0, 1):
        trainer = GRPOTrainer(make_stage(reward=str(Path(__file__).parent / "data" / "rewards.py") + ":by_length"),
                              rows, seed=seed)
        for _ in range(2):
            trainer.step()
        runs.append(state(trainer))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(not torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


def test_reward_differences_drive_the_update(rows: list[dict]) -> None:
    varied = GRPOTrainer(make_stage(reward=str(Path(__file__).parent / "data" / "rewards.py") + ":by_length"),
                         rows, seed=0)
    before = state(varied)
    metrics = varied.step()
    assert metrics["actor/grad_norm"] > 0
    assert any(not torch.allclose(before[k], v) for k, v in state(varied).items())
    for name in ("critic/score/mean", "actor/pg_loss", "actor/pg_clipfrac", "timing_s/gen", "timing_s/step",
                 "response_length/mean"):
        assert name in metrics

    # A constant reward gives zero advantages in every group: no policy gradient at all.
    flat = GRPOTrainer(make_stage(reward=str(Path(__file__).parent / "data" / "rewards.py") + ":constant"),
                       rows, seed=0)
    assert flat.step()["actor/grad_norm"] == 0.0
