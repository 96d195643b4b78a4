"""The converter interface and registry: one converter per dataset, chosen by name in the config."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.config.algorithms import register_pair_converter
from omni_core.data.sources import RawSource
from omni_core.errors import ConfigError, DataError
from omni_core.media_limits import MediaLimits
from omni_core.registry import Registry


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
    `preference_pairs`: its rows are preference pairs (`chosen` / `rejected`), which dpo/mpo train on,
    not prompts to sample and reward (`omni_core.data.holds_preference_pairs`).
    """

    name: ClassVar[str]
    version: ClassVar[str]
    schema: ClassVar[pa.Schema]
    preference_pairs: ClassVar[bool] = False
    limits: MediaLimits = MediaLimits()  # the dataset's media limits: ingest sets them; rows over one are rejected

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

    def convert_batch(self, table: pa.Table, split: str, first_index: int, raw: RawSource) -> BatchConverted | None:
        """Optional columnar `convert` of a chunk's raw rows (`first_index`: the first row's index in
        the split): the same output rows and rejections as calling `convert` on each record, built
        from Arrow arrays (media columns reuse the raw buffers). None: use `convert` row by row."""
        return None

    def chunks(self, raw: RawSource, split: str) -> list[Chunk] | None:
        """Independent pieces of a split that a worker can read by itself (so raw bytes never cross
        processes), in order; None when the layout cannot be split (records are then read here)."""
        return None


@dataclass(frozen=True)
class BatchConverted:
    """What `Converter.convert_batch` made of a chunk: the kept rows in input order, and the rows
    it rejected as (offset within the chunk, reason)."""

    table: pa.Table
    rejected: list[tuple[int, str]]


@dataclass(frozen=True)
class Chunk:
    """Row groups of one raw Parquet file; `first_index` is its first row's position in the split."""

    rel: str
    row_groups: tuple[int, ...]
    first_row: int  # row number within the file
    first_index: int
    columns: tuple[str, ...]

    def read(self, raw: RawSource) -> pa.Table:
        """The chunk's rows as Arrow (pyarrow releases the GIL here, so a thread can read ahead)."""
        return pq.ParquetFile(raw.path(self.rel)).read_row_groups(list(self.row_groups), columns=list(self.columns))

    def records(self, raw: RawSource, table: pa.Table | None = None) -> Iterator[RawRecord]:
        """The chunk's records; `table` is its already-read rows, if a reader thread fetched them."""
        table = self.read(raw) if table is None else table
        for offset, record in enumerate(table_records(table)):
            yield self.rel, self.first_row + offset, record


def is_binary_type(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def binary_values(array: pa.Array) -> list[memoryview | None]:
    """Each value as a slice of the array's data buffer (scalar `as_buffer()` would copy it)."""
    _, offsets_buffer, data = array.buffers()
    width = np.int64 if pa.types.is_large_binary(array.type) else np.int32
    offsets = np.frombuffer(offsets_buffer, dtype=width)[array.offset:array.offset + len(array) + 1].tolist()
    view = memoryview(data) if data is not None else memoryview(b"")
    valid = array.is_valid().to_pylist() if array.null_count else [True] * len(array)
    return [view[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(array))]


def table_records(table: pa.Table) -> list[dict[str, Any]]:
    """`table.to_pylist()`, except that binary values (a binary column, or binary fields of a struct
    column, as in Hugging Face's Image and Audio features) are memoryviews over Arrow's buffers.

    Media is most of an ingest's bytes; copying each image into a Python bytes object and back into
    Arrow cost more than the conversion itself, so records borrow the bytes and only the output
    table copies them (once, into reused Arrow memory).
    """
    media = [f.name for f in table.schema
             if is_binary_type(f.type) or (pa.types.is_struct(f.type) and any(is_binary_type(c.type) for c in f.type))]
    records = table.drop_columns(media).to_pylist() if media else table.to_pylist()
    for name in media:
        values: list[Any] = []
        for chunk in table.column(name).chunks:
            if is_binary_type(chunk.type):
                values += binary_values(chunk)
                continue
            fields = {f.name: (binary_values(chunk.field(f.name)) if is_binary_type(f.type)
                               else chunk.field(f.name).to_pylist()) for f in chunk.type}
            valid = chunk.is_valid().to_pylist()
            values += [{k: v[i] for k, v in fields.items()} if valid[i] else None for i in range(len(chunk))]
        for record, value in zip(records, values, strict=True):
            record[name] = value
    return records


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


class SplitFileConverter(Converter):
    """A dataset of one file per split, `{split}{split_suffix}` (found anywhere under the source by file name)."""

    split_names: ClassVar[tuple[str, ...]] = ("train", "test")
    split_suffix: ClassVar[str]

    def split_file(self, raw: RawSource, split: str) -> str | None:
        """The source-relative path of `split`'s file (the first by sorted path), or None."""
        name = f"{split}{self.split_suffix}"
        return next((rel for rel in sorted(raw.files) if rel.rsplit("/", 1)[-1] == name), None)

    def splits(self, raw: RawSource) -> list[str]:
        return [split for split in self.split_names if self.split_file(raw, split)]


def text_lines(raw: RawSource, rel: str, expected: str) -> Iterator[tuple[int, str]]:
    """(line number, line without its line end) of each non-blank line of a raw UTF-8 text file; a file
    that is not UTF-8 is a DataError saying it should be `expected`."""
    try:
        with open(raw.path(rel), encoding="utf-8") as lines:
            for line_no, line in enumerate(lines):
                if line.strip():
                    yield line_no, line.rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise DataError(f"{raw.uri}: {rel} is not UTF-8 text ({exc.reason}); expected {expected}") from exc


_CONVERTERS: Registry[type[Converter]] = Registry(
    "converter", hint="add a Converter subclass decorated with @register_converter to omni_core/data/")


def register_converter(cls: type[Converter]) -> type[Converter]:
    if cls.preference_pairs:
        register_pair_converter(cls.name)
    return _CONVERTERS.add(cls.name, cls)


def get_converter(name: str) -> Converter:
    return _CONVERTERS.get(name)()


def converter_problem(name: str) -> str | None:
    """Why no converter is registered as `name` (the registry's error, naming the known ones); None: one is."""
    try:
        _CONVERTERS.get(name)
    except ConfigError as exc:
        return str(exc)
    return None


def holds_preference_pairs(converter: str) -> bool:
    """Whether the converter named `converter` writes preference pairs (its `preference_pairs`);
    False for a name no converter is registered under."""
    return converter in _CONVERTERS and _CONVERTERS.get(converter).preference_pairs


def preference_converters() -> list[str]:
    """The registered converters that write preference pairs, by name."""
    return [name for name, cls in _CONVERTERS.items() if cls.preference_pairs]
