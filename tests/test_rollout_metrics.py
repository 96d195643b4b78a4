"""verl's rollout-vs-actor metrics (omni_core.rollout.metrics): against a direct float64 recomputation,
verl's own float32 formula, hand-worked cases, and as reported by a GRPO and a FlowGRPO step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_core.config import RLStage
from omni_core.data.gsm8k import GSM8KConverter
from omni_core.data.sources import resolve_source
from omni_core.models import load_model
from omni_core.rollout.metrics import (
    PROBS_DIFF_MAX,
    PROBS_DIFF_MEAN,
    PROBS_DIFF_STD,
    PROBS_DIFF_VALID,
    PROBS_PEARSON,
    rollout_consistency,
)
from omni_core.training.components import RolloutBatch, encode_prompt_inputs, generate_rollouts
from omni_core.training.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer
from omni_core.training.grpo_loop import GRPOTrainer

NAMES = (PROBS_DIFF_VALID, PROBS_DIFF_MAX, PROBS_DIFF_MEAN, PROBS_DIFF_STD, PROBS_PEARSON)


def direct(rollout_logp: torch.Tensor, actor_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The definitions, written out in numpy float64."""
    keep = mask.numpy().astype(bool)
    p_actor = np.exp(actor_logp.numpy().astype(np.float64))[keep]
    p_rollout = np.exp(rollout_logp.numpy().astype(np.float64))[keep]
    diff = np.abs(p_actor - p_rollout)
    n = len(diff)
    cov = np.sum((p_actor - p_actor.mean()) * (p_rollout - p_rollout.mean())) / (n - 1)
    pearson = cov / (np.std(p_actor, ddof=1) * np.std(p_rollout, ddof=1))
    return {PROBS_DIFF_VALID: 1.0, PROBS_DIFF_MAX: diff.max(), PROBS_DIFF_MEAN: diff.mean(),
            PROBS_DIFF_STD: np.std(diff, ddof=1), PROBS_PEARSON: pearson}


