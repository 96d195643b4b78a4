"""Media helpers shared by the multimodal converters and their fixture generators.

Validation returns a reason string (None when the bytes are usable) so converters can quarantine a
row with it. Drawing and tone helpers are deterministic: the same arguments give the same bytes.
"""

from __future__ import annotations

import io
import math
import random
import struct
import wave
import zlib

import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw, UnidentifiedImageError

from omni_core.data.schema import MEDIA_LIST
from omni_core.media_limits import PNG_SIGNATURE, MediaLimits

DEFAULT_LIMITS = MediaLimits()


def media_list(values: pa.ChunkedArray, keep: list[bool]) -> pa.ChunkedArray:
    """A MEDIA_LIST column with one `[{"bytes": value}]` per kept row of the binary `values`.

    Built on the binary arrays' own buffers (no copy of the media; a chunk with rejected rows is
    filtered, which copies that chunk once), so a batch's media never become Python objects.
    """
    out, start = [], 0
    for chunk in values.chunks:
        mask = keep[start:start + len(chunk)]
        start += len(chunk)
        if not all(mask):
            chunk = chunk.filter(pa.array(mask, pa.bool_()))
        if chunk.type != pa.binary():
            chunk = chunk.cast(pa.binary())
        items = pa.StructArray.from_arrays([chunk], fields=[MEDIA_LIST.value_type.field(0)])
        offsets = pa.array(np.arange(len(chunk) + 1, dtype=np.int32))
        out.append(pa.ListArray.from_arrays(offsets, items, type=MEDIA_LIST))
    return pa.chunked_array(out, type=MEDIA_LIST)


# ---- validation --------------------------------------------------------------------------------


def image_problem(data: bytes | memoryview | None, limits: MediaLimits = DEFAULT_LIMITS) -> str | None:
    """Why `data` is not a usable image, or None.

    First the size its header declares is held against `limits` (nothing decoded). Then a PNG has
    its header and every chunk's CRC checked (a truncated or bit-flipped file fails) without
    decoding pixels; other formats have no such checksums, so PIL fully decodes them.
    """
    if data is None or not len(data):
        return "missing image"
    if problem := limits.image_problem(data):
        return problem
    if bytes(data[:8]) == PNG_SIGNATURE:
        return png_problem(data)
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.width < 1 or img.height < 1:
                return "undecodable image: zero-sized"
            img.load()
    except UnidentifiedImageError:
        return "undecodable image: not a recognised image format"
    except Exception as exc:  # PIL raises many types for bad input
        return f"undecodable image: {exc.__class__.__name__}: {exc}"
    return None


# PNG colour type -> allowed bit depths (PNG specification, table 11.1)
_PNG_DEPTHS = {0: {1, 2, 4, 8, 16}, 2: {8, 16}, 3: {1, 2, 4, 8}, 4: {8, 16}, 6: {8, 16}}


def png_problem(data: bytes | memoryview) -> str | None:
    """Why the PNG in `data` is broken (bad IHDR, a CRC mismatch, a truncation, no IEND), or None.

    The checks PIL's `open` + `verify()` make, done on the buffer in place. PIL reads each chunk
    through Python file reads (a copy per chunk, four times the cost of the CRCs at ingest volumes),
    and its image objects sit in reference cycles: one not yet collected kept a whole borrowed
    Arrow batch alive, so memory grew with the input. `zlib.crc32` on memoryview slices copies
    nothing, keeps nothing, and releases the GIL.
    """
    view = memoryview(data)
    pos = len(PNG_SIGNATURE)
    while True:
        if pos + 8 > len(view):
            return "undecodable image: truncated PNG file" + (" (no IEND chunk)" if pos > 8 else "")
        (length,) = struct.unpack_from(">I", view, pos)
        end = pos + 8 + length
        if end + 4 > len(view):
            return "undecodable image: truncated PNG file"
        kind = bytes(view[pos + 4:pos + 8])
        if zlib.crc32(view[pos + 4:end]) != struct.unpack_from(">I", view, end)[0]:
            return f"undecodable image: broken PNG chunk {kind.decode('latin-1')} (CRC mismatch)"
        if pos == len(PNG_SIGNATURE):
            width, height, depth, color = struct.unpack_from(">IIBB", view, pos + 8) if length >= 10 else (0,) * 4
            if kind != b"IHDR" or length != 13:
                return "undecodable image: PNG does not start with an IHDR chunk"
            if width < 1 or height < 1:
                return "undecodable image: zero-sized"
            if depth not in _PNG_DEPTHS.get(color, set()):
                return f"undecodable image: PNG colour type {color} with bit depth {depth} is invalid"
        if kind == b"IEND":
            return None
        pos = end + 4


