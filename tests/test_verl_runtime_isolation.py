"""The code that runs inside verl's interpreter (omni_core/backends/verl/runtime/: the CPU platform and the
CPU rollout, which import verl, torch and ray at module level) is never imported by our own interpreter:
not by any module of omni_core, flows or tasks (read from their syntax trees, lazy imports included),
and not at run time by the CLI, the pipeline flow or the verl backend."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ROOT / "omni_core" / "backends" / "verl" / "runtime"
RUNTIME_MODULES = {p.stem for p in RUNTIME.glob("*.py")}
RUNTIME_PACKAGE = "omni_core.backends.verl.runtime"


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_the_runtime_folder_holds_the_cpu_platform_and_rollout() -> None:
    assert {"omni_verl_cpu", "omni_verl_cpu_rollout"} <= RUNTIME_MODULES
    assert not (RUNTIME / "__init__.py").exists()  # not a package of ours: verl imports it by module name


def test_no_module_of_ours_imports_the_runtime() -> None:
    offenders = {}
    for folder in ("omni_core", "flows", "tasks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if RUNTIME in path.parents:
                continue
            bad = sorted(n for n in imports_of(path) if n.lstrip(".").split(".")[0] in RUNTIME_MODULES
                         or n.startswith(RUNTIME_PACKAGE) or n.lstrip(".").startswith("runtime"))
            if bad:
                offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


def test_importing_the_cli_flow_and_verl_backend_loads_nothing_of_the_runtime() -> None:
    probe = ("import sys, flows.cli, flows.pipeline, omni_core.backends.verl, omni_core.backends.verl.cpu, "
             "omni_core.backends.verl.runner, omni_core.backends.verl.stage, omni_core.backends.verl_omni.runner\n"
             f"runtime = {str(RUNTIME)!r}\n"
             "bad = sorted(n for n, m in list(sys.modules.items()) if str(getattr(m, '__file__', '') or '').startswith(runtime)"
             " or n.split('.')[0] in ('omni_verl_cpu', 'omni_verl_cpu_rollout', 'verl'))\n"
             "print(bad)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
