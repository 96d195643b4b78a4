"""AVQA-R1-6K (hub id harryhsing/AVQA-R1-6K) -> verl RL Parquet, as VeRL-Omni's
examples/gspo_trainer/data_process/avqa.py, but with the image and WAV bytes embedded in the rows.

Raw (as EchoInk's make_omniInstruct_r1_dataset.py writes it): `train/omni_rl_format_train.json` and
`valid/omni_rl_format_valid.json`, each a JSON list of records whose `path.image` / `path.audio` are
relative to the JSON file's folder (`images/sample_N.jpg`, `audios/sample_N.wav`). Output splits are
`train` and `validation` (VeRL-Omni's names).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from omni_core.data.converter import Converter, RawRecord, RowRejected, register_converter
from omni_core.data.fixtures import register_fixture
from omni_core.data.media import (
    draw_scene,
    encode_image,
    image_problem,
    safe_join,
    tone_wav,
    wav_problem,
)
from omni_core.data.schema import MEDIA_LIST, REWARD_MODEL, extra_info, rl_schema
from omni_core.data.sources import RawSource
from omni_core.errors import DataError

# Verbatim from VeRL-Omni examples/gspo_trainer/data_process/avqa.py (SYSTEM_PROMPT).
SYSTEM_PROMPT = (
    "Please think about this question as if you were a human pondering deeply, carefully considering both the "
    "visual and audio information before answering, engaging in an internal dialogue using expressions such as "
    "let me think, wait, hmm, oh I see, or let's break it down, including self-reflection or verification in the "
    "reasoning process, providing the detailed reasoning between the <think> </think> tags, and finally giving "
    "only the single option letter (e.g., A, B, C, D, etc.) as the final answer within the <answer> </answer> tags."
)
SPLIT_FILES = {"train": "train/omni_rl_format_train.json", "validation": "valid/omni_rl_format_valid.json"}
_ANSWER = re.compile(r"<answer>\s*([A-H])\s*</answer>", re.IGNORECASE)
_OPTION = re.compile(r"^\s*([A-H])[.)、:]\s*(.+?)\s*$", re.IGNORECASE)

SCHEMA = rl_schema(
    ("images", MEDIA_LIST),
    ("audios", MEDIA_LIST),
    ("ability", pa.string()),
    ("reward_model", REWARD_MODEL),
    ("extra_info", extra_info(
        ("problem_id", pa.string()), ("dataset", pa.string()), ("problem_type", pa.string()),
        ("raw_problem", pa.string()), ("raw_solution", pa.string()), ("options", pa.string()),
    )),
)


def iter_json_array(path: Path, label: str, chunk: int = 1 << 16) -> Iterator[Any]:
    """The elements of a top-level JSON list, decoded one by one from a buffer of a few chunks."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = "", 0, False

        def more() -> bool:
            nonlocal buf, pos, eof
            data = f.read(chunk)
            buf, pos, eof = buf[pos:] + data, 0, not data
            return bool(data)

        def skip_ws() -> str:  # the next non-blank character, "" at the end of the file
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n":
                    pos += 1
                if pos < len(buf) or not more():
                    return buf[pos] if pos < len(buf) else ""

        try:
            if skip_ws() != "[":
                raise DataError(f"{label} is not a JSON list of records; expected '[' at its start")
            pos += 1
            first = True
            while True:
                char = skip_ws()
                if char == "]":
                    break
                if not first:
                    if char != ",":
                        raise DataError(f"{label}: malformed JSON list (expected ',' or ']', got {char!r})")
                    pos += 1
                    skip_ws()
                while True:
                    try:
                        value, end = decoder.raw_decode(buf, pos)
                        if end < len(buf) or eof or not more():  # a number may continue in the next chunk
                            break
                    except json.JSONDecodeError as exc:
                        if eof or not more():
                            raise DataError(f"{label}: invalid JSON ({exc.msg} near character "
                                            f"{exc.pos}); re-download the file") from exc
                pos, first = end, False
                yield value
            pos += 1
            if skip_ws():
                raise DataError(f"{label}: unexpected data after the JSON list")
        except UnicodeDecodeError as exc:
            raise DataError(f"{label} is not UTF-8 text ({exc.reason}); re-download the file") from exc


def parse_options(options: Any) -> dict[str, str] | None:
    """`{"A": text, ...}` from `["A. text", ...]`; None if the list is empty, malformed or repeats a letter."""
    if not isinstance(options, list) or not options:
        return None
    parsed: dict[str, str] = {}
    for option in options:
        match = _OPTION.fullmatch(str(option or "").strip())
        if match is None or match.group(1).upper() in parsed:
            return None
        parsed[match.group(1).upper()] = match.group(2)
    return parsed


