"""The `sft` algorithm record and the Trainer interface: every registered algorithm's trainer is a
`Trainer`, its `state_dict()` (optimizer, step, RNG) plus the trainable weights resume a run exactly,
and an SFT row's target is the response the converter kept."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from bench.learning_grpo import LearningSetup, load_rows
from omni_core.config.models import RLStage
from omni_core.errors import DataError
from omni_core.training.actors import trainable_weights
from omni_core.training.algorithms import SUPERVISED, algorithm_names, get_algorithm
from omni_core.training.sft import row_response
from omni_core.training.stage_trainers import build_stage_trainer
from omni_core.training.trainer import Trainer

STAGE = RLStage(name="sft", kind="sft", model="tiny://lm", data="digits:train",
                trainer={"total_steps": 4, "batch_size": 8})


@pytest.fixture(scope="module", autouse=True)
def _env(tiny_model_env: Any) -> Iterator[None]:
    yield


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return load_rows(LearningSetup(source="fixtures://digits?rows=64"))[0]


def test_the_sft_record() -> None:
    record = get_algorithm("sft")
    assert record.data == SUPERVISED and not record.separate_async
    assert STAGE.algorithm.name == "sft" and (STAGE.trainer.lr, STAGE.trainer.batch_size) == (3e-3, 8)
    assert {"grpo", "gspo", "dpo", "mpo", "flow_grpo", "sft"} <= set(algorithm_names())
    assert all(get_algorithm(n).progress and get_algorithm(n).stage_keys for n in algorithm_names())


def test_row_response_picks_the_kept_answer() -> None:
    gsm8k = {"reward_model": {"ground_truth": "72"}, "extra_info": {"answer": "48 / 2 = 24 ... #### 72"}}
    assert row_response(gsm8k) == "48 / 2 = 24 ... #### 72" and row_response(gsm8k, "ground_truth") == "72"
    assert row_response({"reward_model": {"ground_truth": "2341"}, "extra_info": {"number": "1234"}}) == "2341"
    pair = {"chosen": {"role": "assistant", "content": "yes"}, "rejected": {"role": "assistant", "content": "no"}}
    assert row_response(pair) == "yes"
    with pytest.raises(DataError, match="algorithm.response is answer, but a row has no answer"):
        row_response(pair, "answer")


def test_sft_trainer_is_a_trainer_and_resumes_exactly(rows: list[dict[str, Any]]) -> None:
    trainer = build_stage_trainer(STAGE, rows, seed=0)
    assert isinstance(trainer, Trainer) and trainer.text_io is not None
    losses = [trainer.step()["train/loss"] for _ in range(2)]
    state, weights = copy.deepcopy(trainer.state_dict()), trainable_weights(trainer.model)
    straight = [trainer.step()["train/loss"] for _ in range(2)]
    end = trainable_weights(trainer.model)

    resumed = build_stage_trainer(STAGE, rows, seed=0)
    resumed.model.load_state_dict(weights, strict=False)
    resumed.load_state_dict(state)
    assert resumed.global_step == 2
    again = [resumed.step()["train/loss"] for _ in range(2)]
    assert again == straight and losses[0] > straight[-1]
    assert all(torch.equal(end[k], v) for k, v in trainable_weights(resumed.model).items())
