"""Re-exports `omni_core.models.multimodal_inputs` (where the media-input helpers live, so that rollout
and training share them without rollout importing training)."""

from omni_core.models.multimodal_inputs import (
    MEDIA_MARKER,
    Row,
    collate_media,
    encode_media_prompts,
    is_processor,
    media_token_ids,
    prompt_messages,
    row_media,
    tokenizer_of,
)

__all__ = [
    "MEDIA_MARKER",
    "Row",
    "collate_media",
    "encode_media_prompts",
    "is_processor",
    "media_token_ids",
    "prompt_messages",
    "row_media",
    "tokenizer_of",
]
