"""Models: the factory (`load_model`), built-in tiny models, and log-prob helpers."""

from omni_core.models.factory import ACCEPTED_FORMS, load_model
from omni_core.models.logprobs import sequence_logprobs, token_logprobs
from omni_core.models.tiny import cache_root, tiny_model_dir

__all__ = [
    "ACCEPTED_FORMS",
    "cache_root",
    "load_model",
    "sequence_logprobs",
    "tiny_model_dir",
    "token_logprobs",
]
