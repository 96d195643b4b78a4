"""Reward functions by name, by `data_source`, or by a custom `path/to/file.py:function` spec.

A reward function has the signature
    compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float | dict
and returns either the score as a float or a dict with at least the key "score" (plus any other
per-sample metrics, e.g. "accuracy", "format_reward"). `as_score_dict` normalises both to a dict.
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omni_core.errors import ConfigError

RewardFn = Callable[..., "float | dict[str, Any]"]
_BY_NAME: dict[str, RewardFn] = {}
_BY_DATA_SOURCE: dict[str, RewardFn] = {}


def register_reward(name: str, data_sources: Iterable[str] = ()) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under `name` and each of its `data_sources`."""

    def wrap(fn: RewardFn) -> RewardFn:
        _BY_NAME[name] = fn
        for source in data_sources:
            _BY_DATA_SOURCE[source] = fn
        return fn

    return wrap


def reward_names() -> list[str]:
    return sorted(_BY_NAME)


def reward_data_sources() -> list[str]:
    return sorted(_BY_DATA_SOURCE)


def get_reward(spec: str) -> RewardFn:
    """The reward function for a registered name, a data_source, or `path/to/file.py:function`."""
    if spec in _BY_NAME:
        return _BY_NAME[spec]
    if spec in _BY_DATA_SOURCE:
        return _BY_DATA_SOURCE[spec]
    path, sep, func = spec.rpartition(":")
    if sep and path.endswith(".py"):
        return _load_custom(Path(path).expanduser(), func, spec)
    raise ConfigError(
        f"unknown reward {spec!r}; known names: {', '.join(reward_names()) or '(none)'}; "
        f"known data sources: {', '.join(reward_data_sources()) or '(none)'}; "
        "or give a custom reward as 'path/to/file.py:function'"
    )


def _load_custom(path: Path, func: str, spec: str) -> RewardFn:
    if not path.is_file():
        raise ConfigError(f"custom reward {spec!r}: file {path} does not exist; fix the path")
    module_name = "omni_custom_reward_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"custom reward {spec!r}: {path} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: report it as theirs
        raise ConfigError(f"custom reward {spec!r}: importing {path} failed: {exc!r}") from exc
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ConfigError(f"custom reward {spec!r}: {path} defines no function {func!r}; fix the name")
    return fn


def as_score_dict(result: float | dict[str, Any]) -> dict[str, Any]:
    """Normalise a reward function's result to a dict with a float "score"."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward result {result!r} has no 'score' key")
        return {**result, "score": float(result["score"])}
    return {"score": float(result)}
