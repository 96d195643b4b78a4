"""Images for image rewards: for these, the `solution_str` argument is the generated image.

Accepted forms (`to_pil`):
- a PIL image;
- a uint8 array, numpy or anything with `.numpy()` (a torch tensor, moved to the CPU first), shaped
  HxW, HxWxC or CxHxW with C in {1, 3, 4} (CxHxW is VeRL-Omni's layout; an array whose last axis is
  not a channel count while its first is, is read as CxHxW); a leading batch axis of 1 is dropped;
- encoded image bytes (PNG, JPEG, ...).
VeRL-Omni passes the image by the keyword `solution_image`; image rewards accept that name too.
Anything else (float arrays included: their value range is ambiguous) raises ValueError.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

_CHANNELS = (1, 3, 4)


def _to_array(image: Any) -> np.ndarray:
    if hasattr(image, "detach"):  # torch.Tensor, without importing torch
        image = image.detach().cpu()
    if hasattr(image, "numpy") and not isinstance(image, np.ndarray):
        image = image.numpy()
    return np.asarray(image)


def to_pil(image: Any) -> Image.Image:
    """The image as an RGB PIL image (see the module docstring for what is accepted)."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, bytes | bytearray | memoryview):
        with Image.open(io.BytesIO(bytes(image))) as opened:
            return opened.convert("RGB")
    array = _to_array(image)
    if array.dtype != np.uint8:
        raise ValueError(f"an image array must be uint8, got {array.dtype}")
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 3 and array.shape[0] in _CHANNELS and array.shape[-1] not in _CHANNELS:
        array = array.transpose(1, 2, 0)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in _CHANNELS):
        raise ValueError(f"cannot read an image of shape {tuple(array.shape)}; expected HxW, HxWxC or CxHxW")
    return Image.fromarray(np.ascontiguousarray(array)).convert("RGB")


def image_argument(solution_str: Any, solution_image: Any) -> Any:
    """The image passed to an image reward: `solution_str`, or VeRL-Omni's `solution_image` keyword."""
    if solution_image is not None:
        return solution_image
    if solution_str is None:
        raise ValueError("no image: pass it as solution_str (or solution_image)")
    return solution_str
