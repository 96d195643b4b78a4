"""The `pipeline` flow: load a pipeline file, then run its stages in dependency order."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from omni_core.config import load_pipeline
from omni_core.pipeline import PipelineRun
from tasks.stages import stage_task


def _prefect_tags() -> dict[str, str]:
    tags = {"prefect.flow_run_id": str(flow_run.id or "")}
    if flow_run.ui_url:
        tags["prefect.flow_run_url"] = flow_run.ui_url
    return tags


@flow(name="pipeline", log_prints=True)
def pipeline(pipeline_file: str, overrides: list[str] | None = None) -> dict[str, Any]:
    config = load_pipeline(pipeline_file, overrides or [])
    run = PipelineRun.start(config, tags=_prefect_tags())
    ok = False
    try:
        for stage in config.ordered_stages():
            stage_task(stage)(run, stage.name)
        ok = True
    finally:
        summary = run.finish(ok)
    return summary
