"""Ask verl itself whether rendered commands are valid (`compose_check.py`, run by the interpreter
that has verl): before any job is submitted, and in the tests against the real verl release."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from omni_core.backends.verl.render import VerlCommand
from omni_core.errors import ConfigError

SCRIPT = Path(__file__).with_name("compose_check.py")
TIMEOUT_S = 300  # importing verl and its torch on a busy 2-core machine


def compose(command: VerlCommand, python: str) -> dict[str, Any]:
    """verl's composed and validated config of `command`, or a ConfigError with Hydra's or verl's message."""
    result = compose_all([command], python)[0]
    if isinstance(result, ConfigError):
        raise result
    return result


def compose_all(commands: list[VerlCommand], python: str, load_model: bool = True) -> list[dict[str, Any] | ConfigError]:
    """For each command (one interpreter start for all): its composed config (`config`, `verl_version`),
    or the ConfigError that names why verl refuses it. `load_model=False`: sft_trainer's model section
    (which reads the model's config from model.path) is not converted (a model not staged yet)."""
    request = json.dumps([{"config_name": c.config_name, "overrides": c.overrides, "load_model": load_model}
                          for c in commands])
    # verl's interpreter sees its own packages and the job's env (device cpu: the runtime modules), not our path
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({k: v for c in commands for k, v in c.env.items()})
    try:
        proc = subprocess.run([python, str(SCRIPT)], input=request, capture_output=True, text=True, env=env,
                              timeout=TIMEOUT_S * max(1, len(commands)))
    except FileNotFoundError as exc:
        raise ConfigError(f"backend.python {python!r} was not found; point it at the interpreter that has verl "
                          "(`make setup` builds .venv-verl)") from exc
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"ok"')]
    if len(lines) != len(commands):
        raise ConfigError(f"{python} could not check the verl commands (exit {proc.returncode}): "
                          f"{proc.stderr.strip()[-2000:]}")
    return [result if result["ok"] else ConfigError(
        f"verl {command.module} refuses the rendered command ({result['stage']}: {result['error_type']}): "
        f"{result['error']}") for command, result in zip(commands, lines, strict=True)]
