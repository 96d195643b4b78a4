"""Builders: `buildah` and `docker buildx`, chosen by what is installed or by name.

Both take the same spec and reference, write the whole build output to a log file, and tell a
failing Dockerfile step (ImageBuildError, never worth a retry) from a registry or network failure
(RegistryUnavailableError). Credentials are the tools' own (docker/skopeo/buildah login): nothing
here reads or passes secrets.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from omni_core.images.errors import ImageBuildError, RegistryUnavailableError
from omni_core.images.registry import tls_verify
from omni_core.images.spec import ImageSpec
from omni_core.images.tools import TRANSIENT, require, run_logged, run_quiet

BUILDER_ENV = "OMNI_IMAGE_BUILDER"
# How each tool reports that a Dockerfile instruction itself failed (as opposed to pulling or pushing).
_STEP_FAILED = re.compile(r'building at STEP|did not complete successfully|executor failed running|'
                          r'error building at step', re.IGNORECASE)
OnLine = Callable[[str], None]


@dataclass(frozen=True)
class BuiltImage:
    image_id: str | None  # local image (config) id
    digest: str | None  # manifest digest in the registry; None when not pushed
    base_digest: str | None = None  # digest of the base image the builder used, when it reports one


class Builder(Protocol):
    name: str

    def exists_locally(self, ref: str) -> bool: ...

    def build(self, spec: ImageSpec, ref: str, *, push: bool, log: Path, verify_tls: bool | None = None,
              on_line: OnLine | None = None) -> BuiltImage: ...


def _build_args(spec: ImageSpec) -> list[str]:
    args = [f"--build-arg={name}={value}" for name, value in sorted(spec.build_args.items())]
    return args + (["--target", spec.stage] if spec.stage else [])


def build_failure(ref: str, code: int, tail: str, log: Path) -> ImageBuildError:
    """A failed build: transient when it failed reaching a registry rather than in a Dockerfile step."""
    cls = RegistryUnavailableError if TRANSIENT.search(tail) and not _STEP_FAILED.search(tail) else ImageBuildError
    return cls(f"building {ref} failed (exit {code}); full log: {log}\n--- last lines of the build log ---\n{tail}")


def push_failure(ref: str, code: int, tail: str, log: Path) -> ImageBuildError:
    cls = RegistryUnavailableError if TRANSIENT.search(tail) else ImageBuildError
    return cls(f"pushing {ref} failed (exit {code}); log in to the registry if it asks for credentials; "
               f"full log: {log}\n--- last lines ---\n{tail}")


@dataclass
class BuildahBuilder:
    """`buildah build --layers`; storage and isolation come from the arguments, else from buildah's own
    configuration ($STORAGE_DRIVER, $BUILDAH_ISOLATION, $CONTAINERS_STORAGE_CONF, storage.conf)."""

    storage_driver: str | None = None
    isolation: str | None = None
    name: str = "buildah"

    def _cmd(self, *args: str) -> list[str]:
        driver = ["--storage-driver", self.storage_driver] if self.storage_driver else []
        return [require("buildah"), *driver, *args]

    def exists_locally(self, ref: str) -> bool:
        code, _, _ = run_quiet(self._cmd("inspect", "--type", "image", ref), timeout=60)
        if code != 0:  # a multi-platform build leaves a manifest list under the name
            code, _, _ = run_quiet(self._cmd("manifest", "inspect", ref), timeout=60)
        return code == 0

    def build(self, spec: ImageSpec, ref: str, *, push: bool, log: Path, verify_tls: bool | None = None,
              on_line: OnLine | None = None) -> BuiltImage:
        multi = len(spec.platforms) > 1
        if multi:  # --manifest appends to an existing list: start from an empty one
            run_quiet(self._cmd("manifest", "rm", ref), timeout=60)
        with tempfile.TemporaryDirectory(prefix="omni-buildah-") as tmp:
            iidfile, digestfile = Path(tmp) / "iid", Path(tmp) / "digest"
            isolation = ["--isolation", self.isolation] if self.isolation else []
            argv = self._cmd("build", "--layers", *isolation, "--file", str(spec.dockerfile),
                             "--platform", ",".join(spec.platforms), "--iidfile", str(iidfile),
                             "--manifest" if multi else "--tag", ref, *_build_args(spec), str(spec.context))
            code, tail = run_logged(argv, log, on_line)
            if code != 0:
                raise build_failure(ref, code, tail, log)
            image_id = iidfile.read_text().strip() if iidfile.exists() else None
            base_digest = None if multi else self._base_digest(ref)
            if not push:
                return BuiltImage(image_id, None, base_digest)
            verb = ("manifest", "push", "--all") if multi else ("push",)
            tls = "true" if tls_verify(ref, verify_tls) else "false"
            code, tail = run_logged(self._cmd(*verb, f"--tls-verify={tls}", "--digestfile", str(digestfile),
                                              ref, f"docker://{ref}"), log, on_line)
            if code != 0:
                raise push_failure(ref, code, tail, log)
            return BuiltImage(image_id, digestfile.read_text().strip(), base_digest)

    def _base_digest(self, ref: str) -> str | None:
        code, out, _ = run_quiet(self._cmd("inspect", "--type", "image", ref), timeout=60)
        if code != 0:
            return None
        annotations = json.loads(out).get("ImageAnnotations") or {}
        if not annotations.get("org.opencontainers.image.base.name"):
            return None  # FROM scratch: there is no base image
        return annotations.get("org.opencontainers.image.base.digest")


@dataclass
class DockerBuildxBuilder:
    """`docker buildx build` with the current builder; pushes in the same command (multi-platform safe)."""

    name: str = "docker"

    def exists_locally(self, ref: str) -> bool:
        code, _, _ = run_quiet([require("docker"), "image", "inspect", ref], timeout=60)
        return code == 0

    def command(self, spec: ImageSpec, ref: str, *, push: bool, metadata: Path) -> list[str]:
        return ["docker", "buildx", "build", "--file", str(spec.dockerfile),
                "--platform", ",".join(spec.platforms), "--tag", ref, "--progress", "plain",
                "--metadata-file", str(metadata), *_build_args(spec), "--push" if push else "--load",
                str(spec.context)]

    def build(self, spec: ImageSpec, ref: str, *, push: bool, log: Path, verify_tls: bool | None = None,
              on_line: OnLine | None = None) -> BuiltImage:
        # verify_tls: the docker daemon decides (127.0.0.0/8 is insecure by default; others via daemon.json).
        require("docker")
        with tempfile.TemporaryDirectory(prefix="omni-buildx-") as tmp:
            metadata = Path(tmp) / "metadata.json"
            code, tail = run_logged(self.command(spec, ref, push=push, metadata=metadata), log, on_line)
            if code != 0:
                pushing = push and "pushing" in tail.lower() and not _STEP_FAILED.search(tail)
                raise (push_failure if pushing else build_failure)(ref, code, tail, log)
            meta = json.loads(metadata.read_text()) if metadata.exists() else {}
        return BuiltImage(meta.get("containerimage.config.digest"),
                          meta.get("containerimage.digest") if push else None)


def _docker_buildx_usable() -> bool:
    try:
        docker = require("docker")
        return run_quiet([docker, "buildx", "version"], timeout=20)[0] == 0 and \
            run_quiet([docker, "info", "--format", "{{.ServerVersion}}"], timeout=20)[0] == 0
    except (ImageBuildError, TimeoutError):
        return False


def select_builder(name: str | None = None) -> Builder:
    """`buildah` or `docker` by name (argument, else $OMNI_IMAGE_BUILDER); `auto` prefers a working
    docker buildx (CLI plugin and a reachable daemon), else buildah."""
    name = name or os.environ.get(BUILDER_ENV) or "auto"
    if name == "buildah":
        require("buildah")
        return BuildahBuilder()
    if name == "docker":
        if not _docker_buildx_usable():
            raise ImageBuildError("docker buildx is not usable: install docker with the buildx plugin and "
                                  "start the daemon, or use --builder buildah")
        return DockerBuildxBuilder()
    if name != "auto":
        raise ImageBuildError(f"unknown image builder {name!r}; use auto, buildah or docker")
    if _docker_buildx_usable():
        return DockerBuildxBuilder()
    try:
        require("buildah")
    except ImageBuildError:
        raise ImageBuildError("no image builder found: install buildah (Debian: apt-get install buildah) "
                              "or docker with the buildx plugin") from None
    return BuildahBuilder()
