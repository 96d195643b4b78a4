"""The fields of TRL's config classes, read from TRL's and transformers' source files without importing
them: `from trl import GRPOConfig` imports torch and transformers' trainer stack (~10 CPU s here), which
`omni validate` should not pay to learn a list of names. The class's dataclass fields are its annotated
class attributes and those of its bases (`_BaseConfig`, transformers' `TrainingArguments`); a test
compares the result with `dataclasses.fields` of the imported class.

    config_fields("GRPOConfig")   # frozenset({"beta", "num_generations", ..., "learning_rate", ...}) or None
    precheck_stage(stage)         # a PrecheckResult: ok, skipped (no TRL here) or refused (an unknown override)
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from omni_core.backends import PrecheckResult
from omni_core.backends.trl.render import CONFIG_MODULES, render

CHECK = "trl config check"
# a base class imported from another package: where it is defined (transformers re-exports it lazily)
EXTERNAL_BASES = {"TrainingArguments": ("transformers", "training_args.py")}


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)  # a top-level package: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def trl_version() -> str | None:
    try:
        return version("trl")
    except PackageNotFoundError:
        return None


@cache
def config_fields(config_class: str) -> frozenset[str] | None:
    """The init fields of TRL's `config_class` (e.g. GRPOConfig), or None where TRL is not installed."""
    trl = _package_dir("trl")
    if trl is None:
        return None
    return frozenset(_class_fields(trl.parent / CONFIG_MODULES[config_class], config_class))


def _class_fields(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        raise LookupError(f"{path} defines no class {name}")
    fields = {node.target.id for node in cls.body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and "ClassVar" not in ast.unparse(node.annotation) and not _init_false(node.value)}
    for base in cls.bases:
        if isinstance(base, ast.Name):
            fields |= _class_fields(_base_file(path, tree, base.id), base.id)
    return fields


def _init_false(value: ast.expr | None) -> bool:
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in value.keywords)


def _base_file(path: Path, tree: ast.Module, base: str) -> Path:
    """The file defining `base`, as `path`'s module imports it (a relative import, or an external base)."""
    if base in EXTERNAL_BASES:
        package, module = EXTERNAL_BASES[base]
        found = _package_dir(package)
        if found is None:
            raise LookupError(f"{package} is not installed")
        return found / module
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == base for a in node.names) and node.level:
            folder = path.parent
            for _ in range(node.level - 1):
                folder = folder.parent
            return folder.joinpath(*(node.module or "").split(".")).with_suffix(".py")
    return path  # defined in the same file


def precheck_stage(stage: Any) -> PrecheckResult:
    """`backend.overrides` against the fields of the stage's TRL config class."""
    rendered = render(stage, 0)
    config_class = rendered.config_class
    fields = config_fields(config_class)
    if fields is None:
        return PrecheckResult(stage.name, "skipped", "trl is not installed here, so backend.overrides were not "
                              "checked against its config class (`make setup` installs it)", CHECK)
    where = f"{config_class} of trl {trl_version()}"
    for name in stage.backend.overrides:
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            return PrecheckResult(stage.name, "refused", f"not a field of {where}{hint}", CHECK,
                                  key=f"backend.overrides.{name}")
    return PrecheckResult(stage.name, "ok", f"backend.overrides are fields of {where}", CHECK)
