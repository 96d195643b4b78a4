"""Image-edit instructions with their source images -> verl RL Parquet, as VeRL-Omni's
examples/flowgrpo_trainer/qwen_image_edit/prepare_data.py writes it (Qwen-Image-Edit-2511 FlowGRPO).

Raw (examples/flowgrpo_trainer/qwen_image_edit/README.md): `train.jsonl` and `test.jsonl`, one JSON object
per line, `{"prompt": instruction, "image": file name}`, the image an encoded file (PNG, JPEG, ...) in
`images/` beside them. Each source image is letterboxed onto a white 512x512 canvas (the script's
default `--image_size`, the recipe's 512x512 output) and stored as PNG bytes in `images`, the way the
script stores it. A line that is not a JSON object, lacks `prompt` / `image`, names an image that is
not there (the script raises FileNotFoundError) or one that does not decode is quarantined.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from PIL import Image, ImageOps, UnidentifiedImageError

from omni_core.data.converter import (
    RawRecord,
    RowRejected,
    SplitFileConverter,
    register_converter,
    text_lines,
)
from omni_core.data.fixtures import register_fixture
from omni_core.data.media import draw_scene, encode_image, safe_join
from omni_core.data.schema import MEDIA_LIST, MESSAGE, REWARD_MODEL, extra_info, rl_schema
from omni_core.data.sources import RawSource
from omni_core.errors import DataError

# Verbatim from VeRL-Omni examples/flowgrpo_trainer/qwen_image_edit/prepare_data.py (SYSTEM_PROMPT).
SYSTEM_PROMPT = (
    "Describe the key features of the input image "
    "(color, shape, size, texture, objects, background), then explain how the user's "
    "text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where "
    "appropriate."
)
IMAGE_SIZE = 512  # prepare_data.py --image_size default
IMAGE_PLACEHOLDER = "<image>"

SCHEMA = rl_schema(
    ("negative_prompt", pa.list_(MESSAGE)),
    ("ability", pa.string()),
    ("images", MEDIA_LIST),
    ("reward_model", REWARD_MODEL),
    ("extra_info", extra_info(("instruction", pa.string()), ("image", pa.string()))),
)


def letterbox_png(data: bytes, image_size: int = IMAGE_SIZE) -> bytes:
    """prepare_data.py's `_load_image`: RGB, fit inside image_size x image_size (LANCZOS), centred on a
    white square canvas, PNG."""
    with Image.open(io.BytesIO(data)) as source:
        image = source.convert("RGB")
    image = ImageOps.contain(image, (image_size, image_size), method=Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (image_size, image_size), color=(255, 255, 255))
    canvas.paste(image, ((image_size - image.width) // 2, (image_size - image.height) // 2))
    return encode_image(canvas, "PNG")


@register_converter
class ImageEditConverter(SplitFileConverter):
    name = "image_edit"
    version = "1"
    schema = SCHEMA
    split_suffix = ".jsonl"

    def records(self, raw: RawSource, split: str) -> Iterator[RawRecord]:
        rel = self.split_file(raw, split)
        if rel is None:
            raise DataError(f"{raw.uri}: {split}.jsonl is missing; expected train.jsonl / test.jsonl and images/")
        folder = rel.rpartition("/")[0]
        for line_no, line in text_lines(raw, rel, "JSON lines"):
            yield rel, line_no, {"line": line, "folder": folder}

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        try:
            example = json.loads(record["line"])
        except json.JSONDecodeError:
            example = None
        if not isinstance(example, dict):
            raise RowRejected("line is not a JSON object")
        for key in ("prompt", "image"):
            if example.get(key) is None:
                raise RowRejected(f"record has no {key!r}")
        instruction, image_name = str(example["prompt"]), str(example["image"])
        images = safe_join(record["folder"], "images")
        rel = safe_join(images or "", image_name) if images else None
        if rel is None or rel not in raw.files:
            raise RowRejected(f"condition image not found: images/{image_name}")
        data = raw.path(rel).read_bytes()
        if problem := self.limits.image_problem(data):  # before letterbox_png decodes it
            raise RowRejected(f"condition image images/{image_name}: {problem}")
        try:
            png = letterbox_png(data)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise RowRejected(f"condition image images/{image_name} does not decode ({exc.__class__.__name__})") from exc
        return {
            "data_source": "image_edit",
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": f"Picture 1: {IMAGE_PLACEHOLDER}{instruction}"}],
            "negative_prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                {"role": "user", "content": f"Picture 1: {IMAGE_PLACEHOLDER} "}],
            "ability": "image_edit",
            "images": [{"bytes": png}],
            "reward_model": {"style": "model", "ground_truth": instruction},
            "extra_info": {"split": split, "index": index, "instruction": instruction, "image": image_name},
        }


# ---- fixture: images/NNNNNN.{png,jpg}, train.jsonl, test.jsonl -------------------------------------------

_EDITS = ["Change the background to blue", "Make it look like a watercolor painting", "Add a red hat on top",
          "Turn the scene into night time", "Remove the circles", "Make the colors warmer",
          "Replace the sky with a sunset", "Add falling snow", "Convert the image to black and white"]
_SIZES = [(64, 48), (40, 72), (56, 56), (96, 32)]


@register_fixture("image_edit")
def image_edit_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    """`rows` train and max(1, rows // 4) test instructions, each with its own source image (PNG or JPEG,
    not square: the converter letterboxes them); `bad_rows` unusable train lines, in turn: an image that
    is not there, an image file that does not decode, a record without `image`, a line that is not JSON."""
    rng = random.Random(f"image_edit:{seed}")
    (out / "images").mkdir(parents=True, exist_ok=True)
    paths, number = [], 0
    for split, n in (("train", rows), ("test", max(1, rows // 4))):
        lines = []
        for _ in range(n):
            number += 1
            fmt, ext = ("PNG", "png") if rng.random() < 0.5 else ("JPEG", "jpg")
            name = f"{number:06d}.{ext}"
            image = draw_scene(rng, rng.choice(_SIZES), str(number))
            (out / "images" / name).write_bytes(encode_image(image, fmt))
            paths.append(out / "images" / name)
            lines.append(json.dumps({"prompt": rng.choice(_EDITS), "image": name}))
        if split == "train":
            for k in range(bad_rows):
                kind, prompt = k % 4, rng.choice(_EDITS)
                if kind == 0:
                    bad = json.dumps({"prompt": prompt, "image": f"missing_{k}.png"})
                elif kind == 1:
                    name = f"broken_{k}.png"
                    (out / "images" / name).write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(16))
                    paths.append(out / "images" / name)
                    bad = json.dumps({"prompt": prompt, "image": name})
                elif kind == 2:
                    bad = json.dumps({"prompt": prompt})
                else:
                    bad = '{"prompt": "' + prompt
                lines.insert(rng.randrange(len(lines) + 1), bad)
        path = out / f"{split}.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths
