"""The stage table of a pipeline run, read from Prefect's API (what `omni status` prints).

A run is named by its flow-run id or name; without one, the latest started run of the `pipeline`
flow. Each stage is a task run of that flow run: its state, start, duration and whether its result
came from the stage cache (state `Cached`; the state's message says from where).
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass, field
from typing import Any

from omni_core.errors import OmniError

PIPELINE_FLOW = "pipeline"


class RunNotFoundError(OmniError):
    """No pipeline run matches what was asked for."""


@dataclass
class StageRow:
    name: str
    state: str
    start: datetime.datetime | None
    seconds: float | None
    cache_hit: bool
    retries: int = 0
    message: str = ""


@dataclass
class RunStatus:
    id: str
    name: str
    flow: str
    state: str
    start: datetime.datetime | None
    seconds: float | None
    deployment: str | None
    parameters: dict[str, Any]
    stages: list[StageRow] = field(default_factory=list)
    artifacts: list[tuple[str, str]] = field(default_factory=list)  # (key or id, type)


def _seconds(start: datetime.datetime | None, end: datetime.datetime | None, total: Any, running: bool) -> float | None:
    if start and end:
        return (end - start).total_seconds()
    if start and running:
        return (datetime.datetime.now(datetime.UTC) - start).total_seconds()
    return total.total_seconds() if isinstance(total, datetime.timedelta) and total else None


def is_cache_hit(state_name: str | None) -> bool:
    """The pipeline's stage task names its state `Cached` when the stage cache had its result (as
    Prefect does for results from its own cache)."""
    return (state_name or "").lower() == "cached"


def _find_flow_run(client: Any, run: str | None) -> Any:
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterStartTime,
    )
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.exceptions import ObjectNotFound

    if run is None:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[PIPELINE_FLOW])),
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(is_null_=False)),
            sort=FlowRunSort.START_TIME_DESC, limit=1)
        if not runs:
            raise RunNotFoundError("no pipeline run has started yet on this Prefect API "
                                   "(run one: omni run PIPELINE.yaml, or from a deployment)")
        return runs[0]
    try:
        return client.read_flow_run(uuid.UUID(run))
    except ValueError:
        pass  # not an id: a name
    except ObjectNotFound:
        raise RunNotFoundError(f"no flow run with id {run}") from None
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run])),
                                 sort=FlowRunSort.START_TIME_DESC, limit=2)
    if not runs:
        raise RunNotFoundError(f"no flow run named {run!r} (give its name or id, as shown by the Prefect UI)")
    return runs[0]


def run_status(run: str | None = None) -> RunStatus:
    """The flow run `run` (id or name; default: the latest started pipeline run) with its stages."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        flow_run = _find_flow_run(client, run)
        flow = client.read_flow(flow_run.flow_id)
        deployment = client.read_deployment(flow_run.deployment_id).name if flow_run.deployment_id else None
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])),
            sort=TaskRunSort.EXPECTED_START_TIME_ASC)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id])))
    running = flow_run.state_type is not None and flow_run.state_type.value == "RUNNING"
    status = RunStatus(
        id=str(flow_run.id), name=flow_run.name, flow=flow.name, state=flow_run.state_name or "?",
        start=flow_run.start_time, seconds=_seconds(flow_run.start_time, flow_run.end_time,
                                                    flow_run.total_run_time, running),
        deployment=deployment, parameters=dict(flow_run.parameters or {}),
        artifacts=[(a.key or str(a.id), a.type or "") for a in artifacts])
    never = datetime.datetime.max.replace(tzinfo=datetime.UTC)
    for task_run in sorted(task_runs, key=lambda t: t.start_time or t.expected_start_time or never):
        state = task_run.state
        message = (state.message or "") if state else ""
        task_running = task_run.state_type is not None and task_run.state_type.value == "RUNNING"
        status.stages.append(StageRow(
            name=task_run.name, state=task_run.state_name or "?", start=task_run.start_time,
            seconds=_seconds(task_run.start_time, task_run.end_time, task_run.total_run_time, task_running),
            cache_hit=is_cache_hit(task_run.state_name), retries=max(task_run.run_count - 1, 0),
            message=message))
    return status
