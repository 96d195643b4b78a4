"""Registry checks through skopeo (it speaks the registry HTTP API v2 and reads the same credentials
as docker, buildah and podman: ~/.docker/config.json, $XDG_RUNTIME_DIR/containers/auth.json)."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re

from omni_core.images.errors import ImageBuildError, RegistryUnavailableError
from omni_core.images.tools import TRANSIENT, require, run_quiet

_ABSENT = re.compile(r"manifest unknown|name unknown|not found|404", re.IGNORECASE)
_DENIED = re.compile(r"unauthorized|authentication required|denied|403", re.IGNORECASE)
REGISTRY_ENV = "OMNI_IMAGE_REGISTRY"


def default_registry() -> str | None:
    return os.environ.get(REGISTRY_ENV) or None


def registry_host(ref: str) -> str:
    return ref.split("/", 1)[0]


def is_loopback(registry: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: plain HTTP is allowed there (docker's own default)."""
    host = registry.rsplit("]", 1)[0].lstrip("[") if registry.startswith("[") else registry.rsplit(":", 1)[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_verify(ref: str, override: bool | None = None) -> bool:
    """Verify TLS unless told otherwise or the registry is on this machine's loopback."""
    return override if override is not None else not is_loopback(registry_host(ref))


def remote_digest(ref: str, verify_tls: bool | None = None, timeout: float = 60) -> str | None:
    """The manifest digest (`sha256:...`) of `ref` (registry/repository:tag) in its registry, or None
    when the tag does not exist there. Raises RegistryUnavailableError when the answer may change on retry."""
    skopeo = require("skopeo")
    tls = "true" if tls_verify(ref, verify_tls) else "false"
    code, manifest, stderr = run_quiet([skopeo, "inspect", "--raw", f"--tls-verify={tls}", f"docker://{ref}"],
                                       timeout=timeout)
    if code == 0:
        # The digest of a manifest is the sha256 of its exact bytes: what `pull repo@sha256:...` resolves.
        return "sha256:" + hashlib.sha256(manifest).hexdigest()
    message = (stderr.strip().splitlines() or ["(no output)"])[-1]
    if TRANSIENT.search(message):
        raise RegistryUnavailableError(f"registry {registry_host(ref)} is unavailable while checking {ref}: "
                                       f"{message}; start it or check the network, then retry")
    if _ABSENT.search(message):
        return None
    if _DENIED.search(message):
        raise ImageBuildError(f"registry {registry_host(ref)} denied access to {ref}: {message}; log in "
                              f"(skopeo login {registry_host(ref)}, or docker login) or fix the registry name")
    raise ImageBuildError(f"cannot check {ref} in its registry: {message}")