@register_converter
class AVQAConverter(Converter):
    name = "avqa"
    version = "1"
    schema = SCHEMA

    def __init__(self) -> None:
        self._found: dict[tuple[Path, str], str | None] = {}  # (raw root, split) -> JSON file

    def _json_file(self, raw: RawSource, split: str) -> str | None:
        if (raw.root, split) not in self._found:
            name = SPLIT_FILES[split]
            matches = sorted(rel for rel in raw.files if rel == name or rel.endswith("/" + name))
            if len(matches) > 1:
                raise DataError(f"{raw.uri}: several {name} files ({matches}); point the source at one "
                                "AVQA-R1-6K folder")
            self._found[(raw.root, split)] = matches[0] if matches else None
        return self._found[(raw.root, split)]

    def splits(self, raw: RawSource) -> list[str]:
        return [split for split in SPLIT_FILES if self._json_file(raw, split)]

    def records(self, raw: RawSource, split: str) -> Iterator[RawRecord]:
        rel = self._json_file(raw, split)
        if rel is None:
            raise DataError(f"{raw.uri}: {SPLIT_FILES[split]} is missing; expected the AVQA-R1-6K layout")
        for row, record in enumerate(iter_json_array(raw.path(rel), f"{raw.uri}: {rel}")):
            yield rel, row, record

    def _media(self, raw: RawSource, split: str, path: Any, kind: str) -> bytes:
        """Bytes of a media file named relative to the split folder (or, failing that, the dataset root)."""
        split_dir = self._json_file(raw, split).rsplit("/", 1)[0]
        root = split_dir.rsplit("/", 1)[0] if "/" in split_dir else ""
        for base in (split_dir, root):
            rel = safe_join(base, str(path or ""))
            if rel is not None and rel in raw.files:
                return raw.path(rel).read_bytes()
        raise RowRejected(f"missing {kind} file: {path!r}")

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        if not isinstance(record, dict):
            raise RowRejected("record is not a JSON object")
        problem = str(record.get("problem") or "").strip()
        if not problem:
            raise RowRejected("empty question")
        if record.get("data_type") != "image_audio":
            raise RowRejected(f"unsupported data_type: {record.get('data_type')!r} (expected 'image_audio')")
        options = parse_options(record.get("options"))
        if options is None:
            raise RowRejected("invalid options: expected a list like ['A. ...', 'B. ...']")
        solution = str(record.get("solution") or "").strip()
        if not solution:
            raise RowRejected("missing answer")
        answer = _ANSWER.fullmatch(solution)
        if answer is None or answer.group(1).upper() not in options:
            raise RowRejected(f"invalid answer: {solution!r} is not <answer>X</answer> with X among the options")
        media = record.get("path") if isinstance(record.get("path"), dict) else {}
        image = self._media(raw, split, media.get("image"), "image")
        if problem_ := image_problem(image, self.limits):
            raise RowRejected(problem_)
        audio = self._media(raw, split, media.get("audio"), "audio")
        if problem_ := wav_problem(audio, self.limits):
            raise RowRejected(problem_)
        lines = "\n".join(f"{letter}. {text}" for letter, text in options.items())
        return {
            "data_source": "avqa_r1_6k",
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                       {"role": "user", "content": f"<image><audio>{problem}\nOptions:\n{lines}"}],
            "images": [{"bytes": image}],
            "audios": [{"bytes": audio}],
            "ability": "audio_visual_qa",
            "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {
                "split": split, "index": index, "problem_id": str(record.get("problem_id", index)),
                "dataset": "AVQA-R1-6K", "problem_type": str(record.get("problem_type") or ""),
                "raw_problem": problem, "raw_solution": solution,
                "options": json.dumps(options, ensure_ascii=False),
            },
        }


# ---- fixture: JSON lists plus JPEG and WAV files, as the dataset ships them -------------------------

_SOURCES = {"dog": 330.0, "car": 110.0, "bird": 1760.0, "piano": 523.0, "drum": 82.0, "bell": 1318.0,
            "rain": 220.0, "guitar": 392.0}
_QUESTIONS = ["What is the main source of the sound in this scene?",
              "Which object in the image is making the sound you hear?",
              "What is producing the sound in this clip?"]


def _write_split(out: Path, split_dir: str, n: int, rng: random.Random, bad_rows: int) -> Path:
    folder = out / split_dir
    (folder / "images").mkdir(parents=True, exist_ok=True)
    (folder / "audios").mkdir(parents=True, exist_ok=True)
    bad_at = set(rng.sample(range(n + bad_rows), bad_rows))
    records = []
    for idx in range(n + bad_rows):
        names = rng.sample(sorted(_SOURCES), 4)
        correct = rng.randrange(4)
        image, audio = f"images/sample_{idx}.jpg", f"audios/sample_{idx}.wav"
        record = {
            "problem_id": idx, "problem": rng.choice(_QUESTIONS), "data_type": "image_audio",
            "problem_type": "multiple choice", "options": [f"{'ABCD'[i]}. {name}" for i, name in enumerate(names)],
            "solution": f"<answer>{'ABCD'[correct]}</answer>", "path": {"image": image, "audio": audio},
            "data_source": "OmniInstruct_v1-AVQA",
        }
        kind = sorted(bad_at).index(idx) % 6 if idx in bad_at else -1
        if kind != 0:  # 0: the image file is missing
            data = b"\xff\xd8\xff\xe0 not a jpeg" if kind == 1 else encode_image(
                draw_scene(rng, (96, 96), names[correct]), "JPEG")
            (folder / image).write_bytes(data)
        if kind != 2:  # 2: the audio file is missing
            data = b"RIFF\x00\x00\x00\x00WAVEjunk" if kind == 3 else tone_wav(_SOURCES[names[correct]])
            (folder / audio).write_bytes(data)
        if kind == 4:
            record["solution"] = ""  # missing answer
        if kind == 5:
            record["problem"] = ""  # empty question
        records.append(record)
    path = folder / f"omni_rl_format_{split_dir}.json"
    path.write_text(json.dumps(records, indent=2), encoding="utf-8")
    return path


@register_fixture("avqa")
def avqa_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    """`rows` train and max(1, rows // 4) valid records; `bad_rows` unusable records mixed into train
    (in turn: missing image file, undecodable image, missing audio file, undecodable audio, missing
    answer, empty question)."""
    rng = random.Random(f"avqa:{seed}")
    _write_split(out, "train", rows, rng, bad_rows)
    _write_split(out, "valid", max(1, rows // 4), rng, 0)
    return sorted(p for p in out.rglob("*") if p.is_file())
