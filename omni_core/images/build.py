"""ensure_image: build and push an image unless its content-addressed tag already exists.

Order of work, each step safe to repeat (a retried call picks up where the last one stopped):
1. compute the tag from the inputs (no network);
2. with a registry: ask it for the tag; found -> record it (if this store lacks the record) and stop;
   without one: an existing record whose image is still in the builder's storage -> stop;
3. build (and push) with the builder, the full output in a log file;
4. copy the log into the store, then write the build record (last: its presence means "done").
A failing Dockerfile step raises ImageBuildError with the log's tail and leaves no record.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from omni_core.images.builders import Builder, BuiltImage, select_builder
from omni_core.images.dockerfile import base_image
from omni_core.images.errors import ImageBuildError
from omni_core.images.records import BuildRecord, load_record, log_key, save_record
from omni_core.images.registry import default_registry, remote_digest
from omni_core.images.spec import ImageSpec
from omni_core.images.tag import content_digest, tag_of
from omni_core.paths import cache_dir
from omni_core.storage import Store

Progress = Callable[[str], None]
_STEP_LINE = re.compile(r"^(\[\d+/\d+\] )?STEP \d+/\d+: |^#\d+ \[")  # buildah; docker buildx


@dataclass(frozen=True)
class ImageOutcome:
    record: BuildRecord
    reused: bool  # True: the tag already existed, nothing was built or pushed


def image_ref(spec: ImageSpec, tag: str, registry: str | None) -> str:
    return f"{registry.rstrip('/')}/{spec.image_name}:{tag}" if registry else f"localhost/{spec.image_name}:{tag}"


def ensure_image(spec: ImageSpec, store: Store, *, registry: str | None = None, push: bool = False,
                 builder: Builder | str | None = None, verify_tls: bool | None = None,
                 log_dir: Path | None = None, progress: Progress = print) -> ImageOutcome:
    """The image of `spec` built (and pushed to `registry` if `push`) exactly once per content tag."""
    registry = (registry or default_registry() or "").rstrip("/") or None
    if push and not registry:
        raise ImageBuildError(f"pushing {spec.target} needs a registry: pass --registry HOST[:PORT][/NAMESPACE] "
                              "or set OMNI_IMAGE_REGISTRY")
    inputs = content_digest(spec)
    tag = tag_of(inputs)
    ref = image_ref(spec, tag, registry)
    existing = load_record(store, spec.target, tag)

    if registry and (digest := remote_digest(ref, verify_tls)):
        if existing is not None and existing.digest == digest:
            progress(f"{spec.target}: {ref} is in the registry ({digest[:19]}…); nothing to do")
            return ImageOutcome(existing, reused=True)
        progress(f"{spec.target}: {ref} is in the registry ({digest[:19]}…); recording it")
        record = _record(spec, store, inputs, tag, ref, registry, BuiltImage(None, digest), None, 0.0)
        save_record(store, record)
        return ImageOutcome(record, reused=True)

    chosen = builder if builder is not None and not isinstance(builder, str) else select_builder(builder)
    if existing is not None and not push and chosen.exists_locally(ref):
        progress(f"{spec.target}: {ref} is already built ({chosen.name} storage); nothing to do")
        return ImageOutcome(existing, reused=True)

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    log = (log_dir or cache_dir("images", "logs")) / f"{spec.target}-{tag}-{stamp}.log"
    progress(f"{spec.target}: building {ref} with {chosen.name} ({', '.join(spec.platforms)}); log {log}")
    started = time.perf_counter()

    def on_line(line: str) -> None:
        if _STEP_LINE.match(line):
            progress(f"{spec.target}: {line[:160]}")

    built = chosen.build(spec, ref, push=push, log=log, verify_tls=verify_tls, on_line=on_line)
    seconds = time.perf_counter() - started
    with open(log, "rb") as src, store.open_write(log_key(spec.target, tag)) as dst:
        dst.write(src.read())
    record = _record(spec, store, inputs, tag, ref, registry, built, chosen.name, seconds,
                     store.uri(log_key(spec.target, tag)))
    save_record(store, record)
    done = f"pushed {record.pinned_ref}" if push else f"built {ref} (not pushed)"
    progress(f"{spec.target}: {done} in {seconds:.1f}s")
    return ImageOutcome(record, reused=False)


def resolve_image(spec: ImageSpec, store: Store) -> BuildRecord:
    """The build record of `spec`'s current tag: what a later stage runs (`record.pinned_ref`)."""
    tag = tag_of(content_digest(spec))
    record = load_record(store, spec.target, tag)
    if record is None:
        raise ImageBuildError(f"no build record for image {spec.target} at tag {tag} in {store.root}; "
                              f"build it first: omni image build {spec.target} --push --registry REGISTRY")
    return record


def _record(spec: ImageSpec, store: Store, inputs: str, tag: str, ref: str, registry: str | None,
            built: BuiltImage, builder: str | None, seconds: float, log_uri: str | None = None) -> BuildRecord:
    return BuildRecord(
        target=spec.target, tag=tag, content_digest=f"sha256:{inputs}", repository=spec.image_name,
        registry=registry, ref=ref, digest=built.digest, image_id=built.image_id, pushed=built.digest is not None,
        platforms=spec.platforms, build_args=spec.build_args, stage=spec.stage, dockerfile=str(spec.dockerfile),
        base_image=base_image(spec.dockerfile.read_text(), spec.build_args, spec.stage),
        base_digest=built.base_digest, builder=builder, log_uri=log_uri,
        built_at=datetime.now(UTC).isoformat(timespec="seconds"), seconds=round(seconds, 2),
    )
