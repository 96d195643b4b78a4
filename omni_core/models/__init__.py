"""Models: the factory (`load_model`), built-in tiny models, adapters, LoRA and log-prob helpers."""

from omni_core.models.adapters import (
    CausalLMAdapter,
    OmniModelBase,
    Qwen3OmniAdapter,
    Qwen3OmniThinkerAdapter,
    SD3DiffusionAdapter,
    parameter_count,
    resolve_adapter,
)
from omni_core.models.diffusion import PromptEmbeds, SD3Model, load_sd3
from omni_core.models.factory import ACCEPTED_FORMS, load_model, model_architecture
from omni_core.models.logprobs import sequence_logprobs, token_logprobs
from omni_core.models.lora import LoraSpec, apply_lora, lora_state_dict, trainable_parameter_count
from omni_core.models.tiny import cache_root, tiny_model_dir, tiny_model_names

__all__ = [
    "ACCEPTED_FORMS",
    "CausalLMAdapter",
    "LoraSpec",
    "OmniModelBase",
    "PromptEmbeds",
    "Qwen3OmniAdapter",
    "Qwen3OmniThinkerAdapter",
    "SD3DiffusionAdapter",
    "SD3Model",
    "apply_lora",
    "cache_root",
    "load_model",
    "load_sd3",
    "lora_state_dict",
    "model_architecture",
    "parameter_count",
    "resolve_adapter",
    "sequence_logprobs",
    "tiny_model_dir",
    "tiny_model_names",
    "token_logprobs",
    "trainable_parameter_count",
]
