"""Backend `verl_omni` (the `Backend` protocol, omni_core.backends): a VeRL-Omni recipe as a Ray Job."""

from __future__ import annotations

from typing import Any

from omni_core.backends import PlannedTraining, PrecheckResult
from omni_core.backends.jobs.backend import JobBackend
from omni_core.backends.jobs.options import cluster_problem

# VeRL-Omni's config tree is its package's, which imports vLLM-Omni (GPU images only)
SKIPPED = ("VeRL-Omni's config tree is composed by its own package, which needs vLLM-Omni (GPU images only); the "
           "recipe's overrides are checked when its Ray Job starts")


class VerlOmniJobBackend(JobBackend):
    name = "verl_omni"
    validation = "omni_core.backends.verl_omni.validation"

    def check(self, stage: Any, config: Any) -> str | None:
        from omni_core.backends.verl_omni.stage import verl_omni_problem

        return verl_omni_problem(stage, config.datasets) or cluster_problem(stage, config, "a VeRL-Omni recipe")

    def precheck(self, config: Any) -> list[PrecheckResult]:
        """A note per VeRL-Omni stage: nothing composes its recipe's overrides before its Ray Job starts."""
        from omni_core.config.backends import backend_name

        return [PrecheckResult(s.name, "skipped", SKIPPED, "verl hydra check") for s in config.stages
                if backend_name(getattr(s, "backend", "native")) == self.name]

    def plan(self, planned: PlannedTraining) -> dict[str, Any]:
        from omni_core.backends.verl_omni.stage import plan

        stage, config, dataset = planned.stage, planned.config, planned.dataset
        job = plan(stage, pipeline=config.name, seed=config.seed, dataset=dataset,
                   converter=config.datasets[dataset].converter if dataset in config.datasets else None,
                   version=planned.version, splits=planned.splits, run_key=planned.run_key,
                   tracking_uri=config.tracking_uri, ray_address=config.ray.address)
        return {"does": f"runs VeRL-Omni recipe {job['task']} as Ray Job {job['submission_id']} on "
                        f"{config.ray.address} on {planned.data} from {job['stages']['model']['from']}", **job}

    def trainer(self) -> Any:
        from omni_core.backends.verl_omni.runner import RecipeTrainer

        return RecipeTrainer()


BACKEND = VerlOmniJobBackend()
