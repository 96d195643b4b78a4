"""A committed dataset version -> the Hugging Face `datasets.Dataset` a TRL trainer takes, on each Ray Train
worker: HF `datasets` over the version's Parquet shards (not Ray Data: GRPO's grouped sampler, which
hands each prompt to `num_generations` completions, stays TRL's), mapped to TRL's columns.

- GRPO: `prompt` (the chat messages); `data_source`, `reward_model`, `extra_info` stay as columns, which
  TRL hands the reward function (omni_core.backends.trl.rewards) as keyword arguments.
- DPO / MPO: `prompt`, `chosen`, `rejected` (TRL's conversational form: a list of messages each).
- SFT: `prompt` and `completion` (one assistant message: the row's response, `algorithm.response`).

verl's `<image>` / `<audio>` / `<video>` markers: a text-only model gets the prompt without them (as our
own trainers do) and no media; a vision-language model gets typed content parts (`{"type": "image"}` where
the marker was, which TRL fills with the row's images in order) and `images` decoded to PIL. Audio and
video are refused: TRL's trainers take images only.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from omni_core.errors import DataError
from omni_core.models.media import MEDIA_MARKER, media_messages

REWARD_COLUMNS = ("data_source", "reward_model", "extra_info")
MEDIA_COLUMNS = ("images", "audios", "videos")


def read_version(store: Any, shard_keys: list[str], folder: str | Path) -> Any:
    """The shards as one `datasets.Dataset` (downloaded into `folder`: the store may be S3)."""
    import datasets

    from omni_core.storage.local_copy import download_prefix

    download_prefix(store, shard_keys, folder)
    files = [str(Path(folder) / key) for key in shard_keys]
    return datasets.Dataset.from_parquet(files, cache_dir=str(Path(folder) / "hf-cache"), keep_in_memory=True)


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Chat messages without verl's media markers."""
    return [{"role": m["role"], "content": MEDIA_MARKER.sub("", m["content"])} for m in messages]


def vision_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as typed parts (`{"type": "image"}`, `{"type": "text", "text": ...}`), marker positions kept."""
    return media_messages([{"role": m["role"], "content": m["content"]} for m in messages])


def _media_problem(dataset: Any, vision: bool) -> str | None:
    present = [c for c in ("audios", "videos") if c in dataset.column_names
               and any(v for v in dataset[c])]
    if vision and present:
        return f"rows with {', '.join(present)}: TRL's trainers take images only"
    return None


def to_trl(dataset: Any, algorithm: str, *, vision: bool, response: str = "auto") -> Any:
    """`dataset` (verl rows) mapped to TRL's columns for `algorithm` (module docstring)."""
    import datasets

    if problem := _media_problem(dataset, vision):
        raise DataError(f"backend trl: {problem}; train a text model on them (their text only), or use backend: "
                        "native")
    messages = vision_messages if vision else text_messages
    if algorithm in ("grpo", "gspo"):
        keep = [c for c in REWARD_COLUMNS if c in dataset.column_names]

        def row(r: dict[str, Any]) -> dict[str, Any]:
            return {"prompt": messages(r["prompt"])}
    elif algorithm in ("dpo", "mpo"):
        keep = []

        def row(r: dict[str, Any]) -> dict[str, Any]:
            return {"prompt": messages(r["prompt"]), "chosen": [dict(r["chosen"])], "rejected": [dict(r["rejected"])]}
    elif algorithm == "sft":
        from omni_core.training.sft import row_response

        keep = []

        def row(r: dict[str, Any]) -> dict[str, Any]:
            return {"prompt": messages(r["prompt"]),
                    "completion": [{"role": "assistant", "content": row_response(r, response)}]}
    else:
        raise DataError(f"backend trl: no TRL trainer for algorithm {algorithm}")
    images = vision and "images" in dataset.column_names
    dropped = [c for c in dataset.column_names if c not in keep and not (images and c == "images")]
    # a fingerprint of our own: datasets would otherwise hash `row` with dill (and print its bytecode)
    mapped = dataset.map(row, remove_columns=dropped, keep_in_memory=True,
                         new_fingerprint=f"omni-trl-{algorithm}-{'vision' if vision else 'text'}-{dataset._fingerprint}")
    if images:
        mapped = mapped.cast_column("images", datasets.List(datasets.Image()))
    return mapped


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether transformers loads `model_dir` as an image-text-to-text model (TRL then passes it images)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return type(AutoConfig.from_pretrained(model_dir)) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING


def trl_dataset(store: Any, shard_keys: list[str], algorithm: str, model_dir: str | Path, *,
                response: str = "auto") -> tuple[Any, bool]:
    """(the stage's split as TRL's dataset, whether the model sees images)."""
    vision = is_vision_model(model_dir)
    with tempfile.TemporaryDirectory(prefix="omni-trl-data-") as folder:
        dataset = read_version(store, shard_keys, folder)
        return to_trl(dataset, algorithm, vision=vision, response=response), vision
