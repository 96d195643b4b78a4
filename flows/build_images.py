"""The `build_images` flow: build (and push) container images, each once per content-addressed tag.

Targets are built-in names (cuda, ascend) or spec files; `specs` takes spec mappings (e.g. from a
pipeline stage). Returns {target: build record + pinned_ref}; a later stage runs `pinned_ref`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from omni_core.images import ImageBuildError, load_spec, spec_from_dict
from omni_core.paths import DEFAULT_STORE
from tasks.images import build_image


@flow(name="build_images", log_prints=True)
def build_images(targets: list[str] | None = None, specs: list[dict[str, Any]] | None = None, push: bool = False,
                 registry: str | None = None, store: str = DEFAULT_STORE, builder: str | None = None,
                 build_args: dict[str, str] | None = None, platforms: list[str] | None = None,
                 verify_tls: bool | None = None) -> dict[str, dict]:
    chosen = [load_spec(t) for t in targets or []] + [spec_from_dict(s) for s in specs or []]
    if not chosen:
        raise ImageBuildError("build_images: name at least one target (cuda, ascend or a spec file)")
    results: dict[str, dict] = {}
    for spec in chosen:
        spec = spec.with_overrides(build_args, platforms) if build_args or platforms else spec
        results[spec.target] = build_image.with_options(task_run_name=f"image-{spec.target}")(
            spec, store, registry=registry, push=push, builder=builder, verify_tls=verify_tls)
    create_table_artifact(
        key="built-images", description="Images of this run: reused means the tag already existed.",
        table=[{"target": t, "tag": r["tag"], "image": r["pinned_ref"], "reused": r["reused"]}
               for t, r in results.items()])
    return results
