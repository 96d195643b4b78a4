"""Backend `verl` (the `Backend` protocol, omni_core.backends): verl's own trainers as Ray Jobs."""

from __future__ import annotations

from typing import Any

from omni_core.backends import PlannedTraining
from omni_core.backends.jobs.backend import JobBackend
from omni_core.backends.jobs.options import cluster_problem


class VerlJobBackend(JobBackend):
    name = "verl"
    validation = "omni_core.backends.verl.validation"

    def check(self, stage: Any, config: Any) -> str | None:
        from omni_core.backends.verl.stage import verl_problem

        return verl_problem(stage) or cluster_problem(stage, config, "on verl")

    def plan(self, planned: PlannedTraining) -> dict[str, Any]:
        from omni_core.backends.verl.stage import plan

        stage, config = planned.stage, planned.config
        job = plan(stage, pipeline=config.name, seed=config.seed, dataset=planned.dataset, split=planned.split,
                   version=planned.version, shard_count=planned.shard_count, run_key=planned.run_key,
                   model_uri=planned.model, tracking_uri=config.tracking_uri, ray_address=config.ray.address)
        return {"does": f"runs verl's {job['task']} trainer as Ray Job {job['submission_id']} on {config.ray.address} "
                        f"for {stage.trainer.total_steps} steps on {planned.data} from {planned.model}", **job}

    def trainer(self) -> Any:
        from omni_core.backends.verl.runner import VerlTrainer

        return VerlTrainer()


BACKEND = VerlJobBackend()
