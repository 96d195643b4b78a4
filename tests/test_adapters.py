"""Adapters (OmniModelBase registry), the Qwen3-Omni thinker adapter, LoRA for every adapter, S3 loading."""

from __future__ import annotations

import io
import wave
from typing import ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.errors import ModelError
from omni_core.models import (
    CausalLMAdapter,
    OmniModelBase,
    Qwen3OmniAdapter,
    Qwen3OmniThinkerAdapter,
    SD3DiffusionAdapter,
    load_model,
    lora_state_dict,
    parameter_count,
    tiny_model_dir,
    trainable_parameter_count,
)
from omni_core.models.media import decode_wav, media_messages

OMNI = "Qwen3OmniMoeForConditionalGeneration"


@pytest.fixture(scope="module")
def load(model_cache):
    def _load(uri: str, **kwargs):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OMNI_CACHE_DIR", str(model_cache))
            return load_model(uri, **kwargs)

    return _load


@pytest.fixture(scope="module")
def full(load):
    return load("tiny://qwen3-omni")


@pytest.fixture(scope="module")
def thinker(load):
    return load("tiny://qwen3-omni", adapter="qwen3_omni_thinker")


# ---- an AVQA-style row, made here: PNG image from PIL, WAV audio from numpy ----------------------


def _png() -> bytes:
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    pixels[16:48, 16:48] = (220, 60, 60)  # a red square on black
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _wav(seconds: float = 1.0, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.4 * np.sin(2 * np.pi * 330 * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
    return out.getvalue()


AVQA_ROW = {
    "data_source": "avqa_r1_6k",
    "prompt": [
        {
            "role": "system",
            "content": "Think inside <think></think>, then give one option letter inside <answer></answer>.",
        },
        {
            "role": "user",
            "content": "<image><audio>What is the main source of the sound?\nOptions:\nA. dog\nB. car\nC. piano\nD. bird",
        },
    ],
    "images": [{"bytes": _png()}],
    "audios": [{"bytes": _wav()}],
    "reward_model": {"style": "rule", "ground_truth": "<answer>A</answer>"},
}


def _avqa_inputs(processor):
    text = processor.apply_chat_template(
        media_messages(AVQA_ROW["prompt"]), add_generation_prompt=True, tokenize=False
    )
    images = [Image.open(io.BytesIO(m["bytes"])).convert("RGB") for m in AVQA_ROW["images"]]
    audio = [decode_wav(m["bytes"]) for m in AVQA_ROW["audios"]]
    return processor(text=[text], images=images, audio=audio, return_tensors="pt")


# ---- registry ------------------------------------------------------------------------------------


def test_registry_keys_names_and_patterns():
    assert OmniModelBase.get_class(OMNI, "thinker") is Qwen3OmniThinkerAdapter
    assert OmniModelBase.get_class(OMNI) is Qwen3OmniAdapter  # stage "all" by default
    assert OmniModelBase.get_class("Qwen3ForCausalLM") is CausalLMAdapter  # via "*ForCausalLM"
    assert OmniModelBase.get_class("LlamaForCausalLM") is CausalLMAdapter
    assert OmniModelBase.get_class("SD3Transformer2DModel") is SD3DiffusionAdapter
    assert OmniModelBase.by_name("qwen3_omni_thinker") is Qwen3OmniThinkerAdapter
    assert (Qwen3OmniThinkerAdapter.architecture, Qwen3OmniThinkerAdapter.stage) == (OMNI, "thinker")
    with pytest.raises(ModelError, match="no adapter for architecture 'Qwen3ForCausalLM' and stage 'talker'"):
        OmniModelBase.get_class("Qwen3ForCausalLM", "talker")
    with pytest.raises(ModelError, match="known adapters: .*qwen3_omni_thinker"):
        OmniModelBase.by_name("nope")


def test_register_a_new_adapter():
    @OmniModelBase.register("ToyForCausalLM", "talker", name="toy_talker")
    class ToyTalker(CausalLMAdapter):
        lora_targets: ClassVar[list[str] | str] = ["q_proj"]

    try:
        assert OmniModelBase.get_class("ToyForCausalLM", "talker") is ToyTalker
        assert OmniModelBase.by_name("toy_talker") is ToyTalker
        with pytest.raises(ValueError, match="already registered"):
            OmniModelBase.register("OtherForCausalLM", "all", name="toy_talker")(
                type("X", (CausalLMAdapter,), {})
            )
    finally:
        del OmniModelBase._registry[("ToyForCausalLM", "talker")]


def test_adapter_must_fit_the_model(load):
    with pytest.raises(
        ModelError, match="adapter 'qwen3_omni_thinker' is for Qwen3OmniMoeForConditionalGeneration"
    ):
        load("tiny://lm", adapter="qwen3_omni_thinker")
    with pytest.raises(ModelError, match="trains stage 'thinker', not 'all'"):
        load("tiny://qwen3-omni", adapter="qwen3_omni_thinker", stage="all")


# ---- Qwen3OmniThinkerAdapter -----------------------------------------------------------------------


def test_thinker_adapter_strips_talker_code2wav_and_code_predictor(full, thinker):
    full_model, _ = full
    model, _ = thinker
    stripped = parameter_count(full_model.talker) + parameter_count(full_model.code2wav)
    assert parameter_count(full_model.talker.code_predictor) > 0  # inside the talker, stripped with it
    assert stripped > 0
    assert parameter_count(model) == parameter_count(full_model) - stripped
    assert parameter_count(model) == parameter_count(full_model.thinker)
    for gone in Qwen3OmniThinkerAdapter.get_strip_modules():
        assert not hasattr(model, gone)
    assert not any(
        n.startswith(("talker.", "code2wav.")) or ".code_predictor." in n for n, _ in model.named_parameters()
    )
    assert all(n.startswith("thinker.") for n, _ in model.named_parameters())  # checkpoint names kept
    assert model.has_talker is False and model.config.enable_audio_output is False
    assert model.get_input_embeddings() is model.thinker.get_input_embeddings()


def test_thinker_forward_and_generate_on_an_avqa_row(thinker):
    model, processor = thinker
    enc = _avqa_inputs(processor)
    assert (enc["input_ids"] == processor.tokenizer.image_token_id).sum() == 4
    assert (enc["input_ids"] == processor.tokenizer.audio_token_id).sum() == 13
    with torch.no_grad():
        out = model(**enc)
        direct = model.thinker(**enc)
    vocab = model.thinker.config.text_config.vocab_size
    assert out.logits.shape == (1, enc["input_ids"].shape[1], vocab)
    assert torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.logits, direct.logits)  # forward is routed to the thinker
    # the image and audio reach the model: other media, other logits
    other = dict(enc)
    other["input_features"] = torch.zeros_like(enc["input_features"])
    with torch.no_grad():
        assert not torch.allclose(model(**other).logits, out.logits)
    generated = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, enc["input_ids"].shape[1] + 4)
    assert torch.equal(generated[:, : enc["input_ids"].shape[1]], enc["input_ids"])
    again = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, again)
    assert isinstance(processor.batch_decode(generated[:, enc["input_ids"].shape[1] :])[0], str)


