"""`omni recipes import run_x.sh`: a VeRL-Omni recipe script -> the `backend:` of a pipeline stage that
runs the same command.

- The script is a catalog recipe's (same entry point, overrides and exports): `{recipe: NAME}`.
- It starts from one (same entry point, every key of the recipe's overrides present): `{recipe: NAME,
  overrides: [...the script's overrides that differ or are new...], env: {...}}`; Hydra takes the last
  value of a key, so the rendering runs the script's values. The closest such recipe is chosen.
- Otherwise: `{entry_point: MODULE, overrides: [...verbatim...], env: {...}}`.
Our substitutions (data, model, logger, checkpoint folder) apply in every case.
"""

from __future__ import annotations

from typing import Any

from omni_core.backends.verl_omni.catalog import recipes
from omni_core.backends.verl_omni.render import split_override
from omni_core.backends.verl_omni.script import ScriptCommand, parse_script


def _keys(overrides: list[str]) -> dict[str, str]:
    return {key: value for _, key, value in map(split_override, overrides)}


def import_command(cmd: ScriptCommand) -> dict[str, Any]:
    """The stage backend for a parsed script."""
    best: tuple[int, dict[str, Any]] | None = None
    script_keys = _keys(cmd.overrides)
    for recipe in recipes().values():
        if recipe.module != cmd.module or recipe.python != cmd.python:
            continue
        base = set(recipe.base)
        if not set(_keys(recipe.base)) <= set(script_keys):
            continue
        extra = [item for item in cmd.overrides if item not in base]
        env = {k: v for k, v in cmd.env.items() if recipe.env.get(k) != v}
        backend: dict[str, Any] = {"name": "verl_omni", "recipe": recipe.name}
        if extra:
            backend["overrides"] = extra
        if env:
            backend["env"] = env
        cost = len(extra) + len(env) + sum(k not in cmd.env for k in recipe.env)
        if best is None or cost < best[0]:
            best = (cost, backend)
    if best is not None:
        return best[1]
    backend = {"name": "verl_omni", "entry_point": cmd.module, "overrides": list(cmd.overrides)}
    if cmd.python != "python3":
        backend["python"] = cmd.python
    if cmd.env:
        backend["env"] = dict(cmd.env)
    return backend


def import_script(text: str, where: str = "script") -> dict[str, Any]:
    """The stage backend for a recipe script's text."""
    return import_command(parse_script(text, where))
