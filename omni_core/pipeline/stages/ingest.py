"""Stage kind `ingest`: raw dataset -> versioned verl Parquet in the store.

Cache inputs: each dataset's config, its converter's version and a fingerprint of its raw source:
the URI for `fixtures://` (generated from the URI alone), the files' sizes and modification times
for a local folder (a changed file changes the key; an unchanged re-run reads nothing). s3:// and
hf:// sources cannot be fingerprinted without downloading them, so a stage ingesting one always
runs; the ingest itself reuses the version when the downloaded bytes are the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omni_core.config import IngestStage
from omni_core.data import get_converter, ingest, load_version
from omni_core.data.ingest import MANIFEST, dataset_prefix
from omni_core.errors import DataError
from omni_core.lineage import log_dataset_version
from omni_core.pipeline.cache import digest
from omni_core.pipeline.stages import register_stage


def source_fingerprint(uri: str) -> dict[str, Any] | None:
    """What identifies the raw bytes of `uri` without reading them, or None when that is not possible."""
    parsed = urlparse(uri)
    if parsed.scheme == "fixtures":
        return {"uri": uri}
    if parsed.scheme not in ("", "file"):
        return None
    root = Path(parsed.path if parsed.scheme == "file" else uri).expanduser().resolve()
    if not root.is_dir():
        return None  # the ingest fails with its own message
    files = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        st = path.stat()
        files.append([path.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns])
    return {"uri": uri, "path": str(root), "files": digest(files)}


def ingest_inputs(ctx: Any) -> dict[str, Any] | None:
    inputs = {}
    for key in ctx.stage.datasets:
        config = ctx.config.datasets[key]
        source = source_fingerprint(config.source)
        if source is None:
            return None
        inputs[key] = {"config": config.model_dump(mode="json"), "source": source,
                       "converter_version": get_converter(config.converter).version}
    return inputs


def versions(outputs: dict[str, Any]) -> dict[str, str]:
    return {key: d["version"] for key, d in outputs["datasets"].items()}


def committed(ctx: Any, outputs: dict[str, Any]) -> bool:
    return all(ctx.store.exists(f"{dataset_prefix(key, version)}/{MANIFEST}")
               for key, version in versions(outputs).items())


def log_reused(ctx: Any, record: Any) -> None:
    """A cached ingest still logs its versions as the run's inputs and makes them LATEST, as a run would."""
    for key, version in versions(record.outputs).items():
        dv = load_version(ctx.store, key, version)
        log_dataset_version(ctx.tracker, ctx.mlflow_run_id, dv, context="ingest", with_manifest=True)
        latest = f"datasets/{key}/LATEST"
        if not ctx.store.exists(latest) or ctx.store.read_text(latest).strip() != version:
            ctx.store.write_text(latest, version + "\n")


@register_stage("ingest", version="1", seeded=False, retries=2, inputs=ingest_inputs, digest=versions, verify=committed,
                reuse=log_reused, produces=lambda stage: list(stage.datasets), volatile_config=frozenset({"workers"}))
def run_ingest(ctx: Any) -> dict[str, Any]:
    stage: IngestStage = ctx.stage
    datasets = {}
    for key in stage.datasets:
        config = ctx.config.datasets[key]
        dv = ingest(ctx.store, key, config, progress=ctx.progress, workers=stage.workers)
        if ctx.force and dv.reused:  # redo on purpose: uncommit the version, then convert it again
            ctx.progress(f"dataset {key}: --force: converting version {dv.version} again")
            ctx.store.delete(f"{dataset_prefix(key, dv.version)}/{MANIFEST}")
            dv = ingest(ctx.store, key, config, progress=ctx.progress, workers=stage.workers)
            if dv.reused:
                raise DataError(f"dataset {key}: --force could not uncommit version {dv.version}; check the store")
        log_dataset_version(ctx.tracker, ctx.mlflow_run_id, dv, context="ingest", with_manifest=True)
        datasets[key] = {"version": dv.version, "uri": dv.uri, "reused": dv.reused,
                         "rows": {s: e["rows"] for s, e in dv.manifest["splits"].items()},
                         "quarantined": dv.manifest["counts"]["quarantined"],
                         "skipped": dv.manifest["counts"]["skipped"]}
    return {"datasets": datasets, "reused": all(d["reused"] for d in datasets.values())}
