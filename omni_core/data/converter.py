"""The converter interface and registry: one converter per dataset, chosen by name in the config."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pyarrow as pa

from omni_core.data.sources import RawSource
from omni_core.errors import ConfigError


class RowRejected(Exception):
    """A raw row that cannot be converted; it goes to quarantine with `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Converter:
    """Turns a dataset's raw files into verl RL Parquet rows of a declared schema.

    `version` is part of every dataset version id: bump it whenever the output could change.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    schema: ClassVar[pa.Schema]

    def split_files(self, raw: RawSource) -> dict[str, list[str]]:
        """Split name -> raw files (relative paths) that hold it."""
        raise NotImplementedError

    def read(self, raw: RawSource, rel_path: str, batch_rows: int) -> Iterator[list[dict[str, Any]]]:
        """Raw records of one file, in batches of at most `batch_rows`."""
        raise NotImplementedError

    def convert(self, record: dict[str, Any], split: str, index: int) -> dict[str, Any]:
        """One output row, or raise RowRejected(reason)."""
        raise NotImplementedError


_CONVERTERS: dict[str, type[Converter]] = {}


def register_converter(cls: type[Converter]) -> type[Converter]:
    _CONVERTERS[cls.name] = cls
    return cls


def get_converter(name: str) -> Converter:
    if name not in _CONVERTERS:
        raise ConfigError(f"converter '{name}' is not registered; known: {', '.join(sorted(_CONVERTERS))}")
    return _CONVERTERS[name]()
