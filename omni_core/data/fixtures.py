"""Fixture generators: raw files written exactly as each dataset ships them, for tests and the demo.

No machine here reaches a dataset hub, so every converter is exercised on these files instead.
A generator is deterministic in (rows, seed, bad_rows): the same arguments give byte-identical files.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.errors import DataError
from omni_core.registry import Registry

FixtureGenerator = Callable[[Path, int, int, int], list[Path]]
_GENERATORS: Registry[FixtureGenerator] = Registry("fixture generator")


def register_fixture(name: str) -> Callable[[FixtureGenerator], FixtureGenerator]:
    return _GENERATORS.decorator(name)


def fixture_names() -> list[str]:
    return _GENERATORS.names()


def write_fixture(name: str, out_dir: str | Path, rows: int, seed: int = 0, bad_rows: int = 0) -> list[Path]:
    """Write the raw files of dataset `name` under `out_dir`; returns the paths written."""
    if name not in _GENERATORS:
        raise DataError(f"no fixture generator named '{name}'; known: {', '.join(fixture_names())}")
    if rows < 1:
        raise DataError(f"fixture '{name}': rows must be >= 1, got {rows}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _GENERATORS.get(name)(out, rows, seed, bad_rows)


# --- GSM8K (openai/gsm8k, config "main"): main/{train,test}-00000-of-00001.parquet, columns question, answer.

_NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
_ITEMS = ["clips", "apples", "books", "pencils", "stickers", "cookies", "marbles", "cards"]


def _gsm8k_problem(rng: random.Random) -> tuple[str, str]:
    """One word problem with a worked answer in GSM8K's style (<<a*b=c>> notes, final `#### N`)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a = rng.randrange(2, 60) * 2
        half = a // 2
        question = (f"{name} sold {item} to {a} of her friends in April, and then she sold half as many "
                    f"{item} in May. How many {item} did {name} sell altogether in April and May?")
        steps = [f"{name} sold {a}/2 = <<{a}/2={half}>>{half} {item} in May.",
                 f"{name} sold {a}+{half} = <<{a}+{half}={a + half}>>{a + half} {item} altogether in April and May."]
        result = a + half
    elif kind == 1:
        boxes, per_box, price = rng.randrange(20, 120), rng.randrange(12, 40), rng.randrange(2, 9)
        count = boxes * per_box
        question = (f"{name} buys {boxes} boxes of {item} with {per_box} {item} in each box and sells every one "
                    f"for ${price}. How many dollars does {name} make?")
        steps = [f"There are {boxes}*{per_box} = <<{boxes}*{per_box}={count}>>{count} {item}.",
                 f"{name} makes {count}*{price} = <<{count}*{price}={count * price}>>{count * price} dollars."]
        result = count * price
    elif kind == 2:
        start, spent, gift = rng.randrange(40, 200), rng.randrange(5, 39), rng.randrange(3, 30)
        question = (f"{name} has {start} {item}. She gives away {spent} {item} and then gets {gift} more from a "
                    f"friend. How many {item} does {name} have now?")
        left = start - spent
        steps = [f"After giving some away {name} has {start}-{spent} = <<{start}-{spent}={left}>>{left} {item}.",
                 f"Then {name} has {left}+{gift} = <<{left}+{gift}={left + gift}>>{left + gift} {item}."]
        result = left + gift
    else:
        rate, hours, costs = rng.randrange(8, 30), rng.randrange(2, 9), rng.randrange(5, 80)
        question = (f"{name} earns ${rate} an hour babysitting. Yesterday she babysat for {hours} hours and then "
                    f"spent ${costs} on {item}. How much money does she have left from yesterday's work?")
        earned = rate * hours
        steps = [f"{name} earned {rate}*{hours} = <<{rate}*{hours}={earned}>>{earned} dollars.",
                 f"She has {earned}-{costs} = <<{earned}-{costs}={earned - costs}>>{earned - costs} dollars left."]
        result = earned - costs
    final = f"{result:,}" if abs(result) >= 1000 else str(result)  # GSM8K writes thousands with commas
    return question, "\n".join(steps) + f"\n#### {final}"


def _gsm8k_bad_row(rng: random.Random, k: int) -> tuple[str, str]:
    question, answer = _gsm8k_problem(rng)
    if k % 2 == 0:
        return question, answer.rsplit("\n####", 1)[0]  # answer without its `#### N` line
    return "  ", answer  # empty question


@register_fixture("gsm8k")
def gsm8k_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    """`rows` train rows and max(1, rows // 4) test rows; `bad_rows` unusable rows mixed into train."""
    rng = random.Random(f"gsm8k:{seed}")
    paths = []
    for split, n in (("train", rows), ("test", max(1, rows // 4))):
        records = [_gsm8k_problem(rng) for _ in range(n)]
        if split == "train":
            for k in range(bad_rows):
                records.insert(rng.randrange(len(records) + 1), _gsm8k_bad_row(rng, k))
        table = pa.table({"question": [q for q, _ in records], "answer": [a for _, a in records]})
        path = out / "main" / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        paths.append(path)
    return paths
