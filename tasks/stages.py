"""Prefect task around one pipeline stage: retries by stage kind, the stage cache's verdict as the task
state ("Cached" for a hit, with where the result came from), training steps as a progress artifact."""

from __future__ import annotations

import logging
import threading

from prefect import Task, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from omni_core.config.models import AnyStage
from omni_core.pipeline import PipelineRun, StageOutcome, stage_kind
from tasks.artifacts import artifact_key
from tasks.retry import retry_unless_user_error

log = logging.getLogger(__name__)


class StepProgress:
    """A progress artifact for a stage that reports steps: created at its first report (from the task's
    thread, so it belongs to this task run), then updated from whichever thread reports."""

    def __init__(self, pipeline: str, stage: str):
        self.stage, self.key = stage, artifact_key(pipeline, stage, "progress")
        self.artifact_id = None
        self.last = -1.0
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        percent = round(100.0 * done / max(total, 1), 1)
        description = f"stage {self.stage}: step {done} of {total}"
        with self.lock:
            try:
                if self.artifact_id is None:
                    self.artifact_id = create_progress_artifact(percent, key=self.key, description=description)
                elif percent != self.last:
                    update_progress_artifact(self.artifact_id, percent, description=description)
                self.last = percent
            except Exception as exc:  # progress is best effort: never fail the stage over it
                log.warning("stage %s: progress artifact not updated (%s)", self.stage, exc)


@task(cache_policy=NO_CACHE, retry_condition_fn=retry_unless_user_error)
def run_stage(run: PipelineRun, name: str, upstream: dict[str, StageOutcome]) -> State:
    outcome = run.run_stage(name, upstream, on_step=StepProgress(run.config.name, name))
    return Completed(name="Cached" if outcome.cache_hit else "Completed", message=f"{outcome.status}: {outcome.note}",
                     data=outcome)


def stage_task(stage: AnyStage) -> Task:
    retries, delays = stage_kind(stage.kind).retry(stage)
    return run_stage.with_options(name=stage.name, task_run_name=stage.name, retries=retries,
                                  retry_delay_seconds=delays or 0)
