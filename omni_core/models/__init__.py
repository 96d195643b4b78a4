"""Models: the factory (`load_model`), built-in tiny models, adapters, LoRA and log-prob helpers.

The names below load lazily (PEP 562), so importing a light submodule (the adapters' registry, which
the config's model-kind table reads) costs no torch."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "CausalLMAdapter": "adapters", "OmniModelBase": "adapters", "Qwen3OmniAdapter": "adapters",
    "Qwen3OmniThinkerAdapter": "adapters", "SD3DiffusionAdapter": "adapters", "parameter_count": "adapters",
    "resolve_adapter": "adapters",
    "PromptEmbeds": "diffusion", "SD3Model": "diffusion", "load_sd3": "diffusion",
    "ACCEPTED_FORMS": "factory", "load_model": "factory", "model_architecture": "factory",
    "response_logits": "logprobs", "sequence_logprobs": "logprobs", "takes_logits_to_keep": "logprobs",
    "token_logprobs": "logprobs",
    "LoraSpec": "lora", "apply_lora": "lora", "lora_state_dict": "lora", "trainable_parameter_count": "lora",
    "cache_root": "tiny", "tiny_model_dir": "tiny", "tiny_model_names": "tiny",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"omni_core.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'omni_core.models' has no attribute {name!r}")
