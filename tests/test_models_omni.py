"""The built-in tiny://qwen3-omni model: build, determinism, the whole architecture, its processor."""

from __future__ import annotations

import io
import json
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.models import load_model, parameter_count, tiny_model_dir
from omni_core.models.media import decode_wav, media_messages

BUILD_FILES = [
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "README.md",
]


@pytest.fixture(scope="module")
def omni_dir(model_cache) -> Path:
    return tiny_model_dir("qwen3-omni", cache_dir=model_cache)


@pytest.fixture(scope="module")
def full(omni_dir, model_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(model_cache))
        return load_model("tiny://qwen3-omni")


def _image(seed: int = 0, size: int = 64) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _tone(seconds: float = 1.0, rate: int = 16_000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def test_build_layout_config_and_card(omni_dir, model_cache):
    assert omni_dir.parent == model_cache / "tiny" and omni_dir.name.startswith("qwen3-omni-")
    for name in BUILD_FILES:
        assert (omni_dir / name).is_file(), name
    config = json.loads((omni_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert {"thinker_config", "talker_config", "code2wav_config"} <= config.keys()
    text = config["thinker_config"]["text_config"]
    assert (
        sum(text["rope_parameters"]["mrope_section"]) * 2
        == text["hidden_size"] // text["num_attention_heads"]
    )
    processor = json.loads((omni_dir / "processor_config.json").read_text())
    assert processor["processor_class"] == "Qwen3OmniMoeProcessor"  # AutoProcessor loads it with torchvision
    assert {"image_processor", "feature_extractor", "video_processor"} <= processor.keys()
    card = (omni_dir / "README.md").read_text()
    assert "Random weights, not a trained model" in card and "Qwen3OmniMoeForConditionalGeneration" in card


def test_build_is_byte_identical_and_seeded(omni_dir, tmp_path):
    torch.manual_seed(1234)  # the build must not depend on the global RNG
    again = tiny_model_dir("qwen3-omni", cache_dir=tmp_path)
    assert again.name == omni_dir.name
    for name in BUILD_FILES:
        assert (again / name).read_bytes() == (omni_dir / name).read_bytes(), name
    other = tiny_model_dir("qwen3-omni", seed=1, cache_dir=tmp_path)
    assert other.name != omni_dir.name
    assert (other / "model.safetensors").read_bytes() != (omni_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (omni_dir / "tokenizer.json").read_bytes()


def test_full_model_has_every_part(full, omni_dir):
    model, processor = full
    assert type(model).__name__ == "Qwen3OmniMoeForConditionalGeneration" and not model.training
    assert model.dtype == torch.float32
    thinker = model.thinker.model
    for part in (thinker.audio_tower, thinker.visual, thinker.language_model, model.talker, model.code2wav):
        assert parameter_count(part) > 0
    assert parameter_count(model.talker.code_predictor) > 0
    experts = thinker.language_model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4  # MoE: 4 fused experts
    card = (omni_dir / "README.md").read_text()
    assert f"Parameters: {parameter_count(model)} in all" in card
    assert type(processor).__name__ in ("OmniProcessor", "Qwen3OmniMoeProcessor")


def test_processor_expands_image_and_audio_placeholders(full):
    _, processor = full
    tok = processor.tokenizer
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>Hi<|im_end|>\n"
    enc = processor(text=[text], images=[_image()], audio=[_tone(1.0)], return_tensors="pt")
    ids = enc["input_ids"][0]
    t, h, w = enc["image_grid_thw"][0].tolist()
    assert (t, h, w) == (1, 4, 4)  # 64 px / patch 16
    assert (ids == tok.image_token_id).sum() == t * h * w // 4  # 2x2 merge
    assert (ids == tok.audio_token_id).sum() == 13  # 1 s = 100 mel frames -> 13 tokens
    assert enc["input_features"].shape == (1, 128, 100)
    text_only = processor(text=["What is 2 + 3?"], return_tensors="pt")
    assert text_only["input_ids"].shape[0] == 1 and "pixel_values" not in text_only


def test_chat_template_renders_media_parts(full):
    _, processor = full
    messages = media_messages(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image><audio>Which one?"}]
    )
    assert messages[1]["content"] == [
        {"type": "image"},
        {"type": "audio"},
        {"type": "text", "text": "Which one?"},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>"
        "Which one?<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = processor.tokenizer
    assert tok.decode(tok(text)["input_ids"]) == text


def test_decode_wav_resamples_to_16k():
    rate, seconds = 8000, 0.5
    pcm = (np.sin(2 * np.pi * 200 * np.arange(int(rate * seconds)) / rate) * 16000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
    samples = decode_wav(buf.getvalue())
    assert samples.dtype == np.float32 and len(samples) == 8000
    assert 0.45 < np.abs(samples).max() <= 0.5
