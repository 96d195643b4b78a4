"""A reward that costs real time, for bench/async.py: the response text is rendered to an image with
PIL and read back by tesseract through the project's OCR reward (`omni_core.rewards.ocr`), scored
against the ground truth as that reward scores an image (1 - capped Levenshtein / len(target)).

    reward: {name: "bench/slow_rewards.py:compute_score"}

One call is one tesseract process (about 0.1-0.3 s of CPU), so scoring a batch takes seconds, as an
OCR or model-judged reward does.
"""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageDraw, ImageFont

from omni_core.rewards.ocr import compute_score as ocr_compute_score

FONT_SIZE = 32
_FONT: Any = None


def render(text: str) -> Image.Image:
    """`text` in black on white, one line per line of text, large enough for tesseract."""
    global _FONT
    if _FONT is None:
        _FONT = ImageFont.load_default(size=FONT_SIZE)
    lines = text.splitlines() or [""]
    width = max(64, 24 + max(int(_FONT.getlength(line)) for line in lines))
    image = Image.new("RGB", (width, 24 + len(lines) * (FONT_SIZE + 8)), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((12, 12 + i * (FONT_SIZE + 8)), line, fill="black", font=_FONT)
    return image


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict[str, Any] | None = None,
                  **kwargs: Any) -> dict[str, Any]:
    """{"score", "ocr_text"}: the OCR reward of the rendered response against `ground_truth`."""
    return ocr_compute_score("flow_grpo/ocr", solution_str=render(solution_str), ground_truth=ground_truth,
                             psm=7)
