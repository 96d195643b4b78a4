"""Ingest a raw dataset into a versioned, content-addressed set of verl Parquet shards in the store.

Layout (docs/concepts/stages.md#storage-layout): datasets/{name}/{version}/{split}-{shard:05d}.parquet, quarantine.parquet,
_manifest.json (written last: its presence commits the version), and datasets/{name}/LATEST, the
version committed last. An ingest that fails on its data (too many quarantined rows, an unreadable raw
file) removes what it wrote; one that fails on the store (a transient error) leaves it uncommitted (no
manifest: invisible; the next attempt overwrites it), since a concurrent ingest of the same version may
be writing those very names. LATEST is left alone either way.

Two ingests of the same version at once (two identical runs) write the same shard names with the same
bytes, each shard replacing its name whole: nothing is deleted before the write, a failed attempt
deletes nothing the other may still commit, and an attempt that fails after the other committed takes
that commit. LATEST is settled on the newest commit (`settle_pointer`):
two versions committed at once never leave it on the older one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from omni_core.config.models import MEDIA_LIMIT_KEYS, DatasetConfig
from omni_core.data.converter import (
    Chunk,
    Converter,
    RawRecord,
    RowRejected,
    RowSkipped,
    get_converter,
    table_records,
)
from omni_core.data.memory import release_freed_memory, without_huge_pages
from omni_core.data.shards import ShardWriters, parquet_write_options  # noqa: F401 (re-exported)
from omni_core.data.sources import RawSource, resolve_source
from omni_core.errors import DataError
from omni_core.media_limits import MediaLimits
from omni_core.storage import Store, settle_pointer

MANIFEST = "_manifest.json"
BATCH_ROWS = 256  # rows per conversion batch and per Parquet row group
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

    def rows(self, store: Any, split: str) -> list[dict[str, Any]]:
        """Every row of `split`, as dicts, in shard order (what training and eval read)."""
        return read_rows(store, self.shard_keys(split))


def read_rows(store: Any, shard_keys: list[str]) -> list[dict[str, Any]]:
    """The rows of Parquet shards in `store`, in order, as dicts."""
    rows: list[dict[str, Any]] = []
    for key in shard_keys:
        with store.open_read(key) as f:
            rows.extend(pq.read_table(f).to_pylist())
    return rows


def version_id(converter: Converter, raw: RawSource, options: dict[str, Any]) -> str:
    """Digest of everything that determines the output: converter and version, raw bytes, options."""
    payload = {"converter": converter.name, "converter_version": converter.version,
               "raw": raw.files, "options": options}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def dataset_prefix(name: str, version: str) -> str:
    return f"datasets/{name}/{version}"


def list_versions(store: Store, name: str) -> list[str]:
    """Committed versions of a dataset (those with a manifest), oldest name first."""
    keys = store.list(f"datasets/{name}")
    return sorted({k.split("/")[2] for k in keys if k.endswith(f"/{MANIFEST}") and k.count("/") == 3})


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


def ingest(store: Store, name: str, config: DatasetConfig, progress: Progress = print, workers: int = 1
           ) -> DatasetVersion:
    """Convert `config.source` with `config.converter` and commit it as a version of dataset `name`."""
    converter = get_converter(config.converter)
    converter.limits = MediaLimits.of(config)
    raw = resolve_source(config.source)
    options: dict[str, Any] = {"shard_rows": config.shard_rows}
    if config.shard_bytes is not None:  # only when set: the ids of versions ingested without it stay
        options["shard_bytes"] = int(config.shard_bytes)
    # media limits only when not the default, likewise (a version ingested before they existed kept
    # every row; its id is reused, so a re-ingest does not quarantine what it kept: `omni verify`)
    options.update({k: v for k, v in config.model_dump(include=set(MEDIA_LIMIT_KEYS)).items()})
    version = version_id(converter, raw, options)
    prefix = dataset_prefix(name, version)
    if store.exists(f"{prefix}/{MANIFEST}"):
        progress(f"dataset {name}: version {version} already committed; nothing to do")
        if not store.exists(f"datasets/{name}/LATEST") or store.read_text(f"datasets/{name}/LATEST").strip() != version:
            store.write_json(f"{prefix}/{MANIFEST}", store.read_json(f"{prefix}/{MANIFEST}"))  # committed again: now
            settle_latest(store, name)
        return load_version(store, name, version)

    splits = converter.splits(raw)
    if not splits:
        raise DataError(f"dataset source {config.source}: no files that converter '{converter.name}' recognises "
                        f"among {sorted(raw.files)[:5]}; check that the source is a {converter.name} dataset")
    progress(f"dataset {name}: converting {len(raw.files)} raw file(s) with {converter.name} v{converter.version}"
             + (f" on {workers} workers" if workers > 1 else ""))
    try:  # an interrupted attempt's leftovers are overwritten: the same names, the same bytes
        with without_huge_pages():
            manifest = _convert(store, name, version, prefix, raw, converter, config, options, splits, progress,
                                workers)
    except DataError:  # the data itself: every attempt at this version fails alike, none can commit it
        if not store.exists(f"{prefix}/{MANIFEST}"):
            store.delete(prefix)  # no half-written version stays behind
        raise
    except Exception:
        # a storage or other transient error: what this attempt wrote stays uncommitted (no manifest:
        # invisible) and is the same bytes a concurrent ingest of this version writes, so deleting it
        # could take that one's shards from under its commit; a retry overwrites it
        if store.exists(f"{prefix}/{MANIFEST}"):
            progress(f"dataset {name}: version {version} was committed by a concurrent ingest meanwhile; using it")
            return load_version(store, name, version)
        raise
    missing = _missing_shards(store, prefix, manifest)
    if missing:
        raise DataError(f"dataset {name}: shard(s) {', '.join(missing[:3])} of version {version} vanished while "
                        "it was written (removed by hand, or by a concurrent ingest of the same data that failed "
                        "on bad rows); run the ingest again")
    store.write_json(f"{prefix}/{MANIFEST}", manifest)  # the commit point
    settle_latest(store, name)
    return DatasetVersion(name, version, store.uri(prefix), manifest, False)


def _missing_shards(store: Store, prefix: str, manifest: dict[str, Any]) -> list[str]:
    """The files the manifest is about to list that the store does not hold (one listing)."""
    held = set(store.list(prefix))
    wanted = [s["key"] for e in manifest["splits"].values() for s in e["shards"]]
    wanted += [manifest["quarantine"]] if manifest.get("quarantine") else []
    return [k for k in wanted if k not in held]


def settle_latest(store: Store, name: str) -> None:
    """datasets/{name}/LATEST on the version whose manifest was written last (ties: the greater id)."""
    def newest() -> str | None:
        manifests = {k.split("/")[2]: t for k, t in store.list_modified(f"datasets/{name}").items()
                     if k.endswith(f"/{MANIFEST}") and k.count("/") == 3}
        return max(manifests, key=lambda v: (manifests[v], v)) if manifests else None

    settle_pointer(store, f"datasets/{name}/LATEST", newest)


def _convert(store: Store, name: str, version: str, prefix: str, raw: RawSource, converter: Converter,
             config: DatasetConfig, options: dict[str, Any], splits: list[str], progress: Progress,
             workers: int) -> dict[str, Any]:
    quarantined: list[dict[str, Any]] = []
    entries = {}
    with ExitStack() as stack:
        pool = spill_dir = None
        if workers > 1:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            spill_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="omni-ingest-", dir=shm))
            pool = stack.enter_context(ProcessPoolExecutor(workers))
        for split in splits:
            entries[split] = _write_split(store, prefix, split, raw, converter, config, quarantined, pool, spill_dir)
            e = entries[split]
            progress(f"dataset {name}: {split}: {e['read']} read, {e['rows']} written in {len(e['shards'])} "
                     f"shard(s), {e['quarantined']} quarantined, {e['skipped']} skipped")
    counts = {k: sum(e[k] for e in entries.values()) for k in ("read", "rows", "quarantined", "skipped")}
    if counts["read"] != counts["rows"] + counts["quarantined"] + counts["skipped"]:  # never lose a row silently
        raise DataError(f"dataset {name}: counts do not add up {counts}; this is a bug, please report it")
    usable = counts["read"] - counts["skipped"]
    fraction = counts["quarantined"] / usable if usable else 0.0
    if fraction > config.max_quarantine_fraction:
        reasons = sorted({q["reason"] for q in quarantined})[:3]
        raise DataError(f"dataset {name}: {counts['quarantined']} of {usable} rows ({fraction:.1%}) were quarantined, "
                        f"over max_quarantine_fraction={config.max_quarantine_fraction} (reasons: {'; '.join(reasons)}); "
                        "fix the source or raise the limit")
    if quarantined:
        with store.open_write(f"{prefix}/quarantine.parquet") as f:
            pq.write_table(pa.Table.from_pylist(quarantined, schema=QUARANTINE_SCHEMA), f)
    return {
        "name": name,
        "version": version,
        "converter": {"name": converter.name, "version": converter.version},
        "source_uri": config.source,
        "raw_files": [{"path": p, "sha256": d} for p, d in sorted(raw.files.items())],
        "options": options,
        "schema": [{"name": f.name, "type": str(f.type)} for f in converter.schema],
        "splits": entries,
        "counts": counts,
        "quarantine": f"{prefix}/quarantine.parquet" if quarantined else None,
    }


@dataclass
class _Converted:
    """What one unit of work produced. A worker hands rows back as an Arrow IPC file in `spill_dir`
    (shared memory where there is one) because pickling tables through the pool's pipe was slower
    than the conversion itself; the main process memory-maps it."""

    table: pa.Table | None
    quarantined: list[dict[str, Any]]
    read: int
    skipped: int
    ipc_path: str | None = None

    def rows(self) -> pa.Table:
        if self.table is not None:
            return self.table
        with pa.memory_map(self.ipc_path) as source:
            return pa.ipc.open_file(source).read_all()

    def release(self) -> None:
        if self.ipc_path:
            os.unlink(self.ipc_path)


Work = Chunk | tuple[int, list[RawRecord]]  # a chunk a worker reads itself, or (first index, records read here)


def _convert_work(converter_name: str, limits: MediaLimits, raw: RawSource, split: str, work: Work,
                  spill_dir: str | None = None, table: pa.Table | None = None) -> _Converted:
    """Runs in this process or a worker: converters are looked up by name, so nothing unpicklable travels.

    `table` is a Chunk's rows when a reader thread has already read them."""
    converter = get_converter(converter_name)
    converter.limits = limits
    batch = None
    if isinstance(work, Chunk):
        table = work.read(raw) if table is None else table
        batch = converter.convert_batch(table, split, work.first_index, raw)
    if batch is not None:
        quarantined = [{"split": split, "source_file": work.rel, "row": work.first_row + offset, "reason": reason,
                        "raw": _raw_json(table_records(table.slice(offset, 1))[0])} for offset, reason in batch.rejected]
        read, skipped = table.num_rows, table.num_rows - batch.table.num_rows - len(batch.rejected)
        table = batch.table
    else:
        first_index, records = (work.first_index, work.records(raw, table)) if isinstance(work, Chunk) else work
        rows, quarantined = [], []
        read = skipped = 0
        for index, (rel, row, record) in enumerate(records, start=first_index):
            read += 1
            try:
                rows.append(converter.convert(record, split, index, raw))
            except RowRejected as exc:
                quarantined.append({"split": split, "source_file": rel, "row": row, "reason": exc.reason,
                                    "raw": _raw_json(record)})
            except RowSkipped:
                skipped += 1
        table = pa.Table.from_pylist(_owned(rows), schema=converter.schema)
    if spill_dir is None:
        return _Converted(table, quarantined, read, skipped)
    path = os.path.join(spill_dir, f"{uuid.uuid4().hex}.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, converter.schema) as ipc:
        ipc.write_table(table)
    return _Converted(None, quarantined, read, skipped, path)


def _owned(value: Any) -> Any:
    """`value` with every memoryview (media borrowed from the raw batch) copied to bytes.

    pyarrow 25's conversion from Python never releases the buffer it reads a memoryview through, so
    a borrowed value would pin its whole raw batch for the life of the process (memory grew with the
    input); bytes objects are converted without that leak.
    """
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, dict):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_owned(v) for v in value]
    return value


