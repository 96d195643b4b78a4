"""`tiny://qwen3-omni`: transformers' Qwen3-Omni-MoE at toy size, with a processor built offline.

The model is `Qwen3OmniMoeForConditionalGeneration` with every part of the real one: the thinker
(MoE text decoder with interleaved M-RoPE, vision tower with deepstack mergers, audio tower), the
talker (MoE, with its code predictor) and code2wav. Weights are random (`seeded_init_`), float32.

The processor is transformers' `Qwen3OmniMoeProcessor` (a Qwen2-VL image processor, the PIL
backend, and a Whisper feature extractor: 128 mel bins, 16 kHz) around a byte-level BPE tokenizer
trained on a fixed corpus, with Qwen3-Omni's multimodal special tokens. Without torchvision it is
built and loaded as `omni_processor.OmniProcessor` (the same class minus video); the saved
`processor_config.json` names the real class, so where torchvision is installed
`AutoProcessor.from_pretrained` loads the directory as is.

Tiny-size care (the real config's defaults do not shrink on their own):
- M-RoPE: `mrope_section` must sum to head_dim / 2 (16 / 2 = 8 here: [4, 2, 2]; real [24, 20, 20]).
- Experts: 4 experts, top-2 (real 128, top-8); all decoder layers are MoE, as in the real model.
- The thinker config needs `vision_start_token_id` (read by `get_rope_index`, absent from the class);
  the talker config needs `shared_expert_intermediate_size` and `spatial_merge_size`.
- `deepstack_visual_indexes` must name vision layers, and there must be no more of them than text
  layers; `num_position_embeddings` must be a perfect square; the talker's `accept_hidden_layer`
  must be a thinker layer; code2wav's `num_quantizers` equals the talker's `num_code_groups`.
- transformers logs "Unrecognized keys in `rope_parameters`" for the talker's M-RoPE keys on every
  build and load; the real checkpoint's config does the same. It is harmless.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from omni_core.models.tiny import (
    NOT_DOWNLOADED,
    byte_bpe_spec,
    byte_bpe_tokenizer,
    lm_corpus,
    model_card,
    seeded_init_,
    toy_model_intro,
)

RECIPE_VERSION = 1

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# Qwen3-Omni's names for its multimodal tokens (tokenizer attribute -> token).
MEDIA_TOKENS = {
    "image_token": "<|image_pad|>",
    "audio_token": "<|audio_pad|>",
    "video_token": "<|video_pad|>",
    "vision_bos_token": "<|vision_start|>",
    "vision_eos_token": "<|vision_end|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
TTS_TOKENS = ["<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *MEDIA_TOKENS.values(), *TTS_TOKENS]

# ChatML; list content renders each part, media parts as Qwen3-Omni's placeholder spans.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'audio' %}{{- '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{%- elif part['type'] == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- else %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Extra corpus lines in the style of AVQA / Omni-Preference rows (original text).
_OMNI_CORPUS = [
    "Answer the question about the image and the audio. Think first inside <think></think>, then "
    "give one letter inside <answer></answer>.",
    "What is making the sound in the video? Options:\nA. a dog\nB. a car\nC. a piano\nD. a bird",
    "Which instrument is playing? Options:\nA. guitar\nB. violin\nC. drum\nD. flute",
    "<think>\nThe audio has a steady low engine noise and the image shows a road.\n</think>\n"
    "<answer>B</answer>",
    "Where is the sound coming from? Is the speaker a man or a woman? How many people are talking?",
    "Listen to the audio and look at the picture. The person is singing, speaking, laughing or crying.",
]

_ROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2], "interleaved": True}


def _tokenizer_corpus() -> list[str]:
    return [*lm_corpus(), *_OMNI_CORPUS]


def recipe(seed: int) -> dict:
    """Everything that determines the build (its digest names the cache directory)."""
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "tokenizer": byte_bpe_spec(_tokenizer_corpus(), SPECIAL_TOKENS, media_tokens=MEDIA_TOKENS,
                                   chat_template=CHAT_TEMPLATE),
        "image_processor": {
            "class": "Qwen2VLImageProcessorPil",
            "patch_size": 16,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "min_pixels": 32 * 32,
            "max_pixels": 128 * 128,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        "feature_extractor": {
            "class": "WhisperFeatureExtractor",
            "feature_size": 128,
            "sampling_rate": 16000,
            "hop_length": 160,
            "chunk_length": 30,
            "n_fft": 400,
            "return_attention_mask": True,
        },
        "model": {
            "architecture": "Qwen3OmniMoeForConditionalGeneration",
            "dtype": "float32",
            "text": {
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "moe_intermediate_size": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "norm_topk_prob": True,
                "max_position_embeddings": 4096,
                "rope_parameters": _ROPE,
            },
            "vision": {
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "patch_size": 16,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [1],
            },
            "audio": {
                "num_mel_bins": 128,
                "encoder_layers": 2,
                "encoder_attention_heads": 2,
                "encoder_ffn_dim": 64,
                "d_model": 32,
                "downsample_hidden_size": 16,
                "n_window": 50,
                "n_window_infer": 800,
                "conv_chunksize": 500,
                "max_source_positions": 1500,
            },
            "position_id_per_seconds": 13,
            "talker": {
                "text": {
                    "vocab_size": 64,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "moe_intermediate_size": 16,
                    "shared_expert_intermediate_size": 32,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "rope_parameters": _ROPE,
                },
                "code_predictor": {
                    "vocab_size": 32,
                    "hidden_size": 32,
                    "intermediate_size": 64,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "num_key_value_heads": 1,
                    "head_dim": 16,
                },
                "num_code_groups": 4,
                "accept_hidden_layer": 1,
                "spatial_merge_size": 2,
                # codec ids live in the talker's own vocab (64)
                "codec_eos_token_id": 50,
                "codec_nothink_id": 51,
                "codec_think_bos_id": 52,
                "codec_think_eos_id": 53,
                "codec_pad_id": 54,
                "codec_bos_id": 55,
                "speaker_id": {"ethan": 56},
            },
            "code2wav": {
                "codebook_size": 32,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "num_hidden_layers": 1,
                "intermediate_size": 64,
                "sliding_window": 8,
                "num_quantizers": 4,
                "upsample_rates": [2, 2],
                "upsampling_ratios": [2, 2],
                "decoder_dim": 32,
                "max_position_embeddings": 512,
            },
        },
    }


def build_tokenizer(spec: dict, max_length: int):
    """Byte-level BPE with Qwen3-Omni's special tokens; `tokenizer.image_token` etc. name them."""
    return byte_bpe_tokenizer(_tokenizer_corpus(), spec, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                              extra_special_tokens=dict(spec["media_tokens"]), chat_template=spec["chat_template"],
                              padding_side="left", model_max_length=max_length)


