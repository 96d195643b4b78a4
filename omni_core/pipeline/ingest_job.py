"""A standalone ingest (outside a pipeline file): one dataset, logged as its own MLflow run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_core.config import DatasetConfig
from omni_core.data import DatasetVersion, ingest
from omni_core.lineage import Tracker, git_commit, log_dataset_version
from omni_core.storage import Store

EXPERIMENT = "datasets"


def version_summary(dv: DatasetVersion) -> dict[str, Any]:
    manifest = dv.manifest
    return {"name": dv.name, "version": dv.version, "uri": dv.uri, "reused": dv.reused,
            "source_uri": manifest["source_uri"], "counts": manifest["counts"],
            "rows": {split: entry["rows"] for split, entry in manifest["splits"].items()}}


def ingest_with_lineage(*, store_root: str, tracking_uri: str, name: str, config: DatasetConfig, workers: int = 1,
                        tags: dict[str, str] | None = None, progress: Callable[[str], None] = print
                        ) -> dict[str, Any]:
    store = Store(store_root)
    store.check_writable()
    tracker = Tracker(tracking_uri)
    run_id = tracker.start_run(EXPERIMENT, run_name=f"ingest {name}", tags={
        "omni.dataset": name, "omni.git_commit": git_commit(), "omni.store": store.root, **(tags or {})})
    try:
        dv = ingest(store, name, config, progress=progress, workers=workers)
        log_dataset_version(tracker, run_id, dv, context="ingest", with_manifest=True)
    except BaseException:
        tracker.end_run(run_id, ok=False)
        raise
    tracker.end_run(run_id, ok=True)
    return {**version_summary(dv), "mlflow_run_id": run_id, "tracking_uri": tracker.tracking_uri}
