"""Dataset versions in MLflow: logged as dataset inputs (store URI, raw source, digest, schema, counts)."""

from __future__ import annotations

from omni_core.data import DatasetVersion
from omni_core.lineage.tracking import Tracker

# What an ingest stage logs per dataset version (the docs' metric reference lists these)
INGEST_METRICS = {
    "{dataset}/read": "raw rows read",
    "{dataset}/rows": "rows written to the version",
    "{dataset}/rows/{split}": "rows written, per split",
    "{dataset}/quarantined": "rows rejected, kept in quarantine.parquet with a reason",
    "{dataset}/skipped": "rows skipped on purpose (counted, not kept)",
}


def log_dataset_version(tracker: Tracker, run_id: str, dv: DatasetVersion, context: str,
                        with_manifest: bool = False) -> None:
    manifest = dv.manifest
    tracker.log_dataset_input(
        run_id, name=dv.name, digest=dv.version, source_uri=dv.uri, raw_source_uri=manifest["source_uri"],
        schema=manifest["schema"], context=context,
        profile={"splits": {s: e["rows"] for s, e in manifest["splits"].items()}, "counts": manifest["counts"],
                 "converter": manifest["converter"]},
    )
    if with_manifest:
        tracker.log_dict(run_id, manifest, f"datasets/{dv.name}/{dv.version}/_manifest.json")
        tracker.log_params(run_id, {f"{dv.name}.version": dv.version, f"{dv.name}.source": manifest["source_uri"]})
        counts = {f"{dv.name}/{k}": v for k, v in manifest["counts"].items()}
        counts.update({f"{dv.name}/rows/{s}": e["rows"] for s, e in manifest["splits"].items()})
        tracker.log_metrics(run_id, counts, step=0, timestamp_ms=0)
