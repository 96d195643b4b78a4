"""GRPO advantages and the clipped policy losses, against small hand-computed examples."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from omni_core.algorithms import (
    get_policy_loss,
    grpo_advantages,
    k3_kl,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
)
from omni_core.errors import ConfigError

# the package exports the function `policy_loss`, which hides the submodule of the same name
policy_loss_module = importlib.import_module("omni_core.algorithms.policy_loss")


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected), atol=tol, rtol=tol
    )


# ---------------------------------------------------------------- GRPO advantages


def test_group_scale_uses_unbiased_group_std():
    # group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 1: identical rewards
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0]), [0, 0, 0, 0, 1, 1])
    close(adv, [1.5, -0.5, -0.5, -0.5, 0.0, 0.0])
    assert adv.dtype == torch.float32


def test_group_of_one_gets_zero_and_ids_can_be_strings():
    # group "b": mean 0.5, std sqrt(0.5): A = +-0.5 / sqrt(0.5) = +-sqrt(0.5)
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 0.0]), ["a", "b", "b"])
    close(adv, [0.0, math.sqrt(0.5), -math.sqrt(0.5)])
    for scale in ("group", "batch", "none"):
        close(grpo_advantages(torch.tensor([5.0]), [7], scale=scale), [0.0])


def test_batch_scale_divides_by_the_batch_std():
    # batch [1, 0, 3, 1]: unbiased std sqrt(4.75 / 3); group-centred rewards [0.5, -0.5, 1, -1]
    std = math.sqrt(4.75 / 3)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), scale="batch")
    close(adv, [0.5 / std, -0.5 / std, 1 / std, -1 / std])


def test_none_scale_is_dr_grpo_centering_only():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), [0, 0, 1, 1], scale="none")
    close(adv, [0.5, -0.5, 1.0, -1.0])


def test_eps_is_added_to_the_std():
    # std sqrt(0.5): A = 0.5 / (sqrt(0.5) + 0.5) = sqrt(2) - 1
    close(grpo_advantages(torch.tensor([1.0, 0.0]), [0, 0], eps=0.5), [math.sqrt(2) - 1, 1 - math.sqrt(2)])
    close(
        grpo_advantages(torch.tensor([1.0, 0.0]), [0, 0]),
        [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)],
    )


def test_interleaved_groups_and_matches_torch_std():
    rewards = torch.tensor([0.3, 1.0, 0.7, 0.0, 0.2, 0.9])
    groups = [2, 5, 2, 5, 2, 5]
    adv = grpo_advantages(rewards, groups)
    for g in (2, 5):
        idx = torch.tensor([i for i, x in enumerate(groups) if x == g])
        r = rewards[idx]
        close(adv[idx], ((r - r.mean()) / (r.std() + 1e-6)).tolist())


def test_unknown_scale_and_length_mismatch():
    with pytest.raises(ConfigError, match="group, batch, none"):
        grpo_advantages(torch.tensor([1.0, 0.0]), [0, 0], scale="global")
    with pytest.raises(ValueError):
        grpo_advantages(torch.tensor([1.0, 0.0]), [0])


# ---------------------------------------------------------------- policy losses

# Two sequences of 3 tokens, old_logp = 0 so the token ratios are exp(logp):
# row 0: A = +1, ratios (1.1, 1.5, 0.7), all tokens in the response
# row 1: A = -2, ratios (1.3, 0.5, 9.0), the last token is padding
RATIOS = [[1.1, 1.5, 0.7], [1.3, 0.5, 9.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def batch():
    logp = torch.tensor(RATIOS).log().requires_grad_(True)
    return logp, torch.zeros(2, 3), ADV.clone(), MASK.clone()


def test_token_level_clip_inside_and_outside():
    # L = max(-A w, -A clip(w, 0.8, 1.2)):
    # row 0: 1.1 -> -1.1 (inside), 1.5 -> -1.2 (clipped), 0.7 -> -0.7 (A > 0: no clip below)
    # row 1: 1.3 -> 2.6 (A < 0: no clip above), 0.5 -> max(1.0, 1.6) = 1.6 (clipped)
    logp, old, adv, mask = batch()
    loss, m = policy_loss(logp, old, adv, mask, level="token", agg="token-mean")
    close(loss, (-1.1 - 1.2 - 0.7 + 2.6 + 1.6) / 5)
    close(m["actor/pg_loss"], 0.24)
    close(m["actor/pg_clipfrac"], 2 / 5)
    kl = -sum(math.log(r) for r in [1.1, 1.5, 0.7, 1.3, 0.5]) / 5
    close(m["actor/ppo_kl"], kl)
    assert "actor/kl_loss" not in m
    assert all(isinstance(v, float) for v in m.values())


def test_aggregation_modes():
    logp, old, adv, mask = batch()
    # per-token losses: row 0 (-1.1, -1.2, -0.7), row 1 (2.6, 1.6, masked)
    expected = {
        "token-mean": 1.2 / 5,
        "seq-mean-token-mean": (-3.0 / 3 + 4.2 / 2) / 2,
        "seq-mean-token-sum-norm": 1.2 / (2 * 3),
    }
    for agg, value in expected.items():
        loss, _ = policy_loss(logp, old, adv, mask, agg=agg)
        close(loss, value)
    with pytest.raises(ConfigError, match="seq-mean-token-mean"):
        policy_loss(logp, old, adv, mask, agg="seq-sum")


def test_per_token_advantages_equal_broadcast_ones():
    logp, old, adv, mask = batch()
    a, _ = policy_loss(logp, old, adv, mask)
    b, _ = policy_loss(logp, old, adv.unsqueeze(-1).expand(2, 3), mask)
    close(a, b.item())


def test_asymmetric_clip():
    # clip(w, 0.9, 1.3): row 0: 1.5 -> -1.3; 0.7 stays -0.7; row 1: 0.5 -> max(1.0, 1.8) = 1.8
    logp, old, adv, mask = batch()
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    close(loss, (-1.1 - 1.3 - 0.7 + 2.6 + 1.8) / 5)
    close(m["actor/pg_clipfrac"], 2 / 5)


def test_sequence_level_gspo_ratio_inside_and_outside_the_clip():
    # s = mean log ratio over the response: w0 = (1.1 * 1.5 * 0.7)^(1/3), w1 = (1.3 * 0.5)^(1/2)
    w0, w1 = 1.155 ** (1 / 3), 0.65**0.5
    logp, old, adv, mask = batch()
    loss, m = policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean")
    # clip 0.2: w0 inside -> -w0; w1 below 0.8 but A < 0 -> max(2 w1, 1.6) = 2 w1
    close(loss, (-w0 + 2 * w1) / 2)
    close(m["actor/pg_clipfrac"], 0.0)
    loss, m = policy_loss(
        logp, old, adv, mask, level="sequence", clip_low=0.02, clip_high=0.02, agg="seq-mean-token-mean"
    )
    # clip 0.02: row 0 -> -1.02, row 1 -> 2 * 0.98
    close(loss, (-1.02 + 1.96) / 2)
    close(m["actor/pg_clipfrac"], 1.0)


def test_gspo_token_form_gradient_equals_sequence_ratio_gradient():
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    old = torch.randn(3, 4) * 0.1 - 2
    adv = torch.tensor([0.7, -1.3, 0.4])
    base = old + torch.randn(3, 4) * 0.05

    logp = base.clone().requires_grad_(True)
    loss, _ = policy_loss(
        logp, old, adv, mask, level="sequence", clip_low=10.0, clip_high=10.0, agg="seq-mean-token-mean"
    )
    loss.backward()

    ref = base.clone().requires_grad_(True)
    s = ((ref - old) * mask).sum(-1) / mask.sum(-1)
    ref_loss = (-adv * torch.exp(s)).mean()  # the sequence-level objective
    ref_loss.backward()

    close(loss, ref_loss.item())
    torch.testing.assert_close(logp.grad, ref.grad)
    assert (logp.grad[mask == 0] == 0).all()


def test_gradient_flows_only_through_logp():
    logp, _, _, mask = batch()
    old = torch.zeros(2, 3, requires_grad=True)
    adv = ADV.clone().requires_grad_(True)
    ref = torch.full((2, 3), -0.5, requires_grad=True)
    for level in ("token", "sequence"):
        logp.grad = None
        loss, _ = policy_loss(logp, old, adv, mask, level=level, ref_logp=ref, beta=0.1)
        loss.backward()
        assert logp.grad is not None and logp.grad.abs().sum() > 0
        assert old.grad is None and adv.grad is None and ref.grad is None


def test_k3_kl_value_and_beta():
    # token 1: ref - logp = ln(0.25 / 0.5) = -ln 2 -> 0.5 + ln 2 - 1; token 2: ln 2 -> 2 - ln 2 - 1
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.4)]])
    kl = [0.5 + math.log(2) - 1, 2 - math.log(2) - 1]
    close(k3_kl(logp, ref), [kl])
    mask = torch.ones(1, 2)
    # ratio 1 and A = 0: the pg loss is 0 and the loss is beta * mean(kl)
    loss, m = policy_loss(logp, logp.detach(), torch.zeros(1), mask, ref_logp=ref, beta=0.5)
    close(m["actor/kl_loss"], sum(kl) / 2)
    close(m["actor/pg_loss"], 0.0)
    close(loss, 0.5 * sum(kl) / 2)
    loss.backward()
    # d kl / d logp = 1 - exp(ref - logp); token-mean over 2 tokens; times beta
    close(logp.grad, [[0.5 * (1 - 0.5) / 2, 0.5 * (1 - 2.0) / 2]])


def test_registry_grpo_and_gspo():
    logp, old, adv, mask = batch()
    assert {"grpo", "gspo"} <= set(policy_loss_names())
    a, _ = get_policy_loss("grpo")(logp, old, adv, mask)
    b, _ = policy_loss(logp, old, adv, mask, level="token", clip_low=0.2, clip_high=0.2, agg="token-mean")
    close(a, b.item())
    a, _ = get_policy_loss("gspo")(logp, old, adv, mask)
    b, _ = policy_loss(
        logp, old, adv, mask, level="sequence", clip_low=3e-4, clip_high=4e-4, agg="seq-mean-token-mean"
    )
    close(a, b.item())
    # config values override the defaults
    a, _ = get_policy_loss("gspo")(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    b, _ = policy_loss(logp, old, adv, mask, level="sequence", agg="seq-mean-token-mean")
    close(a, b.item())


def test_registry_unknown_and_custom(monkeypatch):
    monkeypatch.setattr(policy_loss_module, "_POLICY_LOSSES", policy_loss_module._POLICY_LOSSES.copy())
    with pytest.raises(ConfigError, match="grpo, gspo"):
        get_policy_loss("ppo2")

    @register_policy_loss("zero")
    def zero(logp, old_logp, advantages, mask, **kwargs):
        return logp.sum() * 0, {}

    assert get_policy_loss("zero") is zero
