"""`make bench` on a fresh clone: every package a bench/*.py script imports is one that pyproject.toml
installs for it (the dependencies, or the `dev` and `bench` extras the Makefile's bench target installs)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"omni_core", "flows", "tasks", "bench", "tests"}
# the tests' own support modules (e.g. tests/postgres.py), which a bench script imports with tests/ on
# sys.path (bench/scaled_out.py starts the test stack)
TEST_SUPPORT = {path.stem for path in (ROOT / "tests").glob("*.py")}
# the benchmarks' own shared modules (e.g. bench/learning_flow.py), imported with bench/ on sys.path
BENCH_SUPPORT = {path.stem for path in (ROOT / "bench").glob("*.py")}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: tuple[str, ...] = ("dev", "bench")) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return {canonical(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in requirements}


def third_party_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.partition(".")[0])
    return {n for n in names
            if n not in sys.stdlib_module_names and n not in OURS and n not in TEST_SUPPORT and n not in BENCH_SUPPORT
            and n != "__future__"}


def test_the_bench_extra_covers_every_bench_import() -> None:
    provided_by = importlib.metadata.packages_distributions()
    allowed = declared()
    missing = {}
    for path in sorted((ROOT / "bench").glob("*.py")):
        for module in sorted(third_party_imports(path)):
            dists = {canonical(d) for d in provided_by.get(module, [module])}
            if not dists & allowed:
                missing.setdefault(path.name, []).append(f"{module} ({', '.join(sorted(dists))})")
    assert missing == {}, "add these to the `bench` extra of pyproject.toml"
    assert {"datasets", "psutil", "matplotlib"} <= declared(("bench",))  # what only the benchmarks use


def test_make_bench_installs_the_bench_extra() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r'^\$\(BENCH_STAMP\):.*\n(?:\t.*\n)*?\t.*pip install .*-e "\.\[dev,bench\]"', makefile, re.M)
    assert re.search(r"^bench: .*\$\(BENCH_STAMP\)", makefile, re.M)