def wav_problem(data: bytes | None, limits: MediaLimits = DEFAULT_LIMITS) -> str | None:
    """Why `data` is not a readable WAV file or is longer than `limits` allow, or None (a truncated
    data chunk is a problem)."""
    if not data:
        return "missing audio"
    if problem := limits.audio_problem(data):
        return problem
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            channels, width, frames = wav.getnchannels(), wav.getsampwidth(), wav.getnframes()
            if wav.getframerate() < 1 or frames < 1:
                return "undecodable audio: WAV has no frames"
            if len(wav.readframes(frames)) != frames * channels * width:
                return "undecodable audio: WAV data is truncated"
    except (wave.Error, EOFError, struct.error) as exc:
        return f"undecodable audio: not a WAV file ({exc})"
    return None


def _iso_boxes(data: bytes) -> list[bytes] | None:
    """Top-level ISO-BMFF box types, or None when the box sizes do not tile the file exactly."""
    boxes, pos = [], 0
    while pos < len(data):
        if pos + 8 > len(data):
            return None
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if size == 1:  # 64-bit size follows
            if pos + 16 > len(data):
                return None
            size = struct.unpack(">Q", data[pos + 8:pos + 16])[0]
        elif size == 0:  # box runs to the end of the file
            size = len(data) - pos
        if size < 8 or pos + size > len(data):
            return None
        boxes.append(kind)
        pos += size
    return boxes


def video_problem(data: bytes | None, limits: MediaLimits = DEFAULT_LIMITS) -> str | None:
    """Why `data` is not a video container or is longer than `limits` allow, or None.

    No video decoder is a dependency, so this checks the container: an MP4/MOV must be a complete
    box structure starting with `ftyp` and holding a `moov` box; WebM/MKV and AVI by their magic.
    """
    if not data:
        return "missing video"
    if problem := limits.video_problem(data):
        return problem
    if data[4:8] == b"ftyp":
        boxes = _iso_boxes(data)
        if boxes is None:
            return "undecodable video: MP4 box structure is truncated"
        return None if b"moov" in boxes else "undecodable video: MP4 has no moov box"
    if data[:4] == b"\x1a\x45\xdf\xa3" or (data[:4] == b"RIFF" and data[8:12] == b"AVI "):
        return None
    return "undecodable video: not an MP4, MOV, WebM, MKV or AVI container"


def safe_join(base: str, rel: str) -> str | None:
    """`base/rel` as a normalised posix path, or None if `rel` is empty, absolute or escapes `base`."""
    rel = rel.replace("\\", "/").strip()
    if not rel or rel.startswith("/"):
        return None
    root = [p for p in base.split("/") if p not in ("", ".")]
    parts = list(root)
    for part in rel.split("/"):
        if part == "..":
            if len(parts) == len(root):
                return None
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts) if len(parts) > len(root) else None


# ---- fixture helpers -----------------------------------------------------------------------------

_COLORS = [(220, 60, 60), (60, 140, 220), (60, 180, 90), (240, 180, 40), (150, 80, 200), (40, 40, 40)]


def draw_scene(rng: random.Random, size: tuple[int, int], label: str) -> Image.Image:
    """A white canvas with a few random shapes and `label` written on it."""
    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    w, h = size
    for _ in range(rng.randrange(2, 5)):
        x0, y0 = rng.randrange(0, w // 2), rng.randrange(0, h // 2)
        box = (x0, y0, x0 + rng.randrange(8, w // 2), y0 + rng.randrange(8, h // 2))
        color = rng.choice(_COLORS)
        if rng.random() < 0.5:
            draw.ellipse(box, outline=color, width=2)
        else:
            draw.rectangle(box, outline=color, width=2)
    draw.text((4, h - 14), label, fill="black")
    return img


def encode_image(img: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def tone_wav(freq_hz: float, seconds: float = 0.25, rate: int = 16_000) -> bytes:
    """A mono 16-bit PCM WAV of a sine tone."""
    frames = b"".join(struct.pack("<h", int(12_000 * math.sin(2 * math.pi * freq_hz * i / rate)))
                      for i in range(int(rate * seconds)))
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(frames)
    return out.getvalue()


def stub_mp4(payload: bytes) -> bytes:
    """A minimal MP4 container (ftyp, moov, mdat boxes) around `payload`; not playable, structurally valid."""
    def box(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I4s", 8 + len(body), kind) + body

    return (box(b"ftyp", b"isom\x00\x00\x02\x00isomiso2mp41")
            + box(b"moov", box(b"mvhd", bytes(100)))
            + box(b"mdat", payload))
