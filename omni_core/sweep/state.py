"""A sweep's state in the store, so a sweep run again (after a crash, a SIGKILL, a Ctrl-C) goes on where
it stood: `sweeps/{pipeline}/{name}/{key}/`

    spec.json               the sweep file, the pipeline file and overrides, the plan (written once)
    state.json              the sweep's MLflow run, the shared stages' run, the winner (replaced whole)
    variants/{index}.json   one record per variant: its values, status, rung values, scores (replaced whole)
    report/                 the comparison (JSON, CSV, markdown) and the plots

Each file is written whole and last (the store's atomic writes), so a reader sees an old record or a
new one, never half of one. `key` digests the sweep file and the resolved pipeline (not the code
version: a resumed sweep keeps its finished variants; the stage cache decides what to re-run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from omni_core.config import config_digest
from omni_core.errors import OmniError
from omni_core.storage import Store

SWEEPS = "sweeps"
PENDING, RUNNING, COMPLETED, PRUNED, FAILED = "pending", "running", "completed", "pruned", "failed"
FINAL = (COMPLETED, PRUNED)  # kept by a resumed sweep; the others run (again)


class SweepNotFoundError(OmniError):
    """No sweep of that name in the store."""


def sweep_key(spec: dict[str, Any], pipeline: dict[str, Any]) -> str:
    return config_digest({"spec": spec, "pipeline": pipeline})[:16]


@dataclass
class SweepState:
    store: Store
    prefix: str
    spec: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    records: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def open(cls, store: Store, pipeline: str, name: str, key: str, spec: dict[str, Any]) -> SweepState:
        """The sweep's state, created (spec.json) or read back with every variant's record."""
        prefix = f"{SWEEPS}/{pipeline}/{name}/{key}"
        if not store.exists(f"{prefix}/spec.json"):
            store.write_json(f"{prefix}/spec.json", {**spec, "created_at": time.time()})
        opened = cls(store, prefix, store.read_json(f"{prefix}/spec.json"))
        if store.exists(f"{prefix}/state.json"):
            opened.state = store.read_json(f"{prefix}/state.json")
        for key_ in store.list(f"{prefix}/variants/"):
            if key_.endswith(".json"):
                record = store.read_json(key_)
                opened.records[int(record["index"])] = record
        return opened

    def save(self, record: dict[str, Any]) -> None:
        record["updated_at"] = time.time()
        self.records[int(record["index"])] = record
        self.store.write_json(f"{self.prefix}/variants/{int(record['index']):04d}.json", record)

    def update(self, **fields: Any) -> None:
        self.state.update(fields)
        self.store.write_json(f"{self.prefix}/state.json", self.state)

    def report_key(self, name: str) -> str:
        return f"{self.prefix}/report/{name}"


def find_sweeps(store: Store, name: str | None = None) -> list[SweepState]:
    """The sweeps in the store (of `name`), newest first."""
    found = []
    for key in store.list(f"{SWEEPS}/"):
        parts = key.split("/")
        if len(parts) == 5 and parts[-1] == "spec.json" and (name is None or parts[2] == name):
            found.append(SweepState.open(store, parts[1], parts[2], parts[3], {}))
    if name is not None and not found:
        known = sorted({s.spec.get("name", "") for s in find_sweeps(store)})
        raise SweepNotFoundError(f"no sweep named '{name}' in store {store.root} (sweeps there: "
                                 f"{', '.join(known) or 'none'}); `omni sweep status` lists them")
    return sorted(found, key=lambda s: -float(s.spec.get("created_at", 0)))