def _single_token_id(tokenizer, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"tiny tokenizer splits {text!r} into {ids}; the corpus must make it one token")
    return ids[0]


def build_config(spec: dict, tokenizer):
    """The `Qwen3OmniMoeConfig`: the recipe's sizes plus the tokenizer's vocab and token ids."""
    from transformers import Qwen3OmniMoeConfig

    ids = {
        name.removesuffix("_token"): tokenizer.convert_tokens_to_ids(tok)
        for name, tok in MEDIA_TOKENS.items()
    }
    media = {
        "audio_token_id": ids["audio"],
        "image_token_id": ids["image"],
        "video_token_id": ids["video"],
        "audio_start_token_id": ids["audio_bos"],
        "vision_start_token_id": ids["vision_bos"],
    }
    text_hidden = spec["text"]["hidden_size"]
    role_ids = {r: _single_token_id(tokenizer, r) for r in ("system", "user", "assistant")}
    thinker = {
        "text_config": {
            **spec["text"],
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        "vision_config": {**spec["vision"], "out_hidden_size": text_hidden},
        "audio_config": {**spec["audio"], "output_dim": text_hidden},
        "position_id_per_seconds": spec["position_id_per_seconds"],
        "user_token_id": role_ids["user"],
        **media,
    }
    talker = spec["talker"]
    talker = {
        **{k: v for k, v in talker.items() if k not in ("text", "code_predictor")},
        "text_config": talker["text"],
        "code_predictor_config": {**talker["code_predictor"], "num_code_groups": talker["num_code_groups"]},
        "thinker_hidden_size": text_hidden,
        "position_id_per_seconds": spec["position_id_per_seconds"],
        **media,
    }
    tts = dict(
        zip(
            ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"),
            tokenizer.convert_tokens_to_ids(TTS_TOKENS),
            strict=True,
        )
    )
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=spec["code2wav"],
        im_start_token_id=tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        im_end_token_id=tokenizer.eos_token_id,
        system_token_id=role_ids["system"],
        user_token_id=role_ids["user"],
        assistant_token_id=role_ids["assistant"],
        dtype=spec["dtype"],
        **tts,
    )


