"""Rows with images and audio as model inputs, shared by the rollout engines, the RL step and
preference training (here in `models/` so that rollout does not depend on training).

A verl row's `prompt` holds `<image>`/`<audio>` markers and its `images`/`audios` columns the bytes
(the verl dataset schema in docs/reference/formats.md). With a multimodal processor (Qwen3-Omni's) the markers become the model's
media tokens and the bytes become processor tensors; with a plain tokenizer the markers are dropped.

The RL step keeps each prompt's media tensors apart (`encode_media_prompts`), so a rollout batch can
repeat, reorder and slice its rows and re-collate their media for every forward (`collate_media`):
the processor concatenates media over all images/audio clips of a batch, not per row.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from omni_core.errors import ModelError
from omni_core.models.media import MEDIA_MARKER, MEDIA_TOKEN_ATTRS, decode_wav, media_messages

Row = Mapping[str, Any]


def tokenizer_of(text_io: Any) -> Any:
    """The tokenizer of a processor, or `text_io` itself when it is a tokenizer."""
    return getattr(text_io, "tokenizer", text_io)


def is_processor(text_io: Any) -> bool:
    """True for a multimodal processor (it wraps a tokenizer), False for a tokenizer."""
    return tokenizer_of(text_io) is not text_io


def prompt_messages(row: Row, multimodal: bool) -> list[dict[str, Any]]:
    """Chat messages of the row's prompt: typed media parts for a processor, markers dropped otherwise."""
    messages = [dict(m) for m in row["prompt"]]
    if multimodal:
        return media_messages(messages)
    return [{**m, "content": MEDIA_MARKER.sub("", m["content"])} for m in messages]


def row_media(rows: Sequence[Row]) -> dict[str, list[Any]]:
    """The rows' images (PIL, RGB) and audio (16 kHz float arrays), in row order, as processor keyword
    arguments (absent when there are none); videos are refused."""
    from PIL import Image

    images, audio = [], []
    for row in rows:
        if row.get("videos"):
            raise ModelError("video inputs are not supported by the native trainers (no video decoder here); "
                             "give video weight 0 in modality_weights, drop the video rows, or train text-only "
                             "on a tokenizer")
        try:
            images += [Image.open(io.BytesIO(m["bytes"])).convert("RGB") for m in row.get("images") or []]
        except Image.DecompressionBombError as exc:  # PIL's hard limit; a dataset's own limits are checked
            # where rows are loaded (omni_core.media_limits.check_rows)
            raise ModelError(f"an image of the batch is too large to decode ({exc}); drop the row or re-ingest "
                             "its dataset (ingest quarantines images over max_image_pixels)") from None
        audio += [decode_wav(m["bytes"]) for m in row.get("audios") or []]
    return {k: v for k, v in (("images", images), ("audio", audio)) if v}


def media_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokenizer's media tokens (placeholders and their start/end markers; Qwen3-Omni's
    attribute names), those it has."""
    ids = []
    for attr in MEDIA_TOKEN_ATTRS:
        token = getattr(tokenizer, attr, None)
        if isinstance(token, str):
            ids.append(tokenizer.convert_tokens_to_ids(token))
    return sorted({i for i in ids if i is not None and i != tokenizer.unk_token_id})


def encode_media_prompts(processor: Any, rows: Sequence[Row], max_prompt_tokens: int,
                         ) -> tuple[list[list[int]], list[dict[str, Tensor]]]:
    """Each row's chat-template prompt (with the generation prompt) through `processor` with the row's
    own images and audio: (token ids with the media tokens expanded, media tensors) per row.

    The media tensors of a row are the processor's outputs other than the ids and attention mask
    (`pixel_values`, `image_grid_thw`, `input_features`, `feature_attention_mask`, ...); a text-only
    row has none. Longer prompts keep their last `max_prompt_tokens` tokens, as `encode_prompts` does,
    unless that would cut media tokens: then a `ModelError` (as verl's `truncation: error`).
    """
    media_ids = torch.tensor(media_token_ids(tokenizer_of(processor)), dtype=torch.long)
    prompt_ids, media = [], []
    for index, row in enumerate(rows):
        text = processor.apply_chat_template(prompt_messages(row, True), add_generation_prompt=True, tokenize=False)
        try:
            encoded = processor(text=[text], return_tensors="pt", **row_media([row]))
        except ValueError as exc:  # e.g. an `<image>` marker without an image
            raise ModelError(f"row {index} of the batch: its prompt and media do not match: {exc}") from exc
        ids = encoded["input_ids"][0]
        kept = ids[-max_prompt_tokens:]
        if torch.isin(ids, media_ids).sum() != torch.isin(kept, media_ids).sum():
            raise ModelError(f"row {index} of the batch: its prompt has {len(ids)} tokens with its media, more than "
                             f"max_prompt_tokens={max_prompt_tokens}, and cutting it would cut the media; raise "
                             "trainer.max_prompt_tokens")
        prompt_ids.append(kept.tolist())
        media.append({k: v for k, v in encoded.items() if k not in ("input_ids", "attention_mask")})
    return prompt_ids, media


def collate_media(media: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One forward's media arguments from per-row media (in row order): each tensor's first dimension
    counts media items (image patches, images, audio clips) and rows' tensors are concatenated on it.
    Trailing dimensions that differ (audio frames) are zero-padded to the longest, and the padding is
    0 in `feature_attention_mask`, which the audio encoder uses to drop it. {} for text-only rows."""
    out: dict[str, Tensor] = {}
    for key in dict.fromkeys(k for m in media for k in m):
        parts = [m[key] for m in media if key in m]
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = []
        for p in parts:
            pad: list[int] = []
            for d in reversed(range(1, p.dim())):
                pad += [0, shape[d - 1] - p.shape[d]]
            padded.append(torch.nn.functional.pad(p, pad) if any(pad) else p)
        out[key] = torch.cat(padded)
    return out
