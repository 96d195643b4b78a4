"""Load a pipeline file from YAML, apply dotted overrides, validate, and report errors by key path."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from omni_core.config.algorithms import get_algorithm
from omni_core.config.backends import get_backend_record
from omni_core.config.models import _STAGE_CONFIGS, DatasetConfig, PipelineConfig
from omni_core.config.names import name_problem
from omni_core.errors import ConfigError


class ConfigValidationError(ConfigError):
    """Validation failed; `errors` holds one `key.path: message` line per problem."""

    def __init__(self, source: str, errors: list[str]):
        self.source = source
        self.errors = errors
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        super().__init__(
            f"{source}: {errors[0]}{more}; fix the file or the override "
            f"(`omni validate {source}` lists every error)"
        )


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping with the same key twice (plain PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(key, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, first: int, again: int):
        super().__init__(f"key {key!r} appears twice in one mapping (line {first} and line {again})")
        self.key, self.first, self.again = key, first, again


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such pipeline file; check the path (examples are in configs/)")
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a pipeline file; pass a .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.__class__.__name__}: {exc}); check its permissions and encoding") from exc
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{path}: {exc}; keep one of them (YAML would silently use the last)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: invalid YAML{where}: {problem}; fix the syntax") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a pipeline file must be a YAML mapping (name:, stages:, ...), got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML (3 -> int, true -> bool, [a] -> list).

    A list of named items (stages) is addressed by the item's name: `stages.rl.trainer.total_steps=3`;
    an integer index works too. The same KEY.PATH given twice is refused (as a key written twice in
    the file is), rather than the last one silently winning.
    """
    given: dict[str, str] = {}
    for override in overrides:
        path, sep, raw_value = override.partition("=")
        if not sep or not path:
            raise ConfigError(f"override '{override}': expected KEY.PATH=VALUE, e.g. stages.rl.trainer.total_steps=3")
        if path in given:
            raise ConfigError(f"override '{override}': {path} is already set by '{given[path]}'; give each key once")
        given[path] = override
        try:
            value = yaml.load(raw_value, Loader=UniqueKeyLoader) if raw_value != "" else ""
        except DuplicateKeyError as exc:
            raise ConfigError(f"override '{override}': {exc.args[0].split(' (line')[0]}; keep one") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"override '{override}': value is not valid YAML; quote it") from exc
        set_path(data, path, value, f"override '{override}'")
    return data


def set_path(data: dict[str, Any], path: str, value: Any, what: str) -> None:
    """Set dotted `path` of a pipeline mapping to `value`, addressing stages by name (or index) as
    overrides do; a ConfigError starting with `what` when the path goes through a missing item."""
    keys = path.split(".")
    node: Any = data
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        where = ".".join(keys[: i + 1])
        if isinstance(node, list):
            index = _list_index(node, key)
            if index is None:
                names = [str(item.get("name")) for item in node if isinstance(item, dict)]
                raise ConfigError(f"{what}: no item '{key}' in {'.'.join(keys[:i]) or 'root'} (have: {', '.join(names)})")
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[key] = value
            else:
                node = node.setdefault(key, {})
        else:
            raise ConfigError(f"{what}: '{where}' goes inside a {type(node).__name__}, not a mapping")


def _list_index(items: list[Any], key: str) -> int | None:
    for index, item in enumerate(items):
        if isinstance(item, dict) and item.get("name") == key:
            return index
    if key.lstrip("-").isdigit() and -len(items) <= int(key) < len(items):
        return int(key) % len(items)
    return None


def validate_pipeline(data: dict[str, Any], source: str = "<pipeline>") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigValidationError(source, [_format_error(err, data) for err in exc.errors()]) from None


def validate_dataset(name: str, data: dict[str, Any]) -> DatasetConfig:
    """One dataset given outside a pipeline file (`omni ingest NAME --source URI`), checked as the
    pipeline's `datasets.NAME` is; a ConfigError naming the first problem otherwise."""
    errors = [problem] if (problem := name_problem(name, "dataset name")) else []
    try:
        config = DatasetConfig.model_validate(data)
    except ValidationError as exc:
        errors += [f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()]
    if errors:
        raise ConfigError(f"ingest {name}: {'; '.join(errors)}")
    return config


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    data = apply_overrides(read_yaml(path), list(overrides or []))
    return validate_pipeline(data, str(path))


