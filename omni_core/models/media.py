"""Qwen3-Omni's media conventions without its processor: the tokenizer's media-token attributes,
verl-style `<image>`/`<audio>`/`<video>` markers as chat-template parts, and WAV bytes as the Whisper
feature extractor's input. Apart from `omni_processor`, whose transformers processor classes a
text-only trainer, rollout or eval process has no use for."""

from __future__ import annotations

import io
import re
import wave
from typing import Any

import numpy as np

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


MEDIA_MARKER = re.compile(r"<(image|audio|video)>")


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
        pieces = MEDIA_MARKER.split(content)  # text, kind, text, kind, ..., text
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
