"""Content-addressed image tags.

The tag is a digest of everything that decides what the builder produces: the Dockerfile's bytes,
every file of the context the Dockerfile can see (path, bytes, executable bit; .dockerignore
honoured with docker-py's port of moby's matcher), the build-arg overrides, the platforms and the
stage. Same inputs, same tag, so an image whose tag is already in the registry is never rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

from docker.utils.build import exclude_paths  # docker-py's port of moby's .dockerignore matcher

from omni_core.images.spec import ImageSpec

TAG_PREFIX = "c-"  # bump (e.g. "c2-") if what goes into the digest ever changes
TAG_HEX = 24  # 96 bits: collisions are not a practical concern for one repository's tags
_CHUNK = 2**20


def dockerignore_patterns(spec: ImageSpec) -> list[str]:
    """Patterns of `<Dockerfile>.dockerignore` if present (it wins, as in BuildKit and buildah), else
    of `<context>/.dockerignore`."""
    for candidate in (spec.dockerfile.with_name(spec.dockerfile.name + ".dockerignore"),
                      spec.context / ".dockerignore"):
        if candidate.is_file():
            lines = (line.strip() for line in candidate.read_text().splitlines())
            return [line for line in lines if line and not line.startswith("#")]
    return []


def context_files(spec: ImageSpec) -> list[str]:
    """Relative paths (files, links and folders) of the context that a COPY or ADD can see."""
    try:
        dockerfile = spec.dockerfile.relative_to(spec.context).as_posix()
    except ValueError:
        dockerfile = spec.dockerfile.name  # outside the context: it is sent separately
    return sorted(exclude_paths(str(spec.context), dockerignore_patterns(spec), dockerfile=dockerfile))


def _entry(root: Path, relative: str) -> list[str]:
    path = root / relative
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return [relative, "link", os.readlink(path)]
    if stat.S_ISDIR(info.st_mode):
        return [relative, "dir"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return [relative, "exec" if info.st_mode & 0o111 else "file", digest.hexdigest()]


def content_manifest(spec: ImageSpec) -> dict:
    """Everything the tag is a digest of (also written into the build record's `inputs_digest`)."""
    return {
        "dockerfile": hashlib.sha256(spec.dockerfile.read_bytes()).hexdigest(),
        "context": [_entry(spec.context, relative) for relative in context_files(spec)],
        "build_args": dict(sorted(spec.build_args.items())),
        "platforms": sorted(spec.platforms),
        "stage": spec.stage,
    }


def content_digest(spec: ImageSpec) -> str:
    canonical = json.dumps(content_manifest(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def tag_of(digest: str) -> str:
    return TAG_PREFIX + digest[:TAG_HEX]


def content_tag(spec: ImageSpec) -> str:
    """The image tag for `spec`, e.g. `c-3f2a9c...` (computed locally; no registry or builder needed)."""
    return tag_of(content_digest(spec))
