"""The import layers (docs/design.md), read from every module's syntax tree, lazy imports inside
functions included: a violation fails here, not in a deployment that lacks the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` imports, as absolute names (relative ones resolved against `package`);
    `from pkg import name` counts as importing `pkg` and `pkg.name` (name may be a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def file_imports(path: Path) -> set[str]:
    name = module_name(path)
    return imported_modules(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def offenders(files: list[Path], forbidden: str) -> dict[str, list[str]]:
    found = {}
    for path in files:
        bad = sorted(n for n in file_imports(path) if n == forbidden or n.startswith(forbidden + "."))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_walk_sees_lazy_relative_and_from_imports() -> None:
    source = ("import os\n"
              "def f():\n    from ..training import runner\n    import prefect.flows\n"
              "class C:\n    def g(self):\n        from flows import cli\n")
    names = imported_modules(source, "omni_core.rollout")
    assert {"omni_core.training", "omni_core.training.runner", "prefect.flows", "flows.cli", "os"} <= names
    files = sorted((ROOT / "omni_core" / "rollout").rglob("*.py"))
    assert ROOT / "omni_core" / "rollout" / "autoregressive.py" in files


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("omni_core/rollout", "omni_core.training"),  # training uses the rollout engines, never the reverse
    ("omni_core", "prefect"),  # the library runs without Prefect (a notebook, a Ray job)
])
def test_no_forbidden_imports(folder: str, forbidden: str) -> None:
    assert offenders(sorted((ROOT / folder).rglob("*.py")), forbidden) == {}, f"{folder} must not import {forbidden}"


def test_no_command_module_imports_the_cli_entry_point() -> None:
    """flows/cli.py mounts the commands; they share flows/cli_options.py and flows/prefect_env.py instead."""
    commands = [p for p in sorted((ROOT / "flows").glob("*.py")) if p.name != "cli.py"]
    assert offenders(commands, "flows.cli") == {}