def verl_float32(rollout_logp: torch.Tensor, actor_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's calculate_debug_metrics body (verl/utils/debug/metrics.py) on float32 inputs."""
    actor_probs, rollout_probs, keep = torch.exp(actor_logp), torch.exp(rollout_logp), mask.bool()
    pearson = torch.corrcoef(torch.stack([torch.masked_select(actor_probs, keep),
                                          torch.masked_select(rollout_probs, keep)], dim=0))[0][1].item()
    diff = torch.masked_select(torch.abs(actor_probs - rollout_probs), keep)
    return {PROBS_DIFF_VALID: 1.0, PROBS_DIFF_MAX: diff.max().item(), PROBS_DIFF_MEAN: diff.mean().item(),
            PROBS_DIFF_STD: diff.std().item(), PROBS_PEARSON: pearson}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_a_direct_float64_recomputation_and_verls_formula(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    actor = torch.log_softmax(torch.randn(6, 20, 50, generator=g), -1).max(-1).values  # [6, 20] token log-probs
    rollout = actor + 0.05 * torch.randn(6, 20, generator=g)  # a slightly different engine
    mask = torch.rand(6, 20, generator=g) < 0.7
    rollout[~mask] = 30.0  # garbage outside the mask must not count (exp(30) would dominate)
    got = rollout_consistency(rollout, actor, mask)
    assert set(got) == set(NAMES) and all(isinstance(v, float) for v in got.values())
    want = direct(rollout, actor, mask)
    for name in NAMES:
        assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-15), name
    verl = verl_float32(rollout, actor, mask)
    for name in NAMES:
        assert got[name] == pytest.approx(verl[name], rel=1e-4, abs=1e-6), name
    assert 0.9 < got[PROBS_PEARSON] < 1.0


def test_hand_worked_cases() -> None:
    log = torch.log
    # p_actor = [0.1, 0.2, 0.3], p_rollout = 2 p_actor: |diff| = [0.1, 0.2, 0.3], perfectly correlated
    m = rollout_consistency(log(torch.tensor([[0.2, 0.4, 0.6]])), log(torch.tensor([[0.1, 0.2, 0.3]])))
    assert m[PROBS_DIFF_VALID] == 1.0
    assert m[PROBS_DIFF_MEAN] == pytest.approx(0.2) and m[PROBS_DIFF_MAX] == pytest.approx(0.3)
    assert m[PROBS_DIFF_STD] == pytest.approx(0.1)  # Bessel-corrected, as torch.std
    assert m[PROBS_PEARSON] == pytest.approx(1.0)
    # reversed order: a correlation of -1
    m = rollout_consistency(log(torch.tensor([0.3, 0.2, 0.1])), log(torch.tensor([0.1, 0.2, 0.3])))
    assert m[PROBS_PEARSON] == pytest.approx(-1.0) and m[PROBS_DIFF_MEAN] == pytest.approx(0.4 / 3)
    # the mask picks positions: [0.5 vs 0.25] and [0.8 vs 0.4]; the masked-out pair would change all
    rollout = log(torch.tensor([[0.25, 0.9], [0.4, 0.01]]))
    actor = log(torch.tensor([[0.5, 0.1], [0.8, 0.99]]))
    m = rollout_consistency(rollout, actor, torch.tensor([[1, 0], [1, 0]]))
    assert m[PROBS_DIFF_MEAN] == pytest.approx(0.325) and m[PROBS_DIFF_MAX] == pytest.approx(0.4)
    assert m[PROBS_DIFF_STD] == pytest.approx(math.sqrt(2 * 0.075**2)) and m[PROBS_PEARSON] == pytest.approx(1.0)
    # identical log-probs: no difference at all
    same = torch.tensor([[-0.1, -2.0, -0.7]])
    m = rollout_consistency(same, same.clone())
    assert m[PROBS_DIFF_MAX] == 0.0 and m[PROBS_DIFF_MEAN] == 0.0 and m[PROBS_PEARSON] == pytest.approx(1.0)


def test_degenerate_cases_follow_verl() -> None:
    nan = math.isnan
    # no valid token: valid 0, the rest NaN (verl's early return)
    m = rollout_consistency(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert m[PROBS_DIFF_VALID] == 0.0 and all(nan(m[k]) for k in NAMES[1:])
    # a constant side: zero variance, Pearson 0/0 = NaN as torch.corrcoef gives it; the diffs are defined
    log = torch.log
    m = rollout_consistency(log(torch.tensor([0.25, 0.5])), log(torch.tensor([0.5, 0.5])))
    assert nan(m[PROBS_PEARSON]) and m[PROBS_DIFF_MEAN] == pytest.approx(0.125)
    assert m[PROBS_DIFF_STD] == pytest.approx(math.sqrt(2 * 0.125**2))
    assert nan(torch.corrcoef(torch.tensor([[0.5, 0.5], [0.25, 0.5]]))[0][1].item())  # torch's, for the record
    # one token: max and mean defined, std and correlation NaN
    m = rollout_consistency(log(torch.tensor([[0.5]])), log(torch.tensor([[0.25]])))
    assert m[PROBS_DIFF_MEAN] == pytest.approx(0.25) and nan(m[PROBS_DIFF_STD]) and nan(m[PROBS_PEARSON])
    with pytest.raises(ValueError, match="same shape"):
        rollout_consistency(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mask"):
        rollout_consistency(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2))


# ---- in the trainers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        raw = resolve_source("fixtures://gsm8k?rows=8&seed=0")
        converter = GSM8KConverter()
        return [converter.convert(record, "train", i, raw)
                for i, (_, _, record) in enumerate(converter.records(raw, "train"))]


class KeepLogprobsGRPO(GRPOTrainer):
    """The GRPO trainer with the rollout's own log-probs kept (verl's rollout_log_probs)."""

    def generate(self, rows: list[dict], step: int) -> RolloutBatch:
        prompts, media = encode_prompt_inputs(self.tokenizer, rows, self.stage.trainer.max_prompt_tokens)
        return generate_rollouts(self.model, self.tokenizer, prompts, media=media, n=self.stage.rollout.n,
                                 sampling=self.sampling, seed=self.seed * 7919 + step, keep_logprobs=True)


def test_grpo_step_reports_rollout_vs_actor_metrics(gsm8k_rows: list[dict]) -> None:
    reward = str(Path(__file__).parent / "data" / "rewards.py") + ":by_length"
    stage = RLStage(name="rl", model="tiny://lm", data="gsm8k", reward={"name": reward},
                    rollout={"n": 4, "max_new_tokens": 8, "temperature": 0.8},
                    trainer={"total_steps": 1, "batch_size": 2, "lr": 1e-2})
    metrics = KeepLogprobsGRPO(stage, gsm8k_rows, seed=0).step()
    assert metrics[PROBS_DIFF_VALID] == 1.0
    assert metrics[PROBS_PEARSON] > 0.999  # the same weights, sampled and recomputed: the same numbers
    assert 0.0 <= metrics[PROBS_DIFF_MEAN] < 1e-4
    # the plain trainer samples through ARengine, which records the rollout log-probs on every step
    plain = GRPOTrainer(stage, gsm8k_rows, seed=0).step()
    assert plain[PROBS_PEARSON] >= 0.9999 and plain[PROBS_DIFF_MEAN] < 1e-4  # the trainer keeps rollout log-probs


def test_flow_grpo_step_reports_rollout_vs_actor_metrics(tmp_path_factory: pytest.TempPathFactory) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "omni-model-cache"))
        model = load_model("tiny://sd3", seed=0)[0]
    rows = [{"data_source": "jpeg_compressibility", "prompt": p} for p in ("a red sign", "a cat", "a lake")]
    config = FlowGRPOConfig(group_size=2, prompts_per_step=2, num_steps=4, timestep_fraction=0.5, lr=1e-2)
    metrics = FlowGRPOTrainer(config, rows, 0, model=model).step()
    assert metrics[PROBS_DIFF_VALID] == 1.0 and metrics[PROBS_PEARSON] > 0.999
    assert metrics["timing_s/old_log_prob"] >= 0
