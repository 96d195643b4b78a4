"""The import layers (docs/design/architecture.md#layers), read from every module's syntax tree, lazy imports inside
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


def repo_modules() -> dict[str, Path]:
    """Every module of omni_core, flows and tasks by name (code that runs inside verl's interpreter,
    omni_core/backends/*/compose_check.py, is a script: it imports nothing of ours)."""
    return {module_name(p): p for folder in ("omni_core", "flows", "tasks") for p in sorted((ROOT / folder).rglob("*.py"))}


def test_config_imports_nothing_above_it() -> None:
    """omni_core/config is the bottom layer: pydantic, the registry, the errors and its own modules.
    What plugins add (algorithms, backends) is named by strings and imported when asked for."""
    allowed = ("omni_core.config", "omni_core.registry", "omni_core.errors")
    files = sorted((ROOT / "omni_core" / "config").rglob("*.py"))
    found = {str(p.relative_to(ROOT)): sorted(n for n in file_imports(p) if n.startswith("omni_core")
                                              and n != "omni_core" and not n.startswith(allowed)) for p in files}
    assert {k: v for k, v in found.items() if v} == {}


def test_no_backend_imports_another_backends_modules() -> None:
    """A backend is one package (or module) plus its registration; the job machinery both external
    backends share is omni_core/backends/jobs, which imports no backend."""
    root = ROOT / "omni_core" / "backends"
    backends = sorted([p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()
                       and p.name != "jobs"] + [p.stem for p in root.glob("*.py") if p.name != "__init__.py"])
    assert {"native", "verl", "verl_omni"} <= set(backends)
    found = {}
    for owner in [*backends, "jobs"]:
        files = sorted((root / owner).rglob("*.py")) if (root / owner).is_dir() else [root / f"{owner}.py"]
        for other in backends:
            if other != owner and (bad := offenders(files, f"omni_core.backends.{other}")):
                found[f"{owner} -> {other}"] = bad
    assert found == {}


# Removed by the training-side change (the trainer no longer subclasses the options of its record module).
KNOWN_CIRCLES: list[set[str]] = []


def import_graph() -> dict[str, set[str]]:
    """module -> the repo modules it imports (lazy ones included). An import of one's own ancestor package
    is no edge: Python has run that package's __init__ before the module anyway (a package that imports
    its kinds at its end, which import the package's registration function, is not a circle)."""
    modules = repo_modules()
    graph = {}
    for name, path in modules.items():
        targets = {n for n in file_imports(path) if n in modules and n != name}
        graph[name] = {t for t in targets if not name.startswith(t + ".")}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module (the import circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_sees_a_circle_through_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [{"a", "b", "c"}]
    source = "def f():\n    from omni_core.config import models\n"
    assert "omni_core.config.models" in imported_modules(source, "omni_core.training")


def test_no_import_circles() -> None:
    """No module imports (at the top or inside a function) something that imports it back."""
    circles = [c for c in strongly_connected(import_graph()) if c not in KNOWN_CIRCLES]
    assert circles == []


@pytest.mark.parametrize("command", [["-c", "import flows.pipeline"], ["-m", "flows.cli", "--help"]])
def test_the_flow_and_the_cli_help_import_no_torch(command: list[str]) -> None:
    """A deployment's flow process and `omni --help` do not pay for torch (~16 CPU s): models, trainers
    and checkpoints are imported inside the functions that need them."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-X", "importtime", *command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "flows" in imported
    assert sorted(m for m in imported if m == "torch" or m.startswith("torch.")) == []
