"""Deployments against a real `prefect server start` (SQLite, 127.0.0.1, a free port, a temporary
PREFECT_HOME): `omni deploy`; a run triggered from a deployment with changed parameters through the
API call the UI's "Run" button makes, executed by a process worker; the scheduler creating the
nightly runs; `omni status`; `omni serve`.

The server is conftest.py's `prefect_server`, started once per session (per test process) and shared
with the other modules that need "a Prefect API"; every `omni` and `prefect` command runs as a
subprocess, as a user would run it.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from ports import free_port

from flows.deployments import load_prefect_file

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "omni-process"
RUN_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


@contextmanager
def api_client(server: dict[str, str]) -> Iterator[Any]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server["PREFECT_API_URL"]}), \
            get_client(sync_client=True) as client:
        yield client


def omni(server: dict[str, str] | None, *args: str, timeout: float = 300, cwd: Path = ROOT,
         **extra_env: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(server or {})}
    if server is None:
        env.pop("PREFECT_API_URL", None)
    env.update(extra_env)
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def wait_for(predicate: Any, timeout: float, what: str, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def final_flow_run(server: dict[str, str], run_id: uuid.UUID, timeout: float = RUN_TIMEOUT_S) -> Any:
    def final() -> Any:
        with api_client(server) as client:
            run = client.read_flow_run(run_id)
        return run if run.state and run.state.is_final() else None

    return wait_for(final, timeout, f"flow run {run_id} to finish", every=0.5)


def tiny_pipeline(folder: Path, name: str) -> Path:
    """An ingest-only pipeline of 8 fixture rows, writing only under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "store": str(folder / "store"), "tracking_uri": f"sqlite:///{folder / 'mlflow.db'}",
        "datasets": {"gsm8k": {"source": "fixtures://gsm8k?rows=8&seed=0", "converter": "gsm8k"}},
        "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["gsm8k"]}],
    }))
    return path


# ---- without a server -----------------------------------------------------------------------------


def test_deploy_without_an_api_says_what_to_do(tmp_path: Path) -> None:
    unset = omni(None, "deploy", PREFECT_HOME=str(tmp_path / "home"))
    assert unset.returncode == 2, unset.stdout + unset.stderr
    assert "PREFECT_API_URL is not set" in unset.stderr and "prefect server start" in unset.stderr
    port = free_port()  # nothing listens there
    unreachable = omni(None, "deploy", PREFECT_HOME=str(tmp_path / "home"),
                       PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
    assert unreachable.returncode == 2, unreachable.stdout + unreachable.stderr
    assert f"Prefect API at http://127.0.0.1:{port}/api is unreachable" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr


# ---- against the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployed(prefect_server: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = omni(prefect_server, "deploy", OMNI_CUDA_IMAGE="registry.test/omni-cuda:c-0123456789abcdef")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_deploy_registers_every_deployment_of_prefect_yaml(prefect_server: dict[str, str], deployed) -> None:
    prefect_file = load_prefect_file()
    assert {d.pool_type for d in prefect_file.deployments} == {"process", "docker", "kubernetes"}
    with api_client(prefect_server) as client:
        pools = {p.name: p for p in client.read_work_pools()}
        deployments = {d.name: d for d in client.read_deployments()}
        for spec in prefect_file.deployments:
            deployment = deployments[spec.name]
            function = spec.entrypoint.replace(":", ".").rsplit(".", 1)[1]
            assert client.read_flow(deployment.flow_id).name == function
            assert deployment.work_pool_name == spec.pool
            assert deployment.parameters == (spec.raw.get("parameters") or {})
            assert pools[spec.pool].type == spec.pool_type
            if spec.pool_type in ("docker", "kubernetes"):
                assert deployment.job_variables["image"] == "registry.test/omni-cuda:c-0123456789abcdef"
                assert deployment.pull_steps == [
                    {"prefect.deployments.steps.set_working_directory": {"directory": "/home/omni"}}]
            else:  # the process pool runs this checkout
                assert deployment.pull_steps == [
                    {"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
        kubernetes = pools["omni-kubernetes"].base_job_template
        container = kubernetes["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpu_limit }}"
        # zombie detection: a running flow run without heartbeats for 2 x 180 s (Prefect's default) is crashed
        automation = client.read_automations_by_name("omni: crash flow runs without heartbeats")[0]
        assert automation.trigger.within.total_seconds() == 360 and automation.trigger.posture == "Proactive"
        assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
        assert [a.state for a in automation.actions] == ["CRASHED"]
    out = deployed.stdout
    assert "created work pool omni-process (process)" in out, out
    assert "a flow run without a heartbeat for 360 s is marked Crashed" in " ".join(out.split()), out
    assert "ingest/nightly-demo" in out and "0 2 * * * UTC (active)" in out, out


@pytest.fixture(scope="module")
def triggered_run(prefect_server: dict[str, str], deployed, tmp_path_factory: pytest.TempPathFactory,
                  mlflow_db: Callable[[Path], str]) -> dict:
    """A run of pipeline/local with other parameters than the deployment's, made the way the UI's
    Run button makes it, then executed by a process worker that polls once."""
    folder = tmp_path_factory.mktemp("triggered")
    pipeline_file = tiny_pipeline(folder, "tiny-ingest")
    mlflow_db(folder / "mlflow.db")
    parameters = {"pipeline_file": str(pipeline_file), "overrides": ["seed=7"]}
    with api_client(prefect_server) as client:
        deployment = client.read_deployment_by_name("pipeline/local")
        assert deployment.parameters["pipeline_file"] == "configs/demo.yaml"  # the deployment's default
        flow_run = client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
    worker = subprocess.run(
        [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process", "--run-once"],
        cwd=folder, env={**os.environ, **prefect_server}, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    final = final_flow_run(prefect_server, flow_run.id, timeout=30)
    return {"run": final, "parameters": parameters, "folder": folder, "worker": worker.stdout + worker.stderr}


def test_triggered_run_completes_with_the_changed_parameters(prefect_server: dict[str, str], triggered_run) -> None:
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    run = triggered_run["run"]
    assert run.state.is_completed(), f"{run.state}\n{triggered_run['worker'][-4000:]}"
    assert run.parameters == triggered_run["parameters"]
    with api_client(prefect_server) as client:
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert [t.name for t in task_runs] == ["ingest"]
    assert all(t.state.is_completed() for t in task_runs)
    store = triggered_run["folder"] / "store"
    version = (store / "datasets/gsm8k/LATEST").read_text().strip()
    assert (store / "datasets/gsm8k" / version / "_manifest.json").exists()
    with api_client(prefect_server) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run.id])))
    kinds = {a.key: a.type for a in artifacts}
    assert kinds.get("tiny-ingest-summary") == "markdown" and kinds.get("tiny-ingest-metrics") == "table", kinds
    summary = next(a for a in artifacts if a.key == "tiny-ingest-summary").data
    assert "ingest" in summary and version in summary


def test_scheduler_creates_the_nightly_runs(prefect_server: dict[str, str], deployed) -> None:
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    def scheduled(name: str) -> list:
        with api_client(prefect_server) as client:
            deployment = client.read_deployment_by_name(name)
            return client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                    type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))))

    runs = wait_for(lambda: scheduled("ingest/nightly-demo"), 90, "the scheduler to create nightly ingest runs")
    now = datetime.datetime.now(datetime.UTC)
    for run in runs:
        assert run.auto_scheduled
        assert run.expected_start_time > now - datetime.timedelta(minutes=1)
        start = run.expected_start_time.astimezone(datetime.UTC)
        assert (start.hour, start.minute) == (2, 0)
        assert run.parameters == {"pipeline_file": "configs/demo.yaml"}
    assert not scheduled("pipeline/local")  # its weekly schedule is inactive