def build_processor(recipe: dict, tokenizer) -> Any:
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = {k: v for k, v in recipe["image_processor"].items() if k != "class"}
    audio = {k: v for k, v in recipe["feature_extractor"].items() if k != "class"}
    from omni_core.models.omni_processor import OmniProcessor

    return OmniProcessor(
        image_processor=Qwen2VLImageProcessorPil(**image),
        feature_extractor=WhisperFeatureExtractor(**audio),
        tokenizer=tokenizer,
        chat_template=recipe["tokenizer"]["chat_template"],
    )


def _save_processor(processor, out: Path, recipe: dict) -> None:
    """Save, then name the real class (and its video processor) so AutoProcessor loads it too."""
    processor.save_pretrained(out)
    cfg_path = out / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    image = recipe["image_processor"]
    cfg["processor_class"] = "Qwen3OmniMoeProcessor"
    cfg["video_processor"] = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": image["patch_size"],
        "merge_size": image["merge_size"],
        "temporal_patch_size": image["temporal_patch_size"],
        "size": {"shortest_edge": image["min_pixels"], "longest_edge": image["max_pixels"]},
        "image_mean": image["image_mean"],
        "image_std": image["image_std"],
    }
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["processor_class"] = "Qwen3OmniMoeProcessor"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def _model_card(name: str, recipe: dict, params: dict[str, int], vocab: int) -> str:
    m = recipe["model"]
    t, v, a = m["text"], m["vision"], m["audio"]
    return model_card(name, toy_model_intro("omni_core.models.tiny_omni"), [
        f"Architecture: {m['architecture']} (transformers), {m['dtype']}, seed {recipe['seed']}.",
        f"Thinker text: hidden {t['hidden_size']}, {t['num_hidden_layers']} MoE layers, "
        f"{t['num_experts']} experts (top-{t['num_experts_per_tok']}), {t['num_attention_heads']} heads, "
        f"M-RoPE sections {t['rope_parameters']['mrope_section']} (interleaved).",
        f"Vision tower: {v['depth']} layers, hidden {v['hidden_size']}, patch {v['patch_size']}, "
        f"merge {v['spatial_merge_size']}, deepstack {v['deepstack_visual_indexes']}.",
        f"Audio tower: {a['encoder_layers']} layers, d_model {a['d_model']}, {a['num_mel_bins']} mel bins.",
        f"Parameters: {params['total']} in all; thinker {params['thinker']}, talker {params['talker']} "
        f"(code predictor {params['code_predictor']}), code2wav {params['code2wav']}.",
        f"Processor: Qwen3OmniMoeProcessor (Qwen2-VL image processor, PIL backend; Whisper feature "
        f"extractor, 16 kHz); byte-level BPE tokenizer, vocab {vocab}, with Qwen3-Omni's media tokens "
        f"{', '.join(f'`{t}`' for t in MEDIA_TOKENS.values())}; ChatML chat template.",
        NOT_DOWNLOADED,
    ], recipe)


def build(name: str, recipe: dict, out: Path) -> None:
    """Write the model, its generation config, the processor and a model card into `out`."""
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    spec = recipe["model"]
    tokenizer = build_tokenizer(recipe["tokenizer"], spec["text"]["max_position_embeddings"])
    config = build_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        model = Qwen3OmniMoeForConditionalGeneration(config).to(torch.float32)
    seeded_init_(model, recipe["seed"], config.thinker_config.initializer_range)
    ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out, safe_serialization=True)
    _save_processor(build_processor(recipe, tokenizer), out, recipe)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    params = {
        "total": count(model),
        "thinker": count(model.thinker),
        "talker": count(model.talker),
        "code_predictor": count(model.talker.code_predictor),
        "code2wav": count(model.code2wav),
    }
    (out / "README.md").write_text(_model_card(name, recipe, params, len(tokenizer)))
