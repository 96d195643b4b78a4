"""The options both external backends share (`backend: {name: verl | verl_omni, shared_dir: PATH, ...}`)
and the check every stage run as a Ray Job needs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, field_validator

from omni_core.config.backends import BackendOptions


class JobBackendOptions(BackendOptions):
    """A backend whose trainer runs as a Ray Job on a cluster whose nodes share `shared_dir`."""

    # where the job runs (interpreter, shared path, env, entry point resources), not what it trains
    run_key_excluded: ClassVar[frozenset[str]] = frozenset({"python", "shared_dir", "env", "entrypoint_resources"})

    shared_dir: str = Field(description="A path every Ray node sees (NFS, Lustre, a PVC; locally any folder): "
                                        "datasets, models and the trainer's checkpoints are staged under it.")
    entrypoint_resources: dict[str, float] | None = Field(
        None, description="Keyword arguments of Ray's submit_job for the entry point (entrypoint_num_cpus, "
                          "entrypoint_num_gpus).")

    @field_validator("shared_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("backend.shared_dir is empty; give a path every Ray node sees")
        return os.path.abspath(os.path.expanduser(value))

    def run_dir(self, pipeline: str, run_key: str, stage: str) -> Path:
        """shared_dir/runs/{pipeline}/{run_key}/{stage} (absolute)."""
        return Path(self.shared_dir) / "runs" / pipeline / run_key / stage


def cluster_problem(stage: Any, config: Any, runs: str) -> str | None:
    """A stage run as a Ray Job needs a cluster's job server, not a local Ray."""
    if config.ray.address == "local":
        return (f"ray.address: local, but stage {stage.name} runs {runs} as a Ray Job: set ray.address to the "
                "cluster's job server (the dashboard URL, http://HOST:8265)")
    return None


def job_retries(stage: Any) -> tuple[int, list[float]]:
    """A failed try (a killed trainer, a lost node) is retried `execution.max_failures` times,
    `execution.retry_backoff_s` apart (doubling): each retry resubmits the Ray Job as `-attempt-N`,
    which resumes from the last mirrored checkpoint."""
    execution = stage.execution
    return execution.max_failures, [execution.retry_backoff_s * 2 ** i for i in range(execution.max_failures)]
