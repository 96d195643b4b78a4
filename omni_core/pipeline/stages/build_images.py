"""Stage kind `build_images`: container images built (and pushed) once per content tag.

Outputs the pinned reference and digest of each image; later stages record them in MLflow, and
stages submitted to a cluster run in them.
"""

from __future__ import annotations

from typing import Any

from omni_core.config import BuildImagesStage
from omni_core.images import ensure_image, image_tags, load_spec
from omni_core.pipeline.stages import register_stage


@register_stage("build_images")
def run_build_images(run: Any, stage: BuildImagesStage, mlflow_run_id: str) -> dict[str, Any]:
    images = {}
    for target in stage.targets:
        outcome = ensure_image(load_spec(target), run.store, registry=stage.registry, push=stage.push,
                               builder=None if stage.builder == "auto" else stage.builder, progress=run.progress)
        record = outcome.record
        run.tracker.set_tags(mlflow_run_id, image_tags(record, prefix=f"omni.image.{record.target}"))
        images[record.target] = {"tag": record.tag, "digest": record.digest, "ref": record.ref,
                                 "pinned_ref": record.pinned_ref, "reused": outcome.reused}
    return {"images": images, "reused": all(i["reused"] for i in images.values())}


def upstream_images(run: Any) -> dict[str, dict[str, Any]]:
    """Images built by earlier stages of this pipeline run, by target."""
    found: dict[str, dict[str, Any]] = {}
    for outcome in run.outcomes.values():
        found.update(outcome.outputs.get("images", {}))
    return found
