"""Image rewards: JPEG compressibility, and the tesseract OCR reward on rendered text and on noise."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from omni_core.errors import ConfigError
from omni_core.rewards import jpeg as jpeg_reward
from omni_core.rewards import ocr as ocr_reward
from omni_core.rewards import score_batch
from omni_core.rewards.images import to_pil

FONT = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")  # Debian package fonts-dejavu-core
TARGETS = ["Hello World", "OPEN 24 HOURS", "omni posttrain", "Quantum Bakery 1987", "stop"]


def render(text: str, size: int = 40) -> Image.Image:
    """Black DejaVu Sans text on white, with a margin, as a text-to-image model should draw it."""
    font = ImageFont.truetype(str(FONT), size)
    left, top, right, bottom = font.getbbox(text)
    image = Image.new("RGB", (right - left + 2 * size, bottom - top + 2 * size), "white")
    ImageDraw.Draw(image).text((size - left, size - top), text, fill="black", font=font)
    return image


def noise(seed: int, size: int = 256) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


# ---- image forms --------------------------------------------------------------------------------


def test_to_pil_accepts_pil_arrays_and_bytes():
    hwc = noise(0, 8)
    png = io.BytesIO()
    Image.fromarray(hwc).save(png, format="PNG")
    for form in (Image.fromarray(hwc), hwc, hwc.transpose(2, 0, 1), hwc[None], png.getvalue()):
        assert np.array_equal(np.asarray(to_pil(form)), hwc)
    assert to_pil(hwc[..., 0]).mode == "RGB"  # grayscale HxW
    with pytest.raises(ValueError, match="uint8"):
        to_pil(hwc.astype(np.float32) / 255)
    with pytest.raises(ValueError, match="shape"):
        to_pil(np.zeros((2, 8, 8, 8), dtype=np.uint8))


# ---- JPEG compressibility -----------------------------------------------------------------------


def test_jpeg_compressibility_prefers_smooth_images():
    smooth = np.tile(np.linspace(0, 255, 128, dtype=np.uint8)[None, :, None], (128, 1, 3))
    rough = noise(1, 128)
    s_smooth = jpeg_reward.compute_score("jpeg_compressibility", smooth)
    s_rough = jpeg_reward.compute_score("jpeg_compressibility", rough)
    assert s_rough < s_smooth < 0
    assert s_rough == -jpeg_reward.jpeg_bytes(rough) / 1000 / 500  # the DDPO formula, quality 95
    assert jpeg_reward.jpeg_bytes(rough) > 5 * jpeg_reward.jpeg_bytes(smooth)
    # VeRL-Omni passes the image as solution_image, a CxHxW uint8 tensor-like
    assert jpeg_reward.compute_score(data_source="jpeg_compressibility", solution_image=rough.transpose(2, 0, 1),
                                     ground_truth="", extra_info={}) == s_rough


# ---- OCR ----------------------------------------------------------------------------------------


def test_ocr_similarity_formula():
    sim = ocr_reward.ocr_similarity
    assert sim("a sign: HELLO world!\n", "Hello World") == 1.0  # substring after lowercasing, no spaces
    assert sim("hello\nworld", "hello world") == 1.0  # every kind of whitespace goes
    assert sim("helo world", "hello world") == pytest.approx(1 - 1 / 10)  # Levenshtein 1 over 10 chars
    assert sim("", "stop") == 0.0
    assert sim("x" * 50, "stop") == 0.0  # the distance is capped at len(target)
    with pytest.raises(ValueError):
        sim("anything", "   ")


@pytest.fixture(scope="module")
def tesseract() -> None:
    if shutil.which("tesseract") is None:
        pytest.fail("the OCR reward needs tesseract: apt-get install tesseract-ocr tesseract-ocr-eng")
    if not FONT.is_file():
        pytest.fail(f"{FONT} is missing: apt-get install fonts-dejavu-core")


def test_ocr_reads_rendered_text_and_not_noise(tesseract):
    """The proof: >= 0.9 on images where PIL rendered the target, <= 0.2 on noise images."""
    rendered = [{"data_source": "flow_grpo/ocr", "solution_str": render(text), "ground_truth": text}
                for text in TARGETS]
    noisy = [{"data_source": "flow_grpo/ocr", "solution_str": noise(seed), "ground_truth": text}
             for seed, text in enumerate(TARGETS)]
    results = score_batch(rendered + noisy, workers=4)
    for item, result in zip(rendered, results[: len(TARGETS)], strict=True):
        assert result["score"] >= 0.9, (item["ground_truth"], result["ocr_text"])
    for item, result in zip(noisy, results[len(TARGETS):], strict=True):
        assert result["score"] <= 0.2, (item["ground_truth"], result["ocr_text"])


def test_ocr_image_forms_and_failures(tesseract):
    image = render("Hello World")
    png = io.BytesIO()
    image.save(png, format="PNG")
    for form in (np.asarray(image), png.getvalue()):
        assert ocr_reward.compute_score("flow_grpo/ocr", form, "hello world")["score"] >= 0.9
    assert ocr_reward.compute_score(data_source="flow_grpo/ocr", solution_image=np.asarray(image).transpose(2, 0, 1),
                                    ground_truth="Hello World", extra_info={})["score"] >= 0.9
    # any failure scores 0: undecodable bytes, a float array, an empty target, no image at all
    assert ocr_reward.compute_score("flow_grpo/ocr", b"not an image", "hello")["score"] == 0.0
    assert ocr_reward.compute_score("flow_grpo/ocr", np.zeros((8, 8, 3)), "hello")["score"] == 0.0
    assert ocr_reward.compute_score("flow_grpo/ocr", image, "")["score"] == 0.0
    assert ocr_reward.compute_score("flow_grpo/ocr", None, "hello")["score"] == 0.0


def test_ocr_without_tesseract_is_a_config_error(tesseract, monkeypatch):
    """Not a per-sample failure: scoring every sample 0 would train on nothing without a word."""
    image = render("stop")
    with pytest.raises(ConfigError, match="language data 'xyz'.*tesseract-ocr-eng"):
        ocr_reward.compute_score("flow_grpo/ocr", image, "stop", lang="xyz")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ConfigError, match="needs tesseract.*apt-get install tesseract-ocr"):
        ocr_reward.compute_score("flow_grpo/ocr", image, "stop")
