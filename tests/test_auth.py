"""Access control on the servers of the scaled-out deployment: a Prefect server with basic auth
(PREFECT_SERVER_API_AUTH_STRING), an `mlflow server --app-name basic-auth` and an S3 store checking
IAM access keys (moto with IAM auth on; MLflow's artifacts go there with the key it issued), all
real on 127.0.0.1. A request without credentials (or with wrong ones) is refused by each; `omni deploy`, `omni run` and
`omni lineage` take the credentials from the environment (PREFECT_API_AUTH_STRING,
MLFLOW_TRACKING_USERNAME / _PASSWORD) and, without them, say what to set. The secrets never reach
the runs' params or tags. (Ray's token auth: tests/test_ray_cluster.py.)"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from auth_servers import IamMoto, MlflowServer, PrefectServer, iam_moto, mlflow_server, prefect_server

ROOT = Path(__file__).resolve().parents[1]
PREFECT_AUTH = f"omni:{secrets.token_urlsafe(16)}"
MLFLOW_PASSWORD = secrets.token_urlsafe(18)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, mlflow_db: Any, prefect_db: Any) -> Any:
    folder = tmp_path_factory.mktemp("auth")
    started: list[Any] = []
    try:
        # side by side (each start is mostly a Python process importing its server): moto, Prefect,
        # MLflow; MLflow's artifact bucket is made once moto answers, before any request to MLflow
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(iam_moto, folder / "s3"),
                       pool.submit(prefect_server, folder / "prefect", f"sqlite+aiosqlite:///{prefect_db(folder / 'prefect.db')}",
                                   PREFECT_AUTH)]
            try:
                s3 = futures[0].result()
                futures.append(pool.submit(mlflow_server, folder / "mlflow", mlflow_db(folder / "mlflow.db"),
                                           "s3://auth-artifacts/ml", f"sqlite:///{folder / 'auth.db'}",
                                           MLFLOW_PASSWORD, s3.client_env()))
                s3.client().create_bucket(Bucket="auth-artifacts")
            finally:  # whatever started is stopped below, even when another failed
                started.extend(f.result() for f in futures if f.exception() is None)
            prefect, mlflow = futures[1].result(), futures[2].result()
        yield prefect, mlflow, folder, s3
    finally:
        for server in reversed(started):
            server.stop()


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


def test_s3_refuses_an_unsigned_or_wrongly_signed_request(servers: Any) -> None:
    from botocore.exceptions import ClientError

    s3: IamMoto = servers[3]
    s3.client().put_object(Bucket="auth-artifacts", Key="probe", Body=b"ok")
    assert s3.client().get_object(Bucket="auth-artifacts", Key="probe")["Body"].read() == b"ok"
    # unsigned: moto answers a GET 403 and a PUT or a listing 500 (its check finds no Authorization header)
    assert httpx.get(f"{s3.endpoint}/auth-artifacts/probe").status_code == 403
    assert httpx.put(f"{s3.endpoint}/auth-artifacts/unsigned", content=b"x").status_code in (403, 500)
    assert httpx.get(f"{s3.endpoint}/auth-artifacts").status_code in (403, 500)
    for keys, code in (({"secret": "wrong"}, "SignatureDoesNotMatch"),
                       ({"key_id": "testing", "secret": "testing"}, "InvalidAccessKeyId")):
        with pytest.raises(ClientError) as refused:
            s3.client(**keys).get_object(Bucket="auth-artifacts", Key="probe")
        assert refused.value.response["Error"]["Code"] == code
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket="auth-artifacts").get("Contents", [])]
    assert "unsigned" not in keys and "probe" in keys


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
    prefect, mlflow, folder, s3 = servers
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
    # the pipeline's config artifact went through the MLflow server to S3, signed with the server's IAM key
    assert s3.client().list_objects_v2(Bucket="auth-artifacts", Prefix="ml/").get("KeyCount", 0) > 0
    for r in runs:  # no secret in what the runs record
        recorded = yaml.safe_dump({"params": r.data.params, "tags": r.data.tags})
        assert MLFLOW_PASSWORD not in recorded and PREFECT_AUTH.split(":")[1] not in recorded
        assert "testing" not in recorded and s3.secret_access_key not in recorded  # the S3 keys
    pipeline_run = next(r for r in runs if r.info.status == "FINISHED" and "mlflow.parentRunId" not in r.data.tags)
    # with the credentials `omni lineage` reads the run (an ingest-only pipeline has no chain to trace)
    lineage = omni("lineage", pipeline_run.info.run_id, "--pipeline", str(pipeline), env=env)
    assert f"pipeline run {pipeline_run.info.run_id} (auth-pipeline) has no register" in lineage.stderr, \
        lineage.stdout + lineage.stderr
    no_creds = omni("lineage", pipeline_run.info.run_id, "--pipeline", str(pipeline), env=env,
                    drop=("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"))
    assert no_creds.returncode == 2 and "MLFLOW_TRACKING_USERNAME" in no_creds.stderr, no_creds.stdout + no_creds.stderr
