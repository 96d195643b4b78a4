"""Every `omni` command's --help renders (help text is rich markup: a stray `[/X]` used to crash it),
and an error message with brackets in it prints as it is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import typer
from typer.testing import CliRunner

from flows.cli import app


def command_paths(group: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        paths.append((*prefix, name))
        if hasattr(command, "commands"):  # a sub-app (typer's own click group class)
            paths += command_paths(command, (*prefix, name))
    return paths


def test_every_command_help_renders() -> None:
    root = typer.main.get_command(app)
    paths = command_paths(root)
    assert {("run",), ("image", "tag"), ("datasets", "show"), ("lineage",)} <= set(paths)
    runner = CliRunner()
    for path in [(), *paths]:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output, result.exception)
        assert "Usage:" in result.output, path
    tag_help = runner.invoke(app, ["image", "tag", "--help"], env={"COLUMNS": "200"}).output
    assert "HOST[:PORT][/NAMESPACE]" in tag_help


def test_an_error_naming_brackets_prints_as_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "p[/x].yaml"
    result = subprocess.run([sys.executable, "-m", "flows.cli", "validate", str(missing)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "p[/x].yaml" in result.stderr and "Traceback" not in result.stderr
