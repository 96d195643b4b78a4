"""OCR prompts (flow_grpo dataset/ocr/{train,test}.txt) -> verl RL Parquet for text-to-image FlowGRPO,
as VeRL-Omni's examples/flowgrpo_trainer/data_process/qwenimage_ocr.py (and sd3_ocr.py). bagel_ocr.py
reads the same files; the VeRL-Omni export makes the SD3 and BAGEL forms from these rows.

Raw: one prompt per line; the text the image must show is the first double-quoted span, and is the
ground truth (`text.split('"')[1]`). Blank lines are not prompts and are passed over.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from omni_core.data.converter import (
    RawRecord,
    RowRejected,
    SplitFileConverter,
    register_converter,
    text_lines,
)
from omni_core.data.fixtures import register_fixture
from omni_core.data.schema import MESSAGE, REWARD_MODEL, extra_info, rl_schema
from omni_core.data.sources import RawSource
from omni_core.errors import ConfigError, DataError

# Verbatim from VeRL-Omni's qwenimage_ocr.py (system_prompt); SD3 encodes the raw prompt, no system message.
SYSTEM_PROMPT = ("Describe the image by detailing the color, shape, size, "
                 "texture, quantity, text, spatial relationships of the objects and background:")
NEGATIVE_USER_PROMPT = " "
MODEL_FAMILIES = ("qwen_image", "sd3")

SCHEMA = rl_schema(
    ("negative_prompt", pa.list_(MESSAGE)),
    ("ability", pa.string()),
    ("reward_model", REWARD_MODEL),
    ("extra_info", extra_info()),
)


@register_converter
class OCRConverter(SplitFileConverter):
    """`model_family` picks the prompt template: `qwen_image` (system + user, the default) or `sd3` (user only).

    The pipeline config has no option for it yet, so `get_converter("ocr")` always builds qwen_image;
    when the option is added it must also go into the dataset version's options (the output differs).
    """

    name = "ocr"
    version = "1"
    schema = SCHEMA
    split_suffix = ".txt"

    def __init__(self, model_family: str = "qwen_image") -> None:
        if model_family not in MODEL_FAMILIES:
            raise ConfigError(f"ocr converter: model_family '{model_family}' is unknown; use one of {MODEL_FAMILIES}")
        self.model_family = model_family

    def records(self, raw: RawSource, split: str) -> Iterator[RawRecord]:
        rel = self.split_file(raw, split)
        if rel is None:
            raise DataError(f"{raw.uri}: {split}.txt is missing; expected flow_grpo's dataset/ocr layout")
        for line_no, line in text_lines(raw, rel, "one prompt per line"):
            yield rel, line_no, {"text": line}

    def _messages(self, user: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": SYSTEM_PROMPT}] if self.model_family == "qwen_image" else []
        return system + [{"role": "user", "content": user}]

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        text = record["text"]
        if text.count('"') < 2:
            raise RowRejected("prompt has no double-quoted text")
        target = text.split('"')[1]
        if not target.strip():
            raise RowRejected("quoted text is empty")
        return {
            "data_source": "flow_grpo/ocr",
            "prompt": self._messages(text),
            "negative_prompt": self._messages(NEGATIVE_USER_PROMPT),
            "ability": "ocr",
            "reward_model": {"style": "model", "ground_truth": target},
            "extra_info": {"split": split, "index": index},
        }


# ---- fixture: train.txt / test.txt, one prompt per line ------------------------------------------------

_SCENES = [
    'A weathered wooden sign above a bakery door that reads "{}"',
    'A pink neon sign glowing in a rainy alley, spelling out "{}"',
    'A chalkboard menu on a cafe sidewalk with the words "{}" written in white chalk',
    'A birthday cake with "{}" written in blue icing on top',
    'A vintage travel poster with the title "{}" printed in bold yellow letters',
    'A coffee mug on a wooden desk printed with the slogan "{}"',
    'A protest banner held by a crowd, painted with the words "{}"',
]
_WORDS = ["Open", "Late", "Fresh", "Bread", "Hello", "World", "Keep", "Calm", "Sale", "Welcome", "Home",
          "Exit", "Coffee", "Summer", "Dreams", "No", "Parking", "Best", "Friends", "Forever", "1987", "50%"]
_NO_QUOTE = ["A quiet beach at sunset with two palm trees", "A red bicycle leaning against a brick wall"]


def _prompt(rng: random.Random) -> str:
    return rng.choice(_SCENES).format(" ".join(rng.sample(_WORDS, rng.randrange(1, 4))))


@register_fixture("ocr")
def ocr_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    """`rows` train and max(1, rows // 4) test prompts; `bad_rows` unusable train prompts (in turn: no
    quoted text, an empty quoted span)."""
    rng = random.Random(f"ocr:{seed}")
    paths = []
    for split, n in (("train", rows), ("test", max(1, rows // 4))):
        lines = [_prompt(rng) for _ in range(n)]
        if split == "train":
            for k in range(bad_rows):
                bad = rng.choice(_NO_QUOTE) if k % 2 == 0 else rng.choice(_SCENES).format("")
                lines.insert(rng.randrange(len(lines) + 1), bad)
        path = out / f"{split}.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths
