"""The `ingest` flow: one dataset from a source URI, or every dataset named in a pipeline file."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from omni_core.config import load_pipeline, validate_dataset
from omni_core.errors import ConfigError
from omni_core.paths import DEFAULT_STORE, DEFAULT_TRACKING_URI
from tasks.ingest import ingest_dataset


@flow(name="ingest", log_prints=True)
def ingest(
    name: str | None = None,
    source: str | None = None,
    converter: str | None = None,
    store: str = DEFAULT_STORE,
    tracking_uri: str = DEFAULT_TRACKING_URI,
    workers: int = 1,
    max_quarantine_fraction: float = 0.05,
    pipeline_file: str | None = None,
    overrides: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Either `name` + `source` (+ `converter`, default: the name), or `pipeline_file` (all its datasets,
    or only `name`), which also supplies the store and tracking URI."""
    tags = {"prefect.flow_run_id": str(flow_run.id or "")}
    if pipeline_file:
        config = load_pipeline(pipeline_file, overrides or [])
        jobs = {k: v for k, v in config.datasets.items() if name in (None, k)}
        store, tracking_uri = config.store, config.tracking_uri
    else:
        if not (name and source):
            raise ConfigError("ingest: give a dataset name and --source URI, or a pipeline file")
        jobs = {name: validate_dataset(name, {"source": source, "converter": converter or name,
                                              "max_quarantine_fraction": max_quarantine_fraction})}
    return [ingest_dataset(store_root=store, tracking_uri=tracking_uri, name=key, config=cfg, workers=workers,
                           tags=tags) for key, cfg in jobs.items()]
