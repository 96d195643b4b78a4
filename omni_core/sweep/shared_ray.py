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
import os
from collections.abc import Iterator
from dataclasses import dataclass

from omni_core.config.models import RayConfig


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
    from omni_core.training.ray_env import init_local_ray, join_cluster

    if config.address == "local":
        cpus = config.num_cpus or os.cpu_count() or 1
        where = f"the sweep's local Ray ({cpus} CPUs: ray.num_cpus)"
        if not start:
            yield SharedRay([], {"CPU": float(cpus)}, where)
            return
        init_local_ray(cpus)
        try:
            address = ray.get_runtime_context().gcs_address
            yield SharedRay([f"ray.address={address}", "ray.code=image"], dict(ray.cluster_resources()), where)
        finally:
            ray.shutdown()
        return
    if is_jobs_api(config.address):
        yield SharedRay([], None, f"the cluster behind {config.address}")
        return
    join_cluster(config.address)  # only to read what the cluster has: no runtime env (the variants bring their own)
    try:
        resources = dict(ray.cluster_resources())
    finally:
        ray.shutdown()
    yield SharedRay([], resources, f"the cluster at {config.address}")
