"""Running a whole pipeline in the test process: every stage in dependency order, then the finish
(the Prefect flow does the same with a task per stage; these tests are about the stages)."""

from __future__ import annotations

from collections.abc import Callable

from omni_core.config import PipelineConfig
from omni_core.pipeline.run import PipelineRun


def run_in_order(config: PipelineConfig, progress: Callable[[str], None] = lambda line: None) -> PipelineRun:
    run = PipelineRun.start(config, progress=progress)
    ok = False
    try:
        for stage in config.ordered_stages():
            run.run_stage(stage.name)
        ok = True
    finally:
        run.finish(ok)
    return run
