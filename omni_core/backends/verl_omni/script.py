"""Read a VeRL-Omni recipe script (`examples/*/run_*.sh`): its `python3 -m MODULE` command line, the
Hydra overrides on it and the variables it exports, as bash would run it with no variable set by the
caller (every `${X:-default}` takes its default).

This is a small reader of the shell the recipe scripts are written in, not a shell:
- assignments (`X=...`, `export X=...`), `${X}`, `$X`, `${X:-w}`, `${X:=w}`, `${X:+w}`, `$((a / b))`,
  single and double quotes, backslash escapes, `~` at a word's start;
- a variable nobody sets (`$HOME`) and one set from a command (`$(pwd)`, `$(dirname "$0")`) stay
  symbolic as `${NAME}`: they name a machine's folder, which a pipeline substitutes;
- `if ... fi`: the `else` branch is read (the script's default path: the GPU branch of an NPU/GPU
  test, no FA3), none when there is no `else`, the branch before it when `else` exits (the error of
  an NPU-or-GPU probe); `while`/`for` loops and here-documents are skipped;
- the command ends at `"$@"` (the caller's extra overrides), `2>&1` or `|`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from omni_core.errors import ConfigError

_ASSIGN = re.compile(r"^(export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
_PYTHON = re.compile(r"^python3?\s+-m\s+")
_ARITH_OK = re.compile(r"^[0-9+\-*/%() ]+$")
_PASSTHROUGH = "\x00ARGS\x00"


@dataclass
class ScriptCommand:
    """What a recipe script runs."""

    python: str  # python3
    module: str  # verl_omni.trainer.main_omni ...
    overrides: list[str]  # the Hydra overrides after `-m MODULE`, quotes removed, variables expanded
    env: dict[str, str] = field(default_factory=dict)  # the variables the script exports, in order
    variables: dict[str, str] = field(default_factory=dict)  # every variable it sets (for reading)

    @property
    def argv(self) -> list[str]:
        return [self.python, "-m", self.module, *self.overrides]


class _Unsupported(Exception):
    pass


def _logical_lines(text: str) -> list[str]:
    """Backslash-continued lines joined; here-documents dropped."""
    out: list[str] = []
    lines = text.splitlines()
    i, buf = 0, ""
    while i < len(lines):
        line = lines[i]
        i += 1
        heredoc = re.search(r"<<-?\s*['\"]?([A-Za-z_]+)['\"]?", line)
        if heredoc and not buf and not line.lstrip().startswith("#"):
            end = heredoc.group(1)
            while i < len(lines) and lines[i].strip() != end:
                i += 1
            i += 1
            continue
        if line.endswith("\\") and not line.lstrip().startswith("#"):
            buf += line[:-1] + " "
            continue
        out.append(buf + line)
        buf = ""
    if buf:
        out.append(buf)
    return out


def _blocks(lines: list[str]) -> list[str]:
    """The lines bash runs by default: `if` blocks reduced to their `else` branch, loops dropped."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        s = lines[i].strip()
        head = s.split(" ", 1)[0]
        if head in ("while", "for", "until"):
            depth, i = 1, i + 1
            while i < len(lines) and depth:
                h = lines[i].strip().split(" ", 1)[0]
                depth += h in ("while", "for", "until")
                depth -= h == "done"
                i += 1
            continue
        if head == "if":
            depth, i, branch = 1, i + 1, "then"
            branches: list[list[str]] = [[]]
            while i < len(lines) and depth:
                t = lines[i].strip()
                h = t.split(" ", 1)[0]
                if h == "if":
                    depth += 1
                elif h == "fi":
                    depth -= 1
                    if not depth:
                        i += 1
                        break
                elif depth == 1 and h in ("elif", "else"):
                    branch = h
                    branches.append([])
                    i += 1
                    continue
                branches[-1].append(lines[i])
                i += 1
            if branch == "else":
                chosen = branches[-1]
                if any(t.strip().split(" ", 1)[0] == "exit" for t in chosen):  # else = "no device": error
                    chosen = branches[-2]
                out.extend(_blocks(chosen))
            continue
        out.append(lines[i])
        i += 1
    return out


