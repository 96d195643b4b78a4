"""Ingest a raw dataset into a versioned, content-addressed set of verl Parquet shards in the store.

Layout (DESIGN.md): datasets/{name}/{version}/{split}-{shard:05d}.parquet, quarantine.parquet,
_manifest.json (written last: its presence commits the version), and datasets/{name}/LATEST.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

import omni_core.data.gsm8k  # noqa: F401  (registers the converter)
from omni_core.config.models import DatasetConfig
from omni_core.data.converter import Converter, RowRejected, get_converter
from omni_core.data.sources import RawSource, resolve_source
from omni_core.errors import DataError
from omni_core.storage import Store

MANIFEST = "_manifest.json"
READ_BATCH_ROWS = 1000
QUARANTINE_SCHEMA = pa.schema([
    ("split", pa.string()), ("source_file", pa.string()), ("row", pa.int64()),
    ("reason", pa.string()), ("raw", pa.string()),
])

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DatasetVersion:
    name: str
    version: str
    uri: str  # store URI of the version folder
    manifest: dict[str, Any]
    reused: bool  # True when the version already existed and no work was done

    def shard_keys(self, split: str) -> list[str]:
        return [s["key"] for s in self.manifest["splits"][split]["shards"]]


def version_id(converter: Converter, raw: RawSource, options: dict[str, Any]) -> str:
    """Digest of everything that determines the output: converter and version, raw bytes, options."""
    payload = {"converter": converter.name, "converter_version": converter.version,
               "raw": raw.files, "options": options}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def dataset_prefix(name: str, version: str) -> str:
    return f"datasets/{name}/{version}"


def load_version(store: Store, name: str, version: str | None = None) -> DatasetVersion:
    """A committed version (default: the one LATEST names)."""
    if version is None:
        if not store.exists(f"datasets/{name}/LATEST"):
            raise DataError(f"dataset '{name}' has no version in {store.root}; run its ingest stage first")
        version = store.read_text(f"datasets/{name}/LATEST").strip()
    key = f"{dataset_prefix(name, version)}/{MANIFEST}"
    if not store.exists(key):
        raise DataError(f"dataset '{name}' version {version} is not committed in {store.root} (no {MANIFEST})")
    return DatasetVersion(name, version, store.uri(dataset_prefix(name, version)), store.read_json(key), True)


def ingest(store: Store, name: str, config: DatasetConfig, progress: Progress = print) -> DatasetVersion:
    converter = get_converter(config.converter)
    raw = resolve_source(config.source)
    options = {"shard_rows": config.shard_rows}
    version = version_id(converter, raw, options)
    prefix = dataset_prefix(name, version)
    if store.exists(f"{prefix}/{MANIFEST}"):
        progress(f"dataset {name}: version {version} already committed; nothing to do")
        store.write_text(f"datasets/{name}/LATEST", version + "\n")
        return load_version(store, name, version)

    splits = converter.splits(raw)
    if not splits:
        raise DataError(f"dataset source {config.source}: no split files that converter '{converter.name}' "
                        f"recognises among {sorted(raw.files)[:5]}; check the source folder")
    progress(f"dataset {name}: converting {len(raw.files)} raw file(s) with {converter.name} v{converter.version}")
    quarantined: list[dict[str, Any]] = []
    split_entries = {}
    for split in splits:
        split_entries[split] = _write_split(store, prefix, split, raw, converter, config.shard_rows, quarantined)
        entry = split_entries[split]
        progress(f"dataset {name}: {split}: {entry['rows']} rows in {len(entry['shards'])} shard(s), "
                 f"{entry['quarantined']} quarantined")
    if quarantined:
        with store.open_write(f"{prefix}/quarantine.parquet") as f:
            pq.write_table(pa.Table.from_pylist(quarantined, schema=QUARANTINE_SCHEMA), f)

    counts = {k: sum(e[k] for e in split_entries.values()) for k in ("read", "rows", "quarantined")}
    if counts["read"] != counts["rows"] + counts["quarantined"]:  # never lose a row silently
        raise DataError(f"dataset {name}: counts do not add up {counts}; this is a bug, please report it")
    manifest = {
        "name": name,
        "version": version,
        "converter": {"name": converter.name, "version": converter.version},
        "source_uri": config.source,
        "raw_files": [{"path": p, "sha256": d} for p, d in sorted(raw.files.items())],
        "options": options,
        "schema": [{"name": f.name, "type": str(f.type)} for f in converter.schema],
        "splits": split_entries,
        "counts": counts,
        "quarantine": f"{prefix}/quarantine.parquet" if quarantined else None,
    }
    store.write_json(f"{prefix}/{MANIFEST}", manifest)  # the commit point
    store.write_text(f"datasets/{name}/LATEST", version + "\n")
    return DatasetVersion(name, version, store.uri(prefix), manifest, False)


class _ShardWriter:
    """Writes `{split}-{n:05d}.parquet` shards of at most `shard_rows` rows, one row group per batch.

    Only the current row group is in memory, and each shard appears in the store atomically.
    """

    def __init__(self, store: Store, prefix: str, split: str, schema: pa.Schema, shard_rows: int):
        self.store, self.prefix, self.split, self.schema, self.shard_rows = store, prefix, split, schema, shard_rows
        self.shards: list[dict[str, Any]] = []
        self._stack: ExitStack | None = None
        self._writer: pq.ParquetWriter | None = None
        self._key = ""
        self._rows = 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        while rows:
            if self._writer is None:
                self._open()
            take = rows[: self.shard_rows - self._rows]
            rows = rows[len(take):]
            self._writer.write_table(pa.Table.from_pylist(take, schema=self.schema))
            self._rows += len(take)
            if self._rows >= self.shard_rows:
                self.close()

    def _open(self) -> None:
        self._key = f"{self.prefix}/{self.split}-{len(self.shards):05d}.parquet"
        self._stack = ExitStack()
        sink = self._stack.enter_context(self.store.open_write(self._key))
        self._writer = self._stack.enter_context(pq.ParquetWriter(sink, self.schema))

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()  # closes the Parquet footer, then commits the object
            self.shards.append({"key": self._key, "rows": self._rows, "sha256": self.store.sha256(self._key)})
        self._stack, self._writer, self._rows = None, None, 0

    def abort(self) -> None:
        if self._stack is not None:
            self._stack.__exit__(DataError, DataError("ingest aborted"), None)  # discards the partial shard
        self._stack, self._writer, self._rows = None, None, 0


def _write_split(store: Store, prefix: str, split: str, raw: RawSource, converter: Converter, shard_rows: int,
                 quarantined: list[dict[str, Any]]) -> dict[str, Any]:
    writer = _ShardWriter(store, prefix, split, converter.schema, shard_rows)
    batch: list[dict[str, Any]] = []
    read = 0
    try:
        for index, (rel, row, record) in enumerate(converter.records(raw, split)):
            read += 1
            try:
                batch.append(converter.convert(record, split, index, raw))
            except RowRejected as rejected:
                quarantined.append({"split": split, "source_file": rel, "row": row, "reason": rejected.reason,
                                    "raw": json.dumps(record, default=repr, sort_keys=True)})
            if len(batch) >= READ_BATCH_ROWS:
                writer.write(batch)
                batch = []
        writer.write(batch)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    rows = sum(s["rows"] for s in writer.shards)
    return {"rows": rows, "read": read, "quarantined": read - rows, "shards": writer.shards}
