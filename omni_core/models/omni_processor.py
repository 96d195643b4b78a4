"""Loading Qwen3-Omni's processor with or without torchvision.

transformers' `Qwen3OmniMoeProcessor` always builds a video processor, and its video processor needs
torchvision, which the CPU environment does not install. `OmniProcessor` is the same class without
the video part: text, images (Qwen2-VL image processor, PIL backend) and audio (Whisper features)
go through the real class's code; `videos=` is not accepted. `load_omni_processor` returns the real
class where torchvision is installed (the GPU images) and `OmniProcessor` elsewhere.
"""

from __future__ import annotations

import io
import re
import wave
from pathlib import Path
from typing import Any

import numpy as np
from transformers import Qwen3OmniMoeProcessor
from transformers.processing_utils import OmniModalProcessorMixin
from transformers.utils import is_torchvision_available

# Qwen3-Omni's tokenizer attributes for its multimodal special tokens.
MEDIA_TOKEN_ATTRS = (
    "image_token",
    "audio_token",
    "video_token",
    "vision_bos_token",
    "vision_eos_token",
    "audio_bos_token",
    "audio_eos_token",
)


_MARKER = re.compile(r"<(image|audio|video)>")


def media_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """verl-style messages (string content with `<image>`, `<audio>`, `<video>` markers, as the
    dataset converters write them) -> chat-template messages whose content is a list of typed parts,
    in order: `{"type": "image"}`, `{"type": "audio"}`, `{"type": "text", "text": ...}`."""
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        pieces = _MARKER.split(content)  # text, kind, text, kind, ..., text
        for i, piece in enumerate(pieces):
            if i % 2:
                parts.append({"type": piece})
            elif piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    return out


def decode_wav(data: bytes, sampling_rate: int = 16_000) -> np.ndarray:
    """WAV bytes (PCM 8/16/32-bit, any channels and rate) -> mono float32 in [-1, 1] at
    `sampling_rate` (linear-interpolation resampling), what the Whisper feature extractor takes."""
    with wave.open(io.BytesIO(data), "rb") as wav:
        width, channels, rate = wav.getsampwidth(), wav.getnchannels(), wav.getframerate()
        frames = wav.readframes(wav.getnframes())
    if width == 1:
        samples = (np.frombuffer(frames, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width in (2, 4):
        dtype = np.int16 if width == 2 else np.int32
        samples = np.frombuffer(frames, dtype=dtype).astype(np.float32) / float(np.iinfo(dtype).max + 1)
    else:
        raise ValueError(f"unsupported WAV sample width: {width} bytes")
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != sampling_rate and len(samples) > 1:
        n = max(1, round(len(samples) * sampling_rate / rate))
        samples = np.interp(np.linspace(0, len(samples) - 1, n), np.arange(len(samples)), samples)
    return samples.astype(np.float32)


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
