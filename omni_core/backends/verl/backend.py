"""Backend `verl` (the `Backend` protocol, omni_core.backends): verl's own trainers as Ray Jobs."""

from __future__ import annotations

from typing import Any

from omni_core.backends import PlannedTraining, PrecheckResult
from omni_core.backends.jobs.backend import JobBackend
from omni_core.backends.jobs.options import cluster_problem


class VerlJobBackend(JobBackend):
    name = "verl"
    validation = "omni_core.backends.verl.validation"

    def check(self, stage: Any, config: Any) -> str | None:
        from omni_core.backends.verl.stage import verl_problem

        return verl_problem(stage) or cluster_problem(stage, config, "on verl")

    def precheck(self, config: Any) -> list[PrecheckResult]:
        """verl's own Hydra composition of each verl stage's command (and of an `engine: trainer` eval of
        one) in verl's interpreter (omni_core.backends.verl.precheck): refused with Hydra's message, or a
        note that it composed or why the check was skipped."""
        from omni_core.backends.verl.precheck import check_pipeline

        return [PrecheckResult(r.stage, r.status, r.message, "verl hydra check") for r in check_pipeline(config)
                if _verl_or_eval(config.stage(r.stage))]

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


def _verl_or_eval(stage: Any) -> bool:
    """A verl training stage, or a stage that trains nothing (an eval by a verl stage's validation): the
    stages of other backends are theirs to check."""
    from omni_core.config.backends import backend_name

    return not hasattr(stage, "backend") or backend_name(stage.backend) == "verl"


BACKEND = VerlJobBackend()
