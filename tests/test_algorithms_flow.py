"""FlowGRPO: SDE/CPS step, advantages, clipped loss with KL, CFG; float64 re-computations and hand cases."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.algorithms import (
    cfg_combine,
    flow_grpo_advantages,
    flow_grpo_loss,
    flow_sde_step,
    get_diffusion_loss,
)
from omni_core.errors import ConfigError

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)  # 0.9189385332046727


def close(actual, expected, tol=1e-5):
    a = torch.as_tensor(actual, dtype=torch.float64)
    torch.testing.assert_close(a, torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=tol)


def col(values, like):  # per-sample values as [B, 1, ..., 1] float64
    return torch.as_tensor(values, dtype=torch.float64).reshape(-1, *([1] * (like.dim() - 1)))


def sde_ref(x, v, sigma, sigma_prev, a, noise=None, prev=None):
    """The docs/reference/formulas.md#flowgrpo formula, written out in float64; `prev` replaces mean + scale * noise."""
    x, v = x.double(), v.double()
    s, sp = col(sigma, x), col(sigma_prev, x)
    dt = sp - s
    std = a * torch.sqrt(s / (1 - torch.where(s == 1, sp, s)))
    mean = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    scale = std * torch.sqrt(-dt)
    xp = mean + scale * noise.double() if prev is None else prev.double()
    lp = -((xp - mean) ** 2) / (2 * scale**2) - torch.log(scale) - math.log(math.sqrt(2 * math.pi))
    return xp, lp.flatten(1).mean(1), mean, std


def cps_ref(x, v, sigma, sigma_prev, a, noise=None, prev=None):
    x, v = x.double(), v.double()
    s, sp = col(sigma, x), col(sigma_prev, x)
    std = sp * math.sin(a * math.pi / 2)
    x0, x1 = x - s * v, x + (1 - s) * v
    mean = x0 * (1 - sp) + x1 * torch.sqrt(sp**2 - std**2)
    xp = mean + std * noise.double() if prev is None else prev.double()
    return xp, (-((xp - mean) ** 2)).flatten(1).mean(1), mean, std


def random_inputs(seed=0, shape=(4, 3, 5, 5)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


SIGMAS = [0.9, 0.6, 0.35, 0.1]
SIGMAS_PREV = [0.8, 0.45, 0.2, 0.0]


# ---------------------------------------------------------------- SDE / CPS step


def test_sde_step_hand_worked():
    # sigma 0.5, sigma_prev 0.25, a 0.5: std_t = 0.5 * sqrt(0.5 / 0.5) = 0.5, dt = -0.25
    # mean = x (1 + 0.25/1 * -0.25) + v (1 + 0.25 * 0.5 / 1) * -0.25 = 0.9375 x - 0.28125 v; x=1, v=2: 0.375
    # scale = 0.5 * sqrt(0.25) = 0.25; noise 2 -> x_prev 0.875
    # log_prob = -0.5^2 / (2 * 0.0625) - log 0.25 - log sqrt(2 pi) = -2 + 1.3862943611 - 0.9189385332
    x, v = torch.tensor([[1.0]]), torch.tensor([[2.0]])
    xp, lp, mean, std = flow_sde_step(x, v, 0.5, 0.25, noise_level=0.5, noise=torch.tensor([[2.0]]))
    close(xp, [[0.875]])
    close(mean, [[0.375]])
    close(std, [[0.5]])
    close(lp, [-1.532644172084782])
    # two elements, noise [2, 0]: log-probs -2 + c and 0 + c (c = 0.4673558279), averaged: -0.5326441721
    x2, v2 = torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0, 2.0]])
    _, lp2, _, _ = flow_sde_step(x2, v2, 0.5, 0.25, noise_level=0.5, noise=torch.tensor([[2.0, 0.0]]))
    close(lp2, [-0.5326441720847821])


