"""Stage cache: a key per stage from what determines its result, and the result record in the store.

    key = digest(kind, the stage's resolved config, its direct upstream stages' output digests,
                 the digests of what else it reads (dataset versions, raw sources, images), code version)

A finished stage writes its record to `runs/{pipeline}/stages/{stage}/{key}.json` after everything
it produced is committed, so the record's presence means "done": a re-run with the same key skips
the stage, from any process or machine that sees the store. Nothing is kept in process memory.

An upstream stage contributes the digest of its *outputs* (dataset versions, weights digests, image
digests: content, not the URIs or timings), so an upstream stage that re-ran and produced the same
result leaves its dependents' keys unchanged.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import omni_core
from omni_core.storage import ObjectNotFoundError, Store

KEY_CHARS = 16  # like dataset versions and run keys


def digest(obj: Any) -> str:
    """sha256 of canonical JSON: equal data, equal digest, whatever the key order."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def code_version(kind: str, kind_version: str) -> str:
    """The library version and the stage kind's own version; bump either when the same inputs would
    give a different result (as converters bump theirs)."""
    return f"omni_core-{omni_core.__version__}/{kind}-{kind_version}"


def key_inputs(*, kind: str, kind_version: str, config: dict[str, Any], upstream: dict[str, str],
               inputs: dict[str, Any]) -> dict[str, Any]:
    """Everything a stage's cache key is made of, as recorded in its record (to explain a later miss)."""
    return {"kind": kind, "config": config, "upstream": upstream, "inputs": inputs,
            "code_version": code_version(kind, kind_version)}


def cache_key(parts: dict[str, Any]) -> str:
    return digest(parts)[:KEY_CHARS]


def explain_change(before: dict[str, Any], now: dict[str, Any]) -> str:
    """Which parts of the key differ from an earlier record's: `config`, `upstream ingest`, ..."""
    changed = []
    for part in ("kind", "config", "inputs", "code_version"):
        if before.get(part) != now.get(part):
            changed.append(part.replace("_", " "))
    old_up, new_up = before.get("upstream", {}), now.get("upstream", {})
    changed += [f"upstream {name}" for name in sorted(set(old_up) | set(new_up)) if old_up.get(name) != new_up.get(name)]
    return ", ".join(changed) or "nothing (same key parts)"


@dataclass
class StageRecord:
    """What a finished stage produced, stored as JSON under its cache key."""

    pipeline: str
    stage: str
    kind: str
    cache_key: str
    key_inputs: dict[str, Any]
    outputs: dict[str, Any]
    output_digest: str
    seconds: float
    mlflow_run_id: str
    tracking_uri: str
    report: dict[str, Any] = field(default_factory=dict)  # shown, not digested: e.g. the reward curve
    finished_at: str = ""
    git_commit: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StageRecord:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def stage_folder(pipeline: str, stage: str) -> str:
    return f"runs/{pipeline}/stages/{stage}"


def record_key(pipeline: str, stage: str, key: str) -> str:
    return f"{stage_folder(pipeline, stage)}/{key}.json"


def files_prefix(pipeline: str, stage: str, key: str) -> str:
    """Where a stage keeps files that belong to its record (e.g. reward_curve.png)."""
    return f"{stage_folder(pipeline, stage)}/{key}"


def load_record(store: Store, pipeline: str, stage: str, key: str) -> StageRecord | None:
    try:  # one GET, not exists() then a read: on S3 a missing key costs a HEAD and a listing besides
        return StageRecord.from_json(store.read_json(record_key(pipeline, stage, key)))
    except ObjectNotFoundError:
        return None


def save_record(store: Store, record: StageRecord) -> str:
    """Writes the record atomically (the commit point of the stage); returns its URI."""
    if not record.finished_at:
        record.finished_at = datetime.now(UTC).isoformat(timespec="seconds")
    path = record_key(record.pipeline, record.stage, record.cache_key)
    store.write_json(path, record.to_json())
    return store.uri(path)


# S3 stamps LastModified in whole seconds, and a record's `finished_at` is the writer's clock: records
# modified within this many seconds of the newest are all read and ordered by `finished_at`.
SAME_TIME_S = 2.0


def record_times(store: Store, pipeline: str, stage: str) -> dict[str, float]:
    """A stage's records (any key) with their last-modified times, from one listing of its folder."""
    folder = stage_folder(pipeline, stage)
    depth = folder.count("/") + 1
    return {k: t for k, t in store.list_modified(folder).items() if k.endswith(".json") and k.count("/") == depth}


def latest_record(store: Store, pipeline: str, stage: str, times: dict[str, float] | None = None) -> StageRecord | None:
    """The most recently finished record of a stage (any key), to say why a key changed. `times`:
    `record_times`'s answer if the caller listed already.

    One listing, which carries each record's last-modified time, and a read of the newest record only
    (of each record modified within `SAME_TIME_S` of it, to pick by `finished_at` where times tie):
    not a read of every earlier record, which would grow with the stage's history."""
    times = record_times(store, pipeline, stage) if times is None else times
    if not times:
        return None
    newest = max(times.values())
    found = [StageRecord.from_json(store.read_json(k)) for k in sorted(times) if times[k] >= newest - SAME_TIME_S]
    return max(found, key=lambda r: r.finished_at)