class _Reader:
    def __init__(self) -> None:
        self.vars: dict[str, str] = {}

    def lookup(self, name: str) -> str | None:
        return self.vars.get(name)

    def expand_param(self, body: str) -> str:
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:=|:\+|-)(.*))?$", body, re.S)
        if not m:
            raise _Unsupported(f"${{{body}}}")
        name, op, word = m.group(1), m.group(2), m.group(3)
        value = self.lookup(name)
        if op is None:
            return value if value is not None else "${" + name + "}"
        if op in (":-", "-"):
            return value if value else self.expand_string(word)
        if op == ":=":
            if not value:
                self.vars[name] = self.expand_string(word)
            return self.vars[name]
        return self.expand_string(word) if value else ""  # :+

    def arith(self, expr: str) -> str:
        def var(m: re.Match[str]) -> str:
            value = self.lookup(m.group(1)) or "0"
            if not value.strip().lstrip("-").isdigit():
                raise _Unsupported(f"$(( {expr} )): {m.group(1)}={value!r} is not a number")
            return value

        text = re.sub(r"\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?", var, expr)
        if not _ARITH_OK.match(text):
            raise _Unsupported(f"$(( {expr} ))")
        return str(eval(text.replace("/", "//"), {"__builtins__": {}}))  # digits and operators only

    def dollar(self, s: str, i: int) -> tuple[str, int]:
        """Expand the `$...` at s[i]; return (text, index after it)."""
        if s.startswith("$((", i):
            depth, j = 2, i + 3
            while j < len(s) and depth:
                depth += s[j] == "("
                depth -= s[j] == ")"
                j += 1
            return self.arith(s[i + 3:j - 2]), j
        if s.startswith("$(", i):
            raise _Unsupported("command substitution")
        if s.startswith("${", i):
            depth, j = 1, i + 2
            while j < len(s) and depth:
                depth += s[j] == "{"
                depth -= s[j] == "}"
                j += 1
            return self.expand_param(s[i + 2:j - 1]), j
        if s.startswith("$@", i):
            return _PASSTHROUGH, i + 2
        m = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]").match(s, i + 1)
        if not m:
            return "$", i + 1
        name = m.group(0)
        value = self.lookup(name)
        return (value if value is not None else "${" + name + "}"), m.end()

    def expand_string(self, s: str) -> str:
        """A word with its quotes removed, no splitting (a `${X:-word}` default, an assignment)."""
        words = self.words(s, split=False)
        return words[0] if words else ""

    def words(self, s: str, split: bool = True) -> list[str]:
        words: list[str] = []
        cur: list[str] = []
        started = False
        i, n = 0, len(s)
        while i < n:
            c = s[i]
            if c in " \t" and split:
                if started:
                    words.append("".join(cur))
                    cur, started = [], False
                i += 1
                continue
            if split and c == "|":
                break
            if split and s.startswith("2>&1", i) and not started:
                i += 4
                continue
            if c == "#" and split and not started:
                break
            started = True
            if c == "'":
                j = s.index("'", i + 1)
                cur.append(s[i + 1:j])
                i = j + 1
            elif c == '"':
                i += 1
                while i < n and s[i] != '"':
                    if s[i] == "\\" and i + 1 < n and s[i + 1] in '"\\$`':
                        cur.append(s[i + 1])
                        i += 2
                    elif s[i] == "$":
                        text, i = self.dollar(s, i)
                        cur.append(text)
                    else:
                        cur.append(s[i])
                        i += 1
                i += 1
            elif c == "\\" and i + 1 < n:
                cur.append(s[i + 1])
                i += 2
            elif c == "$":
                text, i = self.dollar(s, i)
                cur.append(text)
            elif c == "~" and not cur:
                cur.append("${HOME}")
                i += 1
            else:
                cur.append(c)
                i += 1
        if started:
            words.append("".join(cur))
        return words


def parse_script(text: str, where: str = "script") -> ScriptCommand:
    """The command a recipe script runs (see the module docstring for what is read)."""
    reader = _Reader()
    env: dict[str, str] = {}
    command: ScriptCommand | None = None
    for line in _blocks(_logical_lines(text)):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        m = _ASSIGN.match(s)
        if m:
            exported, name, raw = bool(m.group(1)), m.group(2), m.group(3)
            try:
                value = (reader.words(raw) or [""])[0]
            except _Unsupported:
                value = "${" + name + "}"  # set by a command: a machine's folder, kept symbolic
            reader.vars[name] = value
            if exported:
                env[name] = value
            continue
        if _PYTHON.match(s):
            if command is not None:
                raise ConfigError(f"{where}: more than one `python3 -m` command; import one recipe script "
                                  "per stage")
            try:
                words = reader.words(s)
            except _Unsupported as exc:
                raise ConfigError(f"{where}: cannot read {exc} on the python3 line; write the value out") from exc
            words = [w for w in words if w != _PASSTHROUGH]
            command = ScriptCommand(python=words[0], module=words[2], overrides=words[3:], env=env,
                                    variables=reader.vars)
    if command is None:
        raise ConfigError(f"{where}: no `python3 -m MODULE ...` line (a VeRL-Omni recipe script runs "
                          "`python3 -m verl_omni.trainer.main_omni` or `main_diffusion[_v1]`)")
    return command


def python_line(text: str) -> str:
    """The script's `python3 -m ...` line, continuations joined (as bash reads it)."""
    for line in _blocks(_logical_lines(text)):
        if _PYTHON.match(line.strip()):
            return line.strip()
    raise ConfigError("no `python3 -m MODULE ...` line")