def test_sde_step_at_sigma_one_uses_the_next_sigma_in_the_denominator():
    # sigma 1, sigma_prev 0.75, a 0.7: std_t = 0.7 * sqrt(1 / (1 - 0.75)) = 1.4 (finite, not inf)
    # mean = x (1 + 1.96/2 * -0.25) + v (1 + 0) * -0.25 = 0.755 x - 0.25 v; x=1, v=2 -> 0.255
    # scale = 1.4 * 0.5 = 0.7; noise 1 -> x_prev 0.955; log_prob = -0.5 - log 0.7 - 0.9189385332
    x, v = torch.tensor([[1.0]]), torch.tensor([[2.0]])
    xp, lp, mean, std = flow_sde_step(x, v, 1.0, 0.75, noise=torch.tensor([[1.0]]))
    close(std, [[1.4]])
    close(mean, [[0.255]])
    close(xp, [[0.955]])
    close(lp, [-0.5 - math.log(0.7) - LOG_SQRT_2PI])
    # per-sample sigmas: only the row at sigma 1 is swapped
    xs, vs, ns = random_inputs(seed=1, shape=(2, 4))
    out = flow_sde_step(xs, vs, torch.tensor([1.0, 0.5]), torch.tensor([0.75, 0.25]), noise=ns)
    for got, want in zip(out, sde_ref(xs, vs, [1.0, 0.5], [0.75, 0.25], 0.7, ns), strict=True):
        close(got, want)


def test_cps_step_hand_worked():
    # sigma 0.5, sigma_prev 0.25, a 1/3: std = 0.25 * sin(pi/6) = 0.125
    # x=1, v=2: x0_hat = 1 - 0.5*2 = 0, x1_hat = 1 + 0.5*2 = 2
    # mean = 0 * 0.75 + 2 * sqrt(0.0625 - 0.015625) = 2 * 0.21650635094610965 = 0.4330127018922193
    # noise 2 -> x_prev = mean + 0.25; log_prob = -(0.25)^2 = -0.0625
    x, v = torch.tensor([[1.0]]), torch.tensor([[2.0]])
    xp, lp, mean, std = flow_sde_step(
        x, v, 0.5, 0.25, noise_level=1 / 3, noise=torch.tensor([[2.0]]), sde_type="cps"
    )
    close(std, [[0.125]])
    close(mean, [[0.4330127018922193]])
    close(xp, [[0.6830127018922193]])
    close(lp, [-0.0625])


@pytest.mark.parametrize("a", [0.3, 0.7, 1.0])
def test_sde_step_matches_float64_formula(a):
    x, v, noise = random_inputs(seed=2)
    out = flow_sde_step(x, v, torch.tensor(SIGMAS), torch.tensor(SIGMAS_PREV), noise_level=a, noise=noise)
    for got, want in zip(out, sde_ref(x, v, SIGMAS, SIGMAS_PREV, a, noise), strict=True):
        close(got, want, tol=1e-4)


@pytest.mark.parametrize("a", [0.3, 0.7, 1.0])
def test_cps_step_matches_float64_formula(a):
    x, v, noise = random_inputs(seed=3)
    out = flow_sde_step(x, v, torch.tensor(SIGMAS), torch.tensor(SIGMAS_PREV), a, noise=noise, sde_type="cps")
    for got, want in zip(out, cps_ref(x, v, SIGMAS, SIGMAS_PREV, a, noise), strict=True):
        close(got, want, tol=1e-4)


def test_sde_log_prob_is_the_gaussian_density_of_the_sample():
    x, v, noise = random_inputs(seed=4)
    xp, lp, mean, std = flow_sde_step(x, v, 0.6, 0.45, noise=noise)
    scale = std * math.sqrt(0.15)
    density = torch.distributions.Normal(mean.double(), scale.double()).log_prob(xp.double())
    close(lp, density.flatten(1).mean(1))


def test_scalar_and_per_sample_sigmas_agree_and_std_is_per_sample():
    x, v, noise = random_inputs(seed=5)
    a = flow_sde_step(x, v, 0.6, 0.45, noise=noise)
    b = flow_sde_step(x, v, torch.full((4,), 0.6), torch.full((4,), 0.45), noise=noise)
    for got, want in zip(a, b, strict=True):
        close(got, want, tol=0)
    assert a[3].shape == (4, 1, 1, 1)
    assert a[1].shape == (4,)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_sampled_noise_follows_the_seeded_generator(sde_type):
    x, v, _ = random_inputs(seed=6)
    xp1, lp1, _, _ = flow_sde_step(
        x, v, 0.6, 0.45, sde_type=sde_type, generator=torch.Generator().manual_seed(7)
    )
    xp2, lp2, _, _ = flow_sde_step(
        x, v, 0.6, 0.45, sde_type=sde_type, generator=torch.Generator().manual_seed(7)
    )
    close(xp1, xp2, tol=0)
    close(lp1, lp2, tol=0)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    xp3, lp3, _, _ = flow_sde_step(x, v, 0.6, 0.45, sde_type=sde_type, noise=noise)
    close(xp1, xp3, tol=0)
    close(lp1, lp3, tol=0)
    xp4, _, _, _ = flow_sde_step(
        x, v, 0.6, 0.45, sde_type=sde_type, generator=torch.Generator().manual_seed(8)
    )
    assert not torch.equal(xp1, xp4)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_prev_sample_given_returns_its_log_prob(sde_type):
    x, v, noise = random_inputs(seed=9)
    xp, lp, mean, _ = flow_sde_step(x, v, 0.6, 0.45, noise=noise, sde_type=sde_type)
    # recomputation (the training pass): same sample, same log-prob; the noise argument is ignored
    xp2, lp2, mean2, _ = flow_sde_step(
        x, v, 0.6, 0.45, prev_sample=xp, noise=torch.zeros_like(x), sde_type=sde_type
    )
    close(xp2, xp, tol=0)
    close(lp2, lp, tol=1e-6)
    close(mean2, mean, tol=0)
    # another sample: its own log-prob, and the mean is the most likely point
    other = xp + 0.3
    _, lp_other, _, _ = flow_sde_step(x, v, 0.6, 0.45, prev_sample=other, sde_type=sde_type)
    ref = (sde_ref if sde_type == "sde" else cps_ref)(x, v, 0.6, 0.45, 0.7, prev=other)
    close(lp_other, ref[1], tol=1e-4)
    _, lp_mean, _, _ = flow_sde_step(x, v, 0.6, 0.45, prev_sample=mean, sde_type=sde_type)
    assert torch.all(lp_mean >= lp_other)


