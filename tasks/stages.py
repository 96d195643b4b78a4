"""Prefect tasks around pipeline stages: one task per stage, retries suited to its kind."""

from __future__ import annotations

from prefect import Task, task
from prefect.cache_policies import NO_CACHE

from omni_core.config.models import AnyStage
from omni_core.pipeline import PipelineRun, StageOutcome
from tasks.retry import retry_unless_user_error

# Ingest and image builds are idempotent and cheap to retry (transient S3 or registry errors);
# training retries once for now.
RETRIES = {"ingest": 2, "build_images": 2, "rl": 1}


@task(cache_policy=NO_CACHE, retry_condition_fn=retry_unless_user_error)
def run_stage(run: PipelineRun, name: str) -> StageOutcome:
    return run.run_stage(name)


def stage_task(stage: AnyStage) -> Task:
    return run_stage.with_options(name=stage.name, task_run_name=stage.name,
                                  retries=RETRIES.get(stage.kind, 0), retry_delay_seconds=2)
