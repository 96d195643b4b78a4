"""GRPO rollouts from ARengine: per-response seeds (a prompt's responses do not depend on the rest of
the batch), the batch layout, and verl's rollout-vs-actor metrics on every step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omni_core.config import RLStage
from omni_core.data.avqa import AVQAConverter
from omni_core.data.gsm8k import GSM8KConverter
from omni_core.data.sources import resolve_source
from omni_core.models import load_model
from omni_core.rollout.metrics import PROBS_DIFF_MEAN, PROBS_DIFF_VALID, PROBS_PEARSON
from omni_core.training.components import rollout_logprobs, rollout_seed
from omni_core.training.grpo_loop import GRPOTrainer

BY_LENGTH = str(Path(__file__).parent / "data" / "rewards.py") + ":by_length"


@pytest.fixture(scope="module", autouse=True)
def _env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The session-wide model cache the model test files share; one torch thread (tiny tensors, busy
    machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "omni-model-cache"))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    raw = resolve_source("fixtures://gsm8k?rows=8&seed=0")
    converter = GSM8KConverter()
    return [converter.convert(record, "train", i, raw)
            for i, (_, _, record) in enumerate(converter.records(raw, "train"))]


def make_stage(algorithm: str = "grpo", **rollout) -> RLStage:
    return RLStage(name="rl", model="tiny://lm", data="gsm8k", algorithm={"name": algorithm},
                   reward={"name": BY_LENGTH},
                   rollout={"n": 4, "max_new_tokens": 8, "temperature": 0.8, **rollout},
                   trainer={"total_steps": 2, "batch_size": 2, "lr": 1e-2})


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_every_step_reports_rollout_vs_actor_metrics(rows: list[dict], algorithm: str) -> None:
    trainer = GRPOTrainer(make_stage(algorithm), rows, seed=0)
    try:
        for _ in range(2):  # the second step samples with the weights the first one updated
            metrics = trainer.step()
            assert metrics[PROBS_DIFF_VALID] == 1.0
            # the same weights, sampled by the engine and recomputed by the trainer (CPU float32)
            assert metrics[PROBS_PEARSON] >= 0.9999, metrics
            assert 0.0 <= metrics[PROBS_DIFF_MEAN] < 1e-4, metrics
    finally:
        trainer.close()


def test_batch_layout_and_rollout_logprobs(rows: list[dict]) -> None:
    trainer = GRPOTrainer(make_stage(), rows, seed=0)
    try:
        batch = trainer.generate(rows[:3], 0)
        tokenizer = trainer.tokenizer
        assert batch.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4 and len(batch.responses) == 12
        prompt = batch.attention_mask - batch.response_mask
        assert len(set(prompt.sum(1).tolist())) > 1  # prompts of different lengths: left padding
        start = prompt.shape[1] - batch.response_mask.sum(0).gt(0).sum()  # where the responses begin
        assert (prompt[:, start - 1] == 1).all() and (prompt[:, start:] == 0).all()  # right-aligned prompts
        for row in range(12):
            mask = batch.response_mask[row].bool()
            response = batch.input_ids[row, mask].tolist()
            length = len(response)
            assert 1 <= length <= 8 and mask[start:start + length].all()  # right after the prompt
            assert batch.attention_mask[row, start + length:].sum() == 0  # then right padding
            eos = [i for i, t in enumerate(response) if t == tokenizer.eos_token_id]
            assert eos in ([], [length - 1]) and (length == 8 or eos)  # up to and including the first EOS
            assert batch.responses[row] == tokenizer.decode(response, skip_special_tokens=True)
        assert batch.media is None
        logp = batch.rollout_logp
        assert ((logp != 0) == batch.response_mask.bool()).all()
        with torch.no_grad():
            torch.testing.assert_close(rollout_logprobs(trainer.model, batch, 0.8), logp, atol=1e-5, rtol=0)
    finally:
        trainer.close()


def test_a_prompts_rollouts_do_not_depend_on_the_other_prompts(rows: list[dict]) -> None:
    trainer = GRPOTrainer(make_stage(), rows, seed=0)
    try:
        two = trainer.generate(rows[:2], 5)
        four = trainer.generate(rows[:4], 5)
        again = trainer.generate(rows[:4], 5)
        other_step = trainer.generate(rows[:2], 6)
    finally:
        trainer.close()
    assert four.responses[:8] == two.responses  # the shared prompts: the same responses
    for row in range(8):
        assert (two.input_ids[row][two.response_mask[row].bool()].tolist()
                == four.input_ids[row][four.response_mask[row].bool()].tolist())
        torch.testing.assert_close(two.rollout_logp[row][two.response_mask[row].bool()],
                                   four.rollout_logp[row][four.response_mask[row].bool()], atol=1e-5, rtol=0)
    assert again.responses == four.responses  # same seed and step: the same batch
    assert other_step.responses != two.responses  # the step is part of the seed
    assert len(set(two.responses[:4])) > 1  # the responses of a group differ (own seeds)
    assert len({rollout_seed(0, 5, i, j) for i in range(4) for j in range(4)}) == 16


@pytest.mark.parametrize("rollout", [{"max_num_seqs": 3}, {"step_execution": True, "max_num_seqs": 5}])
def test_engine_scheduling_does_not_change_the_rollouts(rows: list[dict], rollout: dict) -> None:
    trainers = [GRPOTrainer(make_stage(), rows, seed=0), GRPOTrainer(make_stage(**rollout), rows, seed=0)]
    try:
        default, scheduled = (t.generate(rows[:2], 0) for t in trainers)
        assert trainers[1].engine.config.max_num_seqs == rollout["max_num_seqs"]
        assert trainers[1].engine.stats["max_batch"] <= rollout["max_num_seqs"]
        assert trainers[1].engine.config.step_execution == rollout.get("step_execution", False)
    finally:
        for t in trainers:
            t.close()
    assert scheduled.responses == default.responses
    torch.testing.assert_close(scheduled.rollout_logp, default.rollout_logp, atol=1e-5, rtol=0)


def test_thinker_steps_report_the_metrics_and_rows_keep_their_media() -> None:
    """Qwen3-Omni's thinker on AVQA rows (an image and an audio clip each): the engine's rollouts carry
    each prompt's media per row and its log-probs match the trainer's recomputation."""
    raw = resolve_source("fixtures://avqa?rows=4&seed=0")
    converter = AVQAConverter()
    avqa = [converter.convert(record, "train", i, raw) for i, (_, _, record) in enumerate(converter.records(raw, "train"))]
    model, processor = load_model("tiny://qwen3-omni", adapter="qwen3_omni_thinker")
    stage = RLStage(name="rl", model="tiny://qwen3-omni", data="avqa", algorithm={"name": "gspo"},
                    reward={"name": BY_LENGTH}, rollout={"n": 2, "max_new_tokens": 4},
                    trainer={"total_steps": 2, "batch_size": 2, "lr": 1e-2, "max_prompt_tokens": 512})
    trainer = GRPOTrainer(stage, avqa, seed=0, model=model, text_io=processor)
    try:
        batch = trainer.generate(avqa[:2], 0)
        assert batch.media is not None and len(batch.media) == 4
        assert all("pixel_values" in m and "input_features" in m for m in batch.media)
        assert batch.media[0] is batch.media[1] and batch.media[1] is not batch.media[2]  # per prompt
        for _ in range(2):
            metrics = trainer.step()
            assert metrics[PROBS_PEARSON] >= 0.9999 and 0.0 <= metrics[PROBS_DIFF_MEAN] < 1e-4, metrics
    finally:
        trainer.close()