def test_computes_in_fp32_whatever_the_input_dtype():
    x, v, noise = random_inputs(seed=10)
    out16 = flow_sde_step(x.bfloat16(), v.bfloat16(), 0.6, 0.45, noise=noise.bfloat16())
    out64 = flow_sde_step(x.double(), v.double(), 0.6, 0.45, noise=noise.double())
    assert all(t.dtype == torch.float32 for t in (*out16, *out64))
    ref = flow_sde_step(x.bfloat16().float(), v.bfloat16().float(), 0.6, 0.45, noise=noise.bfloat16().float())
    for got, want in zip(out16, ref, strict=True):
        close(got, want, tol=0)


def test_noise_level_zero_sample_is_the_euler_ode_step():
    x, v, noise = random_inputs(seed=11)
    xp, _, mean, _ = flow_sde_step(x, v, 0.6, 0.45, noise_level=0.0, noise=noise)
    close(xp, x.double() + v.double() * -0.15)
    close(mean, xp, tol=0)


def test_log_prob_gradient_flows_through_v_only():
    x, v, noise = random_inputs(seed=12, shape=(2, 6))
    v = v.clone().requires_grad_(True)
    xp, _, _, _ = flow_sde_step(x, v.detach(), 0.6, 0.45, noise=noise)
    xp = xp.clone().requires_grad_(True)
    _, lp, mean, std = flow_sde_step(x, v, 0.6, 0.45, prev_sample=xp)
    lp.sum().backward()
    assert xp.grad is None
    # d lp / d v = (x_prev - mean) / scale^2 / N * dmean/dv, dmean/dv = (1 + std^2 (1 - sigma) / (2 sigma)) dt
    s, dt = 0.6, -0.15
    scale2 = std.detach().double() ** 2 * -dt
    dmean_dv = (1 + std.detach().double() ** 2 * (1 - s) / (2 * s)) * dt
    close(v.grad, (xp.detach().double() - mean.detach().double()) / scale2 / 6 * dmean_dv, tol=1e-4)


def test_unknown_sde_type():
    x, v, _ = random_inputs()
    with pytest.raises(ConfigError, match="sde_type"):
        flow_sde_step(x, v, 0.6, 0.45, sde_type="ode")


# ---------------------------------------------------------------- advantages


def test_group_advantages_hand_worked_population_std():
    # group 0: [1, 0, 0, 0] mean 0.25, population std sqrt(0.75 / 4) = sqrt(3)/4: A = sqrt(3), -1/sqrt(3)
    # group 1: identical rewards -> 0; group 2: a group of one -> 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 7.0])
    adv = flow_grpo_advantages(rewards, [0, 0, 0, 0, 1, 1, 2], eps=1e-12)  # eps > 0 keeps 0 / 0 away
    s3 = math.sqrt(3)
    close(adv, [s3, -1 / s3, -1 / s3, -1 / s3, 0.0, 0.0, 0.0])
    assert adv.dtype == torch.float32
    # default eps 1e-4 added to the std: 0.75 / (0.4330127019 + 1e-4)
    close(flow_grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), ["p"] * 4)[0], 0.75 / (s3 / 4 + 1e-4))


