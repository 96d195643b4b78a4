"""The `pipeline` flow: validate the parameters, then run the stage graph, each stage as soon as its
`after:` stages have finished (independent stages in parallel), each through the stage cache."""

from __future__ import annotations

from typing import Any, Protocol

from prefect import flow
from prefect.futures import PrefectFuture, as_completed
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from omni_core.config import PipelineConfig
from omni_core.pipeline import PipelineRun, resolve_pipeline
from omni_core.quiet import quiet_startup
from tasks.artifacts import publish_run_artifacts
from tasks.stages import stage_task


def _flow_run_url() -> str:
    """This flow run's page in the Prefect UI, or "" when no UI URL is known (Prefect's embedded API
    has none, and `flow_run.ui_url` then reads "None/flow-runs/...")."""
    from prefect.settings import PREFECT_UI_URL

    return (flow_run.ui_url or "") if PREFECT_UI_URL.value() else ""


def _prefect_tags() -> dict[str, str]:
    tags = {"prefect.flow_run_id": str(flow_run.id or "")}
    if url := _flow_run_url():
        tags["prefect.flow_run_url"] = url
    return tags


class RunHooks(Protocol):
    """What a sweep's variant process (flows/sweep_variant.py) adds to the pipeline run it hosts: MLflow
    tags for the pipeline run, a wait before a stage starts (the sweep's go-ahead), the summary at the end."""

    tags: dict[str, str]

    def before_stage(self, name: str) -> None: ...

    def finished(self, summary: dict[str, Any]) -> None: ...


_hooks: list[RunHooks] = []  # at most one: set for the whole process by `use_hooks`


def use_hooks(hooks: RunHooks) -> None:
    _hooks[:] = [hooks]


# Parameters are validated by resolve_pipeline (messages name the stage, not its index), not by Prefect.
@flow(name="pipeline", log_prints=True, validate_parameters=False)
def pipeline(pipeline_file: str | None = None, config: PipelineConfig | None = None,
             overrides: list[str] | None = None, force: list[str] | None = None) -> dict[str, Any]:
    """Run a pipeline: `pipeline_file` (a YAML path) or `config` (the pipeline inline), with dotted
    `overrides` (stages.rl.trainer.total_steps=3); `force` names stages to redo although cached."""
    quiet_startup()  # before a stage starts Ray or loads a model
    extra = _hooks[0].tags if _hooks else {}
    run = PipelineRun.start(resolve_pipeline(pipeline_file, config, overrides), tags={**_prefect_tags(), **extra},
                            force=force or [])
    try:
        futures = run_graph(run)
    except BaseException:  # also Ctrl-C and a cancel's SIGTERM (Prefect's TerminationSignal), in this thread
        run.cancel()  # stop the stages' external jobs (verl's Ray Jobs) before the process goes
        _finished(run.finish(ok=False))
        raise
    failed = []
    for name in run.graph.order:
        future = futures.get(name)
        if future is None:
            continue  # not run: downstream of a failure
        if future.state.is_completed():
            run.outcomes[name] = future.result()
        else:
            run.stage_failed(name, future.result(raise_on_failure=False))
            failed.append(future)
    summary = {**run.finish(ok=not failed), "prefect_flow_run_url": _flow_run_url()}
    _finished(summary)
    publish_run_artifacts(summary, summary["prefect_flow_run_url"])
    if failed:
        failed[0].result()  # raises the first failed stage's error (in dependency order)
    return summary


def _finished(summary: dict[str, Any]) -> None:
    for hooks in _hooks:
        hooks.finished(summary)


def run_graph(run: PipelineRun) -> dict[str, PrefectFuture]:
    """Submits each stage once all its `after:` stages completed; never one downstream of a failure.
    A stage gets its ancestors' outcomes, so its result does not depend on the order siblings finish."""
    futures: dict[str, PrefectFuture] = {}
    finished: set[str] = set()
    while True:
        done = {name for name in finished if futures[name].state.is_completed()}
        for name in run.graph.ready(done, started=set(futures)):
            for hooks in _hooks:
                hooks.before_stage(name)
            upstream = {a: futures[a] for a in run.graph.ancestors(name)}
            # quote: Prefect must not look into the run for upstream results (edges come from `upstream`)
            futures[name] = stage_task(run.config.stage(name)).submit(quote(run), name, upstream)
        running = {future: name for name, future in futures.items() if name not in finished}
        if not running:
            return futures
        first = next(as_completed(list(running)))
        first.wait()  # takes the final state from the task itself, not from the API (which may lag behind)
        finished.add(running[first])
