"""Plugins: packages that add converters, rewards, algorithms, backends or stage kinds to the
platform's tables without editing this repository (the way pytest and MLflow find theirs).

A plugin package declares an entry point in the `omni_core.plugins` group, e.g. in its pyproject.toml:

    [project.entry-points."omni_core.plugins"]
    my_plugin = "my_plugin.register"            # a module whose import registers its things
    # or "my_plugin:register": a function called once (with no arguments) that registers them

Its module calls the same registration functions the built-ins call (`register_converter`,
`register_reward`, `register_algorithm`, `register_backend`, `register_stage` with
`register_stage_config`). Plugins load once per process, lazily: the first lookup in any table
(omni_core.registry) loads the built-in plugins (`BUILTIN`), then every entry point of the group. A
plugin that fails to load is a PluginError naming it, its distribution and the cause.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import EntryPoint, entry_points

from omni_core.errors import ConfigError

GROUP = "omni_core.plugins"
# Loaded the same way before the entry points: the tables config reads without importing what they run
BUILTIN = (
    "omni_core.training.algorithms",  # grpo/gspo, dpo/mpo, flow_grpo, sft
    "omni_core.backends.native",
    "omni_core.backends.verl",
    "omni_core.backends.verl_omni",
    "omni_core.backends.trl",
    "omni_core.models.adapters",  # the kind of model each adapter (and built-in model) is
    "omni_core.data",  # the converters (which of them write preference pairs)
)

_lock = threading.RLock()
_state = {"loaded": False, "loading": False}


class PluginError(ConfigError):
    """A plugin (built-in or an installed package's entry point) failed to load."""


def plugin_entry_points() -> list[EntryPoint]:
    """The installed entry points of the group, by name."""
    return sorted(entry_points(group=GROUP), key=lambda ep: ep.name)


def load_plugins() -> None:
    """Load the built-in plugins and every installed one, once. Lookups made while they load (a
    plugin module that reads a table at import) see what is registered so far."""
    if _state["loaded"]:
        return
    with _lock:
        if _state["loaded"] or _state["loading"]:
            return
        _state["loading"] = True
        try:
            for module in BUILTIN:
                _load(module, lambda module=module: importlib.import_module(module), "omni_core (built in)")
            for ep in plugin_entry_points():
                _load(f"{ep.name} = {ep.value}", lambda ep=ep: _call_if_function(ep), _distribution(ep))
            _state["loaded"] = True
        finally:
            _state["loading"] = False


def _call_if_function(ep: EntryPoint) -> None:
    loaded = ep.load()
    if ep.attr and callable(loaded):
        loaded()


def _load(name: str, load: object, distribution: str) -> None:
    try:
        load()  # type: ignore[operator]
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(f"plugin {name!r} (from {distribution}) failed to load: {type(exc).__name__}: {exc}; "
                          f"fix the plugin, or uninstall {distribution} to run without it") from exc


def _distribution(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"distribution {dist.name} {dist.version}" if dist is not None else "an unknown distribution"
