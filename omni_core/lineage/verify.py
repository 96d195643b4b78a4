"""Re-check the digests recorded in the store's manifests against the bytes the store holds now.

What is checked (storage layout in docs/concepts/stages.md#storage-layout):
- a dataset version, `datasets/{name}/{version}/_manifest.json`: every shard of every split
  (`splits.{split}.shards[].key` and `.sha256`);
- a checkpoint, `runs/.../checkpoints/global_step_{N}/_manifest.json`: every file it lists
  (`files[].path`, relative to the checkpoint folder, and `.sha256`).

With `raw`, a dataset version's raw input is checked too: its source URI is resolved again (a local
directory read in place, an s3:// prefix or hub dataset downloaded, a fixture regenerated) and every
raw file the manifest lists (`raw_files[].path`, `.sha256`) is hashed and compared.

Only committed objects (those whose manifest exists) are checked: a folder without its manifest is
a write still in progress, or an interrupted one, and nothing in it was ever promised.

`resolve_target` turns what a user typed (nothing, `NAME@VERSION`, a store key, a store URI or a
local path) into a store and a key prefix; `verify` yields one `FileCheck` per file, in a stable
order, hashing several files at once (an S3 store answers each read with a round trip).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_core.errors import OmniError
from omni_core.storage import ObjectNotFoundError, Store

MANIFEST = "_manifest.json"  # the commit marker of a dataset version and of a checkpoint
OK, MISMATCH, MISSING, INVALID = "ok", "MISMATCH", "MISSING", "INVALID"
FAILED = (MISMATCH, MISSING, INVALID)

_DATASET_MANIFEST = re.compile(r"^datasets/[^/]+/[^/]+/" + re.escape(MANIFEST) + "$")
_CHECKPOINT_MANIFEST = re.compile(r"^runs/(?:.+/)?checkpoints/global_step_\d+/" + re.escape(MANIFEST) + "$")
_NAME_AT_VERSION = re.compile(r"^(?P<name>[^/@\s]+)@(?P<version>[^/@\s]+)$")


class VerifyError(OmniError):
    """What was asked to be verified is not a dataset version, a checkpoint or a store."""


@dataclass(frozen=True)
class Target:
    store: Store
    prefix: str  # "" (the whole store), datasets/..., or runs/...
    label: str  # what the user asked for, for messages


@dataclass(frozen=True)
class FileCheck:
    """The outcome for one file a manifest lists."""

    kind: str  # "dataset" | "checkpoint" | "raw" (a dataset version's raw source file)
    object: str  # the dataset version (NAME@VERSION) or the checkpoint folder (store key)
    key: str  # the file's store key
    uri: str
    status: str  # ok | MISMATCH | MISSING | INVALID (the manifest itself cannot be read)
    expected_sha256: str | None
    actual_sha256: str | None = None
    expected_bytes: int | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Summary:
    store: str
    target: str
    counts: dict[str, int] = field(default_factory=lambda: {OK: 0, MISMATCH: 0, MISSING: 0, INVALID: 0})
    datasets: set[str] = field(default_factory=set)
    checkpoints: set[str] = field(default_factory=set)

    def add(self, check: FileCheck) -> None:
        self.counts[check.status] += 1
        (self.datasets if check.kind in ("dataset", "raw") else self.checkpoints).add(check.object)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def ok(self) -> bool:
        return not any(self.counts[s] for s in FAILED)

    def line(self) -> str:
        failed = ", ".join(f"{self.counts[s]} {s}" for s in FAILED if self.counts[s])
        return (f"verified {self.total} file(s) of {len(self.datasets)} dataset version(s) and "
                f"{len(self.checkpoints)} checkpoint(s) in {self.store}: {self.counts[OK]} ok"
                + (f", {failed}" if failed else ""))

    def to_json(self) -> dict[str, Any]:
        return {"store": self.store, "target": self.target, "ok": self.ok, "files": self.total,
                "counts": dict(self.counts), "datasets": sorted(self.datasets),
                "checkpoints": sorted(self.checkpoints)}


# ---- what to verify --------------------------------------------------------------------------


def resolve_target(target: str | None, store_root: str) -> Target:
    """The store and key prefix `target` names. `store_root` is the configured store, used for
    NAME@VERSION and for store keys (`datasets/...`, `runs/...`).

    `target` may be: None or "" (the whole configured store); `NAME@VERSION`; a store key under
    datasets/ or runs/; the URI (s3://, file://) or local path of a store root or of a dataset
    version, dataset, checkpoint folder or run folder in one.
    """
    if not target:
        return Target(Store(store_root), "", store_root)
    if match := _NAME_AT_VERSION.match(target):
        return Target(Store(store_root), f"datasets/{match['name']}/{match['version']}", target)
    text = target.rstrip("/")
    if text.endswith("/" + MANIFEST):
        text = text[: -len(MANIFEST) - 1]
    if "://" not in text and not os.path.isabs(text) and text.split("/", 1)[0] in ("datasets", "runs"):
        return Target(Store(store_root), text, target)  # a key in the configured store
    is_uri = "://" in text
    if not is_uri and not os.path.exists(os.path.expanduser(text)):
        raise VerifyError(f"{target}: not found; give NAME@VERSION, a store key (datasets/NAME/VERSION, "
                          "runs/.../checkpoints/global_step_N), a store URI (s3://bucket/prefix/...) "
                          "or an existing local store path")
    if _is_store_root(text):
        return Target(Store(text), "", target)
    for root, key in _splits(text):
        return Target(Store(root or "/"), key, target)
    return Target(Store(text), "", target)  # a store root that holds nothing yet: verify says so


def _is_store_root(root: str) -> bool:
    store = Store(root)
    return store.exists("datasets") or store.exists("runs")


def _splits(text: str) -> Iterator[tuple[str, str]]:
    """(store root, key) for each place in `text` where a key of the storage layout could start:
    datasets/NAME[/VERSION] or runs/PIPELINE[/RUN_KEY[/STAGE[/checkpoints[/global_step_N]]]]."""
    parts = text.split("/")
    for i, part in enumerate(parts):
        key = parts[i:]
        if i == 0 or not all(key):
            continue
        dataset = part == "datasets" and len(key) <= 3
        checkpoint = (part == "runs" and len(key) <= 6 and (len(key) < 5 or key[4] == "checkpoints")
                      and (len(key) < 6 or re.fullmatch(r"global_step_\d+", key[5]) is not None))
        if dataset or checkpoint:
            yield "/".join(parts[:i]), "/".join(key)


def manifest_keys(store: Store, prefix: str) -> list[str]:
    """The dataset and checkpoint manifests at or under `prefix` (sorted)."""
    if prefix and not prefix.startswith(("datasets", "runs")):
        raise VerifyError(f"{store.uri(prefix)}: only datasets/... and runs/... hold manifests to verify; "
                          "give a dataset version, a checkpoint folder or the store root")
    scopes = [prefix] if prefix else ["datasets", "runs"]
    keys = [k for scope in scopes for k in store.list(scope)]
    return sorted(k for k in keys if _DATASET_MANIFEST.match(k) or _CHECKPOINT_MANIFEST.match(k))


# ---- checking --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Expected:
    kind: str
    object: str
    key: str
    sha256: str | None
    bytes: int | None


def _expected(store: Store, manifest_key: str) -> tuple[list[_Expected], FileCheck | None]:
    """The files a manifest lists, or (if it cannot be read) an INVALID check naming it."""
    folder = manifest_key.rsplit("/", 1)[0]
    is_dataset = manifest_key.startswith("datasets/")
    kind = "dataset" if is_dataset else "checkpoint"
    label = "@".join(folder.split("/")[1:3]) if is_dataset else folder
    try:
        manifest = store.read_json(manifest_key)
        if is_dataset:
            listed = [(s["key"], s.get("sha256"), s.get("bytes"))
                      for split in manifest["splits"].values() for s in split["shards"]]
        else:
            listed = [(f"{folder}/{f['path']}", f.get("sha256"), f.get("bytes")) for f in manifest["files"]]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        what = "not valid JSON" if isinstance(exc, json.JSONDecodeError) else f"malformed ({type(exc).__name__}: {exc})"
        return [], FileCheck(kind, label, manifest_key, store.uri(manifest_key), INVALID, None,
                             detail=f"manifest is {what}; restore it from a copy, or delete this {kind} folder "
                                    "and ingest or train it again")
    return [_Expected(kind, label, key, sha, size) for key, sha, size in listed], None


def _check(store: Store, e: _Expected) -> FileCheck:
    uri = store.uri(e.key)
    if not e.sha256:
        return FileCheck(e.kind, e.object, e.key, uri, INVALID, None, None, e.bytes,
                         "the manifest records no sha256 for this file")
    try:
        actual = store.sha256(e.key)
    except ObjectNotFoundError:
        return FileCheck(e.kind, e.object, e.key, uri, MISSING, e.sha256, None, e.bytes)
    return FileCheck(e.kind, e.object, e.key, uri, OK if actual == e.sha256 else MISMATCH, e.sha256, actual, e.bytes)


def _raw_checks(store: Store, manifest_key: str) -> list[FileCheck]:
    """The raw source files of the dataset version whose manifest is `manifest_key`, hashed again."""
    from omni_core.data.sources import resolve_source  # only with --raw: it may download or regenerate

    folder = manifest_key.rsplit("/", 1)[0]
    label = "@".join(folder.split("/")[1:3])
    try:
        manifest = store.read_json(manifest_key)
        listed = {f["path"]: f["sha256"] for f in manifest["raw_files"]}
        source = manifest["source_uri"]
    except (ValueError, KeyError, TypeError) as exc:
        return [FileCheck("raw", label, manifest_key, store.uri(manifest_key), INVALID, None,
                          detail=f"manifest lists no raw files ({type(exc).__name__}: {exc})")]
    try:
        found = resolve_source(source).files
    except OmniError as exc:
        return [FileCheck("raw", label, path, f"{source} {path}", MISSING, sha,
                          detail=f"source cannot be read: {exc}") for path, sha in sorted(listed.items())]
    return [FileCheck("raw", label, path, f"{source} {path}",
                      MISSING if path not in found else OK if found[path] == sha else MISMATCH, sha, found.get(path))
            for path, sha in sorted(listed.items())]


def verify(store: Store, prefix: str = "", *, workers: int = 4,
           on_manifest: Callable[[str], None] | None = None, raw: bool = False) -> Iterator[FileCheck]:
    """One FileCheck per file listed by every committed manifest at or under `prefix`, in manifest
    order (with `raw`, each dataset version's raw source files after its shards). Raises VerifyError
    when `prefix` names something that holds no committed manifest."""
    keys = manifest_keys(store, prefix)
    if not keys:
        where = store.uri(prefix)
        raise VerifyError(f"nothing to verify at {where}: no committed dataset version or checkpoint "
                          f"(no {MANIFEST}) there; check the store root (--store) and the name or key")
    yield from _verify_manifests(store, keys, workers=workers, on_manifest=on_manifest, raw=raw)


def _verify_manifests(store: Store, keys: Iterable[str], *, workers: int,
                      on_manifest: Callable[[str], None] | None, raw: bool = False) -> Iterator[FileCheck]:
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="omni-verify") as pool:
        for key in keys:
            if on_manifest:
                on_manifest(key)
            expected, invalid = _expected(store, key)
            if invalid is not None:
                yield invalid
            yield from pool.map(lambda e: _check(store, e), expected)
            if raw and _DATASET_MANIFEST.match(key):
                yield from _raw_checks(store, key)


def verify_target(target: str | None, store_root: str, *, workers: int = 4,
                  raw: bool = False) -> tuple[Summary, list[FileCheck]]:
    """Every check for `target` (see resolve_target) and their summary, in one call."""
    t = resolve_target(target, store_root)
    summary = Summary(t.store.root, t.label)
    checks = []
    for check in verify(t.store, t.prefix, workers=workers, raw=raw):
        summary.add(check)
        checks.append(check)
    return summary, checks
