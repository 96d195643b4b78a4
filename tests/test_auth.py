"""Access control on the servers of the scaled-out deployment: a Prefect server with basic auth
(PREFECT_SERVER_API_AUTH_STRING) and an `mlflow server --app-name basic-auth`, both real on
127.0.0.1. A request without credentials is refused by each; `omni deploy`, `omni run` and
`omni lineage` take the credentials from the environment (PREFECT_API_AUTH_STRING,
MLFLOW_TRACKING_USERNAME / _PASSWORD) and, without them, say what to set. The secrets never reach
the runs' params or tags. (Ray's token auth: tests/test_ray_cluster.py.)"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from auth_servers import MlflowServer, PrefectServer, mlflow_server, prefect_server
from mlflow_server import s3_environment

ROOT = Path(__file__).resolve().parents[1]
PREFECT_AUTH = f"omni:{secrets.token_urlsafe(16)}"
MLFLOW_PASSWORD = secrets.token_urlsafe(18)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(moto_server: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import boto3

    folder = tmp_path_factory.mktemp("auth")
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="auth-artifacts")
    prefect = prefect_server(folder / "prefect", f"sqlite+aiosqlite:///{folder / 'prefect.db'}", PREFECT_AUTH)
    try:
        mlflow = mlflow_server(folder / "mlflow", f"sqlite:///{folder / 'mlflow.db'}", "s3://auth-artifacts/ml",
                               f"sqlite:///{folder / 'auth.db'}", MLFLOW_PASSWORD, s3_environment(moto_server))
    except BaseException:
        prefect.stop()
        raise
    yield prefect, mlflow, folder
    mlflow.stop()
    prefect.stop()


def omni(*args: str, env: dict[str, str], drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env, "COLUMNS": "200"}
    for name in drop:
        full.pop(name, None)
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=300)


def test_prefect_refuses_a_request_without_credentials(servers: Any) -> None:
    prefect: PrefectServer = servers[0]
    assert httpx.post(f"{prefect.url}/flows/filter", json={}).status_code == 401
    assert httpx.post(f"{prefect.url}/flows/filter", json={}, auth=("omni", "wrong")).status_code == 401
    user, password = PREFECT_AUTH.split(":", 1)
    assert httpx.post(f"{prefect.url}/flows/filter", json={}, auth=(user, password)).status_code == 200


def test_mlflow_refuses_a_request_without_credentials(servers: Any) -> None:
    mlflow: MlflowServer = servers[1]
    search = f"{mlflow.url}/api/2.0/mlflow/experiments/search?max_results=1"
    assert httpx.get(search, timeout=60).status_code == 401
    assert httpx.get(search, auth=("admin", "wrong"), timeout=60).status_code == 401
    assert httpx.get(search, auth=(mlflow.username, mlflow.password), timeout=60).status_code == 200


def test_omni_deploy_takes_the_credentials_from_the_environment(servers: Any) -> None:
    prefect: PrefectServer = servers[0]
    refused = omni("deploy", env=prefect.client_env(), drop=("PREFECT_API_AUTH_STRING",))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "refused the request (401)" in refused.stderr and "PREFECT_API_AUTH_STRING" in refused.stderr
    deployed = omni("deploy", env=prefect.client_env())
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "pipeline/local" in deployed.stdout
    assert PREFECT_AUTH not in deployed.stdout + deployed.stderr


def test_omni_run_and_lineage_take_the_credentials_from_the_environment(servers: Any, s3_env: str) -> None:
    prefect, mlflow, folder = servers
    pipeline = folder / "auth-pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({
        "name": "auth-pipeline", "store": str(folder / "store"), "tracking_uri": mlflow.url,
        "datasets": {"gsm8k": {"source": "fixtures://gsm8k?rows=8&seed=0", "converter": "gsm8k"}},
        "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["gsm8k"]}]}))
    env = {**prefect.client_env(), **mlflow.client_env(), "OMNI_CACHE_DIR": str(folder / "cache")}
    refused = omni("run", str(pipeline), env=env, drop=("MLFLOW_TRACKING_PASSWORD",))
    assert refused.returncode != 0 and "MLFLOW_TRACKING_PASSWORD" in refused.stderr, refused.stdout + refused.stderr
    ran = omni("run", str(pipeline), env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr

    from mlflow import MlflowClient

    os.environ.update(mlflow.client_env())  # the client reads them from the environment, as omni does
    try:
        client = MlflowClient(mlflow.url)
        experiment = client.get_experiment_by_name("auth-pipeline")
        runs = client.search_runs([experiment.experiment_id])
    finally:
        for name in mlflow.client_env():
            os.environ.pop(name, None)
    assert any(r.info.status == "FINISHED" for r in runs)
    for r in runs:  # no secret in what the runs record
        recorded = yaml.safe_dump({"params": r.data.params, "tags": r.data.tags})
        assert MLFLOW_PASSWORD not in recorded and PREFECT_AUTH.split(":")[1] not in recorded
        assert "testing" not in recorded  # the S3 keys
    pipeline_run = next(r for r in runs if r.info.status == "FINISHED" and "mlflow.parentRunId" not in r.data.tags)
    # with the credentials `omni lineage` reads the run (an ingest-only pipeline has no chain to trace)
    lineage = omni("lineage", pipeline_run.info.run_id, "--pipeline", str(pipeline), env=env)
    assert f"pipeline run {pipeline_run.info.run_id} (auth-pipeline) has no register" in lineage.stderr, \
        lineage.stdout + lineage.stderr
    no_creds = omni("lineage", pipeline_run.info.run_id, "--pipeline", str(pipeline), env=env,
                    drop=("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"))
    assert no_creds.returncode == 2 and "MLFLOW_TRACKING_USERNAME" in no_creds.stderr, no_creds.stdout + no_creds.stderr
