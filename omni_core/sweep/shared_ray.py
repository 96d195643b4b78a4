"""The one Ray every variant of a sweep uses, and what it can place.

On the embedded default (`ray.address: local`) each pipeline run would start a fresh Ray of its own,
each believing it owns every core; a sweep instead starts one local Ray in its own process (Ray's head
processes end with it, also when it is killed) and hands its address to every variant, whose actors
then queue for its CPUs. `ray.code: image`: its workers are this machine's processes and import the
project as the sweep does. On a cluster (any other address) the variants join it as they would alone;
the sweep reads its resources once to check `max_concurrent`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from omni_core.config.models import RayConfig
from omni_core.errors import OmniError


@dataclass
class SharedRay:
    overrides: list[str]  # given to every variant
    resources: dict[str, float] | None  # what it can place (None: not known, e.g. a Jobs API address)
    where: str  # for messages: "the sweep's local Ray (2 CPUs)"


@contextlib.contextmanager
def shared_ray(config: RayConfig, *, start: bool = True) -> Iterator[SharedRay]:
    """`start=False` (a dry run): the resources a local Ray would have, and nothing started."""
    import ray

    from omni_core.evaluation.ray_job import is_jobs_api
    from omni_core.training.ray_env import wait_for_gcs

    if config.address == "local":
        cpus = config.num_cpus or os.cpu_count() or 1
        where = f"the sweep's local Ray ({cpus} CPUs: ray.num_cpus)"
        if not start:
            yield SharedRay([], {"CPU": float(cpus)}, where)
            return
        start_local_ray(cpus)
        try:
            address = ray.get_runtime_context().gcs_address
            yield SharedRay([f"ray.address={address}", "ray.code=image"], dict(ray.cluster_resources()), where)
        finally:
            ray.shutdown()
        return
    if is_jobs_api(config.address):
        yield SharedRay([], None, f"the cluster behind {config.address}")
        return
    try:  # only to read what the cluster has: no runtime env (the variants bring their own)
        wait_for_gcs(config.address)
        ray.init(address=config.address, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise OmniError(f"ray.address {config.address}: cannot connect ({exc}); start the cluster (with "
                        "RAY_AUTH_TOKEN set if it uses token authentication) or use ray.address=local") from exc
    try:
        resources = dict(ray.cluster_resources())
    finally:
        ray.shutdown()
    yield SharedRay([], resources, f"the cluster at {config.address}")


RAY_START_TIMED_OUT = "timed out during startup"  # Ray gives a node 30 s to register, hard-coded


def start_local_ray(cpus: int) -> None:
    """A local Ray of `cpus` CPUs in this process; started again once when it missed Ray's own start-up
    timeout (a busy small machine does, now and then)."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
            return
        except Exception as exc:  # Ray raises a bare Exception for it
            ray.shutdown()
            if RAY_START_TIMED_OUT not in str(exc):
                raise
            if attempt == 2:
                raise OmniError(f"the sweep's local Ray did not start ({exc}); the machine is too busy: try again, "
                                "or start one with `ray start --head` and give its address as ray.address") from exc
