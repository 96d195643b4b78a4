"""DPO / IPO / BCO-pair / SFT / MPO losses: float64 re-computations, hand-worked cases, gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from omni_core.algorithms import (
    dpo_loss,
    get_preference_loss,
    mpo_loss,
    preference_loss_names,
    register_preference_loss,
    sequence_logps,
    sft_loss,
    token_logps,
)
from omni_core.algorithms import preference as preference_module
from omni_core.errors import ConfigError


def close(actual, expected, tol=1e-5):
    a = torch.as_tensor(actual, dtype=torch.float64)
    torch.testing.assert_close(a, torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=tol)


def random_pairs(n: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(-20 * torch.rand(n, generator=g, dtype=torch.float64)).float() for _ in range(4)]


def softplus64(x: torch.Tensor) -> torch.Tensor:  # -logsigmoid(-x), written out
    return torch.log1p(torch.exp(x))


# the hand-worked pair: logp_c = -1, ref_c = -2, logp_r = -3, ref_r = -2
# chosen log-ratio +1, rejected log-ratio -1, delta = 2
HAND = [torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0])]


# ---------------------------------------------------------------- hand-worked


def test_sigmoid_hand_worked_with_and_without_label_smoothing():
    # beta 0.5: beta * delta = 1; -logsigmoid(1) = log(1 + e^-1) = 0.3132616875182228
    loss, metrics = dpo_loss(*HAND, beta=0.5)
    close(loss, 0.3132616875182228)
    # ls 0.1: 0.9 * 0.3132616875182228 + 0.1 * log(1 + e^1) = 0.28193551876640 + 0.13132616875182 = 0.41326168751822
    loss, _ = dpo_loss(*HAND, beta=0.5, label_smoothing=0.1)
    close(loss, 0.4132616875182228)
    expected = {"dpo_loss": 0.3132616875, "chosen_rewards": 0.5, "rejected_rewards": -0.5}
    assert metrics == pytest.approx({**expected, "reward_accuracy": 1.0, "reward_margin": 1.0})


def test_ipo_hand_worked():
    # (delta - 1/(2 beta))^2: beta 0.5 -> (2 - 1)^2 = 1; beta 0.1 -> (2 - 5)^2 = 9; beta 1 -> (2 - 0.5)^2 = 2.25
    close(dpo_loss(*HAND, loss_type="ipo", beta=0.5)[0], 1.0)
    close(dpo_loss(*HAND, loss_type="ipo")[0], 9.0)
    close(dpo_loss(*HAND, loss_type="ipo", beta=1.0)[0], 2.25)
    # label smoothing does not enter IPO
    close(dpo_loss(*HAND, loss_type="ipo", label_smoothing=0.3)[0], 9.0)


def test_bco_pair_hand_worked_without_running_mean_shift():
    # -logsigmoid(0.5 * 1) - logsigmoid(-0.5 * -1) = 2 * log(1 + e^-0.5) = 2 * 0.4740769841801067
    close(dpo_loss(*HAND, loss_type="bco_pair", beta=0.5)[0], 0.9481539683602134)
    # a constant shift of both log-ratios changes it (no batch-mean centering): ratios +3 and +1
    shifted = [torch.tensor([0.0]), torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0])]
    # log(1 + e^-1.5) + log(1 + e^0.5) = 0.20141327798275246 + 0.9740769841801067
    close(dpo_loss(*shifted, loss_type="bco_pair", beta=0.5)[0], 1.1754902621628592)


def test_metrics_over_a_batch_count_ties_as_wrong():
    # beta 1; chosen log-ratios [1, 0, 2], rejected [0, 0, 3]
    c, r = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0])
    zero = torch.zeros(3)
    _, m = dpo_loss(c, r, zero, zero, beta=1.0)
    assert m["chosen_rewards"] == pytest.approx(1.0)
    assert m["rejected_rewards"] == pytest.approx(1.0)
    assert m["reward_accuracy"] == pytest.approx(1 / 3)
    assert m["reward_margin"] == pytest.approx(0.0)


def test_label_smoothing_half_is_symmetric_in_delta():
    # ls 0.5: 0.5 * (softplus(-z) + softplus(z)), the same for delta and -delta
    a, b, z = torch.tensor([-1.0]), torch.tensor([-4.0]), torch.zeros(1)
    close(
        dpo_loss(a, b, z, z, beta=0.2, label_smoothing=0.5)[0],
        dpo_loss(b, a, z, z, beta=0.2, label_smoothing=0.5)[0],
    )
    assert dpo_loss(a, b, z, z, beta=0.2)[0] < dpo_loss(b, a, z, z, beta=0.2)[0]


def test_sft_loss_hand_worked():
    # token log-probs [-1, -2, -3] with the last masked out: (1 + 2) / 2 = 1.5
    close(sft_loss(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[1, 1, 0]])), 1.5)
    # logits [0, log 3] over 2 classes: p(label 1) = 3/4 -> CE log(4/3); p(label 0) = 1/4 -> CE log 4
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    close(
        sft_loss(logits, torch.tensor([[1, 1]]), labels=torch.tensor([[1, 0]])),
        (math.log(4 / 3) + math.log(4)) / 2,
    )
    close(sft_loss(logits, torch.tensor([[1, 0]]), labels=torch.tensor([[1, 0]])), math.log(4 / 3))


def test_mpo_hand_worked_default_weights():
    # 0.8 * 0.3132616875182228 + 0.2 * 0.9481539683602134 + 1.0 * 1.5 = 1.9402401
    loss, m = mpo_loss(*HAND, nll=torch.tensor(1.5), beta=0.5)
    close(loss, 0.8 * 0.3132616875182228 + 0.2 * 0.9481539683602134 + 1.5)
    close(loss, 1.9402401436866209)
    assert m["sigmoid_loss"] == pytest.approx(0.3132616875)
    assert m["bco_pair_loss"] == pytest.approx(0.9481539684)
    assert m["sft_loss"] == pytest.approx(1.5)
    assert m["mpo_loss"] == pytest.approx(1.9402401437)
    assert m["reward_accuracy"] == 1.0


# ---------------------------------------------------------------- against float64 re-computation


@pytest.mark.parametrize("ls", [0.0, 0.1, 0.3])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_sigmoid_matches_float64_formula(beta, ls):
    pc, pr, rc, rr = random_pairs()
    delta = (pc.double() - rc.double()) - (pr.double() - rr.double())
    expected = ((1 - ls) * softplus64(-beta * delta) + ls * softplus64(beta * delta)).mean()
    close(dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls)[0], expected)


def test_ipo_and_bco_pair_match_float64_formulas():
    pc, pr, rc, rr = random_pairs(seed=1)
    c, r = pc.double() - rc.double(), pr.double() - rr.double()
    for beta in (0.1, 0.5):
        close(
            dpo_loss(pc, pr, rc, rr, loss_type="ipo", beta=beta)[0],
            ((c - r - 1 / (2 * beta)) ** 2).mean(),
            tol=1e-4,
        )
        bco = (softplus64(-beta * c) + softplus64(beta * r)).mean()
        close(dpo_loss(pc, pr, rc, rr, loss_type="bco_pair", beta=beta)[0], bco)


def test_metrics_match_float64_formulas():
    pc, pr, rc, rr = random_pairs(seed=2)
    cr = 0.1 * (pc.double() - rc.double())
    rr_ = 0.1 * (pr.double() - rr.double())
    _, m = dpo_loss(pc, pr, rc, rr)
    assert m["chosen_rewards"] == pytest.approx(cr.mean().item(), abs=1e-5)
    assert m["rejected_rewards"] == pytest.approx(rr_.mean().item(), abs=1e-5)
    assert m["reward_accuracy"] == pytest.approx((cr > rr_).double().mean().item())
    assert m["reward_margin"] == pytest.approx((cr - rr_).mean().item(), abs=1e-5)


def test_sft_loss_matches_cross_entropy_and_token_logps():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 11, generator=g)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]])
    expected = F.cross_entropy(logits.double()[mask.bool()], labels[mask.bool()])
    close(sft_loss(logits, mask, labels=labels), expected)
    close(sft_loss(token_logps(logits, labels), mask), expected)
    logp64 = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    close(token_logps(logits, labels), logp64)


def test_sequence_logps_sum_and_average():
    logp = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    close(sequence_logps(logp, mask), [-7.0, -1.0])
    close(sequence_logps(logp, mask, average=True), [-7.0 / 3, -0.5])


def test_mpo_matches_float64_weighted_sum_and_custom_lists():
    pc, pr, rc, rr = random_pairs(seed=4)
    c, r = pc.double() - rc.double(), pr.double() - rr.double()
    nll = torch.tensor(2.25)
    beta = 0.1
    sig = softplus64(-beta * (c - r)).mean()
    bco = (softplus64(-beta * c) + softplus64(beta * r)).mean()
    ipo = ((c - r - 1 / (2 * beta)) ** 2).mean()
    close(mpo_loss(pc, pr, rc, rr, nll=nll)[0], 0.8 * sig + 0.2 * bco + 1.0 * 2.25)
    loss, m = mpo_loss(pc, pr, rc, rr, loss_types=["ipo", "sigmoid"], loss_weights=[0.5, 2.0])
    close(loss, 0.5 * ipo + 2.0 * sig, tol=1e-4)
    assert set(m) >= {"ipo_loss", "sigmoid_loss", "mpo_loss", "reward_accuracy"}


# ---------------------------------------------------------------- gradients


def test_gradient_flows_only_into_the_policy_logps():
    pc, pr, rc, rr = (t.clone().requires_grad_(True) for t in random_pairs(n=4, seed=5))
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=0.5)
    loss.backward()
    assert rc.grad is None and rr.grad is None
    # d/d logp_c of mean(-logsigmoid(beta * delta)) = -beta * sigmoid(-beta * delta) / B; opposite for logp_r
    delta = (pc - rc) - (pr - rr)
    expected = -0.5 * torch.sigmoid(-0.5 * delta.detach()) / 4
    close(pc.grad, expected)
    close(pr.grad, -expected)


def test_mpo_gradient_reaches_logits_through_sft_and_pair_terms():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 4, 7, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (2, 4), generator=g)
    mask = torch.ones(2, 4)
    chosen = sequence_logps(token_logps(logits, labels), mask)
    nll = sft_loss(logits, mask, labels=labels)
    ref = torch.full((2,), -8.0, requires_grad=True)
    loss, _ = mpo_loss(chosen, torch.full((2,), -9.0), ref, ref, nll=nll)
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert ref.grad is None


# ---------------------------------------------------------------- registry and errors


def test_registry_and_errors():
    assert preference_loss_names() == ["bco_pair", "ipo", "sft", "sigmoid"]
    assert get_preference_loss("ipo") is preference_module.ipo_loss
    with pytest.raises(ConfigError, match="known loss types"):
        dpo_loss(*HAND, loss_type="hinge")
    with pytest.raises(ConfigError, match="weight"):
        mpo_loss(*HAND, nll=torch.tensor(1.0), loss_weights=[1.0])
    with pytest.raises(ValueError, match="nll"):
        mpo_loss(*HAND)


def test_register_a_new_pair_loss():
    @register_preference_loss("hinge_test")
    def hinge(chosen, rejected, beta, label_smoothing):
        return torch.relu(1 - beta * (chosen - rejected))

    try:
        # 1 - 0.25 * 2 = 0.5
        close(dpo_loss(*HAND, loss_type="hinge_test", beta=0.25)[0], 0.5)
    finally:
        preference_module._PAIR_LOSSES.pop("hinge_test")