def test_global_std_hand_worked():
    # batch [1, 0, 3, 1]: mean 1.25, population variance 4.75 / 4 -> std 1.0897247358851685
    # group-centred rewards [0.5, -0.5, 1, -1]
    adv = flow_grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), [0, 0, 1, 1], std="global", eps=0.0)
    std = math.sqrt(4.75 / 4)
    close(adv, [0.5 / std, -0.5 / std, 1 / std, -1 / std])
    # a group of one has zero advantage with the global std too
    close(flow_grpo_advantages(torch.tensor([1.0, 0.0, 3.0]), [0, 0, 1], std="global")[2], 0.0)


def test_advantages_are_clipped():
    # one success among 30: A = (1 - 1/30) / sqrt(p (1 - p)), p = 1/30 -> sqrt(29) = 5.385 > 5
    r = torch.zeros(30)
    r[0] = 1.0
    adv = flow_grpo_advantages(r, [0] * 30, eps=0.0)
    close(adv[0], 5.0)
    close(adv[1:], torch.full((29,), -1 / math.sqrt(29)))
    close(flow_grpo_advantages(r, [0] * 30, eps=0.0, clip=None)[0], math.sqrt(29))
    close(flow_grpo_advantages(r, [0] * 30, eps=0.0, clip=0.1), [0.1] + [-0.1] * 29)


@pytest.mark.parametrize("std_mode", ["group", "global"])
def test_advantages_match_float64_formula(std_mode):
    g = torch.Generator().manual_seed(13)
    rewards = torch.rand(24, generator=g)
    groups = torch.randint(0, 5, (24,), generator=g)
    r = rewards.double()
    expected = torch.empty(24, dtype=torch.float64)
    for k in groups.unique():
        sel = groups == k
        std = r[sel].std(correction=0) if std_mode == "group" else r.std(correction=0)
        expected[sel] = ((r[sel] - r[sel].mean()) / (std + 1e-4)).clamp(-5, 5)
    close(flow_grpo_advantages(rewards, groups, std=std_mode), expected, tol=1e-4)


def test_advantage_errors():
    with pytest.raises(ConfigError, match="std"):
        flow_grpo_advantages(torch.ones(2), [0, 0], std="batch")
    with pytest.raises(ValueError, match="group_ids"):
        flow_grpo_advantages(torch.ones(3), [0, 0])


# ---------------------------------------------------------------- loss


