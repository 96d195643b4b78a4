"""Reading the docs' command blocks, for the tests that run the tutorials and check every other command.

A page's ```bash blocks are its commands. In a tutorial (docs/tutorials/) they run, in page order, in
one bash per page (`set -euo pipefail`), unless the block is preceded by `<!-- not run: REASON -->`
(it needs a GPU cluster, a server stack, ...); `<!-- expect: TEXT -->` anywhere on a page is a
line fragment the page's output must contain. Every `omni ...` and `make ...` command of every block on
every page (run or not) must name a real command, options it has, and a Makefile target.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>.+?)\s*-->\s*$")
EXPECT = re.compile(r"<!--\s*expect:\s*(?P<text>.+?)\s*-->")
SHELL_LANGS = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    page: Path
    line: int
    code: str
    not_run: str | None  # why it is not run, or None


def blocks(page: Path) -> list[Block]:
    """The page's shell blocks, in order, each with the reason it is not run (if it says one)."""
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        if match.group("lang") not in SHELL_LANGS:
            continue
        before = text[:match.start()].rstrip().splitlines()
        marker = NOT_RUN.search(before[-1]) if before else None
        found.append(Block(page, text.count("\n", 0, match.start()) + 1, match.group("body"),
                           marker.group("why") if marker else None))
    return found


def expectations(page: Path) -> list[str]:
    return [m.group("text") for m in EXPECT.finditer(page.read_text(encoding="utf-8"))]


def script(page: Path) -> str:
    """The page's runnable blocks as one bash script."""
    parts = ["set -euo pipefail"]
    for block in blocks(page):
        if block.not_run is None:
            parts += [f"# {page.relative_to(ROOT)}:{block.line}", block.code]
    return "\n".join(parts) + "\n"


def commands(code: str) -> list[list[str]]:
    """The simple commands of a block's lines (a line continued with `\\` joined; heredoc bodies,
    comments, pipes and `&&` / `||` / `;` separated), each as argv."""
    lines: list[str] = []
    heredoc_end = None
    pending = ""
    for raw in code.splitlines():
        if heredoc_end is not None:
            if raw.strip() == heredoc_end:
                heredoc_end = None
            continue
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if heredoc := re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line):
            heredoc_end = heredoc.group(1)
            line = line[:heredoc.start()]
        lines.append(line)
    out = []
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # a line of a here-string or a quoted multi-line argument
        argv: list[str] = []
        for word in [*words, ";"]:
            if word in ("|", "||", "&&", ";") or word.endswith(";"):
                if word.endswith(";") and word != ";":
                    argv.append(word[:-1])
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(word)
    return out


def _strip_env(argv: list[str]) -> list[str]:
    """`A=1 B=2 cmd ...` and `env -u X cmd ...` -> `cmd ...`."""
    while argv and (re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]) or argv[0] in ("env", "-u", "sudo")):
        argv = argv[2:] if argv[0] == "-u" else argv[1:]
    return argv


def omni_commands(code: str) -> list[list[str]]:
    """`omni ...` commands (also `.venv/bin/omni`, `../.venv/bin/omni`), without the program name."""
    found = []
    for argv in map(_strip_env, commands(code)):
        if argv and Path(argv[0]).name == "omni":
            found.append(argv[1:])
    return found


def make_targets(code: str) -> list[str]:
    found = []
    for argv in map(_strip_env, commands(code)):
        if argv and argv[0] == "make":
            found += [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
    return found


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M))


def omni_problem(root: Any, args: list[str]) -> str | None:
    """Why `omni ARGS` would not parse (no such command, an unknown option, a missing argument), or None.
    Placeholders like PIPELINE.yaml or [NAME...] are arguments like any other."""
    command, path = root, ["omni"]
    # usage notation on a page: [--json] and [NAME...] are an option or argument one may give
    args = [re.sub(r"^\[(.+?)(\.\.\.)?\]$", r"\1", a) for a in args if a != "--debug"]
    while hasattr(command, "commands") and args and not args[0].startswith("-"):
        name = args.pop(0)
        if name not in command.commands and getattr(command, "default_command", None):
            args.insert(0, name)  # a group that runs its default command on other words (`omni sweep FILE ...`)
            name = command.default_command
        if name not in command.commands:
            return f"{' '.join(path)} has no command {name!r} (has: {', '.join(sorted(command.commands))})"
        command, path = command.commands[name], [*path, name]
    if hasattr(command, "commands"):
        return None  # a group alone (`omni recipes`): prints its help
    if "--help" in args:
        return None
    try:
        with command.make_context(" ".join(path), list(args), resilient_parsing=False):
            pass
    except Exception as exc:  # typer's click errors (usage errors, missing parameters)
        return f"{' '.join(path)} {' '.join(args)}: {type(exc).__name__}: {exc}"
    return None


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
