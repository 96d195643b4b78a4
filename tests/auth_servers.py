"""Real servers with access control on, for tests: `prefect server start` with basic auth
(PREFECT_SERVER_API_AUTH_STRING) and `mlflow server --app-name basic-auth` (admin user from
MLFLOW_AUTH_ADMIN_USERNAME / _PASSWORD, its user store beside the backend), and moto as an S3 server
with IAM authentication on (`iam_moto`: only requests signed with the IAM access key it issued pass). Each runs in its own
process group on 127.0.0.1 and a free port; the database URL is the caller's (SQLite or Postgres).
`client_env()` of each is what a client (`omni`, `prefect`, a training job) needs: the credentials
come from the environment, as they do for a user."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from mlflow_server import s3_environment
from ports import free_port

BIN = Path(sys.executable).parent


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_until(check, proc: subprocess.Popen, log: Path, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout:.0f} s: {log.read_text()[-3000:]}")
        time.sleep(0.5)


@dataclass
class PrefectServer:
    url: str  # .../api
    auth: str  # "user:password"
    home: Path
    db_url: str
    proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.home / "server.log"

    def start(self, extra_env: dict[str, str] | None = None) -> PrefectServer:
        env = {**os.environ, "PREFECT_HOME": str(self.home / "server-home"),
               "PREFECT_API_DATABASE_CONNECTION_URL": self.db_url, "PREFECT_SERVER_API_AUTH_STRING": self.auth,
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false", **(extra_env or {})}
        env.pop("PREFECT_API_URL", None)
        port = self.url.split(":")[2].split("/")[0]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                          "--port", port], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        wait_until(lambda: httpx.get(f"{self.url}/health", timeout=2).status_code == 200, self.proc, self.log,
                   "prefect server")
        return self

    def client_env(self) -> dict[str, str]:
        return {"PREFECT_API_URL": self.url, "PREFECT_API_AUTH_STRING": self.auth,
                "PREFECT_HOME": str(self.home / "client-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def prefect_server(home: Path, db_url: str, auth: str, extra_env: dict[str, str] | None = None) -> PrefectServer:
    """`extra_env`: more of the server's settings (its UI's, as the compose stack sets them)."""
    home.mkdir(parents=True, exist_ok=True)
    return PrefectServer(f"http://127.0.0.1:{free_port()}/api", auth, home, db_url).start(extra_env)


@dataclass
class MlflowServer:
    url: str
    username: str
    password: str
    folder: Path
    backend: str
    artifacts: str  # s3://BUCKET/PREFIX
    auth_db: str
    s3_env: dict[str, str]
    secret_key: str = "csrf-key-for-tests"
    # uvicorn processes: MLflow's default is 4; on a 2-core host one answered a pipeline's sequential
    # requests faster than four (bench/RESULTS.md, "Scaled-out stack vs embedded default")
    workers: int = 1
    proc: subprocess.Popen | None = None

    @property
    def log(self) -> Path:
        return self.folder / "server.log"

    def start(self) -> MlflowServer:
        ini = self.folder / "basic_auth.ini"  # no secret in it: the admin password comes from the environment
        ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = {self.auth_db}\n"
                       "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                       "auth_cache_ttl_seconds = 300\n")  # else each request re-hashes the password (~1 s a request)
        env = {**os.environ, **self.s3_env, "MLFLOW_AUTH_CONFIG_PATH": str(ini),
               "MLFLOW_AUTH_ADMIN_USERNAME": self.username, "MLFLOW_AUTH_ADMIN_PASSWORD": self.password,
               "MLFLOW_FLASK_SERVER_SECRET_KEY": self.secret_key,
               "AWS_CONFIG_FILE": str(self.folder / "no-aws-config"),
               "AWS_SHARED_CREDENTIALS_FILE": str(self.folder / "no-aws-credentials"),
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no GenAI job runner (~5 processes)
        for var in ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
            env.pop(var, None)
        port = self.url.rsplit(":", 1)[1]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--host", "127.0.0.1",
                 "--port", port, "--workers", str(self.workers), "--backend-store-uri", self.backend, "--serve-artifacts",
                 "--artifacts-destination", self.artifacts],
                cwd=self.folder, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: httpx.get(f"{self.url}/health", timeout=2).status_code == 200, self.proc, self.log,
                   "mlflow server")
        return self

    def client_env(self) -> dict[str, str]:
        return {"MLFLOW_TRACKING_USERNAME": self.username, "MLFLOW_TRACKING_PASSWORD": self.password}

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def mlflow_server(folder: Path, backend: str, artifacts: str, auth_db: str, password: str,
                  s3_env: dict[str, str]) -> MlflowServer:
    folder.mkdir(parents=True, exist_ok=True)
    return MlflowServer(f"http://127.0.0.1:{free_port()}", "admin", password, folder, backend, artifacts, auth_db,
                        s3_env).start()


@dataclass
class IamMoto:
    """moto in server mode checking every request against its IAM users' access keys, as S3 does."""
    endpoint: str
    access_key_id: str
    secret_access_key: str
    log: Path
    proc: subprocess.Popen

    def client_env(self) -> dict[str, str]:
        """What a client of the store needs: the endpoint and the IAM key (the servers' and omni's boto3)."""
        return {**s3_environment(self.endpoint), "AWS_ACCESS_KEY_ID": self.access_key_id,
                "AWS_SECRET_ACCESS_KEY": self.secret_access_key}

    def client(self, service: str = "s3", **keys: str) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=keys.get("key_id", self.access_key_id),
                            aws_secret_access_key=keys.get("secret", self.secret_access_key),
                            config=Config(retries={"max_attempts": 1}))

    def stop(self) -> None:
        stop(self.proc)


# moto lets the first INITIAL_NO_AUTH_ACTION_COUNT AWS requests through unchecked (moto/settings.py,
# moto/core/authorization.py): here the three IAM calls that create the store's user, its access key
# and its s3:* policy. Every later request must carry a SigV4 signature of that key: an unsigned one,
# an unknown key or a wrong secret is refused.
_BOOTSTRAP_REQUESTS = 3
_S3_POLICY = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'


def iam_moto(folder: Path, user: str = "omni-store") -> IamMoto:
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "moto.log"
    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_BOOTSTRAP_REQUESTS)}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:  # moto's own API is no AWS action: polling it does not use up the unchecked requests
        wait_until(lambda: httpx.get(f"{endpoint}/moto-api/data.json", timeout=2).status_code == 200, proc, log,
                   "moto server", timeout=60)
        bootstrap = IamMoto(endpoint, "bootstrap", "bootstrap", log, proc).client("iam")
        bootstrap.create_user(UserName=user)
        key = bootstrap.create_access_key(UserName=user)["AccessKey"]
        bootstrap.put_user_policy(UserName=user, PolicyName="s3-all", PolicyDocument=_S3_POLICY)
    except BaseException:
        stop(proc)
        raise
    return IamMoto(endpoint, key["AccessKeyId"], key["SecretAccessKey"], log, proc)
