"""Container images: specs, content-addressed tags, builders (buildah, docker buildx), registry checks,
build records in the store. No Prefect here: `flows/build_images.py` orchestrates these calls.

    spec = load_spec("cuda")                      # or a spec file: load_spec("my-image.yaml")
    content_tag(spec)                             # "c-…": no network, no builder
    outcome = ensure_image(spec, Store(".omni/store"), registry="ghcr.io/org", push=True)
    outcome.record.pinned_ref                     # "ghcr.io/org/omni-cuda@sha256:…" for later stages
    image_tags(outcome.record)                    # MLflow tags of a stage that runs in it
"""

from omni_core.images.build import ImageOutcome, ensure_image, image_ref, resolve_image
from omni_core.images.builders import BuildahBuilder, Builder, DockerBuildxBuilder, select_builder
from omni_core.images.errors import ImageBuildError, RegistryUnavailableError, is_transient
from omni_core.images.records import BuildRecord, image_tags, list_records, load_record
from omni_core.images.registry import remote_digest
from omni_core.images.spec import ImageSpec, builtin_spec, load_spec, spec_from_dict
from omni_core.images.tag import content_digest, content_tag

__all__ = [
    "BuildRecord", "BuildahBuilder", "Builder", "DockerBuildxBuilder", "ImageBuildError", "ImageOutcome",
    "ImageSpec", "RegistryUnavailableError", "builtin_spec", "content_digest", "content_tag", "ensure_image",
    "image_ref", "image_tags", "is_transient", "list_records", "load_record", "load_spec", "remote_digest",
    "resolve_image", "select_builder", "spec_from_dict",
]
