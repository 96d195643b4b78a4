"""Stage kind `build_images`: container images built (and pushed) once per content tag.

Outputs the pinned reference and digest of each image; later stages record them in MLflow, and
stages submitted to a cluster run in them. Cache inputs: each target's content tag (Dockerfile,
context, build args) and the registry; a cached result needs the build records still in the store.
An image deleted from its registry behind the store's back is rebuilt with `--force STAGE`.
"""

from __future__ import annotations

from typing import Any

from omni_core.config import BuildImagesStage
from omni_core.images import content_tag, ensure_image, image_tags, load_record, load_spec
from omni_core.images.registry import default_registry
from omni_core.pipeline.stages import register_stage


def image_inputs(ctx: Any) -> dict[str, Any]:
    stage: BuildImagesStage = ctx.stage
    return {"registry": (stage.registry or default_registry() or "").rstrip("/"),
            "tags": {target: content_tag(load_spec(target)) for target in stage.targets}}


def image_digests(outputs: dict[str, Any]) -> dict[str, str]:
    return {target: i["digest"] or i["tag"] for target, i in outputs["images"].items()}


def _records(ctx: Any, outputs: dict[str, Any]) -> list[Any]:
    return [load_record(ctx.store, target, i["tag"]) for target, i in outputs["images"].items()]


def recorded(ctx: Any, outputs: dict[str, Any]) -> bool:
    return all(r is not None for r in _records(ctx, outputs))


def tag_reused(ctx: Any, record: Any) -> None:
    for build in _records(ctx, record.outputs):
        ctx.tracker.set_tags(ctx.mlflow_run_id, image_tags(build, prefix=f"omni.image.{build.target}"))


@register_stage("build_images", version="1", seeded=False, retries=2, inputs=image_inputs, digest=image_digests, verify=recorded,
                reuse=tag_reused, volatile_config=frozenset({"builder"}))
def run_build_images(ctx: Any) -> dict[str, Any]:
    stage: BuildImagesStage = ctx.stage
    images = {}
    for target in stage.targets:
        outcome = ensure_image(load_spec(target), ctx.store, registry=stage.registry, push=stage.push,
                               builder=None if stage.builder == "auto" else stage.builder, progress=ctx.progress)
        record = outcome.record
        ctx.tracker.set_tags(ctx.mlflow_run_id, image_tags(record, prefix=f"omni.image.{record.target}"))
        images[record.target] = {"tag": record.tag, "digest": record.digest, "ref": record.ref,
                                 "pinned_ref": record.pinned_ref, "reused": outcome.reused}
    return {"images": images, "reused": all(i["reused"] for i in images.values())}


def upstream_images(ctx: Any) -> dict[str, dict[str, Any]]:
    """Images built by this stage's ancestors, by target (a later ancestor wins)."""
    found: dict[str, dict[str, Any]] = {}
    for outcome in ctx.upstream.values():
        found.update(outcome.outputs.get("images", {}))
    return found
