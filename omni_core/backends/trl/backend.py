"""Backend `trl` (the `Backend` protocol, omni_core.backends): TRL's trainers on Ray Train."""

from __future__ import annotations

import json
from typing import Any

from omni_core.backends import PlannedTraining, PrecheckResult, TrainingRun
from omni_core.config.backends import backend_name
from omni_core.errors import ConfigError


class TrlRayTrainBackend:
    name = "trl"

    def check(self, stage: Any, config: Any) -> str | None:
        from omni_core.backends.trl.stage import trl_problem

        return trl_problem(stage, config)

    def precheck(self, config: Any) -> list[PrecheckResult]:
        """Each trl stage's `backend.overrides` against TRL's config class (read from its source)."""
        from omni_core.backends.trl.fields import precheck_stage

        return [precheck_stage(s) for s in config.stages
                if backend_name(getattr(s, "backend", "native")) == self.name]

    def plan(self, planned: PlannedTraining) -> dict[str, Any]:
        from omni_core.backends.trl.fields import trl_version
        from omni_core.backends.trl.render import render

        stage, config = planned.stage, planned.config
        backend = stage.backend
        rendered = render(stage, config.seed)
        device = "GPU" if backend.use_gpu else "CPU"
        workers = f"{backend.num_workers} {device} worker{'s' if backend.num_workers > 1 else ''}"
        details = [f"{rendered.config_class}: {json.dumps(rendered.fields, sort_keys=True)}",
                   f"workers: {backend.num_workers} x {json.dumps(backend.worker_resources(), sort_keys=True)}, "
                   f"{backend.num_threads} torch thread(s) each"]
        if rendered.lora:
            details.append(f"peft LoraConfig: {json.dumps(rendered.lora, sort_keys=True)}")
        return {"backend": self.name, "details": details, "trl": {
                    "version": trl_version(), "trainer": rendered.trainer, "config": rendered.fields,
                    "lora": rendered.lora, "workers": backend.num_workers, "resources": backend.worker_resources()},
                "does": f"trains {stage.algorithm.name} with TRL's {rendered.trainer} on Ray Train ({workers}, one "
                        f"data-parallel group, on {config.ray.address}) for {stage.trainer.total_steps} steps on "
                        f"{planned.data} from {planned.model}"}

    def run(self, run: TrainingRun) -> Any:
        from omni_core.backends.trl.runner import run_trl

        return run_trl(run)

    def cancel(self) -> dict[str, str | None]:
        return {}  # its Ray Train workers belong to this process's Ray job: they end with it

    def retries(self, stage: Any) -> tuple[int, list[float]] | None:
        return None  # Ray Train restarts the worker group itself (execution.max_failures): the kind's retries apply

    def validation_problem(self, eval_stage: Any, trained: Any) -> str | None:
        return (f"stages.{eval_stage.name}.engine: trainer: stage '{trained.name}' trains on TRL, whose final "
                "checkpoint our eval scores as any other; use engine: native")

    def plan_validation(self, eval_stage: Any, trained: Any, config: Any) -> dict[str, Any]:
        raise ConfigError(self.validation_problem(eval_stage, trained) or "")

    def validate(self, validation: Any) -> dict[str, Any]:
        raise ConfigError(self.validation_problem(validation.ctx.stage, validation.trained) or "")


BACKEND = TrlRayTrainBackend()
