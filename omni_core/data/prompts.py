"""Prompt lists (one prompt per line in `train.txt` / `test.txt`) -> verl RL Parquet in the form the data
script of a VeRL-Omni text-to-image / text-to-video recipe writes (VeRL-Omni at the catalog's pinned commit):

- `vid_prompt`: VidProM prompts (the 50,000-prompt subset of DanceGRPO's assets/video_prompts.txt, split
  into dataset/vid_prompt/{train,test}.txt as examples/flowgrpo_trainer/ltx2/README.md does) ->
  examples/flowgrpo_trainer/ltx2/prepare_data.py's rows (LTX-2.3, text -> video+audio).
- `hpsv3`: the pre-split video prompts (hub id Hao7/video_prompts: train.txt, test.txt) ->
  examples/dancegrpo_trainer/data_process/wan22_hpsv3.py's rows (Wan2.2 DanceGRPO). The script leaves
  out lines with Chinese characters (`[\\u4e00-\\u9fff]`): they are skipped here, counted.
- `pickscore_sfw`: flow_grpo's dataset/pickscore_sfw/{train,test}.txt (the provided split the SD3.5 +
  DiNa-LRM recipe's docs download) -> examples/flowgrpo_trainer/data_process/sd3_pickscore_sfw.py
  `--input-dir` rows (SD3 form: one user message, `extra_info.raw_prompt`).

Raw: UTF-8 text, one prompt per line; each line is stripped and a blank line is not a prompt (as all
three scripts read them). A line that is not UTF-8, or that holds control characters, is quarantined
(the scripts would fail on the whole file, or hand the text encoder the control bytes).
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from omni_core.data.converter import (
    RawRecord,
    RowRejected,
    RowSkipped,
    SplitFileConverter,
    register_converter,
)
from omni_core.data.fixtures import register_fixture
from omni_core.data.schema import MESSAGE, REWARD_MODEL, extra_info, rl_schema
from omni_core.data.sources import RawSource
from omni_core.errors import DataError

_CHINESE = re.compile(r"[\u4e00-\u9fff]")  # wan22_hpsv3.py's _contains_chinese


def _control(text: str) -> bool:
    return any(unicodedata.category(c) == "Cc" and c != "\t" for c in text)


class PromptLinesConverter(SplitFileConverter):
    """A dataset of `{split}.txt` prompt files (found anywhere under the source by file name)."""

    split_suffix = ".txt"

    def records(self, raw: RawSource, split: str) -> Iterator[RawRecord]:
        rel = self.split_file(raw, split)
        if rel is None:
            raise DataError(f"{raw.uri}: {split}.txt is missing; expected one prompt per line in train.txt / test.txt")
        with open(raw.path(rel), "rb") as lines:
            for line_no, line in enumerate(lines):
                try:
                    text = line.decode("utf-8").strip()
                except UnicodeDecodeError:
                    yield rel, line_no, {"line": line.rstrip(b"\r\n")}  # quarantined by convert
                    continue
                if text:
                    yield rel, line_no, {"text": text}

    def prompt(self, record: dict[str, Any]) -> str:
        """The record's stripped prompt; RowRejected for a line that cannot be one."""
        if "text" not in record:
            raise RowRejected("line is not UTF-8 text")
        text = record["text"]
        if _control(text):
            raise RowRejected("prompt holds control characters")
        return text


@register_converter
class VidPromptConverter(PromptLinesConverter):
    """LTX-2.3 text-to-audio-video (examples/flowgrpo_trainer/ltx2/prepare_data.py `_convert_split`)."""

    name = "vid_prompt"
    version = "1"
    schema = rl_schema(("negative_prompt", pa.list_(MESSAGE)), ("ability", pa.string()), ("reward_model", REWARD_MODEL),
                       ("extra_info", extra_info()))

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        prompt = self.prompt(record)
        return {
            "data_source": "ltx2_t2av",
            "prompt": [{"role": "user", "content": prompt}],
            "negative_prompt": [{"role": "user", "content": ""}],
            "ability": "text_to_audio_video",
            "reward_model": {"style": "rule", "ground_truth": prompt},
            "extra_info": {"split": split, "index": index},
        }


@register_converter
class HPSv3Converter(PromptLinesConverter):
    """Wan2.2 DanceGRPO text-to-video (examples/dancegrpo_trainer/data_process/wan22_hpsv3.py `make_record`:
    an empty system message before the user prompt, negative prompt `" "`)."""

    name = "hpsv3"
    version = "1"
    schema = VidPromptConverter.schema

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        prompt = self.prompt(record)
        if _CHINESE.search(prompt):
            raise RowSkipped("prompt has Chinese characters (wan22_hpsv3.py leaves such lines out)")
        system = {"role": "system", "content": ""}
        return {
            "data_source": "dance_grpo/hpsv3",
            "prompt": [system, {"role": "user", "content": prompt}],
            "negative_prompt": [system, {"role": "user", "content": " "}],
            "ability": "t2v",
            "reward_model": {"style": "model", "ground_truth": prompt},
            "extra_info": {"split": split, "index": index},
        }


