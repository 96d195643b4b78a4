"""The diffusion rollout engine on tiny://sd3: a sample is the same (image and per-step log-probs, 1e-5)
alone, in request-level batches with True-CFG and in step-level batches that mix step indices; the
trainer's recomputation of the engine's trajectories gives back its log-probs; weights, sizes, errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omni_core.errors import ConfigError
from omni_core.models import SD3Model, load_model
from omni_core.rollout import DiffusionEngine, DiffusionSampling, EngineConfig, RolloutRequest
from omni_core.rollout.metrics import rollout_consistency
from omni_core.training.flow_grpo import DiffusionRollout, rollout, step_log_prob

PROMPTS = ['A red sign on a brick wall that says "OPEN"', "a cat on a windowsill",
           'A poster with the words "SALE 50%"', "mountains and a lake at sunrise"]
STEPS = 4
CFG = DiffusionSampling(num_steps=STEPS, guidance_scale=4.5)
N = 8


pytestmark = pytest.mark.usefixtures("tiny_model_env")


@pytest.fixture(scope="module")
def model(tiny_model_env) -> SD3Model:
    return load_model("tiny://sd3", seed=0)[0]


def requests(sampling: DiffusionSampling = CFG, n: int = N) -> list[RolloutRequest]:
    """A FlowGRPO-like batch: groups of 2 sharing a prompt, one seed each; half with a negative prompt
    (per-sample conditioning: it does not split batches)."""
    out = []
    for i in range(n):
        s = sampling if i % 4 < 2 else DiffusionSampling(**{**sampling.__dict__, "negative_prompt": "blurry"})
        out.append(RolloutRequest(PROMPTS[(i // 2) % 4], s, seed=1000 + i, request_id=f"r{i}"))
    return out


class Forwards:
    """Records the batch size and the per-sample timesteps of every transformer forward (at
    `SD3Model._forward`: the engine's inference forward does not go through the module's hooks)."""

    def __init__(self, model: SD3Model):
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.model, self.plain = model, model._forward

        def record(x, timestep, text, *args):
            self.calls.append((x.shape[0], timestep.clone()))
            return self.plain(x, timestep, text, *args)

        model._forward = record

    def __enter__(self) -> Forwards:
        return self

    def __exit__(self, *exc) -> None:
        del self.model._forward


def generate(model: SD3Model, config: EngineConfig, reqs: list[RolloutRequest], stagger: bool = False):
    """(results, forwards); `stagger`: submit in pairs, each pair after the engine took one more step,
    so the requests run at different step indices."""
    with Forwards(model) as fw, DiffusionEngine(model, config) as engine:
        if not stagger:
            return engine.generate(reqs), fw.calls
        futures = []
        for k in range(0, len(reqs), 2):
            futures += [engine.submit(r) for r in reqs[k : k + 2]]
            deadline = time.monotonic() + 30
            while engine.stats["forwards"] < k // 2 + 1 and time.monotonic() < deadline:  # steps taken
                time.sleep(0.0005)
        return [f.result(60) for f in futures], fw.calls


def assert_same(results, reference, atol=1e-5):
    for got, want in zip(results, reference, strict=True):
        assert got.request_id == want.request_id and got.seed == want.seed
        torch.testing.assert_close(got.output, want.output, atol=atol, rtol=0)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=atol, rtol=0)
        torch.testing.assert_close(got.extra["latents"], want.extra["latents"], atol=atol, rtol=0)


def test_a_sample_is_the_same_alone_batched_and_interleaved(model):
    reqs = requests()
    alone, fw = generate(model, EngineConfig(max_num_seqs=1), reqs)
    assert [b for b, _ in fw] == [2] * (N * STEPS)  # True-CFG: [uncond; cond] in one forward
    r = alone[0]
    assert r.output.shape == (3, 32, 32) and r.output.abs().max() <= 1
    assert r.logprobs.shape == (STEPS,) and r.logprobs.dtype == torch.float32 and torch.isfinite(r.logprobs).all()
    assert r.extra["latents"].shape == (STEPS + 1, 3, 32, 32) and r.extra["means"].shape == (STEPS, 3, 32, 32)
    assert r.extra["sigmas"].shape == (STEPS + 1,) and r.extra["sampling"].height == 32
    # the initial noise is the seed's own
    torch.testing.assert_close(r.extra["latents"][0], torch.randn((3, 32, 32), generator=torch.Generator().manual_seed(1000)))

    for max_num_seqs in (4, 8):  # request-level: whole requests, 2B rows per forward
        # (the wait only makes the batches full whatever the thread timing: it ends once one is)
        batched, fw = generate(model, EngineConfig(max_num_seqs=max_num_seqs, request_batch_max_wait_ms=10_000), reqs)
        assert max(b for b, _ in fw) == 2 * max_num_seqs and len(fw) == N // max_num_seqs * STEPS
        assert_same(batched, alone)

    interleaved, fw = generate(model, EngineConfig(max_num_seqs=4, step_execution=True), reqs, stagger=True)
    assert_same(interleaved, alone)
    assert max(b for b, _ in fw) <= 8
    # some forwards held requests at different denoising steps (per-sample timesteps)
    assert any(len(set(t.tolist())) > 1 for _, t in fw), [t.tolist() for _, t in fw]

    # the trainer's rollout is the same sampling code: same numbers
    plain = [i for i in range(N) if reqs[i].sampling.negative_prompt == ""]
    trainer = rollout(model, [reqs[i].prompt for i in plain], [reqs[i].seed for i in plain], num_steps=STEPS,
                      guidance_scale=4.5)
    torch.testing.assert_close(trainer.latents, torch.stack([alone[i].extra["latents"] for i in plain]), atol=1e-5, rtol=0)
    torch.testing.assert_close(trainer.log_probs, torch.stack([alone[i].logprobs for i in plain]), atol=1e-5, rtol=0)
    # a different seed is a different sample
    other, _ = generate(model, EngineConfig(max_num_seqs=1), [RolloutRequest(reqs[0].prompt, CFG, seed=7)])
    assert not torch.allclose(other[0].output, alone[0].output, atol=1e-3)


def test_trainer_recomputes_the_engine_log_probs(model):
    reqs = requests()
    results, _ = generate(model, EngineConfig(max_num_seqs=4, step_execution=True), reqs)
    for r in results:  # each sample carries its own (possibly different) negative prompt embeddings
        assert r.extra["negative_prompt_embeds"].shape == r.extra["prompt_embeds"].shape
    batch = DiffusionRollout.from_results(results, [r.prompt for r in reqs], group_ids=[i // 2 for i in range(N)])
    assert batch.latents.shape == (N, STEPS + 1, 3, 32, 32) and batch.uncond is not None
    assert batch.guidance_scale == 4.5 and batch.noise_level == 0.7 and batch.sde_type == "sde"
    with torch.no_grad():
        recomputed = torch.stack([step_log_prob(model, batch, j)[0] for j in range(STEPS)], dim=1)
    metrics = rollout_consistency(batch.log_probs, recomputed)
    assert metrics["training/rollout_actor_probs_pearson_corr"] >= 0.9999, metrics
    assert metrics["training/rollout_probs_diff_mean"] < 1e-4, metrics


def test_ode_sizes_and_cps(model):
    ode = DiffusionSampling(num_steps=3, guidance_scale=4.5, noise_level=0.0)
    small = DiffusionSampling(num_steps=2, height=16, width=24, sde_type="cps")
    reqs = [RolloutRequest(PROMPTS[0], ode, seed=7), RolloutRequest(PROMPTS[1], small, seed=8),
            RolloutRequest(PROMPTS[2], ode, seed=9)]
    with DiffusionEngine(model, EngineConfig(max_num_seqs=4, step_execution=True)) as engine:
        a, b, c = engine.generate(reqs)
        # compatible = same resolved sampling; the negative prompt does not matter
        assert engine.compat_key(RolloutRequest("x", DiffusionSampling(height=32), 0)) == \
            engine.compat_key(RolloutRequest("y", DiffusionSampling(negative_prompt="bad"), 1))
        assert engine.compat_key(reqs[0]) != engine.compat_key(reqs[1])
    sample = model.sample([PROMPTS[0]], num_steps=3, guidance_scale=4.5, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(a.output, sample[0], atol=1e-5, rtol=0)  # the ODE request is the model's sampler
    assert torch.isnan(a.logprobs).all() and c.output.shape == (3, 32, 32)
    assert b.output.shape == (3, 16, 24) and torch.isfinite(b.logprobs).all() and "negative_prompt_embeds" not in b.extra


def test_weights_errors_and_validation(model):
    reqs = [RolloutRequest(PROMPTS[0], DiffusionSampling(num_steps=2), seed=3)]
    name, value = next((k, v) for k, v in model.transformer.state_dict().items() if k.endswith("proj_out.weight"))
    original = value.clone()
    try:
        with DiffusionEngine(model, EngineConfig(max_num_seqs=2)) as engine:
            before = engine.generate(reqs)[0]
            engine.update_weights({name: original * 2}, version=5)
            after = engine.generate(reqs)[0]
            assert after.policy_version == 5 and not torch.allclose(after.output, before.output)
            with pytest.raises(KeyError, match="does not have"):
                engine.update_weights({"nope.weight": original}, version=6)
            with pytest.raises(ValueError, match="shape"):
                engine.update_weights({name: original[:1]}, version=6)
            # a bad request fails alone and the engine goes on
            bad = engine.submit(RolloutRequest(PROMPTS[0], {"num_steps": 2}, seed=1))
            wrong = engine.submit(RolloutRequest(["not", "text"], DiffusionSampling(num_steps=2), seed=1))
            with pytest.raises(TypeError, match="DiffusionSampling"):
                bad.result(30)
            with pytest.raises(TypeError, match="text"):
                wrong.result(30)
            assert engine.generate(reqs)[0].policy_version == 5
    finally:
        with torch.no_grad():
            model.transformer.state_dict()[name].copy_(original)
    for bad_args in ({"num_steps": 0}, {"noise_level": -1.0}, {"sde_type": "ddim"}, {"height": 0}):
        with pytest.raises(ConfigError):
            DiffusionSampling(**bad_args)


def test_submitting_from_threads_matches_serial(model):
    """Callers on several threads at once (request-level, a partial batch waits to fill)."""
    reqs = requests(DiffusionSampling(num_steps=2, guidance_scale=4.5), n=4)
    alone, _ = generate(model, EngineConfig(max_num_seqs=1), reqs)
    results: dict[str, object] = {}
    with DiffusionEngine(model, EngineConfig(max_num_seqs=4, request_batch_max_wait_ms=10_000)) as engine:
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r.request_id, engine.submit(r).result(60)))
                   for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.stats["batches"] == 1 and engine.stats["max_batch"] == 4  # one batch of all four
        assert engine.stats["forwards"] == 2  # one transformer forward per denoising step
    assert_same([results[r.request_id] for r in reqs], alone)


def test_inference_forward_is_the_plain_forward(model):
    """`sd3_inference_forward` (the engine's default) is the diffusers forward up to float rounding: per
    sample timesteps and text, a LoRA adapter with nonzero weights, and it is taken (not a fallback);
    with autograd on, `velocity` runs the plain forward."""
    from omni_core.models.diffusion import sd3_inference_forward
    from omni_core.models.lora import LoraSpec, apply_lora

    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn((3, 3, 32, 32), generator=gen), torch.tensor([1000.0, 500.0, 31.0])
    with DiffusionEngine(model) as engine:
        text = engine.encode([PROMPTS[0], "", PROMPTS[2]])

    def both(transformer):
        with torch.no_grad():
            plain = transformer(hidden_states=x, encoder_hidden_states=text.embeds, pooled_projections=text.pooled,
                                timestep=t, return_dict=False)[0]
            fast = sd3_inference_forward(transformer, x, t, text.embeds, text.pooled)
        assert fast is not None
        torch.testing.assert_close(fast, plain, atol=1e-6, rtol=0)
        return fast

    base = both(model.transformer)
    import copy

    lora = apply_lora(copy.deepcopy(model.transformer), LoraSpec(rank=4, alpha=8),
                      ["to_q", "to_k", "to_v", "add_k_proj", "add_q_proj", "proj", "proj_out"])
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=gen)
    adapted = both(lora)
    assert not torch.allclose(adapted, base, atol=1e-3)
    with lora.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(sd3_inference_forward(lora, x, t, text.embeds, text.pooled), base, atol=1e-6, rtol=0)

    x.requires_grad_(True)  # with autograd: the plain forward, gradients flow
    v = model.velocity(x, t / 1000, text, inference_kernels=True)
    v.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_engine_inference_kernels_match_the_plain_forward(model):
    reqs = requests()
    fast, _ = generate(model, EngineConfig(max_num_seqs=8), reqs)
    with DiffusionEngine(model, EngineConfig(max_num_seqs=1), inference_kernels=False) as engine:
        plain = engine.generate(reqs)
    assert_same(fast, plain)
