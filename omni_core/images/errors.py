"""Errors of image builds. Only `RegistryUnavailableError` is worth retrying."""

from __future__ import annotations

from omni_core.errors import OmniError


class ImageBuildError(OmniError):
    """An image cannot be built or pushed: a failing Dockerfile step, a missing tool, a bad spec."""


class RegistryUnavailableError(ImageBuildError):
    """The registry (or the network to it) failed in a way that may pass on a later try.

    Raised for refused or reset connections, timeouts, DNS failures, HTTP 429 and 5xx answers.
    Orchestrators retry on this class only; every other `ImageBuildError` fails the same way twice.
    """

    transient = True


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised `exc` can help."""
    return isinstance(exc, RegistryUnavailableError | ConnectionError | TimeoutError)
