"""Media validation: the in-place PNG chunk check catches what PIL's verify() catches."""

from __future__ import annotations

import random

import pytest
from PIL import Image

from omni_core.data.media import encode_image, image_problem


@pytest.fixture(scope="module")
def png() -> bytes:
    rng = random.Random(0)
    return encode_image(Image.frombytes("RGB", (96, 96), rng.randbytes(96 * 96 * 3)))


@pytest.mark.parametrize("as_view", [False, True])
def test_valid_png_passes_as_bytes_or_memoryview(png, as_view):
    assert image_problem(memoryview(png) if as_view else png) is None


def test_every_single_bit_flip_in_image_data_is_caught(png):
    rng = random.Random(1)
    for position in rng.sample(range(33, len(png) - 12), 40):  # past the header, inside the chunks
        flipped = bytearray(png)
        flipped[position] ^= 1 << rng.randrange(8)
        problem = image_problem(memoryview(bytes(flipped)))
        assert problem is not None and problem.startswith("undecodable image"), position


@pytest.mark.parametrize("cut", [8, 20, 40, 200, -13, -1])
def test_truncations_are_caught(png, cut):  # -1 cuts IEND's CRC, which PIL's verify() does not check
    data = png[:cut]
    assert image_problem(data) is not None and "truncated" in image_problem(data)


def test_missing_and_garbage_and_other_formats(png):
    assert image_problem(None) == "missing image" and image_problem(b"") == "missing image"
    assert image_problem(memoryview(b"garbage")) == "undecodable image: not a recognised image format"
    jpeg = encode_image(Image.open(__import__("io").BytesIO(png)).convert("RGB"), "JPEG")
    assert image_problem(memoryview(jpeg)) is None
    assert image_problem(jpeg[: len(jpeg) // 2]) is not None  # no checksums: fully decoded, so caught


def test_png_header_is_checked(png):
    import struct
    import zlib

    def with_ihdr(width: int, height: int, depth: int, color: int) -> bytes:
        body = b"IHDR" + struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
        return png[:8] + struct.pack(">I", 13) + body + struct.pack(">I", zlib.crc32(body)) + png[33:]

    assert image_problem(with_ihdr(96, 96, 8, 2)) is None  # the original header, rebuilt
    assert image_problem(with_ihdr(0, 96, 8, 2)) == "undecodable image: zero-sized"
    assert "bit depth" in image_problem(with_ihdr(96, 96, 4, 2))
    assert "IHDR" in image_problem(png[:8] + png[33:])  # header chunk missing
