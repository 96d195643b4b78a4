"""The built-in tiny://sd3 model: pixel-space SD3 transformer, flow-matching scheduler, CLIP text encoder."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.errors import ModelError
from omni_core.models import PromptEmbeds, SD3Model, load_model, tiny_model_dir

COMPONENT_FILES = [
    "omni_pipeline.json",
    "README.md",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "scheduler/scheduler_config.json",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/tokenizer.json",
    "tokenizer/tokenizer_config.json",
]


@pytest.fixture(scope="module")
def sd3_dir(model_cache) -> Path:
    return tiny_model_dir("sd3", cache_dir=model_cache)


@pytest.fixture(scope="module")
def sd3(sd3_dir, model_cache) -> SD3Model:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(model_cache))
        model, tokenizer = load_model("tiny://sd3")
    assert tokenizer is model.tokenizer
    return model


def test_layout_pipeline_file_and_card(sd3_dir):
    for name in COMPONENT_FILES:
        assert (sd3_dir / name).is_file(), name
    pipeline = json.loads((sd3_dir / "omni_pipeline.json").read_text())
    assert pipeline["architecture"] == "SD3Transformer2DModel"
    assert (pipeline["space"], pipeline["channels"], pipeline["sample_size"]) == ("pixel", 3, 32)
    card = (sd3_dir / "README.md").read_text()
    assert "**Pixel space**" in card and "no VAE" in card and "Random weights" in card


def test_build_is_byte_identical_and_seeded(sd3_dir, tmp_path):
    torch.manual_seed(4321)
    again = tiny_model_dir("sd3", cache_dir=tmp_path)
    assert again.name == sd3_dir.name
    for name in COMPONENT_FILES:
        assert (again / name).read_bytes() == (sd3_dir / name).read_bytes(), name
    other = tiny_model_dir("sd3", seed=1, cache_dir=tmp_path)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert other.name != sd3_dir.name and (other / weights).read_bytes() != (sd3_dir / weights).read_bytes()


def test_components_and_prompt_encoding(sd3):
    assert type(sd3.transformer).__name__ == "SD3Transformer2DModel"
    assert type(sd3.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert type(sd3.text_encoder).__name__ == "CLIPTextModelWithProjection"
    assert sd3.transformer.config.in_channels == sd3.transformer.config.out_channels == 3
    cond = sd3.encode_prompt(['A red sign that says "OPEN"', "a cat"])
    assert cond.embeds.shape == (2, sd3.max_text_length, sd3.transformer.config.joint_attention_dim)
    assert cond.pooled.shape == (2, sd3.transformer.config.pooled_projection_dim)
    assert not torch.allclose(cond.pooled[0], cond.pooled[1])
    empty = sd3.negative_embeds(2)
    torch.testing.assert_close(empty.embeds[0], empty.embeds[1])
    assert not torch.allclose(empty.pooled[0], cond.pooled[0])
    ids = sd3.tokenizer("a cat")["input_ids"]
    assert ids[0] == sd3.tokenizer.bos_token_id and ids[-1] == sd3.tokenizer.eos_token_id


def test_sigmas_follow_the_shifted_flow_schedule(sd3):
    sigmas = sd3.sigmas(10)
    assert sigmas.shape == (11,) and sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()
    # shift s > 1 keeps more steps at high noise: sigma = s*t / (1 + (s-1)*t) with t evenly spaced
    shift = sd3.scheduler.config.shift
    t = sigmas[:-1] / (shift - (shift - 1) * sigmas[:-1])  # the inverse map
    steps = t[:-1] - t[1:]
    torch.testing.assert_close(steps, steps.mean().expand_as(steps), atol=1e-5, rtol=1e-4)


def test_one_denoising_forward_with_a_cfg_batch(sd3):
    prompts = ["a red square", "a blue circle", "a green sign"]
    cond, uncond = sd3.encode_prompt(prompts), sd3.negative_embeds(len(prompts))
    x = sd3.initial_noise(len(prompts), torch.Generator().manual_seed(0))
    assert x.shape == (3, 3, 32, 32)
    seen: list[int] = []
    hook = sd3.transformer.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            v = sd3.velocity(x, 0.7, cond, uncond=uncond, guidance_scale=4.5)
    finally:
        hook.remove()
    assert seen == [6]  # one forward over [uncond; cond]
    assert v.shape == x.shape and torch.isfinite(v).all()
    with torch.no_grad():
        v_c = sd3.velocity(x, 0.7, cond)
        v_u = sd3.velocity(x, 0.7, uncond)
    torch.testing.assert_close(v, v_u + 4.5 * (v_c - v_u), atol=1e-5, rtol=1e-4)
    # per-sample noise levels (step-level batching mixes requests at different steps)
    with torch.no_grad():
        mixed = sd3.velocity(x, torch.tensor([0.7, 0.3, 0.7]), cond)
    torch.testing.assert_close(mixed[0], v_c[0], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(mixed[1], v_c[1])


def test_sampling_gives_real_pixels(sd3):
    images = sd3.sample(
        ["a red square", "a cat"], num_steps=3, guidance_scale=4.5, generator=torch.Generator().manual_seed(1)
    )
    assert images.shape == (2, 3, 32, 32) and images.abs().max() <= 1.0
    again = sd3.sample(
        ["a red square", "a cat"], num_steps=3, guidance_scale=4.5, generator=torch.Generator().manual_seed(1)
    )
    torch.testing.assert_close(images, again)
    pixels = SD3Model.to_uint8(images)
    assert pixels.shape == (2, 32, 32, 3) and pixels.dtype == np.uint8
    buf = io.BytesIO()
    sd3.to_pil(images)[0].save(buf, format="JPEG", quality=95)  # what the JPEG-compressibility reward does
    assert Image.open(io.BytesIO(buf.getvalue())).size == (32, 32)
    assert isinstance(
        PromptEmbeds.cat([sd3.encode_prompt(["a"]), sd3.encode_prompt(["b"])]).embeds, torch.Tensor
    )


def test_sd3_rejects_a_text_adapter(sd3_dir):
    with pytest.raises(
        ModelError,
        match="is for Qwen3OmniMoeForConditionalGeneration models, but this model is a SD3Transformer2DModel",
    ):
        load_model(str(sd3_dir), adapter="qwen3_omni_thinker")
