"""The `Backend` protocol's parts every job backend shares: run a training through the skeleton and
turn its manifest into the stage's result, cancel the jobs this process follows, retry by resubmission."""

from __future__ import annotations

import tempfile
from typing import Any

from omni_core.backends import TrainingRun
from omni_core.backends.jobs.options import job_retries


class JobBackend:
    """Base of a backend whose trainer runs as a Ray Job; a subclass sets `name`, `check`, `plan`,
    `trainer()` (its omni_core.backends.jobs.runner.JobTrainer) and `validation`, the module with its
    `validation_problem`, `plan_validation` and `validate` (an eval's `engine: trainer`), imported
    when asked."""

    name = ""
    validation = ""

    def trainer(self) -> Any:
        raise NotImplementedError

    def _validation(self) -> Any:
        import importlib

        return importlib.import_module(self.validation)

    def validation_problem(self, eval_stage: Any, trained: Any) -> str | None:
        return self._validation().validation_problem(eval_stage, trained)

    def plan_validation(self, eval_stage: Any, trained: Any, config: Any) -> dict[str, Any]:
        return self._validation().plan_validation(eval_stage, trained, config)

    def validate(self, validation: Any) -> dict[str, Any]:
        return self._validation().validate(validation)

    def run(self, run: TrainingRun) -> Any:
        from omni_core.backends.jobs.runner import JobInputs, run_job
        from omni_core.training.checkpoint import weights_digest
        from omni_core.training.ray_stage import RLStageResult

        ctx = run.ctx
        with tempfile.TemporaryDirectory(prefix="omni-verl-log-") as logs:
            manifest = run_job(JobInputs(
                pipeline=ctx.config.name, stage=run.stage, seed=ctx.config.seed, store=ctx.store, dataset=run.dataset,
                version=run.version.version, split=run.split, run_key=run.run_key, ray_address=ctx.config.ray.address,
                tracking_uri=ctx.tracker.tracking_uri, mlflow_run_id=ctx.mlflow_run_id, tracker=ctx.tracker,
                progress=ctx.progress, on_step=ctx.on_step, log_dir=logs), self.trainer())
        metrics = {} if manifest["reused"] else dict(ctx.tracker.client.get_run(ctx.mlflow_run_id).data.metrics)
        return RLStageResult(run.run_key, manifest["global_step"], manifest["uri"], weights_digest(manifest), metrics,
                             manifest["reused"])

    def cancel(self) -> dict[str, str | None]:
        from omni_core.backends.jobs.job import stop_followed

        return stop_followed()

    def retries(self, stage: Any) -> tuple[int, list[float]] | None:
        return job_retries(stage)
