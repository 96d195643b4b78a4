"""OCR reward for text-to-image (data_source "flow_grpo/ocr"; docs/reference/datasets.md#ocr-prompts).

The image (`solution_str`, or VeRL-Omni's `solution_image`; any form `images.to_pil` accepts) is
transcribed by tesseract. Both the transcription and the target (the ground truth) are lowercased
with all whitespace removed; `dist = 0` if the target is a substring of the transcription, else
their Levenshtein distance capped at len(target); `reward = 1 - dist / len(target)`. A failure on
the sample (an unreadable image, a tesseract error or timeout, an empty target) scores 0.0; a
machine without tesseract or its language data raises ConfigError instead of scoring every sample 0.

All whitespace goes, not only spaces as in flow_grpo: tesseract ends lines with "\\n" where PaddleOCR
(flow_grpo's engine) joins them with "" (VeRL-Omni strips `\\s+` as well).

Tesseract (Debian packages tesseract-ocr, tesseract-ocr-eng) runs as a subprocess on the PNG bytes,
with OMP_THREAD_LIMIT=1 so that parallel calls (`score_batch`) do not oversubscribe the CPUs with
OpenMP threads (pytesseract can set neither, and writes temporary files).
"""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
from typing import Any

from rapidfuzz.distance import Levenshtein

from omni_core.errors import ConfigError
from omni_core.rewards.images import image_argument, to_pil
from omni_core.rewards.registry import register_reward

log = logging.getLogger(__name__)
OCR_TIMEOUT_S = 30.0
INSTALL_HINT = "apt-get install tesseract-ocr tesseract-ocr-eng (make setup)"
_SPACE = re.compile(r"\s+")


def normalize(text: str) -> str:
    """Lowercase, all whitespace removed."""
    return _SPACE.sub("", text).lower()


def transcribe(image: Any, lang: str = "eng", psm: int = 3, timeout: float = OCR_TIMEOUT_S) -> str:
    """Tesseract's transcription of `image` (page segmentation mode `psm`, 3 = automatic)."""
    png = io.BytesIO()
    to_pil(image).save(png, format="PNG")
    try:
        done = subprocess.run(
            ["tesseract", "stdin", "stdout", "-l", lang, "--psm", str(psm)],
            input=png.getvalue(), capture_output=True, timeout=timeout, check=True,
            env={**os.environ, "OMP_THREAD_LIMIT": "1"},
        )
    except FileNotFoundError:
        raise ConfigError(f"the OCR reward needs tesseract: {INSTALL_HINT}") from None
    except subprocess.CalledProcessError as exc:
        if b"Failed loading language" in exc.stderr:
            raise ConfigError(f"tesseract has no language data {lang!r}: {INSTALL_HINT}") from None
        raise
    return done.stdout.decode("utf-8", errors="replace")


def ocr_similarity(transcription: str, target: str) -> float:
    """`1 - dist/len(target)`: dist 0 if the target is in the transcription, else capped Levenshtein."""
    text, goal = normalize(transcription), normalize(target)
    if not goal:
        raise ValueError("empty OCR target")
    dist = 0 if goal in text else min(Levenshtein.distance(text, goal), len(goal))
    return 1.0 - dist / len(goal)


@register_reward("ocr", data_sources=["flow_grpo/ocr"])
def compute_score(
    data_source: str,
    solution_str: Any = None,
    ground_truth: str = "",
    extra_info: dict[str, Any] | None = None,
    *,
    solution_image: Any = None,
    lang: str = "eng",
    psm: int = 3,
    timeout: float = OCR_TIMEOUT_S,
    **kwargs: Any,
) -> dict[str, Any]:
    """{"score", "ocr_text"}: the OCR similarity of the image's text to `ground_truth`; 0.0 on failure."""
    try:
        text = transcribe(image_argument(solution_str, solution_image), lang=lang, psm=psm, timeout=timeout)
        return {"score": ocr_similarity(text, str(ground_truth)), "ocr_text": text.strip()}
    except ConfigError:
        raise
    except Exception as exc:  # the formula's rule: a failure scores 0
        log.warning("OCR reward failed, scoring 0: %r", exc)
        return {"score": 0.0, "ocr_text": ""}
