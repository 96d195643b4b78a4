"""Prefect task around omni_core.images.ensure_image: retried on registry/network trouble only.

A failing Dockerfile step fails the same way on every try, so it is not retried; a registry that
refuses connections, times out or answers 429/5xx may recover, so it is (with back-off). A retry is
safe: the tag is content-addressed, a pushed tag is found by the registry check, and the build
record is written only after the push.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from omni_core.images import ImageSpec, ensure_image, is_transient
from omni_core.storage import Store

RETRIES = 3
RETRY_DELAYS_S = [5, 20, 60]


def retry_on_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry_condition_fn: True only for RegistryUnavailableError and connection/timeouts."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - classified, not handled
        return is_transient(exc)
    return False


@task(name="build_image", cache_policy=NO_CACHE, retries=RETRIES, retry_delay_seconds=RETRY_DELAYS_S,
      retry_condition_fn=retry_on_transient)
def build_image(spec: ImageSpec, store: str, registry: str | None = None, push: bool = False,
                builder: str | None = None, verify_tls: bool | None = None) -> dict[str, Any]:
    """Build (and push) `spec` unless its tag exists; returns the build record plus `pinned_ref`, `reused`."""
    logger = get_run_logger()
    outcome = ensure_image(spec, Store(store), registry=registry, push=push, builder=builder,
                           verify_tls=verify_tls, progress=logger.info)
    record = outcome.record
    return {**record.model_dump(mode="json"), "pinned_ref": record.pinned_ref, "reused": outcome.reused}
