"""MMK12 (hub id FanqingM/MMK12) -> verl RL Parquet, as VeRL-Omni's examples/gspo_trainer/data_process/mmk12.py.

Raw: `train-*.parquet` / `test-*.parquet` shards, columns `id, question, answer, subject, image`
(`image` = {bytes, path}). Multiple-choice questions carry their options inline as `A. ...` lines.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

from omni_core.data.converter import (
    BatchConverted,
    HubParquetConverter,
    RowRejected,
    binary_values,
    is_binary_type,
    register_converter,
)
from omni_core.data.fixtures import register_fixture
from omni_core.data.media import encode_image, image_problem, media_list
from omni_core.data.schema import MEDIA_LIST, REWARD_MODEL, extra_info, rl_schema
from omni_core.data.sources import RawSource
from omni_core.media_limits import MediaLimits

# Verbatim from VeRL-Omni examples/gspo_trainer/data_process/mmk12.py (INSTRUCTION; "adapted from
# MM-Eureka Table 1, instruct-model variant", with \boxed{} to match the mmk12 reward).
INSTRUCTION = (
    "You should first think about the reasoning process in the mind and then "
    "provide the user with the answer. The final answer must be wrapped using "
    "the \\boxed{} command. The reasoning process and answer are enclosed "
    "within <think></think> and <answer></answer> tags, respectively, i.e., "
    "<think>Since $1+1=2$, so the answer is $2$.</think>"
    "<answer>$\\boxed{2}$</answer>, which means your output should start "
    "with <think> and end with </answer>."
)
USER_TEMPLATE = "<image>\n{instruction}\n\n{question}"
RAW_COLUMNS = ["id", "question", "answer", "subject", "image"]
_OPTION_LINE = re.compile(r"^\s*([A-E])[.)、]\s*(.+?)\s*$", re.MULTILINE)

SCHEMA = rl_schema(
    ("images", MEDIA_LIST),
    ("ability", pa.string()),
    ("reward_model", REWARD_MODEL),
    ("extra_info", extra_info(
        ("id", pa.string()), ("dataset", pa.string()), ("subject", pa.string()), ("raw_question", pa.string()),
        ("raw_answer", pa.string()), ("options", pa.string()),
    )),
)
_TEXT_SCHEMA = pa.schema([f for f in SCHEMA if f.name != "images"])


def parse_options(question: str) -> dict[str, str]:
    """`{"A": text, ...}` from `A. text` / `A) text` / `A、text` lines; empty for free-form questions."""
    return {m.group(1): m.group(2) for m in _OPTION_LINE.finditer(question)}


def _image_bytes(field: Any) -> bytes | memoryview | None:
    """The image's bytes, or None; a memoryview (ingest's zero-copy records) is passed through uncopied."""
    if isinstance(field, dict):
        field = field.get("bytes")
    if isinstance(field, memoryview):
        return field if field.nbytes else None
    return bytes(field) if isinstance(field, bytes | bytearray) and field else None


@register_converter
class MMK12Converter(HubParquetConverter):
    name = "mmk12"
    version = "1"
    schema = SCHEMA
    raw_columns = RAW_COLUMNS
    read_batch_rows = 256  # rows carry images

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        image = _image_bytes(record.get("image"))
        return {**_text_row(record, image, split, index, self.limits), "images": [{"bytes": image}]}

    def convert_batch(self, table: pa.Table, split: str, first_index: int, raw: RawSource) -> BatchConverted | None:
        """`convert` of a whole chunk: the text columns row by row in Python (small), the images
        validated in place and passed to the output column without a copy (see `media_list`)."""
        column = table.column("image")
        if is_binary_type(column.type):
            values = column
        elif pa.types.is_struct(column.type) and column.type.get_field_index("bytes") >= 0 \
                and is_binary_type(column.type.field("bytes").type):
            values = pa.chunked_array([chunk.field("bytes") for chunk in column.chunks], column.type.field("bytes").type)
        else:
            return None  # an unusual raw layout: convert row by row
        images: list[memoryview | None] = []
        for chunk, chunk_values in zip(column.chunks, values.chunks, strict=True):
            views = binary_values(chunk_values)
            if chunk.null_count:  # a null image struct is a missing image, whatever its child holds
                views = [v if ok else None for v, ok in zip(views, chunk.is_valid().to_pylist(), strict=True)]
            images += views
        rows, keep, rejected = [], [], []
        texts = table.select([c for c in RAW_COLUMNS if c != "image"]).to_pylist()
        for offset, (record, image) in enumerate(zip(texts, images, strict=True)):
            try:
                rows.append(_text_row(record, image if image is not None and image.nbytes else None, split,
                                      first_index + offset, self.limits))
                keep.append(True)
            except RowRejected as exc:
                rejected.append((offset, exc.reason))
                keep.append(False)
        out = pa.Table.from_pylist(rows, schema=_TEXT_SCHEMA)
        out = out.add_column(SCHEMA.get_field_index("images"), SCHEMA.field("images"), media_list(values, keep))
        return BatchConverted(out, rejected)


def _text_row(record: dict[str, Any], image: bytes | memoryview | None, split: str, index: int,
              limits: MediaLimits) -> dict[str, Any]:
    """A row's output columns other than `images`; RowRejected if the row (or its `image`) is unusable."""
    question = str(record.get("question") or "").strip()
    answer = str(record.get("answer") or "").strip()
    if not question:
        raise RowRejected("empty question")
    if not answer:
        raise RowRejected("missing answer")
    problem = image_problem(image, limits)
    if problem:
        raise RowRejected(problem)
    return {
        "data_source": "mmk12",
        "prompt": [{"role": "user", "content": USER_TEMPLATE.format(instruction=INSTRUCTION, question=question)}],
        "ability": "math_vl",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split, "index": index, "id": str(record.get("id") or ""), "dataset": "MMK12",
            "subject": str(record.get("subject") or ""), "raw_question": question, "raw_answer": answer,
            "options": json.dumps(parse_options(question), ensure_ascii=False),
        },
    }