def test_status_prints_the_stage_table_of_a_run(prefect_server: dict[str, str], triggered_run) -> None:
    run = triggered_run["run"]
    latest = omni(prefect_server, "status")
    assert latest.returncode == 0, latest.stdout + latest.stderr
    assert f"pipeline run {run.name} ({run.id}, deployment local): Completed" in latest.stdout, latest.stdout
    rows = [line for line in latest.stdout.splitlines() if line.startswith("│ ingest")]
    assert len(rows) == 1 and "Completed" in rows[0], latest.stdout

    by_name = omni(prefect_server, "status", run.name, "--json")
    assert by_name.returncode == 0, by_name.stdout + by_name.stderr
    status = json.loads(by_name.stdout)
    assert status["id"] == str(run.id) and status["state"] == "Completed"
    assert status["parameters"] == triggered_run["parameters"]
    assert [(s["name"], s["state"]) for s in status["stages"]] == [("ingest", "Completed")]
    assert status["stages"][0]["seconds"] > 0

    missing = omni(prefect_server, "status", "no-such-run")
    assert missing.returncode == 2 and "no flow run named 'no-such-run'" in missing.stderr


def test_serve_runs_deployments_from_this_machine(prefect_server: dict[str, str], triggered_run) -> None:
    """`omni serve local` replaces the work-pool deployment with a served one and runs what the API asks."""
    from prefect.exceptions import ObjectNotFound

    # the served runner asks for scheduled runs every second (Prefect's default: 10 s)
    env = {**os.environ, **prefect_server, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = triggered_run["folder"] / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "local"], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def served() -> Any:
            if proc.poll() is not None:
                pytest.fail(f"omni serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                with api_client(prefect_server) as client:
                    deployment = client.read_deployment_by_name("pipeline/local")
            except ObjectNotFound:  # between the work-pool deployment's removal and the served one's creation
                return None
            return deployment if deployment.work_pool_name is None else None

        deployment = wait_for(served, 120, "omni serve to register pipeline/local", every=0.5)
        with api_client(prefect_server) as client:
            flow_run = client.create_flow_run_from_deployment(
                deployment.id, parameters=triggered_run["parameters"])
        run = final_flow_run(prefect_server, flow_run.id)
        assert run.state.is_completed(), f"{run.state}\n{log.read_text()[-4000:]}"
        # the same parameters again: its one stage comes from the stage cache, and status says so
        status = omni(prefect_server, "status", str(run.id), "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        stages = json.loads(status.stdout)["stages"]
        assert [(s["name"], s["state"], s["cache_hit"]) for s in stages] == [("ingest", "Cached", True)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl+C does to a foreground `omni serve`
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "serving from this machine" in text and "pipeline/local" in text
    assert "replaced the work-pool deployment pipeline/local (omni-process)" in text