def test_thinker_full_finetuning_trains_the_text_decoder_only(thinker):
    model, _ = thinker
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {
        n
        for n, _ in model.named_parameters()
        if n.startswith(("thinker.model.language_model.", "thinker.lm_head."))
    }
    assert trainable == expected
    assert not any("audio_tower" in n or "visual" in n for n in trainable)


def _attention_lora_count(text_config, rank: int) -> int:
    """r * (in + out) for q, k, v, o of every decoder layer, from the config alone."""
    hidden, heads, kv = (
        text_config.hidden_size,
        text_config.num_attention_heads,
        text_config.num_key_value_heads,
    )
    head_dim = getattr(text_config, "head_dim", None) or hidden // heads
    q, k = heads * head_dim, kv * head_dim
    per_layer = (hidden + q) + (hidden + k) + (hidden + k) + (q + hidden)
    return rank * per_layer * text_config.num_hidden_layers


def test_thinker_lora_leaves_only_adapter_weights_trainable(load, thinker):
    base, processor = thinker
    rank = 4
    model, _ = load(
        "tiny://qwen3-omni", adapter="qwen3_omni_thinker", lora={"rank": rank, "alpha": 8, "dropout": 0.0}
    )
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    text_config = base.thinker.config.text_config
    assert sum(p.numel() for p in trainable.values()) == _attention_lora_count(text_config, rank) == 3584
    assert trainable_parameter_count(model) == 3584
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(".language_model.layers." in n and ".self_attn." in n for n in trainable)  # not the towers
    assert parameter_count(model) == parameter_count(base) + 3584
    # LoRA B starts at 0: same outputs as the base model; a backward pass reaches only the adapters
    enc = _avqa_inputs(processor)
    with torch.no_grad():
        torch.testing.assert_close(model(**enc).logits, base(**enc).logits)
    model(**enc).logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n not in trainable)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert set(lora_state_dict(model)) and all("lora_" in k for k in lora_state_dict(model))
    assert sum(t.numel() for t in lora_state_dict(model).values()) == 3584
    generated = model.generate(**enc, max_new_tokens=2, do_sample=False)
    assert generated.shape[1] == enc["input_ids"].shape[1] + 2