def _format_error(err: dict[str, Any], data: dict[str, Any]) -> str:
    """`stages.rl.trainer.total_steps: Input should be a valid integer (got 'x')`.

    Stage indices are shown as the stage's name (the spelling overrides use), and pydantic's
    discriminator tag (`rl`, `ingest`) is dropped from the path.
    """
    loc = list(err["loc"])
    parts: list[str] = []
    node: Any = data
    i = 0
    while i < len(loc):
        key = loc[i]
        if isinstance(node, list) and isinstance(key, int):
            item = node[key] if key < len(node) else None
            parts.append(str(item["name"]) if isinstance(item, dict) and "name" in item else str(key))
            node = item
            if isinstance(item, dict) and i + 1 < len(loc) and loc[i + 1] == item.get("kind"):
                i += 1  # the discriminator tag pydantic inserts
        else:
            parts.append(str(key))
            node = node.get(key) if isinstance(node, dict) else None
        i += 1
    message = err["msg"].removeprefix("Value error, ")
    if not parts:
        return message  # model-level checks already name their key path
    about = field_description(loc, data) if err["type"] not in ("missing", "extra_forbidden") else None
    if err["type"] == "union_tag_invalid":
        expected = err.get("ctx", {}).get("expected_tags", "")
        return f"{'.'.join(parts)}.kind: unknown stage kind {err['ctx'].get('tag')!r} (known: {expected})"
    if err["type"] == "extra_forbidden":
        message = "unknown key (remove it or check its spelling)"
    elif err["type"] not in ("missing", "value_error", "unknown_stage_kind") and "input" in err:
        message += f" (got {err['input']!r})"
    if about:
        message += f". {parts[-1]}: {about.rstrip('.')}"
    return f"{'.'.join(parts) or 'pipeline'}: {message}"


def field_description(loc: list[Any] | tuple[Any, ...], data: Any) -> str | None:
    """The description of the field at `loc` (the one the docs' reference shows), following the pipeline
    as written: a stage's kind picks its model, an `algorithm:` or `backend:` its name's options, a
    dataset's key DatasetConfig."""
    model: Any = PipelineConfig
    node: Any = data
    field = None
    keyed = False  # the next key is a name in a mapping of models (datasets: NAME)
    for key in loc:
        if isinstance(node, list) and isinstance(key, int):  # a stage
            node = node[key] if key < len(node) else None
            kind = node.get("kind") if isinstance(node, dict) else None
            model = _STAGE_CONFIGS.get(kind, None) if isinstance(kind, str) else None
            continue
        if keyed:
            node, keyed = node.get(key) if isinstance(node, dict) else None, False
            continue
        if model is None or not isinstance(key, str) or key not in model.model_fields:
            return None
        field = model.model_fields[key]
        node = node.get(key) if isinstance(node, dict) else None
        model, keyed = _model_of(key, field, node)
    return field.description if field is not None else None


def _model_of(key: str, field: Any, value: Any) -> tuple[Any, bool]:
    """The model a field's value is parsed by (its annotation's, or the chosen algorithm's / backend's),
    and whether the value is a mapping of names to that model."""
    from typing import get_args, get_origin

    from pydantic import BaseModel

    name = value.get("name") if isinstance(value, dict) else None
    try:
        if key == "algorithm" and name:
            return get_algorithm(str(name)).options, False
        if key == "backend" and name:
            return get_backend_record(str(name)).options, False
    except ConfigError:
        return None, False
    annotation = field.annotation
    keyed = get_origin(annotation) is dict
    for arg in (annotation, *get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, keyed
    return None, keyed


def config_digest(config: Any) -> str:
    """sha256 of a config's canonical JSON; the same settings give the same digest."""
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
