"""Shared pytest fixtures, and the order of the test modules.

`make test` runs the suite on pytest-xdist workers, a module at a time (`--dist loadfile`, set in
pyproject.toml): a module's fixtures (servers, pipelines run once for the module) stay in one worker
process. Session fixtures (the moto server, the shared Ray) are per worker; the tiny-model cache is
shared by all workers of a run (its entries are built in a temporary folder and renamed into place).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow_server import mlflow_server  # noqa: F401 - the fixture, one server per test process
from module_order import DurationRecorder, sort_items
from ports import free_port

# Every `omni run` / `omni ingest` a test starts (subprocesses inherit this) uses Prefect's temporary
# server, not omni's local server (flows/local_prefect.py), which would outlive the test (by its quiet period);
# tests/test_local_prefect.py tests that server and stops it, as does the embedded sweep
# (tests/test_concurrency.py), whose three runs share one.
os.environ.setdefault("OMNI_PREFECT_SERVER", "temporary")

# Every Ray the tests start (the shared one, each `omni run`'s local Ray, `ray start` nodes: they inherit
# this) starts its workers on demand: by default a raylet prestarts workers for a job's first driver, and
# the suite's stage actors and verl's job actors (another interpreter, a runtime env of their own) never
# used them (measured: 23 idle workers, ~21 CPU s of a suite run, ~13 of them in the verl module).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# ... and its log monitor lists the node's log files every 0.5 s instead of every 0.1 s (Ray's own
# back-off, which it otherwise keeps for nodes with 1,000 log files or more; new files' lines are
# still all forwarded). Measured on an idle `ray start --head`: 0.73 % of a core -> 0.37 %; the suite
# starts ~20 Rays.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
# ... and it collects no metrics for Prometheus and reports no usage statistics, which nothing here reads
# (measured on a local Ray with one actor: 3.15 -> 2.82 CPU s to start, 1.78 -> 1.59 CPU s a minute idle).
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# ---- order: the longest modules first (tests/module_order.py) ------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-module-durations", action="store_true",
                     help="write each module's test time to tests/module_durations.json (the start order)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--record-module-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "omni-module-durations")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    sort_items(items)


# ---- Prefect: one `prefect server` per test process, for the modules that need an API ---------


def _stop(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory, prefect_db: Callable[[Path], Path]) -> Iterator[dict[str, str]]:
    """A `prefect server start` (SQLite, 127.0.0.1, a free port, a temporary PREFECT_HOME) for the session
    (of this test process), shared by the modules that need a Prefect API but not the embedded default:
    one server start instead of a temporary server per `omni` command (~15 s each on a busy machine).
    Yields the environment that points a process at it (`prefect_client` points this process at it)."""
    import httpx

    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    server_env = {
        **os.environ, "PREFECT_HOME": str(home / "server-home"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{prefect_db(home / 'prefect.db')}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
        # the scheduler service makes the runs of active schedules (recently changed deployments
        # within ~5 s; this loop catches any other)
        "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "true", "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
    }
    server_env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=server_env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180  # slow on a busy machine
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prefect server exited with {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server did not answer on {url} within 180 s: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        client_home = home / "client-home"
        yield {"PREFECT_API_URL": url, "PREFECT_HOME": str(client_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "OMNI_CACHE_DIR": str(home / "omni-cache"), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def prefect_client(prefect_server: dict[str, str]) -> Iterator[Any]:
    """For one module, this process's Prefect settings pointed at `prefect_server` (flows called in the
    test process run against it, as `prefect.testing.utilities.prefect_test_harness` does for a
    temporary server of its own); yields a sync client. The log and event workers are drained at the
    module's end, so nothing of it is sent to the next module's API."""
    import prefect.context
    from prefect import get_client
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}), \
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
        try:
            yield get_client(sync_client=True)
        finally:
            with contextlib.suppress(RuntimeError):  # not started
                APILogWorker.drain_all()
            EventsWorker.drain_all()


# ---- S3: a moto server in a real subprocess ------------------------------------------------------


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL (``http://127.0.0.1:PORT``) of a moto S3 server running for the whole session."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"moto server exited with {proc.returncode}: {Path(log).read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"moto server did not answer on port {port} within 30 s")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_env(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Point omni's S3 settings at the moto server with dummy credentials; returns the endpoint URL.

    Subprocesses started during the test inherit these variables.
    """
    monkeypatch.setenv("OMNI_S3_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # never pick up the developer's own AWS config, profile or endpoint
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(var, raising=False)
    return moto_server


@pytest.fixture
def s3_client(s3_env: str):
    """A boto3 S3 client on the moto server (to create buckets or inspect what a test left)."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_env, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_client) -> str:
    """Name of a fresh, empty bucket on the moto server (env already set by ``s3_env``)."""
    name = f"omni-test-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


# ---- stores and caches for ingestion tests -------------------------------------------------------


@pytest.fixture
def omni_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private `$OMNI_CACHE_DIR` (generated fixtures, downloaded raw data) for one test."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    """An empty store: a local folder, then a prefix in a fresh bucket on the moto S3 server."""
    from omni_core.storage import Store

    if request.param == "local":
        return Store(str(tmp_path / "store"))
    bucket = request.getfixturevalue("s3_bucket")
    return Store(f"s3://{bucket}/omni")


# ---- MLflow: a migrated sqlite tracking database, copied for each fresh one ------------------------


@pytest.fixture(scope="session")
def mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], str]:
    """`mlflow_db(path)` puts an empty MLflow sqlite database at `path` and returns its tracking URI
    (`sqlite:///path`). The database is a copy of one created and migrated once per run (MLflow's
    ~50 schema migrations cost each fresh database ~1.2 CPU s and a few seconds on a busy machine); a
    copy is what MLflow itself would have created there. The first use by MLflow of a fresh database
    stays tested where it matters (tests/test_cli_ingest.py: a new user's first command)."""
    template = _run_folder(tmp_path_factory) / "mlflow-template.db"
    if not template.exists():  # built aside and renamed into place: the workers may race here
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        building = template.with_name(f"mlflow-template-{uuid.uuid4().hex}.db")
        # MLflow's `Default` experiment keeps its artifacts under the creator's cwd; here under the run's
        # temporary folder (omni logs to experiments of its own, with their own artifact location)
        SqlAlchemyStore(f"sqlite:///{building}", str(template.parent / "mlruns")).engine.dispose()
        os.replace(building, template)

    def fresh(path: Path) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"

    return fresh


@pytest.fixture(scope="session")
def prefect_db(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """`prefect_db(path)` puts an empty, migrated Prefect sqlite database at `path` (a server's
    `PREFECT_API_DATABASE_CONNECTION_URL`, or `PREFECT_HOME/prefect.db` for Prefect's temporary server)
    and returns `path`. A copy of one that `prefect server database upgrade` made once per run: a
    server on a fresh database runs Prefect's schema migrations first (measured: a temporary server
    ready in 10.4 CPU s on a fresh database, 3.9 on a copy). A fresh database's first start stays
    tested where it matters (tests/test_local_prefect.py: omni's local server, a new user's first run)."""
    import fcntl

    template = _run_folder(tmp_path_factory) / "prefect-template.db"
    # one worker builds it, the other waits (a build is ~7 CPU s, worth not doing twice)
    with open(template.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            home = template.with_name(f"prefect-template-{uuid.uuid4().hex}")
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
            result = subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                                    env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            os.replace(home / "prefect.db", template)  # the upgrade leaves no WAL behind: one file
            shutil.rmtree(home, ignore_errors=True)

    def fresh(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, path)
        return path

    return fresh


# ---- tiny models ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache the model and pipeline test modules share: each tiny model (and generated fixture) is
    built once per run. Under xdist it is the run's folder above the workers' own, shared by all of them:
    `tiny_model_dir` and the fixture generator build in a temporary folder and rename it into place, so
    a concurrent first use builds twice but never reads a half-written entry."""
    return _run_folder(tmp_path_factory) / "omni-model-cache"


def _run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary folder: under xdist the one above the workers' own, shared by all of them."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="module")
def model_cache_env(model_cache: Path) -> Iterator[Path]:
    """`$OMNI_CACHE_DIR` set to the shared model cache for one test module (no Ray: for a module that
    starts a Ray of its own, with settings the shared one lacks, after this is set)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(model_cache))
        yield model_cache


@pytest.fixture(scope="module")
def tiny_model_env(model_cache: Path) -> Iterator[Path]:
    """`$OMNI_CACHE_DIR` set to the shared model cache and torch on one thread (tiny tensors on a
    busy 2-core machine: more threads only add synchronisation), for one test module."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(model_cache))
        yield model_cache
    torch.set_num_threads(threads)


# ---- Ray: one local instance per test process, shared by the modules that need only "a Ray" ------

SHARED_RAY_CPUS = 4  # logical CPUs: room for a trainer, rollout and reward actors at once
_shared_ray: dict[str, str] = {}  # the GCS address of the Ray `shared_ray` started in this process


def _shared_ray_running() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().gcs_address == _shared_ray.get("address")


@pytest.fixture(scope="session")
def _shared_ray_session() -> Iterator[None]:
    """Shuts the shared Ray down at the end of the session (of this worker)."""
    yield
    if _shared_ray and _shared_ray_running():
        import ray

        ray.shutdown()


@pytest.fixture(scope="module")
def shared_ray(model_cache: Path, _shared_ray_session: None) -> Iterator[None]:
    """This test process's local Ray (`ray.init`, SHARED_RAY_CPUS logical CPUs), started once and kept
    for the next module: its raylet and workers got `$OMNI_CACHE_DIR` = the shared model cache, so the
    actors find the tiny models. A Ray someone else started in this process is shut down first. A module
    whose actors need other environment (an S3 endpoint, credentials) shuts this one down and starts its
    own; the next module that asks for this one starts it again. At the module's end, a Ray whose CPUs
    are not all free again (an actor a failed test left behind) is shut down, so no module inherits it."""
    import ray

    if ray.is_initialized() and not _shared_ray_running():
        ray.shutdown()
    if not ray.is_initialized():
        with pytest.MonkeyPatch.context() as mp:  # what the raylet, hence every worker, inherits
            mp.setenv("OMNI_CACHE_DIR", str(model_cache))
            ray.init(address="local", num_cpus=SHARED_RAY_CPUS, include_dashboard=False,
                     logging_level=logging.WARNING)  # "local": never join a Ray running on the machine
        _shared_ray["address"] = ray.get_runtime_context().gcs_address
    yield
    if not _shared_ray_running():
        return
    deadline = time.monotonic() + 20  # a finished stage's actors give their CPUs back asynchronously
    while ray.available_resources().get("CPU", 0) < SHARED_RAY_CPUS:
        if time.monotonic() > deadline:
            ray.shutdown()
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def pipeline_model_env(model_cache_env: Path, shared_ray: None) -> Path:
    """For a module that runs pipelines with rl stages: `$OMNI_CACHE_DIR` set to the shared model cache
    and the process's shared Ray running (started with that cache set, so the actors see it; a stage's
    `ensure_ray` finds it and starts none)."""
    return model_cache_env