def _work(converter: Converter, raw: RawSource, split: str) -> Iterator[Work]:
    chunks = converter.chunks(raw, split)
    if chunks is not None:
        yield from chunks
        return
    batch: list[RawRecord] = []
    first = 0
    for index, record in enumerate(converter.records(raw, split)):
        batch.append(record)
        if len(batch) == BATCH_ROWS:
            yield first, batch
            first, batch = index + 1, []
    if batch:
        yield first, batch


def _converted(converter: Converter, raw: RawSource, split: str, pool: ProcessPoolExecutor | None,
               spill_dir: str | None) -> Iterator[_Converted]:
    """Results in input order; with a pool, at most 2 units per worker are in flight (bounded memory)."""
    if pool is None:
        yield from _converted_here(converter, raw, split)
        return
    window: list[Future] = []
    for work in _work(converter, raw, split):
        window.append(pool.submit(_convert_work, converter.name, converter.limits, raw, split, work, spill_dir))
        if len(window) >= 2 * pool._max_workers:
            yield window.pop(0).result()
    for future in window:
        yield future.result()


def _converted_here(converter: Converter, raw: RawSource, split: str) -> Iterator[_Converted]:
    """In-process conversion; a reader thread reads the next chunk while this one converts (pyarrow
    reads without the GIL), so at most two chunks are in memory."""
    with ThreadPoolExecutor(1, thread_name_prefix="omni-ingest-read") as reader:
        ahead: tuple[Work, Future | None] | None = None
        for work in _work(converter, raw, split):
            upcoming = (work, reader.submit(_read_released, work, raw) if isinstance(work, Chunk) else None)
            if ahead is not None:
                yield _convert_ahead(converter, raw, split, ahead)
            ahead = upcoming
        if ahead is not None:
            yield _convert_ahead(converter, raw, split, ahead)


