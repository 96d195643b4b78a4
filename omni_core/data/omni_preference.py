"""Omni-Preference (hub id Omni-RRM/Omni-Preference) -> verl preference (DPO) Parquet, as VeRL-Omni's
examples/dpo_trainer/data_process/omni_preference_dpo_multisource.py, with the media bytes embedded.

Raw: `dataset_jsonl/{image,video,audio}/final_rl_data.jsonl`. Each line has `images|videos|audios`
(paths like `/data/...`), `messages` (the user message ends with a `### Context` block naming the
media file, the question and candidates A and B) and `solution`, a JSON string
`{score_A, score_B, better, reasoning, final_verdict}`. Media live under the dataset root:
images at `{path without /data/}`, videos under `video-dataset/`, audio under `audio_files/` (found by
file name). Rows judged `better == "equal"` are skipped.

One converter covers all three modalities: every row has `images`, `videos` and `audios` columns, and
only the row's own modality is non-null. Split (train/test) by media file name: a media file is in
`test` when sha256("42:" + file name) read as a fraction of 2**256 is below 0.10, so every row about
the same file lands in the same split, independently of the other rows (streaming-friendly; the
upstream script instead shuffles whole groups with random.Random(42) to hit exactly 10% of rows).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa

from omni_core.data.converter import Converter, RawRecord, RowRejected, RowSkipped, register_converter
from omni_core.data.fixtures import register_fixture
from omni_core.data.media import (
    draw_scene,
    encode_image,
    image_problem,
    safe_join,
    stub_mp4,
    tone_wav,
    video_problem,
    wav_problem,
)
from omni_core.data.schema import MEDIA_LIST, MESSAGE, extra_info, rl_schema
from omni_core.data.sources import RawSource

MODALITIES = {"image": "images", "video": "videos", "audio": "audios"}  # modality -> media field / column
SPLIT_SEED, TEST_FRACTION = 42, 0.10
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi")
_CONTEXT = re.compile(r"(?:Image|Video|Audio) file:\s*(?P<media>.+?)\s+Question:\s*(?P<question>.+?)\s+"
                      r"Candidate A:\s*(?P<a>.+?)\s+Candidate B:\s*(?P<b>.+?)\s*\Z", re.DOTALL)
_MEDIA_CHECK = {"image": image_problem, "video": video_problem, "audio": wav_problem}

SCHEMA = rl_schema(
    ("chosen", MESSAGE),
    ("rejected", MESSAGE),
    ("win_score", pa.float64()),
    ("lose_score", pa.float64()),
    ("images", MEDIA_LIST),
    ("videos", MEDIA_LIST),
    ("audios", MEDIA_LIST),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string())])),
    ("extra_info", extra_info(
        ("sample_id", pa.string()), ("question", pa.string()), ("modality", pa.string()),
        ("source_media", pa.string()), ("source_media_name", pa.string()), ("better", pa.string()),
    )),
)


def media_rel(path: str) -> str:
    """A JSONL media path (`/data/rlaif-v-dataset/...`) relative to the dataset root."""
    path = path.replace("\\", "/").strip().rstrip("_")
    return path[len("/data/"):] if path.startswith("/data/") else path.lstrip("/")


def split_of(media_name: str) -> str:
    digest = hashlib.sha256(f"{SPLIT_SEED}:{media_name}".encode()).digest()
    return "test" if int.from_bytes(digest, "big") < TEST_FRACTION * 2 ** 256 else "train"


def _first_media(row: Any, modality: str) -> str:
    items = row.get(MODALITIES[modality]) if isinstance(row, dict) else None
    return str(items[0]) if isinstance(items, list) and items and items[0] else ""


def _context(messages: Any) -> dict[str, str] | None:
    for message in messages if isinstance(messages, list) else []:
        content = str(message.get("content") or "") if isinstance(message, dict) else ""
        if "### Context" in content:
            match = _CONTEXT.search(content.split("### Context", 1)[1].strip())
            return {k: v.strip() for k, v in match.groupdict().items()} if match else {}
    return None


@register_converter
class OmniPreferenceConverter(Converter):
    name = "omni_preference"
    version = "1"
    schema = SCHEMA
    preference_pairs = True

    def __init__(self) -> None:
        self._audio_index: tuple[tuple[Path, str], dict[str, str]] | None = None

    def _jsonl(self, raw: RawSource, modality: str) -> str | None:
        name = f"dataset_jsonl/{modality}/final_rl_data.jsonl"
        return next((rel for rel in sorted(raw.files) if rel == name or rel.endswith("/" + name)), None)

    def splits(self, raw: RawSource) -> list[str]:
        return ["train", "test"] if any(self._jsonl(raw, m) for m in MODALITIES) else []

    def records(self, raw: RawSource, split: str) -> Iterator[RawRecord]:
        for modality in MODALITIES:
            rel = self._jsonl(raw, modality)
            if rel is None:
                continue
            with open(raw.path(rel), encoding="utf-8", errors="replace") as lines:
                for line_no, line in enumerate(lines):
                    if not line.strip():
                        continue
                    record: dict[str, Any] = {"file": rel, "modality": modality, "line": line_no}
                    try:
                        record["row"] = json.loads(line)
                    except json.JSONDecodeError as exc:
                        record.update(row=line.rstrip("\n"), json_error=str(exc))
                    name = PurePosixPath(media_rel(_first_media(record["row"], modality))).name
                    if split_of(name) == split:
                        yield rel, line_no, record

    def _resolve(self, raw: RawSource, root: str, modality: str, rel: str) -> str | None:
        candidates = [rel]
        if modality == "video":
            candidates.insert(0, f"video-dataset/{rel}")
            if not PurePosixPath(rel).suffix:
                candidates += [c + ext for c in list(candidates) for ext in VIDEO_EXTENSIONS]
        if modality == "audio":
            found = self._audio_files(raw, root).get(PurePosixPath(rel).name)
            candidates = ([found] if found else []) + [f"audio_files/{rel}"] + candidates
        for candidate in candidates:
            path = safe_join(root, candidate)
            if path is not None and path in raw.files:
                return path
        return None

    def _audio_files(self, raw: RawSource, root: str) -> dict[str, str]:
        """File name -> shortest path under `audio_files/` (the WAVs are stored flat, found by name)."""
        if self._audio_index is None or self._audio_index[0] != (raw.root, root):
            index: dict[str, str] = {}
            for rel in raw.files:
                if rel.startswith(f"{root}audio_files/"):
                    name = rel.rsplit("/", 1)[-1]
                    if name not in index or len(rel) < len(index[name]):
                        index[name] = rel
            self._audio_index = ((raw.root, root), index)
        return self._audio_index[1]

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        modality, row = record["modality"], record["row"]
        if "json_error" in record:
            raise RowRejected(f"line is not valid JSON: {record['json_error']}")
        if not isinstance(row, dict):
            raise RowRejected("line is not a JSON object")
        media_path = _first_media(row, modality)
        if not media_path:
            raise RowRejected(f"missing {modality} path: no '{MODALITIES[modality]}' entry")
        try:
            solution = json.loads(row["solution"])
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise RowRejected(f"malformed preference JSON: {exc.__class__.__name__}: {exc}") from None
        if not isinstance(solution, dict):
            raise RowRejected("malformed preference JSON: solution is not a JSON object")
        better = str(solution.get("better", "")).strip()
        if better == "equal":
            raise RowSkipped("preference verdict is 'equal'")
        if better not in ("A", "B"):
            raise RowRejected(f"malformed preference JSON: better={better!r}, expected A, B or equal")
        try:
            scores = {"A": float(solution["score_A"]), "B": float(solution["score_B"])}
        except (KeyError, TypeError, ValueError):
            raise RowRejected("malformed preference JSON: score_A/score_B missing or not numbers") from None
        context = _context(row.get("messages"))
        if not context:
            raise RowRejected("no ### Context block (media file, Question, Candidate A, Candidate B) in the messages")
        if not context["question"]:
            raise RowRejected("empty question")
        loser = "B" if better == "A" else "A"
        rel = media_rel(media_path)
        root = record["file"].split("dataset_jsonl/", 1)[0]
        resolved = self._resolve(raw, root, modality, rel)
        if resolved is None:
            raise RowRejected(f"missing {modality} file: {media_path!r}")
        data = raw.path(resolved).read_bytes()
        if problem := _MEDIA_CHECK[modality](data, self.limits):
            raise RowRejected(problem)
        out = {
            "data_source": f"omni_preference/{modality}",
            "prompt": [{"role": "user", "content": f"<{modality}>{context['question']}"}],
            "chosen": {"role": "assistant", "content": context[better.lower()]},
            "rejected": {"role": "assistant", "content": context[loser.lower()]},
            "win_score": scores[better],
            "lose_score": scores[loser],
            "ability": f"{modality}_qa",
            "reward_model": {"style": "preference"},
            "extra_info": {
                "split": split, "index": index, "sample_id": f"omni_pref_{modality}_{record['line']}",
                "question": context["question"], "modality": modality, "source_media": rel,
                "source_media_name": PurePosixPath(rel).name, "better": better,
            },
        }
        return out | {column: [{"bytes": data}] if m == modality else None for m, column in MODALITIES.items()}


# ---- fixture: JSONL per modality plus media under the dataset's folders ---------------------------------

_COLORS = ["red", "blue", "green", "yellow", "purple", "black"]
_SHAPES = ["circle", "square", "ball", "box", "kite"]
_ACTIONS = ["opens a door", "pours water into a cup", "sits on a sofa", "chops an onion", "waves at the camera"]
_SOUNDS = ["a dog barking", "rain on a roof", "a car engine", "birds singing", "a bell ringing", "people talking"]
_INTRO = ("You are an expert judge of answers about {what}. Compare the two candidate answers on fluency and "
          "coherence, relevance, accuracy and completeness, reasoning quality, and safety. Score each candidate "
          "from 0 to 10, explain your reasoning, and give the better one as <answer>[[A]]</answer> or "
          "<answer>[[B]]</answer>.\n\n")
_WHAT = {"image": "an image", "video": "a video", "audio": "an audio clip"}


def _media_path(rng: random.Random, modality: str, n: int) -> str:
    if modality == "image":
        return f"/data/rlaif-v-dataset/llava1.5_raw_images/{n // 100:05d}/{n:09d}.jpg"
    if modality == "video":
        source = rng.choice(["Charades", "activitynet", "NextQA", "youcook2"])
        return f"/data/academic_source/{source}/{n:05X}.mp4"
    return f"/data/audio/clip_{n:06d}_extract.wav"


def _media_file(modality: str, path: str) -> str:
    rel = media_rel(path)
    return {"image": rel, "video": f"video-dataset/{rel}", "audio": f"audio_files/audio_files/{Path(rel).name}"}[modality]


def _media_bytes(rng: random.Random, modality: str, label: str) -> bytes:
    if modality == "image":
        return encode_image(draw_scene(rng, (96, 96), label), "JPEG")
    if modality == "video":
        return stub_mp4(rng.randbytes(256))
    return tone_wav(rng.choice([220.0, 330.0, 440.0, 660.0]))


def _qa(rng: random.Random, modality: str) -> tuple[str, str, str, str]:
    """Question, a good answer, a poor answer, and the label drawn into the media."""
    if modality == "image":
        color, other, shape = *rng.sample(_COLORS, 2), rng.choice(_SHAPES)
        return (f"What color is the {shape} in the picture?", f"The {shape} in the picture is {color}.",
                f"It is {other}, I think.", f"{color} {shape}")
    if modality == "video":
        good, bad = rng.sample(_ACTIONS, 2)
        return ("What does the person do at the end of the video?",
                f"At the end of the video the person {good}.", f"The person {bad}.", good)
    good, bad = rng.sample(_SOUNDS, 2)
    return "What sound can be heard in the recording?", f"The recording contains {good}.", f"Only {bad}.", good


def _line(rng: random.Random, modality: str, media: str, bad_kind: int | None) -> tuple[dict[str, Any], str]:
    question, good, poor, label = _qa(rng, modality)
    better = rng.choice("AB")
    a, b = (good, poor) if better == "A" else (poor, good)
    win, lose = rng.randrange(6, 10), rng.randrange(2, 6)
    score_a, score_b = (win, lose) if better == "A" else (lose, win)
    if bad_kind == 4:
        better, score_b = "equal", score_a
    solution = json.dumps({"score_A": score_a, "score_B": score_b, "better": better,
                           "reasoning": f"Candidate {better} answers the question more accurately.",
                           "final_verdict": f"<answer>[[{better}]]</answer>"})
    context = (f"### Context\n{modality.capitalize()} file: {media}\nQuestion: {question}\n"
               f"Candidate A: {a}\nCandidate B: {b}")
    if bad_kind == 0:
        solution = solution[: len(solution) // 2]  # malformed preference JSON
    if bad_kind == 2:
        context = f"Question: {question}\nA: {a}\nB: {b}"  # no ### Context block
    content = _INTRO.format(what=_WHAT[modality]) + context
    return {MODALITIES[modality]: [media], "messages": [{"role": "user", "content": content}],
            "solution": solution}, label


def _write_modality(out: Path, modality: str, rows: int, rng: random.Random, bad_kinds: list[int]) -> None:
    names: list[str] = []
    serial = rng.randrange(10_000)
    for j in range(min(rows, max(2, (rows + 1) // 2))):  # about two questions per media file
        want = {0: "test", 1: "train"}.get(j)  # at least one media file in each split
        while True:
            serial += 1
            path = _media_path(rng, modality, serial)
            if want in (None, split_of(Path(media_rel(path)).name)):
                break
        names.append(path)
    plan: list[tuple[str, int | None]] = [(names[i % len(names)], None) for i in range(rows)]
    for kind in bad_kinds:
        serial += 1
        media = _media_path(rng, modality, serial) if kind in (1, 3) else rng.choice(names)
        plan.insert(rng.randrange(len(plan) + 1), (media, kind))
    written: set[str] = set()
    lines = []
    for media, kind in plan:
        record, label = _line(rng, modality, media, kind)
        lines.append(json.dumps(record, ensure_ascii=False))
        target = out / _media_file(modality, media)
        if kind == 1 or (media in written and kind != 3):
            continue  # 1: the media file is missing
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"\x00corrupt media\x00" if kind == 3 else _media_bytes(rng, modality, label))
        written.add(media)
    jsonl = out / "dataset_jsonl" / modality / "final_rl_data.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")


@register_fixture("omni_preference")
def omni_preference_fixture(out: Path, rows: int, seed: int, bad_rows: int) -> list[Path]:
    """`rows` lines per modality; the k-th of `bad_rows` goes to modality k % 3 and is, in turn: malformed
    preference JSON, a missing media file, no ### Context block, undecodable media, or an "equal"
    verdict (skipped, not quarantined)."""
    rng = random.Random(f"omni_preference:{seed}")
    for m, modality in enumerate(MODALITIES):
        _write_modality(out, modality, rows, rng, [k % 5 for k in range(bad_rows) if k % 3 == m])
    return sorted(p for p in out.rglob("*") if p.is_file())
