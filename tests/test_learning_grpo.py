"""RL learns: GRPO and GSPO raise the held-out reward of an SFT-warm-started tiny://lm, deterministically.

The task is the `digits` fixture (rotate a 4-digit number; partial-credit reward), the recipe
`bench/learning_grpo.py` (also run by `bench/learning.py --quick`). Plus the training components
it is made of: SFT, mini-batches of whole groups, several update epochs (the clip acts), the k3 KL to
a frozen reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.learning_grpo import (
    LearningSetup,
    held_out_reward,
    learning_curve,
    load_rows,
    state_digest,
    warm_start,
)
from omni_core.algorithms import get_policy_loss, grpo_advantages
from omni_core.config import RLStage
from omni_core.config.models import TrainerConfig
from omni_core.data import RowRejected, write_fixture
from omni_core.data.digits import DigitsConverter
from omni_core.data.sources import resolve_source
from omni_core.rewards import default_compute_score
from omni_core.training.components import (
    Sampling,
    encode_prompts,
    generate_rollouts,
    minibatches,
    policy_update,
    rollout_logprobs,
    score_rollouts,
)
from omni_core.training.grpo_loop import GRPOTrainer
from omni_core.training.sft import SFTTrainer, examples_from_rows

SETUP = LearningSetup.quick()  # seed 0: SFT 60 steps, then 40 RL steps of 16 prompts x 8 responses


@pytest.fixture(scope="module", autouse=True)
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Own model/fixture cache, and one torch thread (tiny models: threads only add overhead)."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rows() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return load_rows(SETUP)


@pytest.fixture(scope="module")
def warm(rows: tuple[list, list]) -> tuple[Any, Any, list[dict[str, float]]]:
    return warm_start(SETUP, rows[0])


def sft_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- the task ------------------------------------------------------------------------------------------


def test_digits_fixture_splits_are_disjoint_and_bad_rows_are_rejected(tmp_path) -> None:
    train, held_out = load_rows(SETUP)
    assert len(train) == 1000 and len(held_out) == SETUP.val_rows
    assert not {r["extra_info"]["number"] for r in train} & {r["extra_info"]["number"] for r in held_out}
    row = train[0]
    number = row["extra_info"]["number"]
    assert row["prompt"] == [{"role": "user", "content": f"Rotate {number}"}]
    assert row["reward_model"]["ground_truth"] == number[1:] + number[0]

    write_fixture("digits", tmp_path, rows=8, seed=0, bad_rows=3)
    raw = resolve_source(str(tmp_path))
    converter = DigitsConverter()
    outcomes = []
    for i, (_, _, record) in enumerate(converter.records(raw, "train")):
        try:
            converter.convert(record, "train", i, raw)
            outcomes.append("ok")
        except RowRejected:
            outcomes.append("rejected")
    assert outcomes.count("ok") == 8 and outcomes.count("rejected") == 3


@pytest.mark.parametrize(("answer", "score"), [
    ("7194", 1.0), (" 7194\n", 1.0), ("7190", 0.75), ("71", 0.5), ("71945", 0.8), ("4917", 0.0),
    ("71 94", 0.0), ("", 0.0), ("seven", 0.0),
])
def test_digits_reward_gives_partial_credit_by_position(answer: str, score: float) -> None:
    result = default_compute_score(data_source="digits_rotate", solution_str=answer, ground_truth="7194")
    assert result["score"] == pytest.approx(score)
    assert result["acc"] == float(answer.strip() == "7194")


# --- components ------------------------------------------------------------------------------------------


def test_minibatches_hold_whole_groups_and_cover_the_batch() -> None:
    group_ids = torch.arange(6).repeat_interleave(4)
    parts = minibatches(group_ids, 2, torch.Generator().manual_seed(0))
    assert len(parts) == 3
    assert sorted(torch.cat(parts).tolist()) == list(range(24))
    for part in parts:
        assert len(part) == 8 and len(torch.unique(group_ids[part])) == 2
    assert [p.tolist() for p in parts] == [p.tolist() for p in minibatches(group_ids, 2, torch.Generator().manual_seed(0))]
    assert minibatches(group_ids, None, torch.Generator())[0].tolist() == list(range(24))


def test_sft_lowers_the_loss_and_is_deterministic(rows: tuple[list, list]) -> None:
    from omni_core.models import load_model

    examples = examples_from_rows(rows[0][:64], lambda row: row["reward_model"]["ground_truth"])
    cfg = TrainerConfig(total_steps=8, batch_size=16, lr=3e-3)
    runs = []
    for _ in range(2):
        model, tokenizer = load_model(SETUP.model, seed=0)
        metrics = SFTTrainer(cfg, examples, 0, model=model, text_io=tokenizer).fit()
        runs.append((metrics, sft_state(model)))
    assert runs[0][0][-1]["train/loss"] < runs[0][0][0]["train/loss"]
    assert [m["train/loss"] for m in runs[0][0]] == [m["train/loss"] for m in runs[1][0]]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_several_update_epochs_move_the_ratio_and_the_clip_acts(warm: tuple, rows: tuple[list, list]) -> None:
    import copy

    model, tokenizer, _ = warm
    model = copy.deepcopy(model).train()
    batch_rows = rows[0][:8]
    batch = generate_rollouts(model, tokenizer, encode_prompts(tokenizer, batch_rows, 64), n=8,
                              sampling=Sampling(max_new_tokens=SETUP.max_new_tokens), seed=0)
    rewards = torch.tensor([r["score"] for r in score_rollouts(batch_rows, batch.responses, "digits", 8)])
    advantages = grpo_advantages(rewards, batch.group_ids)
    with torch.no_grad():
        old_logp = rollout_logprobs(model, batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    one = policy_update(copy.deepcopy(model), torch.optim.AdamW(model.parameters(), lr=0.0), batch,
                        old_logp=old_logp, advantages=advantages, loss_fn=get_policy_loss("grpo"), loss_kwargs={})
    assert one["actor/pg_clipfrac"] == 0.0 and one["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)
    many = policy_update(model, optimizer, batch, old_logp=old_logp, advantages=advantages,
                         loss_fn=get_policy_loss("grpo"), loss_kwargs={"clip_low": 0.2, "clip_high": 0.2},
                         ppo_epochs=3, groups_per_minibatch=4)
    assert many["actor/pg_clipfrac"] > 0  # 6 optimizer steps: later ones see ratios beyond 1 +- 0.2
    assert many["actor/ppo_kl"] != 0


def test_kl_to_a_frozen_reference_is_reported_and_the_reference_stays(rows: tuple[list, list]) -> None:
    by_length = str(Path(__file__).parent / "data" / "rewards.py") + ":by_length"  # varies within a group
    stage = RLStage(name="rl", data="digits", reward={"name": by_length}, algorithm={"name": "grpo", "kl_beta": 0.1},
                    rollout={"n": 4, "max_new_tokens": 6}, trainer={"batch_size": 4, "lr": 1e-2})
    trainer = GRPOTrainer(stage, rows[0], seed=0)
    reference = sft_state(trainer.reference)
    metrics = [trainer.step() for _ in range(2)]
    assert metrics[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # first update: policy == reference
    assert metrics[1]["actor/kl_loss"] > 0
    assert all(torch.equal(reference[k], v) for k, v in trainer.reference.state_dict().items())
    assert not any(p.requires_grad for p in trainer.reference.parameters())


# --- the proof ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_rl_raises_held_out_reward_well_above_the_warm_start(algorithm: str, warm: tuple,
                                                             rows: tuple[list, list]) -> None:
    model, tokenizer, _ = warm
    before = sft_state(model)
    curve, trainer = learning_curve(algorithm, SETUP, model, tokenizer, *rows)
    print(f"{algorithm}: held-out sampled {curve.val_sampled}, greedy {curve.val_greedy}, {curve.cpu_s:.0f} CPU s")
    # The warm start is partial: the format is there, most digits are not.
    assert curve.val_sampled[0] < 0.3 and curve.val_greedy[0] < 0.4
    # 40 steps later the held-out reward is far higher, sampled (what RL optimises) and greedy.
    assert curve.end >= curve.start + 0.2
    assert curve.val_greedy[-1] >= curve.val_greedy[0] + 0.15
    assert sum(curve.train_score[-10:]) / 10 > sum(curve.train_score[:10]) / 10 + 0.1
    assert sum(curve.clipfrac) > 0  # 2 epochs x 2 mini-batches per step: the clip is exercised
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # RL trained a copy
    assert trainer.global_step == SETUP.rl_steps


def test_same_seed_same_curve_and_weights(warm: tuple, rows: tuple[list, list]) -> None:
    model, tokenizer, _ = warm
    short = LearningSetup.quick(rl_steps=3, eval_every=3, val_rows=32)
    held_out = rows[1][:32]
    runs = [learning_curve("gspo", short, model, tokenizer, rows[0], held_out) for _ in range(2)]
    (a, trainer_a), (b, trainer_b) = runs
    assert (a.val_sampled, a.val_greedy, a.train_score) == (b.val_sampled, b.val_greedy, b.train_score)
    assert state_digest(trainer_a.model) == state_digest(trainer_b.model)
    _, trainer_c = learning_curve("gspo", LearningSetup.quick(rl_steps=3, eval_every=3, seed=1), model, tokenizer,
                                      rows[0], held_out)
    assert state_digest(trainer_c.model) != state_digest(trainer_a.model)
    assert held_out_reward(short, model, tokenizer, held_out) == held_out_reward(short, model, tokenizer, held_out)
