"""A name -> thing table for everything chosen by a string in a pipeline file (stage kinds,
algorithms, losses, rewards, converters, fixtures).

    POLICY_LOSSES = Registry("policy loss", hint="register one with @register_policy_loss(NAME)")
    POLICY_LOSSES.add("gspo", fn)          # a second, different "gspo" raises ValueError
    POLICY_LOSSES.get("gpso")              # ConfigError: unknown policy loss 'gpso'; known: ...

Every lookup first loads the plugins (omni_core.plugins: the built-in ones and the installed
packages' `omni_core.plugins` entry points), once per process, so a table holds what plugins add
before anything is looked up in it.

Written here rather than taken from a library: the nine tables need only this, and each needs the
same two guarantees (a name registered twice by different code is a bug found at import time; an
unknown name is a ConfigError listing the known ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from omni_core.errors import ConfigError

T = TypeVar("T")
_MISSING = object()


def _plugins() -> None:
    from omni_core.plugins import load_plugins

    load_plugins()


def _origin(value: object) -> tuple[str, str] | None:
    """(module, qualname) of a function or class: the same code registered again on a module reload."""
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return (module, qualname) if module and qualname else None


class Registry(Generic[T]):
    def __init__(self, what: str, hint: str = ""):
        self.what = what  # "policy loss": used in messages
        self.hint = hint  # how to add one, appended to the unknown-name error
        self._items: dict[str, T] = {}

    def add(self, name: str, value: T) -> T:
        """Register `value` as `name`; ValueError if different code already has that name."""
        existing = self._items.get(name)
        if existing is not None and existing is not value and (_origin(existing) is None
                                                               or _origin(existing) != _origin(value)):
            raise ValueError(f"{self.what} {name!r} is already registered "
                             f"({getattr(existing, '__qualname__', existing)!s}); pick another name")
        self._items[name] = value
        return value

    def decorator(self, name: str) -> Callable[[T], T]:
        """`@registry.decorator(name)`: register the decorated function or class as `name`."""

        def wrap(value: T) -> T:
            return self.add(name, value)

        return wrap

    def get(self, name: str, default: Any = _MISSING) -> T:
        """The thing registered as `name`; `default` if given, else a ConfigError naming the known ones."""
        _plugins()
        try:
            return self._items[name]
        except KeyError:
            if default is not _MISSING:
                return default
            known = ", ".join(sorted(self._items)) or "(none)"
            hint = f"; {self.hint}" if self.hint else ""
            raise ConfigError(f"unknown {self.what} {name!r}; known: {known}{hint}") from None

    def names(self) -> list[str]:
        _plugins()
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        _plugins()
        return sorted(self._items.items())

    def __contains__(self, name: object) -> bool:
        _plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        _plugins()
        return iter(sorted(self._items))

    def __len__(self) -> int:
        _plugins()
        return len(self._items)

    # Mapping access, for lookups that handle the KeyError themselves and for tests that swap an entry
    # (monkeypatch.setitem): item assignment replaces without the duplicate check.
    def __getitem__(self, name: str) -> T:
        _plugins()
        return self._items[name]

    def __setitem__(self, name: str, value: T) -> None:
        self._items[name] = value

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def pop(self, name: str) -> T:
        return self._items.pop(name)

    def copy(self) -> Registry[T]:
        twin: Registry[T] = Registry(self.what, self.hint)
        twin._items = dict(self._items)
        return twin