def test_loss_hand_worked_clip_cases():
    # ratios [1.5, 1.5, 0.5, 0.5], A [1, -1, 1, -1], c 0.2:
    #   max(-1.5, -1.2) = -1.2; max(1.5, 1.2) = 1.5; max(-0.5, -0.8) = -0.5; max(0.5, 0.8) = 0.8 -> mean 0.15
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5]))
    loss, m = flow_grpo_loss(lp, old, torch.tensor([1.0, -1.0, 1.0, -1.0]), clip_range=0.2)
    close(loss, 0.15)
    assert m["actor/pg_clipfrac"] == 1.0
    assert m["actor/pg_loss"] == pytest.approx(0.15)
    # ppo_kl = mean(old - new) = -(2 log 1.5 + 2 log 0.5) / 4
    assert m["actor/ppo_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 2)
    assert "actor/kl_loss" not in m
    # inside the clip range the loss is -A * ratio: ratio 1.1, A 2 -> -2.2
    inside, _ = flow_grpo_loss(
        torch.log(torch.tensor([1.1])), torch.zeros(1), torch.tensor([2.0]), clip_range=0.2
    )
    close(inside, -2.2)


def test_loss_default_clip_range_and_gradient_at_the_boundaries():
    # c = 1e-4: a ratio of 1 + 5e-5 is inside (gradient -A * ratio), 1 + 2e-4 outside (no gradient for A > 0,
    # gradient for A < 0 since the unclipped term is the larger one)
    lp = torch.log(
        torch.tensor([1 + 5e-5, 1 + 2e-4, 1 + 2e-4, 1 - 2e-4], dtype=torch.float64)
    ).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    loss, m = flow_grpo_loss(lp, torch.zeros(4, dtype=torch.float64), adv)
    loss.backward()
    ratio = lp.detach().exp()
    close(lp.grad, [-ratio[0] / 4, 0.0, ratio[2] / 4, 0.0], tol=1e-9)
    assert m["actor/pg_clipfrac"] == pytest.approx(0.75)


def test_loss_matches_float64_formula():
    g = torch.Generator().manual_seed(14)
    lp, old = 0.01 * torch.randn(64, generator=g), 0.01 * torch.randn(64, generator=g)
    adv = torch.randn(64, generator=g)
    for c in (1e-4, 5e-3, 0.2):
        ratio = torch.exp(lp.double() - old.double())
        expected = torch.maximum(-adv.double() * ratio, -adv.double() * ratio.clamp(1 - c, 1 + c)).mean()
        close(flow_grpo_loss(lp, old, adv, clip_range=c)[0], expected)


def test_kl_term_hand_worked_and_shapes_of_std():
    # mean [[1, 2]], ref 0, std_t 0.5: mean((1, 4)) / (2 * 0.25) = 2.5 / 0.5 = 5; beta 0.04 adds 0.2
    mean, ref = torch.tensor([[1.0, 2.0]], requires_grad=True), torch.zeros(1, 2)
    zero = torch.zeros(1)
    loss, m = flow_grpo_loss(zero, zero, zero, mean=mean, ref_mean=ref, std=0.5, beta=0.04)
    close(loss, 0.2)
    assert m["actor/kl_loss"] == pytest.approx(5.0)
    # d/d mean of beta * mean((m - ref)^2) / (2 s^2) = beta * (m - ref) / (N s^2) = 0.04 * [1, 2] / 0.5
    loss.backward()
    close(mean.grad, [[0.08, 0.16]])
    for std in (torch.tensor([0.5]), torch.tensor([[0.5]]), torch.tensor(0.5)):
        close(flow_grpo_loss(zero, zero, zero, mean=mean, ref_mean=ref, std=std, beta=1.0)[0], 5.0)


def test_kl_term_matches_float64_with_step_outputs():
    x, v, noise = random_inputs(seed=15)
    v_ref = v + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(16))
    v = v.clone().requires_grad_(True)
    sig, sig_prev = torch.tensor(SIGMAS), torch.tensor(SIGMAS_PREV)
    xp, old_lp, _, _ = flow_sde_step(x, v.detach(), sig, sig_prev, noise=noise)
    _, lp, mean, std = flow_sde_step(x, v, sig, sig_prev, prev_sample=xp)
    _, _, ref_mean, _ = flow_sde_step(x, v_ref, sig, sig_prev, prev_sample=xp)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0])
    loss, m = flow_grpo_loss(lp, old_lp, adv, mean=mean, ref_mean=ref_mean, std=std, beta=0.04)
    kl = ((mean.double() - ref_mean.double()) ** 2).flatten(1).mean(1) / (2 * std.double().flatten() ** 2)
    assert m["actor/kl_loss"] == pytest.approx(kl.mean().item(), rel=1e-5)
    # on-policy: ratio 1, pg loss = mean(-A) = -0.625
    close(loss, -0.625 + 0.04 * kl.mean(), tol=1e-5)
    loss.backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_loss_over_stacked_steps_broadcasts_per_sample_advantages():
    lp = torch.log(torch.tensor([[1.5, 1.0], [0.5, 1.0]]))
    adv = torch.tensor([1.0, -1.0])
    # A per row: [[-1.2, -1], [0.8, 1]] -> mean -0.1 (A along the steps would give 0.075)
    close(flow_grpo_loss(lp, torch.zeros(2, 2), adv, clip_range=0.2)[0], -0.1)


def test_loss_gradient_only_through_log_prob():
    lp = torch.zeros(3, requires_grad=True)
    old = torch.zeros(3, requires_grad=True)
    adv = torch.ones(3, requires_grad=True)
    flow_grpo_loss(lp, old, adv)[0].backward()
    assert old.grad is None and adv.grad is None
    close(lp.grad, [-1 / 3] * 3)


def test_kl_needs_mean_and_std():
    zero = torch.zeros(1)
    with pytest.raises(ValueError, match="std"):
        flow_grpo_loss(zero, zero, zero, mean=torch.zeros(1, 2), ref_mean=torch.zeros(1, 2), beta=0.1)


# ---------------------------------------------------------------- CFG and registry


def test_cfg_combine():
    eps_u, eps_c = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 0.0])
    close(cfg_combine(eps_u, eps_c, 4.5), [1 + 4.5 * 2, -2 + 4.5 * 2])  # [10, 7]
    close(cfg_combine(eps_u, eps_c, 1.0), eps_c)
    close(cfg_combine(eps_u, eps_c, 0.0), eps_u)


def test_registry():
    assert get_diffusion_loss("flow_grpo") is flow_grpo_loss
    with pytest.raises(ConfigError, match="unknown diffusion loss .flow_dppo.; known: flow_grpo"):
        get_diffusion_loss("flow_dppo")
