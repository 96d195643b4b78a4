"""`tiny://sd3`: diffusers' SD3 transformer denoising 32x32 RGB images directly (pixel space, no VAE).

Components, each an ordinary `save_pretrained` folder, described by `omni_pipeline.json`:
- `transformer/`: `SD3Transformer2DModel` in SD3.5-medium style (joint attention blocks, RMS q/k
  norm, a dual-attention first block), 3 input and output channels, patch 2 (16x16 = 256 tokens);
- `scheduler/`: `FlowMatchEulerDiscreteScheduler` (shift 3.0, SD3's default);
- `text_encoder/`: transformers' `CLIPTextModelWithProjection` (hidden 32, 2 layers): SD3 takes its
  penultimate hidden states as the token conditioning and its projection as the pooled one;
- `tokenizer/`: a byte-level BPE trained locally, CLIP-style `<|startoftext|> ... <|endoftext|>`.

Load it with `omni_core.models.load_model("tiny://sd3")` or `omni_core.models.diffusion.load_sd3`.
Weights are random (`seeded_init_`); building again gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omni_core.models.diffusion import PIPELINE_FILE
from omni_core.models.tiny import (
    NOT_DOWNLOADED,
    byte_bpe_spec,
    byte_bpe_tokenizer,
    lm_corpus,
    model_card,
    seeded_init_,
)

RECIPE_VERSION = 1

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"  # also the pad token, as in CLIP

# Extra corpus lines in the style of text-to-image prompts (original text).
_PROMPT_CORPUS = [
    'A red sign on a brick wall that says "OPEN"',
    'A white coffee cup with the word "hello" written on it, on a wooden table',
    'A green street sign reading "Main Street" under a blue sky',
    "A photo of a cat sitting on a windowsill, soft light, high detail",
    "A watercolor painting of mountains and a lake at sunrise",
    'A poster with large black letters "SALE 50%" on a yellow background',
    "a dog, a bird, a tree, a house, a car, a flower, a book, a clock, a lamp",
]


def _tokenizer_corpus() -> list[str]:
    return [*lm_corpus(), *_PROMPT_CORPUS]


def recipe(seed: int) -> dict:
    """Everything that determines the build (its digest names the cache directory)."""
    return {
        "recipe_version": RECIPE_VERSION,
        "seed": seed,
        "space": "pixel",
        "sample_size": 32,
        "channels": 3,
        "max_text_length": 64,
        "tokenizer": byte_bpe_spec(_tokenizer_corpus(), [BOS_TOKEN, EOS_TOKEN]),
        "text_encoder": {
            "architecture": "CLIPTextModelWithProjection",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "projection_dim": 32,
        },
        "transformer": {
            "architecture": "SD3Transformer2DModel",
            "patch_size": 2,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "caption_projection_dim": 32,
            "dual_attention_layers": [0],
            "qk_norm": "rms_norm",
        },
        "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "num_train_timesteps": 1000},
        "init_std": 0.02,
    }


def build_tokenizer(recipe: dict):
    return byte_bpe_tokenizer(_tokenizer_corpus(), recipe["tokenizer"], wrap=(BOS_TOKEN, EOS_TOKEN),
                              bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, padding_side="right",
                              model_max_length=recipe["max_text_length"])


def _build_text_encoder(recipe: dict, tokenizer):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    spec = {k: v for k, v in recipe["text_encoder"].items() if k != "architecture"}
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=recipe["max_text_length"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,  # pooled output = first eos position
        pad_token_id=tokenizer.pad_token_id,
        **spec,
    )
    with torch.random.fork_rng(devices=[]):
        model = CLIPTextModelWithProjection(config).to(torch.float32)
    seeded_init_(model, recipe["seed"], recipe["init_std"])
    return model


def _build_transformer(recipe: dict, text_hidden: int, pooled_dim: int):
    from diffusers import SD3Transformer2DModel

    spec = {k: v for k, v in recipe["transformer"].items() if k != "architecture"}
    size, patch = recipe["sample_size"], spec["patch_size"]
    with torch.random.fork_rng(devices=[]):
        model = SD3Transformer2DModel(
            sample_size=size,
            in_channels=recipe["channels"],
            out_channels=recipe["channels"],
            joint_attention_dim=text_hidden,
            pooled_projection_dim=pooled_dim,
            pos_embed_max_size=size // patch,
            **{**spec, "dual_attention_layers": tuple(spec["dual_attention_layers"])},
        )  # float32 by default
    seeded_init_(model, recipe["seed"], recipe["init_std"])
    return model


def _model_card(name: str, recipe: dict, params: dict[str, int], vocab: int) -> str:
    t, te = recipe["transformer"], recipe["text_encoder"]
    size = recipe["sample_size"]
    tokens = (size // t["patch_size"]) ** 2
    intro = ("A toy text-to-image model built locally by `omni_core.models.tiny_sd3` for tests and CPU "
             "pipelines.\n**Random weights, not a trained model**: its images are noise until trained.")
    return model_card(name, intro, [
        f"**Pixel space**: the transformer denoises {size}x{size} RGB images in [-1, 1] directly; "
        "there is no VAE, so image rewards score the very pixels it produced.",
        f"Transformer: diffusers SD3Transformer2DModel, {t['num_layers']} joint blocks (dual attention "
        f"in {t['dual_attention_layers']}, q/k {t['qk_norm']}), {t['num_attention_heads']} heads x "
        f"{t['attention_head_dim']}, patch {t['patch_size']} ({tokens} image tokens), "
        f"{params['transformer']} parameters.",
        f"Scheduler: FlowMatchEulerDiscreteScheduler, shift {recipe['scheduler']['shift']}.",
        f"Text encoder: CLIPTextModelWithProjection (hidden {te['hidden_size']}, {te['num_hidden_layers']} "
        f"layers, projection {te['projection_dim']}), {params['text_encoder']} parameters; prompts padded "
        f"to {recipe['max_text_length']} tokens; byte-level BPE tokenizer, vocab {vocab}.",
        f"Seed {recipe['seed']}. {NOT_DOWNLOADED}",
    ], recipe)


def build(name: str, recipe: dict, out: Path) -> None:
    """Write the four component folders, `omni_pipeline.json` and a model card into `out`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    tokenizer = build_tokenizer(recipe)
    text_encoder = _build_text_encoder(recipe, tokenizer)
    te = recipe["text_encoder"]
    transformer = _build_transformer(recipe, te["hidden_size"], te["projection_dim"])
    sched = {k: v for k, v in recipe["scheduler"].items() if k != "class"}
    scheduler = FlowMatchEulerDiscreteScheduler(**sched)

    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    scheduler.save_pretrained(out / "scheduler")
    text_encoder.save_pretrained(out / "text_encoder", safe_serialization=True)
    tokenizer.save_pretrained(out / "tokenizer")
    pipeline = {
        "architecture": recipe["transformer"]["architecture"],
        "kind": "sd3",
        "space": recipe["space"],
        "sample_size": recipe["sample_size"],
        "channels": recipe["channels"],
        "max_text_length": recipe["max_text_length"],
        "components": {k: k for k in ("transformer", "scheduler", "text_encoder", "tokenizer")},
    }
    (out / PIPELINE_FILE).write_text(json.dumps(pipeline, indent=2, sort_keys=True) + "\n")
    params = {
        "transformer": sum(p.numel() for p in transformer.parameters()),
        "text_encoder": sum(p.numel() for p in text_encoder.parameters()),
    }
    (out / "README.md").write_text(_model_card(name, recipe, params, len(tokenizer)))
