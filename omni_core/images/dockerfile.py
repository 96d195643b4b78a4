"""Just enough Dockerfile parsing to know its ARG defaults and the base image of the built stage."""

from __future__ import annotations

import re
import shlex

_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:[-+])(?P<word>[^{}]*))?\}"
                  r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        result.append((keyword.upper(), rest.strip()))
    if pending.strip():
        keyword, _, rest = pending.strip().partition(" ")
        result.append((keyword.upper(), rest.strip()))
    return result


def parse_arg(arguments: str) -> dict[str, str | None]:
    """`ARG A=1 B` -> {"A": "1", "B": None} (quotes removed)."""
    parsed: dict[str, str | None] = {}
    for item in shlex.split(arguments):
        name, eq, value = item.partition("=")
        parsed[name] = value if eq else None
    return parsed


def arg_defaults(text: str) -> dict[str, str | None]:
    """Every ARG of the Dockerfile with its default (None when it has none); later ARGs win."""
    defaults: dict[str, str | None] = {}
    for keyword, arguments in instructions(text):
        if keyword == "ARG":
            defaults.update(parse_arg(arguments))
    return defaults


def expand(value: str, env: dict[str, str]) -> str:
    """Dockerfile variable substitution: $V, ${V}, ${V:-default}, ${V:+alternative}."""

    def substitute(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("bare")
        current = env.get(name, "")
        op, word = match.group("op"), expand(match.group("word") or "", env)
        if op == ":-":
            return current or word
        if op == ":+":
            return word if current else ""
        return current

    return _VAR.sub(substitute, value)


def base_image(text: str, build_args: dict[str, str] | None = None, stage: str | None = None) -> str:
    """The external image the built stage starts from (following FROM <earlier stage> chains)."""
    env: dict[str, str] = {}
    stages: dict[str, str] = {}
    order: list[str] = []
    seen_from = False
    for keyword, arguments in instructions(text):
        if keyword == "ARG" and not seen_from:  # global ARGs: the only ones FROM can use
            for name, default in parse_arg(arguments).items():
                value = (build_args or {}).get(name, default)
                if value is not None:
                    env[name] = expand(value, env)
        elif keyword == "FROM":
            seen_from = True
            words = [w for w in arguments.split() if not w.startswith("--")]
            image = expand(words[0], env)
            name = words[2].lower() if len(words) >= 3 and words[1].lower() == "as" else str(len(order))
            stages[name] = image
            order.append(name)
    if not order:
        raise ValueError("the Dockerfile has no FROM instruction")
    current = (stage or order[-1]).lower()
    if current not in stages:
        raise ValueError(f"the Dockerfile has no stage named {stage!r} (stages: {', '.join(order)})")
    image = stages[current]
    while image.lower() in stages and image.lower() != current:
        current = image.lower()
        image = stages[current]
    return image
