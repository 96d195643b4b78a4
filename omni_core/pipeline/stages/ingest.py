"""Stage kind `ingest`: raw dataset -> versioned verl Parquet in the store."""

from __future__ import annotations

from typing import Any

from omni_core.config import IngestStage
from omni_core.data import DatasetVersion, ingest
from omni_core.pipeline.stages import register_stage


def log_dataset(run: Any, mlflow_run_id: str, dv: DatasetVersion, context: str) -> None:
    manifest = dv.manifest
    run.tracker.log_dataset_input(
        mlflow_run_id, name=dv.name, digest=dv.version, source_uri=dv.uri, raw_source_uri=manifest["source_uri"],
        schema=manifest["schema"], context=context,
        profile={"splits": {s: e["rows"] for s, e in manifest["splits"].items()}, "counts": manifest["counts"],
                 "converter": manifest["converter"]},
    )


@register_stage("ingest")
def run_ingest(run: Any, stage: IngestStage, mlflow_run_id: str) -> dict[str, Any]:
    datasets = {}
    for key in stage.datasets:
        dv = ingest(run.store, key, run.config.datasets[key], progress=run.progress)
        log_dataset(run, mlflow_run_id, dv, context="ingest")
        run.tracker.log_params(mlflow_run_id, {f"{key}.version": dv.version, f"{key}.source": dv.manifest["source_uri"]})
        datasets[key] = {"version": dv.version, "uri": dv.uri, "reused": dv.reused,
                         "rows": {s: e["rows"] for s, e in dv.manifest["splits"].items()},
                         "quarantined": dv.manifest["counts"]["quarantined"]}
    return {"datasets": datasets, "reused": all(d["reused"] for d in datasets.values())}
