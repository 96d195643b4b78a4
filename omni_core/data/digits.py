"""Digit rotation: a learnable fixture task for proving that RL raises held-out reward on tiny models.

Prompt `Rotate 4719`, answer `7194` (the first digit moves to the end), scored with partial credit
by the `digits` reward (`omni_core.rewards.digits`: the share of positions right). `tiny://lm`'s
tokenizer splits numbers into single digits, so output digit i copies the input digit at a fixed
relative distance: a copy pattern the 2-layer model can represent, learnt in about a hundred SFT
steps, and the partial credit gives GRPO/GSPO a graded signal per response. (Reversal, where the
distance changes with i, takes this model several hundred SFT steps and RL gains far less per step.)
Held-out numbers never occur in the train split.

Raw layout (ours; no hub dataset): `data/{train,test}-00000-of-00001.parquet`, one string column
`number`. The fixture draws distinct 4-digit strings (leading zeros allowed) without replacement, so
train and test are disjoint.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.data.converter import HubParquetConverter, RowRejected, register_converter
from omni_core.data.fixtures import register_fixture
from omni_core.data.schema import REWARD_MODEL, extra_info, rl_schema
from omni_core.data.sources import RawSource
from omni_core.errors import DataError

DATA_SOURCE = "digits_rotate"
DIGITS = 4
_NUMBER = re.compile(r"[0-9]+")

SCHEMA = rl_schema(
    ("ability", pa.string()),
    ("reward_model", REWARD_MODEL),
    ("extra_info", extra_info(("number", pa.string()))),
)


def rotate_row(number: str, split: str, index: int) -> dict[str, Any]:
    """The verl RL row asking to rotate `number` left by one digit."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"Rotate {number}"}],
        "ability": "string",
        "reward_model": {"style": "rule", "ground_truth": number[1:] + number[:1]},
        "extra_info": {"split": split, "index": index, "number": number},
    }


@register_converter
class DigitsConverter(HubParquetConverter):
    name = "digits"
    version = "1"
    schema = SCHEMA
    raw_columns = ["number"]

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        number = record.get("number")
        if not isinstance(number, str) or not _NUMBER.fullmatch(number):
            raise RowRejected(f"number {number!r} is not a string of digits 0-9")
        return rotate_row(number, split, index)


@register_fixture("digits")
def digits_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    """`rows` train and max(1, rows // 4) test numbers, all distinct; `bad_rows` non-numbers in train."""
    test_rows = max(1, rows // 4)
    if rows + test_rows > 10**DIGITS:
        raise DataError(f"fixture 'digits': at most {10**DIGITS * 4 // 5} rows (distinct {DIGITS}-digit numbers)")
    rng = random.Random(f"digits:{seed}")
    numbers = [f"{n:0{DIGITS}d}" for n in rng.sample(range(10**DIGITS), rows + test_rows)]
    paths = []
    for split, chunk in (("train", numbers[:rows]), ("test", numbers[rows:])):
        column: list[str | None] = list(chunk)
        if split == "train":
            for k in range(bad_rows):
                column.insert(rng.randrange(len(column) + 1), ["12a4", "", None][k % 3])
        path = out / "data" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"number": pa.array(column, pa.string())}), path)
        paths.append(path)
    return paths
