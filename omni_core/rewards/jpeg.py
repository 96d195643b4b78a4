"""JPEG compressibility (DDPO; docs/reference/rewards.md): `-(JPEG bytes at quality 95)/1000/500`.

The image is `solution_str` (or VeRL-Omni's `solution_image`), any form `images.to_pil` accepts,
encoded as RGB. A smooth image compresses to fewer bytes, so it scores higher (closer to 0).
"""

from __future__ import annotations

import io
from typing import Any

from omni_core.rewards.images import image_argument, to_pil
from omni_core.rewards.registry import register_reward

JPEG_QUALITY = 95


def jpeg_bytes(image: Any, quality: int = JPEG_QUALITY) -> int:
    """Size in bytes of the image saved as JPEG at `quality`."""
    buffer = io.BytesIO()
    to_pil(image).save(buffer, format="JPEG", quality=quality)
    return buffer.tell()


@register_reward("jpeg_compressibility", data_sources=["jpeg_compressibility"])
def compute_score(
    data_source: str,
    solution_str: Any = None,
    ground_truth: Any = None,
    extra_info: dict[str, Any] | None = None,
    *,
    solution_image: Any = None,
    **kwargs: Any,
) -> float:
    """`-(JPEG bytes at quality 95) / 1000 / 500`; the ground truth is not used."""
    return -jpeg_bytes(image_argument(solution_str, solution_image)) / 1000 / 500
