"""A Ray head whose job server has taken a job, for the modules that submit Ray Jobs
(tests/test_training_job.py, tests/verl_jobs.py): a `start_cluster` head (tests/ray_cluster.py: its own
temp dir, process group and free ports, started without the driver's store and tracking variables, as a
cluster's node is), counted as up once its job server has run a warm-up job: the dashboard answers
before its job agent is ready. A head whose job agent never comes (seen once in a full suite run: `No
available agent to submit job` for 240 s while the head lived; a free port can be taken by another
process before the agent binds it) is stopped and started again once, on fresh ports; a second failure
fails with both heads' logs."""

from __future__ import annotations

import time
from typing import Any

import pytest
from ray_cluster import RayCluster, start_cluster

START_WAIT_S = 150.0  # a cold start on a loaded 2-core machine (usually 5-20 s)


def _took_a_job(cluster: RayCluster, wait: float) -> Any | None:
    """A JobSubmissionClient on the head once a warm-up job has run, or None after `wait` seconds."""
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + wait
    while cluster.nodes[0].poll() is None and time.monotonic() < deadline:
        try:
            client = JobSubmissionClient(cluster.job_server)
            client.submit_job(entrypoint="true", submission_id="warm-up")
        except Exception:
            time.sleep(1)
            continue
        while client.get_job_status("warm-up").value in ("PENDING", "RUNNING"):
            time.sleep(0.5)
        client.delete_job("warm-up")
        return client
    return None


def start_job_head(num_cpus: int, wait: float = START_WAIT_S) -> tuple[RayCluster, Any]:
    """A head with `num_cpus` logical CPUs whose job server has taken a job, and a JobSubmissionClient
    on it (the module docstring)."""
    failures = []
    for _ in range(2):
        cluster = start_cluster(head_cpus=num_cpus, wait=wait)
        client = _took_a_job(cluster, wait)
        if client is not None:
            return cluster, client
        failures.append(cluster.log_tails())
        cluster.stop()
    pytest.fail("the Ray job server did not start, twice:\n" + "\n=====\n".join(failures))