# ---- LoRA for the other adapters ----------------------------------------------------------------


def test_causal_lm_lora_count(load):
    rank = 2
    model, tok = load("tiny://lm", adapter="causal_lm", lora={"rank": rank, "alpha": 4})
    cfg = model.get_base_model().config
    attention = _attention_lora_count(cfg, rank)
    mlp = rank * 3 * (cfg.hidden_size + cfg.intermediate_size) * cfg.num_hidden_layers  # gate, up, down
    assert trainable_parameter_count(model) == attention + mlp == 4096
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    assert tok.eos_token == "<|im_end|>"


def test_causal_lm_lora_custom_targets_and_bad_settings(load):
    model, _ = load("tiny://lm", lora={"rank": 3, "target_modules": ["q_proj"]})
    cfg = model.get_base_model().config
    assert trainable_parameter_count(model) == 3 * (cfg.hidden_size + 64) * cfg.num_hidden_layers
    with pytest.raises(ModelError, match=r"lora\.rnk: Extra inputs are not permitted"):
        load("tiny://lm", lora={"rnk": 8})
    with pytest.raises(ModelError, match=r"lora\.rank: Input should be greater than 0"):
        load("tiny://lm", lora={"rank": 0})
    with pytest.raises(ModelError, match="match no"):
        load("tiny://lm", lora={"target_modules": r"nothing\.here"})


def test_sd3_lora_count_and_frozen_text_encoder(load):
    rank = 4
    model, _ = load("tiny://sd3", lora={"rank": rank, "alpha": 4})
    cfg = model.transformer.get_base_model().config
    dim = cfg.num_attention_heads * cfg.attention_head_dim
    # every joint block: to_q, to_k, to_v, to_out.0, add_q_proj, add_k_proj, add_v_proj (dim -> dim);
    # to_add_out in all but the last block (its context stream ends there)
    modules = 7 * cfg.num_layers + (cfg.num_layers - 1)
    assert trainable_parameter_count(model.transformer) == rank * 2 * dim * modules == 3840
    assert trainable_parameter_count(model.text_encoder) == 0
    plain, _ = load("tiny://sd3")
    assert trainable_parameter_count(plain.transformer) == parameter_count(plain.transformer)
    assert trainable_parameter_count(plain.text_encoder) == 0


# ---- sources ---------------------------------------------------------------------------------------


def test_load_from_an_s3_prefix(s3_env, s3_bucket, model_cache, monkeypatch, tmp_path):
    from omni_core.storage import Store

    lm_dir = tiny_model_dir("lm", cache_dir=model_cache)
    store = Store(f"s3://{s3_bucket}/models/lm")
    for path in sorted(lm_dir.iterdir()):
        store.write_bytes(path.name, path.read_bytes())
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
    model, tok = load_model(f"s3://{s3_bucket}/models/lm", lora={"rank": 2})
    assert type(model.get_base_model()).__name__ == "Qwen3ForCausalLM" and tok.eos_token == "<|im_end|>"
    (downloaded,) = (tmp_path / "cache" / "models" / "s3").iterdir()
    assert (downloaded / "model.safetensors").read_bytes() == (lm_dir / "model.safetensors").read_bytes()
    with pytest.raises(ModelError, match="no objects under it"):
        load_model(f"s3://{s3_bucket}/models/none")
