"""Our rewards as TRL reward functions. TRL calls each with the batch's prompts and completions and
every other dataset column as a list keyword argument (`data_source`, `reward_model`, `extra_info`: kept
by omni_core.backends.trl.data); this calls verl's `compute_score(data_source, solution_str,
ground_truth, extra_info)` per completion through our `score_batch`, as our own GRPO trainer does.
Math-Verify keeps its own process pool (its timeouts need `signal.alarm`, which TRL's reward threads and
Ray's workers cannot use).

A custom `path.py:function` reward reaches a worker as the file's bytes (a Ray node may not see the
driver's file), written beside the worker's output and loaded from there: the bytes are the ones the run
key holds (omni_core.pipeline.stages.rl `reward_file`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_core.errors import ConfigError


def completion_text(completion: Any) -> str:
    """A completion as text: conversational ones are a list of messages (the last is the assistant's)."""
    if isinstance(completion, list):
        content = completion[-1]["content"] if completion else ""
        if isinstance(content, list):  # typed parts
            return "".join(p.get("text") or "" for p in content if p.get("type") == "text")
        return content
    return completion


def reward_label(spec: str | None) -> str:
    """The reward's name in TRL's metrics (`rewards/{label}/mean`): the registered name, or the function's."""
    if spec is None:
        return "default"
    path, sep, function = spec.rpartition(":")
    return function if sep and path.endswith(".py") else spec


def trl_reward(spec: str | None) -> Callable[..., list[float]]:
    """A TRL reward function scoring each completion with the reward `spec` names (None: by each row's data_source)."""
    from omni_core.rewards import resolve_reward, score_batch

    fn = resolve_reward(spec)

    def reward(prompts: list[Any], completions: list[Any], data_source: list[str] | None = None,
               reward_model: list[dict[str, Any]] | None = None, extra_info: list[Any] | None = None,
               **_: Any) -> list[float]:
        n = len(completions)
        items = [{"data_source": (data_source or [""] * n)[i] or "", "solution_str": completion_text(c),
                  "ground_truth": ((reward_model or [{}] * n)[i] or {}).get("ground_truth"),
                  "extra_info": (extra_info or [None] * n)[i]} for i, c in enumerate(completions)]
        return [s["score"] for s in score_batch(items, fn)]

    reward.__name__ = reward_label(spec)  # TRL names its metrics after it
    return reward


def shipped_reward(spec: str | None) -> dict[str, Any] | None:
    """A custom `path.py:function` reward as plain data for the workers: its file's name, bytes and function."""
    from omni_core.rewards.registry import custom_reward_file

    file = None if spec is None else custom_reward_file(spec)
    if file is None:
        if spec is not None and spec.rpartition(":")[0].endswith(".py"):
            raise ConfigError(f"custom reward {spec!r}: its file does not exist; fix the path")
        return None
    function = spec.rpartition(":")[2]  # type: ignore[union-attr]
    data = file.read_bytes()
    return {"name": file.name, "bytes": data, "function": function, "sha256": hashlib.sha256(data).hexdigest()}


def unpack_reward(shipped: dict[str, Any] | None, spec: str | None, folder: Path) -> str | None:
    """The reward spec a worker loads: a shipped file written into `folder`, else `spec` as it is."""
    if shipped is None:
        return spec
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / shipped["name"]
    target.write_bytes(shipped["bytes"])
    return f"{target}:{shipped['function']}"
