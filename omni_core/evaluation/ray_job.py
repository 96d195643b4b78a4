"""An eval job as a Ray Job, for a `ray.address` that is a cluster's Ray Jobs API (http(s)://HEAD:8265,
the address the verl and VeRL-Omni backends submit to): a driver cannot `ray.init` such an address, so
the eval's work is the entry point of a Ray Job that asks for the stage's `resources` itself
(entrypoint_num_cpus / _gpus / _resources) and runs `run_eval_job` on the cluster.

    python -m omni_core.evaluation.ray_job STORE KEY     # reads the pickled EvalJob at KEY, writes KEY.result

The job and its result travel through the store (the cluster already reads the store for the
checkpoint), pickled (the store itself reopened on the cluster's side); both are deleted once the
result is read.
"""

from __future__ import annotations

import dataclasses
import pickle
import shlex
import sys
import uuid
from typing import Any

from omni_core.errors import OmniError

JOBS_PREFIX = "evals/jobs"


def is_jobs_api(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def entrypoint_resources(resources: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {"entrypoint_num_cpus": resources.get("CPU", 1.0)}
    if resources.get("GPU"):
        out["entrypoint_num_gpus"] = resources["GPU"]
    if custom := {k: v for k, v in resources.items() if k not in ("CPU", "GPU") and v}:
        out["entrypoint_resources"] = custom
    return out


def run_as_ray_job(job: Any, resources: dict[str, float], *, name: str, address: str, ray_config: Any,
                   store_root: str, poll_s: float = 1.0) -> dict[str, Any]:
    """`run_eval_job(job)` as the entry point of a Ray Job on the cluster at `address` (its Jobs API)."""
    from ray.job_submission import JobSubmissionClient

    from omni_core.backends.jobs.job import follow, log_tail
    from omni_core.training.ray_env import runtime_env

    key = f"{JOBS_PREFIX}/{uuid.uuid4().hex}.pkl"
    job.store.write_bytes(key, pickle.dumps(dataclasses.replace(job, store=None)))  # the job's side opens its own
    submission = f"omni-eval-{uuid.uuid4().hex[:12]}"
    entry = shlex.join([sys.executable, "-m", "omni_core.evaluation.ray_job", store_root, key])
    try:
        client = JobSubmissionClient(address)
        client.submit_job(entrypoint=entry, submission_id=submission, runtime_env=runtime_env(ray_config, job=True),
                          metadata={"omni.eval": name[:200]}, **entrypoint_resources(resources))
        status = follow(client, submission, total_steps=0, progress=lambda _: None, poll_s=poll_s)
        if status != "SUCCEEDED":
            raise OmniError(f"{name}: the eval's Ray Job {submission} on {address} ended {status}:\n"
                            f"{log_tail(client.get_job_logs(submission))}")
        return pickle.loads(job.store.read_bytes(f"{key}.result"))
    finally:
        for leftover in (key, f"{key}.result"):
            if job.store.exists(leftover):
                job.store.delete(leftover)


def main(argv: list[str]) -> None:
    from omni_core.evaluation.job import run_eval_job
    from omni_core.storage import Store

    store_root, key = argv
    store = Store(store_root)
    result = run_eval_job(dataclasses.replace(pickle.loads(store.read_bytes(key)), store=store))
    store.write_bytes(f"{key}.result", pickle.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
