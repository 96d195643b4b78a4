"""Loading Qwen3-Omni's processor with or without torchvision.

transformers' `Qwen3OmniMoeProcessor` always builds a video processor, and its video processor needs
torchvision, which the CPU environment does not install. `OmniProcessor` is the same class without
the video part: text, images (Qwen2-VL image processor, PIL backend) and audio (Whisper features)
go through the real class's code; `videos=` is not accepted. `load_omni_processor` returns the real
class where torchvision is installed (the GPU images) and `OmniProcessor` elsewhere.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3OmniMoeProcessor
from transformers.processing_utils import OmniModalProcessorMixin
from transformers.utils import is_torchvision_available

from omni_core.models.media import MEDIA_TOKEN_ATTRS


class OmniProcessor(Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` for text, images and audio, without a video processor."""

    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
        # ProcessorMixin takes its sub-processors from this signature: no `video_processor` here.
        OmniModalProcessorMixin.__init__(
            self, image_processor, feature_extractor, tokenizer, chat_template=chat_template
        )
        for attr in MEDIA_TOKEN_ATTRS:
            setattr(self, attr, getattr(tokenizer, attr))
        for kind in ("image", "audio", "video"):
            setattr(self, f"{kind}_token_id", getattr(tokenizer, f"{kind}_token_id"))

    @property
    def model_input_names(self) -> list[str]:
        names = (
            self.tokenizer.model_input_names
            + self.feature_extractor.model_input_names
            + self.image_processor.model_input_names
            + ["feature_attention_mask"]
        )
        return list(dict.fromkeys(names))


def load_omni_processor(path: str | Path, *, local_only: bool = True) -> Qwen3OmniMoeProcessor:
    """The processor saved at `path` (a directory or hub id): transformers' class with torchvision,
    `OmniProcessor` without it."""
    if is_torchvision_available():
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(path, local_files_only=local_only)
    return OmniProcessor.from_pretrained(path, local_files_only=local_only)
