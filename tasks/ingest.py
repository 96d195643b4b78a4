"""Prefect task: ingest one dataset, retried on transient storage errors only."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.config import DatasetConfig
from omni_core.pipeline.ingest_job import ingest_with_lineage
from tasks.retry import retry_transient_storage


@task(name="ingest-dataset", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3,
      retry_condition_fn=retry_transient_storage)
def ingest_dataset(*, store_root: str, tracking_uri: str, name: str, config: DatasetConfig, workers: int,
                   tags: dict[str, str]) -> dict[str, Any]:
    return ingest_with_lineage(store_root=store_root, tracking_uri=tracking_uri, name=name, config=config,
                               workers=workers, tags=tags)
