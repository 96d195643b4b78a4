"""Shared pytest fixtures."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# ---- S3: a moto server in a real subprocess ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Endpoint URL (``http://127.0.0.1:PORT``) of a moto S3 server running for the whole session."""
    port = _free_port()
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


# ---- tiny models ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session-wide cache the model test files share: each tiny model is built once."""
    return tmp_path_factory.getbasetemp() / "omni-model-cache"


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


@pytest.fixture(scope="module")
def pipeline_model_env(model_cache: Path) -> Iterator[Path]:
    """For a module that runs pipelines with rl stages: `$OMNI_CACHE_DIR` set to the shared model cache
    before Ray starts (so the actors see it), and a Ray the module started shut down afterwards."""
    import ray

    started = not ray.is_initialized()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(model_cache))
        yield model_cache
    if started and ray.is_initialized():
        ray.shutdown()
