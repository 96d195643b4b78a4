"""The converter interface and registry: one converter per dataset, chosen by name in the config."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.data.sources import RawSource
from omni_core.errors import ConfigError, DataError


class RowRejected(Exception):
    """A raw row that cannot be converted; it goes to quarantine with `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class RowSkipped(Exception):
    """A raw row the dataset's own rules leave out (e.g. a preference pair judged "equal"): counted, not kept."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


RawRecord = tuple[str, int, dict[str, Any]]  # (source file relative path, row within that file, record)


class Converter:
    """Turns a dataset's raw files into verl RL Parquet rows of a declared schema.

    `version` is part of every dataset version id: bump it whenever the output could change.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    schema: ClassVar[pa.Schema]

    def splits(self, raw: RawSource) -> list[str]:
        """The output splits this raw source holds (empty: the source is not this dataset's layout)."""
        raise NotImplementedError

    def records(self, raw: RawSource, split: str) -> Iterator[RawRecord]:
        """Raw records of one split, streamed (never the whole input in memory).

        Raise DataError for a whole input that is unusable (missing file, corrupt Parquet, wrong
        columns), naming the file and what was expected.
        """
        raise NotImplementedError

    def convert(self, record: dict[str, Any], split: str, index: int, raw: RawSource) -> dict[str, Any]:
        """One output row (media embedded as bytes); raise RowRejected or RowSkipped(reason) otherwise."""
        raise NotImplementedError

    def chunks(self, raw: RawSource, split: str) -> list[Chunk] | None:
        """Independent pieces of a split that a worker can read by itself (so raw bytes never cross
        processes), in order; None when the layout cannot be split (records are then read here)."""
        return None


@dataclass(frozen=True)
class Chunk:
    """Row groups of one raw Parquet file; `first_index` is its first row's position in the split."""

    rel: str
    row_groups: tuple[int, ...]
    first_row: int  # row number within the file
    first_index: int
    columns: tuple[str, ...]

    def records(self, raw: RawSource) -> Iterator[RawRecord]:
        table = pq.ParquetFile(raw.path(self.rel)).read_row_groups(list(self.row_groups), columns=list(self.columns))
        for offset, record in enumerate(table.to_pylist()):
            yield self.rel, self.first_row + offset, record


def _parquet_file(raw: RawSource, rel: str, columns: list[str]) -> pq.ParquetFile:
    """An open raw Parquet file that has `columns`; a corrupt file or a missing column is a DataError."""
    try:
        parquet = pq.ParquetFile(raw.path(rel))
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"{raw.uri}: {rel} is not a readable Parquet file ({exc}); re-download it") from exc
    missing = [c for c in columns if c not in parquet.schema_arrow.names]
    if missing:
        raise DataError(f"{raw.uri}: {rel} lacks column(s) {missing}; expected {columns}, "
                        f"found {parquet.schema_arrow.names}")
    return parquet


def iter_parquet_records(raw: RawSource, rel: str, columns: list[str], batch_rows: int = 1000
                         ) -> Iterator[RawRecord]:
    """Records of one raw Parquet file, read batch by batch; a corrupt file or missing column is a DataError."""
    parquet = _parquet_file(raw, rel, columns)
    row = 0
    for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns):
        for record in batch.to_pylist():
            yield rel, row, record
            row += 1


class HubParquetConverter(Converter):
    """A dataset shipped as `{split}-NNNNN-of-NNNNN.parquet` shards (anywhere under the source folder)."""

    raw_columns: ClassVar[list[str]]
    split_names: ClassVar[tuple[str, ...]] = ("train", "test")
    read_batch_rows: ClassVar[int] = 1000

    def _files(self, raw: RawSource, split: str) -> list[str]:
        return sorted(rel for rel in raw.files
                      if rel.rsplit("/", 1)[-1].startswith(f"{split}-") and rel.endswith(".parquet"))

    def splits(self, raw: RawSource) -> list[str]:
        return [split for split in self.split_names if self._files(raw, split)]

    def records(self, raw: RawSource, split: str) -> Iterator[RawRecord]:
        for rel in self._files(raw, split):
            yield from iter_parquet_records(raw, rel, self.raw_columns, batch_rows=self.read_batch_rows)

    def chunks(self, raw: RawSource, split: str) -> list[Chunk]:
        """Consecutive row groups of about `read_batch_rows` rows, file by file."""
        out: list[Chunk] = []
        index = 0
        for rel in self._files(raw, split):
            metadata = _parquet_file(raw, rel, self.raw_columns).metadata
            row = 0
            group: list[int] = []
            for rg in range(metadata.num_row_groups):
                group.append(rg)
                rows = sum(metadata.row_group(g).num_rows for g in group)
                if rows >= self.read_batch_rows or rg == metadata.num_row_groups - 1:
                    out.append(Chunk(rel, tuple(group), row, index, tuple(self.raw_columns)))
                    row, index, group = row + rows, index + rows, []
        return out


_CONVERTERS: dict[str, type[Converter]] = {}


def register_converter(cls: type[Converter]) -> type[Converter]:
    _CONVERTERS[cls.name] = cls
    return cls


def get_converter(name: str) -> Converter:
    if name not in _CONVERTERS:
        raise ConfigError(f"converter '{name}' is not registered; known: {', '.join(sorted(_CONVERTERS))}")
    return _CONVERTERS[name]()
