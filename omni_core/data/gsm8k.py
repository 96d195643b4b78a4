"""GSM8K (openai/gsm8k, config "main") -> verl RL Parquet, as verl's examples/data_preprocess/gsm8k.py."""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa

from omni_core.data.converter import (
    HubParquetConverter,
    RowRejected,
    register_converter,
)
from omni_core.data.schema import REWARD_MODEL, extra_info, rl_schema
from omni_core.data.sources import RawSource

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")

SCHEMA = rl_schema(
    ("ability", pa.string()),
    ("reward_model", REWARD_MODEL),
    ("extra_info", extra_info(("answer", pa.string()), ("question", pa.string()))),
)


def extract_solution(answer: str) -> str | None:
    match = _FINAL_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


@register_converter
class GSM8KConverter(HubParquetConverter):
    name = "gsm8k"
    version = "1"
    schema = SCHEMA
    raw_columns = ["question", "answer"]

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not question.strip():
            raise RowRejected("empty question")
        if not isinstance(answer, str) or not answer.strip():
            raise RowRejected("missing answer")
        solution = extract_solution(answer)
        if solution is None:
            raise RowRejected("answer has no '#### N' final answer")
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
        }