# ---- fixture: raw shards as the hub ships them ----------------------------------------------------

SUBJECTS = ["math", "physics", "chemistry", "biology"]
Problem = tuple[str, str, list[str], Callable[[ImageDraw.ImageDraw, int], None]]  # stem, value, distractors, draw


def _math(rng: random.Random) -> Problem:
    a, b, c = rng.choice([(3, 4, 5), (5, 12, 13), (6, 8, 10), (8, 15, 17), (7, 24, 25), (9, 12, 15)])
    stem = f"As shown in the figure, in right triangle ABC, ∠C = 90°, AC = {a}, BC = {b}. Find the length of AB."

    def draw(d: ImageDraw.ImageDraw, s: int) -> None:
        d.polygon([(20, s - 30), (s - 20, s - 30), (20, 30)], outline="black", width=2)
        d.text((8, s - 26), "C", fill="black")
        d.text((s - 18, s - 26), "B", fill="black")
        d.text((8, 20), "A", fill="black")
        d.text((s // 2, s - 24), str(b), fill="blue")
        d.text((24, s // 2), str(a), fill="blue")
    return stem, str(c), [str(a + b), str(c + 1), str(c + 2), str(b + 1), str(2 * c), str(a * b)], draw


def _physics(rng: random.Random) -> Problem:
    m, acc = rng.randrange(1, 9), rng.randrange(2, 7)
    stem = ("A block rests on a smooth horizontal surface and a horizontal force acts on it, as shown in "
            "the figure. What is the magnitude of the block's acceleration in m/s^2?")

    def draw(d: ImageDraw.ImageDraw, s: int) -> None:
        d.line([(10, s - 40), (s - 10, s - 40)], fill="black", width=2)
        d.rectangle((s // 3, s - 90, s // 3 + 60, s - 40), outline="black", width=2)
        d.text((s // 3 + 6, s - 72), f"m = {m} kg", fill="black")
        d.line([(s // 3 + 60, s - 65), (s - 20, s - 65)], fill="red", width=3)
        d.text((s - 70, s - 85), f"F = {m * acc} N", fill="red")
    return stem, str(acc), [str(acc + 1), str(m * acc), str(acc + 3), str(acc + 5), str(acc + 7)], draw


def _chemistry(rng: random.Random) -> Problem:
    n = rng.randrange(2, 9)
    stem = ("The figure shows the carbon skeleton of a straight-chain alkane (hydrogen atoms omitted). "
            "What is its relative molecular mass? (C = 12, H = 1)")

    def draw(d: ImageDraw.ImageDraw, s: int) -> None:
        d.text((10, s // 2), "-".join(["C"] * n), fill="black")
        d.text((10, 16), f"C{n}H{2 * n + 2}?", fill="gray")
    return stem, str(14 * n + 2), [str(14 * n), str(12 * n + 2), str(14 * n + 4), str(13 * n + 2), str(14 * n + 16)], draw


def _biology(rng: random.Random) -> Problem:
    phases = ["pro", "meta", "ana", "telo"]
    counts = [rng.randrange(3, 30) for _ in phases]
    stem = ("The bar chart shows the number of cells a student observed in each phase of mitosis. "
            "How many dividing cells were observed in total?")

    def draw(d: ImageDraw.ImageDraw, s: int) -> None:
        for i, (phase, count) in enumerate(zip(phases, counts, strict=True)):
            x = 20 + i * (s - 40) // 4
            d.rectangle((x, s - 30 - count * 5, x + 30, s - 30), fill=(90, 150, 220))
            d.text((x, s - 44 - count * 5), str(count), fill="black")
            d.text((x, s - 24), phase, fill="black")
    total = sum(counts)
    return stem, str(total), [str(total + 2), str(total - 3), str(max(counts)), str(total + 10)], draw


_PROBLEMS = {"math": _math, "physics": _physics, "chemistry": _chemistry, "biology": _biology}


def _render(rng: random.Random, draw: Callable[[ImageDraw.ImageDraw, int], None], size: int, noise: bool) -> bytes:
    img = Image.new("RGB", (size, size), "white")
    draw(ImageDraw.Draw(img), size)
    if noise:  # realistic-size, incompressible PNGs for benchmarks
        img = Image.blend(img, Image.frombytes("RGB", img.size, rng.randbytes(size * size * 3)), 0.25)
    return encode_image(img)


def _row(rng: random.Random, split: str, n: int, subject: str, choice: bool, size: int, noise: bool) -> dict[str, Any]:
    stem, value, distractors, draw = _PROBLEMS[subject](rng)
    question, answer = stem, value
    if choice:
        options = [value] + [d for d in dict.fromkeys(distractors) if d != value][: rng.choice([3, 4])]
        rng.shuffle(options)
        question = stem + "\n" + "\n".join(f"{'ABCDE'[i]}. {opt}" for i, opt in enumerate(options))
        answer = "ABCDE"[options.index(value)]
    rid = f"{split}_{n:06d}"
    return {"id": rid, "question": question, "answer": answer, "subject": subject,
            "image": {"bytes": _render(rng, draw, size, noise), "path": f"{rid}.png"}}


def _bad_row(row: dict[str, Any], k: int) -> dict[str, Any]:
    kind = k % 4
    if kind == 0:
        return {**row, "image": None}  # missing image
    if kind == 1:
        return {**row, "image": {"bytes": row["image"]["bytes"][:60], "path": row["image"]["path"]}}  # truncated PNG
    if kind == 2:
        return {**row, "answer": ""}  # missing answer
    return {**row, "question": "  "}  # empty question


_RAW_SCHEMA = pa.schema(
    [("id", pa.string()), ("question", pa.string()), ("answer", pa.string()), ("subject", pa.string()),
     ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())]))],
    metadata={"huggingface": json.dumps({"info": {"features": {
        "id": {"dtype": "string", "_type": "Value"}, "question": {"dtype": "string", "_type": "Value"},
        "answer": {"dtype": "string", "_type": "Value"}, "subject": {"dtype": "string", "_type": "Value"},
        "image": {"_type": "Image"}}}})},
)


def write_mmk12_raw(out: Path, rows: int, seed: int = 0, bad_rows: int = 0, *, image_size: int = 128,
                    noise: bool = False, shard_rows: int = 1000) -> list[Path]:
    """`rows` train rows (half multiple-choice) and max(1, rows // 4) multiple-choice test rows, subjects
    in turn; `bad_rows` unusable rows mixed into train. Shards of `shard_rows`, row groups of 100."""
    rng = random.Random(f"mmk12:{seed}")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", rows), ("test", max(1, rows // 4))):
        records = [_row(rng, split, i, SUBJECTS[i % 4], split == "test" or rng.random() < 0.5, image_size, noise)
                   for i in range(n)]
        if split == "train":
            for k in range(bad_rows):
                bad = _bad_row(_row(rng, split, n + k, SUBJECTS[k % 4], k % 2 == 0, image_size, noise), k)
                records.insert(rng.randrange(len(records) + 1), bad)
        shards = max(1, -(-len(records) // shard_rows))
        for s in range(shards):
            path = out / f"{split}-{s:05d}-of-{shards:05d}.parquet"
            chunk = records[s * shard_rows:(s + 1) * shard_rows]
            pq.write_table(pa.Table.from_pylist(chunk, schema=_RAW_SCHEMA), path, row_group_size=100)
            paths.append(path)
    return paths


@register_fixture("mmk12")
def mmk12_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    return write_mmk12_raw(out, rows, seed, bad_rows)
