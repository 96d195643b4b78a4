"""A real `mlflow server` for tests: SQLite backend store in a temp folder, artifacts proxied to a bucket
on the moto S3 server (`--serve-artifacts --artifacts-destination s3://BUCKET/mlartifacts`).

The fixture is conftest.py's (imported there, so each test process starts one server for all its
modules: each module names its own experiments and models); it needs the session's `moto_server`. It
yields an `MlflowServer` (URL, bucket, moto endpoint); the server is stopped at the session's end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ports import free_port

STARTUP_TIMEOUT_S = 120  # a cold start (imports, database migrations) on a busy 2-core machine


@dataclass(frozen=True)
class MlflowServer:
    url: str  # the tracking URI: http://127.0.0.1:PORT
    bucket: str  # artifacts go to s3://{bucket}/mlartifacts
    s3_endpoint: str  # the moto server
    backend_store_uri: str
    log: Path

    @property
    def artifacts_destination(self) -> str:
        return f"s3://{self.bucket}/mlartifacts"


def s3_environment(endpoint: str) -> dict[str, str]:
    """Dummy credentials and the moto endpoint, for boto3 in the server (MLflow) and in omni (stores)."""
    return {"MLFLOW_S3_ENDPOINT_URL": endpoint, "OMNI_S3_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker processes (own session)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def mlflow_server(moto_server: str, tmp_path_factory: pytest.TempPathFactory,
                  mlflow_db: Callable[[Path], str]) -> Iterator[MlflowServer]:
    import boto3

    folder = tmp_path_factory.mktemp("mlflow-server")
    bucket = f"mlflow-{uuid.uuid4().hex[:12]}"
    s3_env = s3_environment(moto_server)
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    port = free_port()
    backend = mlflow_db(folder / "mlflow.db")  # migrated already: the server starts sooner
    env = {**os.environ, **s3_env, "AWS_CONFIG_FILE": str(folder / "no-aws-config"),
           "AWS_SHARED_CREDENTIALS_FILE": str(folder / "no-aws-credentials"),
           # MLflow's job runner (a huey consumer per job queue, for GenAI jobs we never submit) would
           # start ~5 extra processes per server
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    server = MlflowServer(f"http://127.0.0.1:{port}", bucket, moto_server, backend, folder / "server.log")
    with open(server.log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", backend, "--serve-artifacts", "--artifacts-destination",
             server.artifacts_destination],
            cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(server.url):
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}: {server.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer {server.url}/health within {STARTUP_TIMEOUT_S} s: "
                            f"{server.log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield server
    finally:
        _stop(proc)


@contextlib.contextmanager
def ui_server(backend_store_uri: str, folder: Path) -> Iterator[str]:
    """`mlflow server` on an existing backend store (artifacts where its runs logged them: local
    folders), for looking at a pipeline's runs in the UI; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    log = folder / "mlflow-ui.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", backend_store_uri],
            cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server on {backend_store_uri} did not start: {log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        _stop(proc)