def _read_released(work: Chunk, raw: RawSource) -> pa.Table:
    """`work.read` on the reader thread, after handing back what that thread's heap holds freed.

    Arrow's allocator keeps a heap per thread, and a raw batch freed by a writer thread returns to
    the reader's heap, which only that thread can give back: without this the reader's heap held a
    few batches' worth more at the peak (measured: peak RSS 380-480 MB with it, 450-570 without)."""
    release_freed_memory()
    return work.read(raw)


def _convert_ahead(converter: Converter, raw: RawSource, split: str, ahead: tuple[Work, Future | None]
                   ) -> _Converted:
    work, table = ahead
    converted = _convert_work(converter.name, converter.limits, raw, split, work,
                              table=None if table is None else table.result())
    release_freed_memory()  # the converting thread's heap, likewise
    return converted


def _raw_json(record: dict[str, Any]) -> str:
    def encode(value: Any) -> Any:
        if isinstance(value, bytes | bytearray | memoryview):
            return {"base64": base64.b64encode(value).decode()}
        return repr(value)

    return json.dumps(record, default=encode, sort_keys=True)


def _write_split(store: Store, prefix: str, split: str, raw: RawSource, converter: Converter, config: DatasetConfig,
                 quarantined: list[dict[str, Any]], pool: ProcessPoolExecutor | None, spill_dir: str | None
                 ) -> dict[str, Any]:
    writers = ShardWriters(store, prefix, split, converter.schema, config.shard_rows,
                           shard_bytes=None if config.shard_bytes is None else int(config.shard_bytes))
    read = skipped = 0
    try:
        for result in _converted(converter, raw, split, pool, spill_dir):
            read += result.read
            skipped += result.skipped
            quarantined.extend(result.quarantined)
            writers.write(result.rows(), result.release)
            del result  # the writers hold the batch now; this loop must not keep it alive too
        shards = writers.close()
    except BaseException:
        writers.abort()
        raise
    rows_written = sum(s["rows"] for s in shards)
    return {"read": read, "rows": rows_written, "quarantined": read - rows_written - skipped, "skipped": skipped,
            "shards": shards}
