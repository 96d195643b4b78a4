"""How large an image, an audio clip or a video declares itself to be, read from its header, and the
limits a dataset sets on that (`datasets.NAME.max_image_pixels`, `max_audio_seconds`,
`max_video_seconds`).

A file is judged by its header alone: a PNG that declares 30000x30000 pixels in a few hundred bytes
(a decompression bomb: 2.7 GB of RGB once decoded) is refused without decoding anything. Ingest
quarantines rows over a limit; rollout and eval refuse them (`check_rows`), so rows that reached a
dataset another way cannot stall a trainer either.
"""

from __future__ import annotations

import io
import struct
import warnings
import wave
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_core.config.models import DatasetConfig
from omni_core.errors import DataError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _default(key: str) -> Any:
    return DatasetConfig.model_fields[key].default


@dataclass(frozen=True)
class MediaLimits:
    max_image_pixels: int = _default("max_image_pixels")
    max_audio_seconds: float = _default("max_audio_seconds")
    max_video_seconds: float = _default("max_video_seconds")

    @classmethod
    def of(cls, dataset: DatasetConfig | None) -> MediaLimits:
        """The limits `dataset` sets (the defaults for None)."""
        if dataset is None:
            return cls()
        return cls(dataset.max_image_pixels, dataset.max_audio_seconds, dataset.max_video_seconds)

    def image_problem(self, data: bytes | memoryview) -> str | None:
        """Why the image is over the limit (by its declared size), or None; None too when the header
        cannot be read (the format checks report that)."""
        try:
            size = image_size(data)
        except OverPilLimit as exc:
            return f"image too large: {exc}, over max_image_pixels={self.max_image_pixels} (not decoded)"
        if size is None:
            return None
        width, height = size
        if width * height > self.max_image_pixels:
            return (f"image too large: declares {width}x{height} = {width * height} pixels, over "
                    f"max_image_pixels={self.max_image_pixels} (not decoded)")
        return None

    def audio_problem(self, data: bytes | memoryview) -> str | None:
        seconds = wav_seconds(data)
        if seconds is not None and seconds > self.max_audio_seconds:
            return (f"audio too long: declares {seconds:.1f} s, over max_audio_seconds={self.max_audio_seconds:g} "
                    "(not decoded)")
        return None

    def video_problem(self, data: bytes | memoryview) -> str | None:
        seconds = video_seconds(data)
        if seconds is not None and seconds > self.max_video_seconds:
            return (f"video too long: declares {seconds:.1f} s, over max_video_seconds={self.max_video_seconds:g} "
                    "(not decoded)")
        return None

    def row_problem(self, row: Mapping[str, Any]) -> str | None:
        """The first medium of a verl row (`images`, `audios`, `videos`: lists of {bytes}) over a limit."""
        checks = (("images", self.image_problem), ("audios", self.audio_problem), ("videos", self.video_problem))
        for column, check in checks:
            for item in row.get(column) or []:
                data = item.get("bytes") if isinstance(item, Mapping) else item
                if data and (problem := check(data)):
                    return problem
        return None


def check_rows(rows: Iterable[Mapping[str, Any]], limits: MediaLimits, what: str) -> None:
    """MediaLimitError naming the first row of `what` whose media is over `limits`."""
    for index, row in enumerate(rows):
        if problem := limits.row_problem(row):
            raise MediaLimitError(f"{what}: row {index}: {problem}; drop the row (re-ingest quarantines it) or raise "
                                  "the dataset's limit (datasets.NAME.max_image_pixels / max_audio_seconds / "
                                  "max_video_seconds)")


class MediaLimitError(DataError):
    """A row's image, audio or video declares a size or duration over the dataset's limit."""


# ---- declared sizes -------------------------------------------------------------------------------


class OverPilLimit(Exception):
    """PIL refused to open the image: it declares more than 2 x Image.MAX_IMAGE_PIXELS pixels."""


def image_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(width, height) as the image's header declares them, or None when it is not a readable image.

    PNG: read from IHDR here. Other formats: PIL's `Image.open`, which reads the header only. PIL
    itself raises DecompressionBombError for more than 2 x Image.MAX_IMAGE_PIXELS (and warns above
    Image.MAX_IMAGE_PIXELS) as it opens; both are handled here, not left to its defaults.
    """
    view = memoryview(data)
    if bytes(view[:8]) == PNG_SIGNATURE:
        if len(view) < 24 or bytes(view[12:16]) != b"IHDR":
            return None
        width, height = struct.unpack_from(">II", view, 16)
        return width, height
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(view)) as img:
                return img.size
    except Image.DecompressionBombError as exc:  # over any max_image_pixels (its bound is PIL's limit)
        raise OverPilLimit(str(exc).split(",")[0]) from None
    except Exception:  # not an image PIL knows: the format check says so
        return None


def wav_seconds(data: bytes | memoryview) -> float | None:
    """The duration a WAV header declares (its data chunk's frames over its rate), or None."""
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            rate = wav.getframerate()
            return wav.getnframes() / rate if rate > 0 else None
    except (wave.Error, EOFError, struct.error):
        return None


def video_seconds(data: bytes | memoryview) -> float | None:
    """The duration a video container declares, or None when it declares none that is read here:
    MP4/MOV from `moov/mvhd` (duration / timescale), AVI from `avih` (frames x microseconds per
    frame). WebM/MKV durations are not read (EBML floats): no limit is applied to them."""
    view = memoryview(data)
    if bytes(view[4:8]) == b"ftyp":
        moov = _box(view, 0, len(view), b"moov")
        mvhd = _box(view, moov[0], moov[1], b"mvhd") if moov else None
        if mvhd is None:
            return None
        start, end = mvhd
        if end - start < 4:
            return None
        if view[start] == 1 and end - start >= 32:  # version 1: 64-bit times
            timescale, duration = struct.unpack_from(">IQ", view, start + 20)
        elif end - start >= 20:
            timescale, duration = struct.unpack_from(">II", view, start + 12)
        else:
            return None
        return duration / timescale if timescale else None
    if bytes(view[:4]) == b"RIFF" and bytes(view[8:12]) == b"AVI ":
        at = bytes(view[:4096]).find(b"avih")
        if at < 0 or at + 8 + 20 > len(view):
            return None
        usec_per_frame, = struct.unpack_from("<I", view, at + 8)
        total_frames, = struct.unpack_from("<I", view, at + 8 + 16)
        return usec_per_frame * total_frames / 1e6
    return None


def _box(view: memoryview, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    """(payload start, end) of the first ISO-BMFF box `kind` among the boxes in view[start:end]."""
    pos = start
    while pos + 8 <= end:
        size, found = struct.unpack_from(">I4s", view, pos)
        header = 8
        if size == 1 and pos + 16 <= end:
            size, header = struct.unpack_from(">Q", view, pos + 8)[0], 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            return None
        if found == kind:
            return pos + header, pos + size
        pos += size
    return None
