"""The backend table: which trainer runs a training stage (`backend:` of an `sft` / `rl` stage).

A backend registers one record: its name, the pydantic model of its options (None: it takes none
and is written as a bare name, as `backend: native` is), and "module:attribute" of its
implementation (an object with the `omni_core.backends.Backend` protocol: plan, check, run, cancel),
imported only when something asks it (`backend_of`), so the config never imports a backend's code.
The options model carries the run-key rules of its options (`BackendOptions`).

    register_backend(BackendRecord(name="verl", options=VerlBackend,
                                   implementation="omni_core.backends.verl.backend:BACKEND",
                                   usage="write backend: {name: verl, shared_dir: PATH}"))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_core.config.algorithms import resolve
from omni_core.registry import Registry

DEFAULT_BACKEND = "native"  # a stage without `backend:` (left out of dumps: digests stay what they were)


class BackendOptions(BaseModel):
    """The base of every backend's options model (`backend: {name: NAME, ...}`)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="The backend.")
    # keys that say where and how the backend runs, not what it trains: left out of the run key
    run_key_excluded: ClassVar[frozenset[str]] = frozenset()
    # the backend decides what the stage's keys mean (a recipe): the algorithm's key checks do not apply,
    # and only the keys the file sets count (`dump_stage`)
    decides_stage_keys: ClassVar[bool] = False
    # a stage that does not set `model:` trains the backend's own model (a recipe's)
    brings_model: ClassVar[bool] = False
    # its final checkpoint is the stage's own model, trained (not a recipe's): a preference eval scores it
    # against the stage's starting model as it scores a native stage's
    trains_stage_model: ClassVar[bool] = False

    def dump_stage(self, stage: Any, data: dict[str, Any]) -> dict[str, Any]:
        """The stage's dump (and so its digest and run key) under this backend; as is by default."""
        return data

    def run_key_options(self, dumped: dict[str, Any]) -> dict[str, Any]:
        """The options' dump as the run key holds it."""
        return {k: v for k, v in dumped.items() if k not in self.run_key_excluded}

    def input_files(self) -> list[str]:
        """Files the options name whose bytes determine the training (e.g. a reward file given to the
        trainer in its own overrides): their sha256 is part of the stage's cache key and run key."""
        return []


@dataclass(frozen=True)
class BackendRecord:
    name: str
    options: type[BackendOptions] | None  # None: no options, written `backend: NAME`
    implementation: str  # "module:attribute" of the Backend object, imported when it is asked for
    usage: str = ""  # how to write it, for an error on `backend: NAME` without its options
    description: str = ""  # one line for listings and the field's description


_BACKENDS: Registry[BackendRecord] = Registry(
    "backend", hint="register one with register_backend(BackendRecord(...)) in a plugin package (docs/concepts/plugins.md)")


def register_backend(record: BackendRecord) -> BackendRecord:
    return _BACKENDS.add(record.name, record)


def backend_names() -> list[str]:
    return _BACKENDS.names()


def get_backend_record(name: str) -> BackendRecord:
    return _BACKENDS.get(name)


def backend_name(backend: Any) -> str:
    """The name of a stage's `backend` value (a bare name or an options model)."""
    return backend if isinstance(backend, str) else backend.name


def backend_of_name(name: str) -> Any:
    """The implementation (omni_core.backends.Backend) registered as `name`, imported now."""
    record = get_backend_record(name)
    return resolve(record.implementation, f"backend {record.name}: implementation")


def backend_of(stage: Any) -> Any:
    """The implementation (omni_core.backends.Backend) of the backend `stage` runs on, imported now."""
    return backend_of_name(backend_name(stage.backend))


def parse_backend(value: Any) -> Any:
    """`backend:` as written -> a bare name (a backend without options) or its options model. A
    ValueError names the backend's key."""
    known = ", ".join(backend_names())
    if isinstance(value, BackendOptions):
        return value
    if isinstance(value, str):
        if value not in _BACKENDS:
            raise ValueError(f"{value!r} is not a backend; use one of {known}")
        record = _BACKENDS[value]
        if record.options is not None:
            try:  # options that all have defaults: the bare name is enough
                return record.options.model_validate({"name": value})
            except ValidationError:
                raise ValueError(f"backend: {value} needs its options: {record.usage}") from None
        return value
    if not isinstance(value, dict):
        raise ValueError(f"must be a backend name or a mapping with name: (one of {known})")
    name = value.get("name")
    if name is None:
        raise ValueError(f"backend.name: missing; one of {known}")
    if name not in _BACKENDS:
        raise ValueError(f"backend.name: {name!r}; use one of {known}")
    record = _BACKENDS[name]
    if record.options is None:
        raise ValueError(f"backend.name: {name} takes no options; write backend: {name}")
    try:  # validated here so that an error names the backend's key
        return record.options.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        message = "unknown key (remove it or check its spelling)" if err["type"] == "extra_forbidden" \
            else err["msg"].removeprefix("Value error, ")
        raise ValueError(f"{key}: {message}" if key else message) from None


def describe_backends(schema: dict[str, Any]) -> None:
    """JSON-schema hook of the `backend:` field: its description lists the registered backends."""
    schema["description"] = "; ".join(
        f"{name}: {record.description}" if record.description else name for name, record in _BACKENDS.items()) \
        + f" (default {DEFAULT_BACKEND}; docs/verl.md)."
