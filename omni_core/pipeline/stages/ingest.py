"""Stage kind `ingest`: raw dataset -> versioned verl Parquet in the store."""

from __future__ import annotations

from typing import Any

from omni_core.config import IngestStage
from omni_core.data import ingest
from omni_core.lineage import log_dataset_version
from omni_core.pipeline.stages import register_stage


@register_stage("ingest")
def run_ingest(run: Any, stage: IngestStage, mlflow_run_id: str) -> dict[str, Any]:
    datasets = {}
    for key in stage.datasets:
        dv = ingest(run.store, key, run.config.datasets[key], progress=run.progress, workers=stage.workers)
        log_dataset_version(run.tracker, mlflow_run_id, dv, context="ingest", with_manifest=True)
        datasets[key] = {"version": dv.version, "uri": dv.uri, "reused": dv.reused,
                         "rows": {s: e["rows"] for s, e in dv.manifest["splits"].items()},
                         "quarantined": dv.manifest["counts"]["quarantined"],
                         "skipped": dv.manifest["counts"]["skipped"]}
    return {"datasets": datasets, "reused": all(d["reused"] for d in datasets.values())}