@register_converter
class PickScoreSFWConverter(PromptLinesConverter):
    """SD3.5 prompts (examples/flowgrpo_trainer/data_process/sd3_pickscore_sfw.py `build_split`: one user
    message, no negative prompt, the caption as ground truth and `extra_info.raw_prompt`)."""

    name = "pickscore_sfw"
    version = "1"
    schema = rl_schema(("ability", pa.string()), ("reward_model", REWARD_MODEL),
                       ("extra_info", extra_info(("raw_prompt", pa.string()))))

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        caption = self.prompt(record)
        return {
            "data_source": "flow_grpo/pickscore_sfw",
            "prompt": [{"role": "user", "content": caption}],
            "ability": "preference_alignment",
            "reward_model": {"style": "model", "ground_truth": caption},
            "extra_info": {"split": split, "index": index, "raw_prompt": caption},
        }


# ---- fixtures: train.txt / test.txt, one prompt per line, as each source ships them -------------------

_VIDEO_SUBJECTS = ["a golden retriever", "an old fisherman", "a paper boat", "a red fox", "two astronauts",
                   "a street musician", "a hummingbird", "a steam locomotive", "a ballerina", "a lighthouse keeper"]
_VIDEO_ACTIONS = ["running along a beach at sunset", "drifting down a rain-filled gutter", "walking through a snowy forest",
                  "playing a violin under a bridge", "hovering over bright red flowers", "crossing a stone viaduct",
                  "spinning on an empty stage", "climbing a spiral staircase"]
_VIDEO_STYLES = ["cinematic lighting", "4k, slow motion", "handheld camera", "aerial drone shot", "film grain",
                 "soft morning light", "time-lapse", "close-up shot"]
_IMAGE_SUBJECTS = ["a cozy cabin in the mountains", "a cat wearing a tiny crown", "a futuristic city skyline",
                   "a bowl of ramen with a soft egg", "an ancient library full of books", "a koi pond in autumn",
                   "a knight riding a giant snail", "a vintage car parked by the sea"]
_IMAGE_STYLES = ["digital art, highly detailed", "oil painting in the style of impressionism", "studio photograph",
                 "watercolor illustration", "trending on artstation", "octane render, 8k", "pencil sketch"]
_CHINESE_PROMPTS = ["一只猫在窗台上晒太阳", "夜晚的城市街道，霓虹灯闪烁"]


def _video_prompt(rng: random.Random) -> str:
    return f"{rng.choice(_VIDEO_SUBJECTS)} {rng.choice(_VIDEO_ACTIONS)}, {rng.choice(_VIDEO_STYLES)}"


def _image_prompt(rng: random.Random) -> str:
    return f"{rng.choice(_IMAGE_SUBJECTS)}, {rng.choice(_IMAGE_STYLES)}"


def _bad_line(rng: random.Random, k: int, make, chinese: bool) -> bytes:
    """In turn: a line that is not UTF-8 (Latin-1 bytes), one with control characters, and (hpsv3) a
    Chinese prompt."""
    kinds = 3 if chinese else 2
    if k % kinds == 0:
        return (make(rng) + ", café").encode("latin-1")
    if k % kinds == 1:
        return (make(rng) + "\x1b[31m\x00").encode()
    return rng.choice(_CHINESE_PROMPTS).encode()


def _write_prompts(out: Path, rows: int, seed: int, bad_rows: int, name: str, make, chinese: bool = False
                   ) -> list[Path]:
    """`rows` train and max(1, rows // 4) test prompts; `bad_rows` bad train lines (see `_bad_line`);
    a blank line in each file (not a prompt)."""
    rng = random.Random(f"{name}:{seed}")
    paths = []
    for split, n in (("train", rows), ("test", max(1, rows // 4))):
        lines = [make(rng).encode() for _ in range(n)]
        lines.insert(rng.randrange(len(lines) + 1), b"   ")
        if split == "train":
            for k in range(bad_rows):
                lines.insert(rng.randrange(len(lines) + 1), _bad_line(rng, k, make, chinese))
        path = out / f"{split}.txt"
        path.write_bytes(b"\n".join(lines) + b"\n")
        paths.append(path)
    return paths


@register_fixture("vid_prompt")
def vid_prompt_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    return _write_prompts(out, rows, seed, bad_rows, "vid_prompt", _video_prompt)


@register_fixture("hpsv3")
def hpsv3_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    return _write_prompts(out, rows, seed, bad_rows, "hpsv3", _video_prompt, chinese=True)


@register_fixture("pickscore_sfw")
def pickscore_sfw_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    return _write_prompts(out, rows, seed, bad_rows, "pickscore_sfw", _image_prompt)
