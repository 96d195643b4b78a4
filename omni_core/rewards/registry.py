"""Reward functions by name, by `data_source`, or by a custom `path/to/file.py:function` spec.

A reward function has verl's custom-reward signature, so functions move between us and verl
(`custom_reward_function.path/name`) in both directions:

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict

verl calls it with keyword arguments; so do we (`score_batch`). It returns the score as a float, or a
dict with at least the key "score" plus other per-sample metrics ("accuracy", "format_reward", ...);
`as_score_dict` normalises both. For image rewards `solution_str` is the image (see `images.py`).

`get_reward(spec)` resolves a registered name ("mmk12"), a data_source ("openai/gsm8k"), or a file;
`default_compute_score` is itself a reward function that dispatches each call by its `data_source`,
as verl's `default_compute_score` does (registered as the name "default").
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omni_core.errors import ConfigError
from omni_core.registry import Registry

RewardFn = Callable[..., "float | dict[str, Any]"]
SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
_BY_NAME: Registry[RewardFn] = Registry("reward")
_BY_DATA_SOURCE: Registry[RewardFn] = Registry("reward data_source")


def accepts_verl_call(fn: Callable[..., Any]) -> bool:
    """True if `fn` can be called as verl calls a reward: the four arguments by keyword."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: cannot tell, let the call decide
        return True
    try:
        signature.bind(data_source="", solution_str="", ground_truth="", extra_info=None)
    except TypeError:
        return False
    return True


def register_reward(name: str, data_sources: Iterable[str] = ()) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register a reward function under `name` and each of its `data_sources`."""

    def wrap(fn: RewardFn) -> RewardFn:
        if not accepts_verl_call(fn):
            raise TypeError(f"reward {name!r}: {fn.__qualname__} must have the signature {SIGNATURE}")
        _BY_NAME.add(name, fn)
        for source in data_sources:
            _BY_DATA_SOURCE.add(source, fn)
        return fn

    return wrap


def reward_names() -> list[str]:
    return sorted(_BY_NAME)


def reward_data_sources() -> list[str]:
    return sorted(_BY_DATA_SOURCE)


def _known() -> str:
    return (f"known names: {', '.join(reward_names()) or '(none)'}; "
            f"known data sources: {', '.join(reward_data_sources()) or '(none)'}")


def reward_for_data_source(data_source: str) -> RewardFn:
    """The reward function registered for `data_source`; ConfigError if there is none."""
    try:
        return _BY_DATA_SOURCE[data_source]
    except KeyError:
        raise ConfigError(f"no reward registered for data_source {data_source!r}; {_known()}") from None


def custom_reward_spec(spec: str) -> tuple[Path, str] | None:
    """(file, function) of a custom `path/to/file.py:function` reward spec, else None."""
    path, sep, func = spec.rpartition(":")
    return (Path(path).expanduser(), func) if sep and path.endswith(".py") else None


def custom_reward_file(spec: str | None) -> Path | None:
    """The file of a custom `path/to/file.py:function` reward when it exists (its bytes key the stages
    that use it), else None."""
    custom = custom_reward_spec(spec or "")
    return custom[0] if custom and custom[0].is_file() else None


def reward_problem(spec: str) -> str | None:
    """Why `spec` names no reward (None: it does), without running anything: a custom reward's file is
    only looked for (its import, its function and signature are checked where it runs)."""
    if spec in _BY_NAME or spec in _BY_DATA_SOURCE:
        return None
    custom = custom_reward_spec(spec)
    if custom is None:
        return f"unknown reward {spec!r}; {_known()}; or give a custom reward as 'path/to/file.py:function'"
    return None if custom[0].is_file() else f"custom reward {spec!r}: file {custom[0]} does not exist; fix the path"


def get_reward(spec: str) -> RewardFn:
    """The reward function for a registered name, a data_source, or `path/to/file.py:function`."""
    if spec in _BY_NAME:
        return _BY_NAME[spec]
    if spec in _BY_DATA_SOURCE:
        return _BY_DATA_SOURCE[spec]
    custom = custom_reward_spec(spec)
    if custom is None or not custom[0].is_file():
        raise ConfigError(reward_problem(spec))
    return _load_custom(*custom, spec)


def _load_custom(path: Path, func: str, spec: str) -> RewardFn:
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
    if not accepts_verl_call(fn):
        raise ConfigError(f"custom reward {spec!r}: {func}{inspect.signature(fn)} cannot be called as "
                          f"verl calls rewards; use the signature {SIGNATURE}")
    return fn


@register_reward("default")
def default_compute_score(
    data_source: str,
    solution_str: Any,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Score with the reward registered for `data_source` (verl's `default_compute_score` role)."""
    fn = reward_for_data_source(data_source)
    return fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
              extra_info=extra_info, **kwargs)


def as_score_dict(result: float | dict[str, Any]) -> dict[str, Any]:
    """Normalise a reward function's result to a dict with a float "score"."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"reward result {result!r} has no 'score' key")
        return {**result, "score": float(result["score"])}
    return {"score": float(result)}
