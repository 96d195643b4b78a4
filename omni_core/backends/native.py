"""Backend `native` (the default): our trainer on Ray (omni_core.training: rollout, reward and trainer
actors, checkpoints, restarts inside one try). Written `backend: native`, or left out."""

from __future__ import annotations

from typing import Any

from omni_core.backends import PlannedTraining, PrecheckResult, TrainingRun
from omni_core.config.backends import DEFAULT_BACKEND, BackendRecord, register_backend
from omni_core.errors import ConfigError

STEP_METRIC = "timing_s/step"  # every algorithm logs it once per step

class NativeBackend:
    name = DEFAULT_BACKEND

    def check(self, stage: Any, config: Any) -> str | None:
        return None  # the algorithm's own checks (omni_core.config.models) are all a native stage needs

    def precheck(self, config: Any) -> list[PrecheckResult]:
        return []  # nothing outside the config to ask

    def plan(self, planned: PlannedTraining) -> dict[str, Any]:
        stage, config = planned.stage, planned.config
        return {"backend": self.name, "does": f"trains {stage.algorithm.name} with our trainer on Ray "
                f"({config.ray.address}) for {stage.trainer.total_steps} steps on {planned.data} from {planned.model}"}

    def run(self, run: TrainingRun) -> Any:
        from omni_core.media_limits import MediaLimits
        from omni_core.pipeline.watch import StepWatcher
        from omni_core.training import run_rl_stage
        from omni_core.training.ray_env import start_ray

        ctx, stage = run.ctx, run.stage
        start_ray(ctx.config.ray)
        total = stage.trainer.total_steps
        with StepWatcher(ctx.tracker.tracking_uri, ctx.mlflow_run_id, STEP_METRIC,
                         lambda step: ctx.on_step(min(step, total), total)):
            return run_rl_stage(
                pipeline=ctx.config.name, stage=stage, seed=ctx.config.seed, store=ctx.store,
                shard_keys=run.version.shard_keys(run.split), dataset_version=run.version.version,
                ray_config=ctx.config.ray, tracking_uri=ctx.tracker.tracking_uri, mlflow_run_id=ctx.mlflow_run_id,
                progress=ctx.progress, media_limits=MediaLimits.of(ctx.config.datasets.get(run.dataset)))

    def cancel(self) -> dict[str, str | None]:
        from omni_core.training.runner import cancel_trainings

        cancel_trainings()  # its actors end with this process's Ray job; no step or checkpoint until then
        return {}

    def retries(self, stage: Any) -> tuple[int, list[float]] | None:
        return None  # it restarts its own actors `max_failures` times inside one try: the kind's retries apply

    def validation_problem(self, eval_stage: Any, trained: Any) -> str | None:
        return (f"stages.{eval_stage.name}.engine: trainer: stage '{trained.name}' trains with backend native, "
                "whose validation is our eval itself; use engine: native")

    def plan_validation(self, eval_stage: Any, trained: Any, config: Any) -> dict[str, Any]:
        raise ConfigError(self.validation_problem(eval_stage, trained) or "")

    def validate(self, validation: Any) -> dict[str, Any]:
        raise ConfigError(self.validation_problem(validation.ctx.stage, validation.trained) or "")


BACKEND = NativeBackend()
register_backend(BackendRecord(name=DEFAULT_BACKEND, options=None, implementation=f"{__name__}:BACKEND",
                               description="our trainer on Ray"))
