"""The `sweep` flow: one pipeline over many settings (omni_core.sweep does the work).

Every pipeline run of the sweep (the shared stages, each variant, the winner's registration) is a
`pipeline` flow run of its own, a child of this flow run (under a `variant` task run named after it),
tagged `sweep:NAME`, run in its own process (flows/sweep_variant.py) on the sweep's Ray. The comparison
ends up as this flow run's artifacts.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_client, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.states import Cancelled, Failed
from prefect.utilities.annotations import quote

from flows.pipeline import _flow_run_url
from omni_core.config.loader import set_path
from omni_core.errors import OmniError
from omni_core.file_lock import file_lock
from omni_core.paths import OMNI_HOME
from omni_core.quiet import quiet_startup
from omni_core.sweep.controller import RunRequest
from omni_core.sweep.plan import plan_sweep, settle_concurrency
from omni_core.sweep.run import SweepResult, open_state, run_sweep
from omni_core.sweep.shared_ray import shared_ray
from omni_core.sweep.spec import load_sweep
from omni_core.sweep.state import PRUNED
from tasks.artifacts import artifact_key

ROOT = Path(__file__).resolve().parents[1]


class ProcessRun:
    """A pipeline run in its own process, started by a `variant` task of the sweep flow."""

    def __init__(self, request: RunRequest, folder: Path, env: dict[str, str]):
        self.request, self.env = request, env
        self.log_path = str(folder / f"{request.label}.log")
        self.summary_path = folder / f"{request.label}.summary.json"
        self.summary_path.unlink(missing_ok=True)
        self.request_path = folder / f"{request.label}.request.json"
        self.flow_run_id: str | None = None
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self._lock = threading.Lock()
        self._released = self._stopped = False

    def started(self, proc: subprocess.Popen, flow_run_id: str) -> None:
        with self._lock:
            self.proc, self.flow_run_id = proc, flow_run_id
            if self._released:
                self._say("go")
            if self._stopped:
                proc.terminate()

    def _say(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # it ended meanwhile
            pass

    def poll(self) -> int | None:
        return self.code

    def release(self) -> None:
        with self._lock:
            self._released = True
            if self.proc is not None:
                self._say("go")

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()

    def summary(self) -> dict[str, Any] | None:
        if not self.summary_path.exists():
            return None
        return json.loads(self.summary_path.read_text())

    def ended(self, status: str, message: str) -> None:
        """A pruned or interrupted run's flow run: Cancelled with why (its process ended it as Crashed)."""
        if self.flow_run_id is None:
            return
        state = Cancelled(message=message) if status in (PRUNED, "interrupted") else Failed(message=message)
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(self.flow_run_id, state, force=True)


# NO_CACHE: a run is never taken from Prefect's cache (the stage cache decides what is reused)
@task(name="variant", task_run_name="{label}", cache_policy=NO_CACHE)
def run_in_process(label: str, run: ProcessRun) -> int:
    """Creates the pipeline's flow run under this task run, runs it in its own process, waits for it."""
    try:
        proc = start_process(run)
        code = proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
    except BaseException as exc:  # the run never started: the controller sees a failed run, not a silent one
        with open(run.log_path, "a") as log:
            log.write(f"error: the sweep could not start this run: {type(exc).__name__}: {exc}\n")
        run.code = 1
        raise
    run.code = code
    return code


def start_process(run: ProcessRun) -> subprocess.Popen:
    from prefect.exceptions import PrefectHTTPStatusError

    from flows.pipeline import pipeline

    request = run.request
    context = TaskRunContext.get()
    deadline = time.monotonic() + 60
    while True:
        try:
            with get_client(sync_client=True) as client:
                flow_run = client.create_flow_run(
                    pipeline, name=request.name, parameters={"config": request.data},
                    parent_task_run_id=context.task_run.id if context else None,
                    tags=[f"sweep:{request.tags['omni.sweep.name']}", f"sweep-{request.tags['omni.sweep.role']}"])
            break
        except PrefectHTTPStatusError as exc:
            # 409: this task run's own row is not on the server yet (Prefect sends task runs as events, in
            # the background), and the flow run names it as its parent: it comes within moments
            if exc.response.status_code != 409 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    run.request_path.write_text(json.dumps({
        "flow_run_id": str(flow_run.id), "data": request.data, "tags": request.tags, "hold": request.hold,
        "summary_path": str(run.summary_path)}))
    with open(run.log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.sweep_variant", str(run.request_path)], cwd=os.getcwd(),
                                env=run.env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True)
    run.started(proc, str(flow_run.id))
    return proc


class PrefectLauncher:
    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        with get_client(sync_client=True) as client:
            api = client.api_url  # also Prefect's temporary server's, which a child would not find
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PREFECT_API_URL": str(api).rstrip("/"), "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}

    def launch(self, request: RunRequest) -> ProcessRun:
        run = ProcessRun(request, self.folder, self.env)
        run_in_process.submit(request.label, quote(run))
        return run


@flow(name="sweep", log_prints=True, validate_parameters=False)
def sweep(pipeline_file: str, sweep_file: str, overrides: list[str] | None = None, poll_s: float = 1.0) -> dict[str, Any]:
    """Run sweep file `sweep_file` over pipeline file `pipeline_file` (with dotted `overrides`)."""
    quiet_startup()
    plan = plan_sweep(load_sweep(sweep_file), pipeline_file, overrides)
    for warning in plan.warnings:
        print(f"warning: {warning}")
    with shared_ray(plan.config.ray) as ray:
        concurrency = settle_concurrency(plan, ray.resources, ray.where)
        for override in ray.overrides:
            key, _, value = override.partition("=")
            set_path(plan.data, key, value, "the sweep's Ray")
        state = open_state(plan)
        folder = OMNI_HOME / "sweeps" / f"{plan.spec.name}-{state.prefix.rsplit('/', 1)[-1]}"
        print(f"sweep {plan.spec.name}: {plan.n_variants} variants, at most {concurrency} at once on {ray.where}; "
              f"logs in {folder}")
        launcher = PrefectLauncher(folder)
        with contextlib.ExitStack() as held:
            try:  # one controller of a sweep per machine
                held.enter_context(file_lock(folder / "sweep.lock", wait=False))
            except BlockingIOError:
                raise OmniError(f"sweep {plan.spec.name} is already running here (it holds {folder / 'sweep.lock'}); "
                                f"wait for it, or watch it with `omni sweep status {plan.spec.name}`") from None
            result = run_sweep(plan, launcher, max_concurrent=concurrency, poll_s=poll_s)
    publish_artifacts(result)
    return {"name": plan.spec.name, "headline": result.headline, "rows": result.rows, "registered": result.registered,
            "report_uri": result.report_uri, "mlflow_run_id": result.sweep_run_id, "tracking_uri": plan.config.tracking_uri,
            "spec": result.spec, "prefect_flow_run_url": _flow_run_url()}


def publish_artifacts(result: SweepResult) -> None:
    name = result.spec["name"]
    create_table_artifact(result.rows, key=artifact_key(name, "sweep-table"),
                          description=f"sweep {name}: every variant, best first")
    create_markdown_artifact(result.markdown, key=artifact_key(name, "sweep"),
                             description=f"sweep {name}: the comparison and its plots")
