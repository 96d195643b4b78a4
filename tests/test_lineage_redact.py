"""Secrets never reach MLflow: what Tracker logs (run tags, tags, params, a dict artifact, a dataset
input) is redacted, checked in the bytes MLflow wrote (the sqlite database and every artifact file)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from omni_core.lineage import REDACTED, Tracker, is_secret_key, redact, redact_text


def _secret(label: str) -> str:
    return f"{label}{uuid.uuid4().hex}"  # distinctive: cannot appear in MLflow's files by chance


def test_tracker_keeps_secrets_out_of_the_sqlite_store_and_artifacts(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      mlflow_db: Callable[[Path], str]) -> None:
    env_secret = _secret("awsSecret")  # in the environment only: must be found wherever it is embedded
    session = _secret("awsSession")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env_secret)
    monkeypatch.setenv("AWS_SESSION_TOKEN", session)
    uri_password, uri_token, query_token, hf_token, dict_password = (
        _secret(x) for x in ("uriPass", "uriTok", "queryTok", "hfTok", "dictPass"))
    secrets = [env_secret, session, uri_password, uri_token, query_token, hf_token, dict_password]

    tracker = Tracker(mlflow_db(tmp_path / "mlflow" / "mlflow.db"))
    run_id = tracker.start_run("redact", run_name="rl", tags={
        "omni.store": f"s3://minio:{uri_password}@127.0.0.1:9000/bucket/omni",
        "omni.note": f"launched with AWS_SECRET_ACCESS_KEY={env_secret}"})
    tracker.set_tags(run_id, {"aws_secret_access_key": env_secret, "AWS_SESSION_TOKEN": session,
                              "omni.endpoint": f"https://ci:{uri_token}@mlflow.example.com",
                              "omni.run_key": "0123abcd"})
    tracker.log_params(run_id, {"hf_token": hf_token, "max_new_tokens": 32, "tokenizer": "tiny://lm",
                                "source": f"https://data.example.com/x.parquet?token={query_token}&split=train",
                                "dataset": "digits@7e1da902"})
    tracker.log_dict(run_id, {"store": f"s3://minio:{uri_password}@127.0.0.1:9000/bucket",
                              "credentials": {"user": "minio", "password": dict_password},
                              "env": {"AWS_SESSION_TOKEN": session}, "log": [f"signed with {env_secret}"],
                              "trainer": {"lr": 0.001, "max_new_tokens": 8}}, "config/pipeline.json")
    tracker.log_dataset_input(run_id, name="digits", digest="7e1da902ecfa1abe",
                              source_uri=f"s3://minio:{uri_password}@127.0.0.1:9000/bucket/datasets/digits/7e1",
                              raw_source_uri=f"hf://org/digits?token={query_token}",
                              schema=[{"name": "prompt", "type": "string"}],
                              profile={"note": f"key {env_secret}", "rows": 8}, context="training")
    tracker.end_run(run_id)

    # the bytes MLflow wrote: the database and everything in the artifact folder beside it
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert tmp_path / "mlflow" / "mlflow.db" in written
    assert any(p.name == "pipeline.json" for p in written)
    for path in written:
        data = path.read_bytes()
        leaked = [s for s in secrets if s.encode() in data]
        assert not leaked, f"{path} holds {leaked}"

    # and what was logged is still there, with the marker where the secret was
    run = tracker.client.get_run(run_id)
    tags, params = run.data.tags, run.data.params
    assert tags["omni.store"] == f"s3://minio:{REDACTED}@127.0.0.1:9000/bucket/omni"
    assert tags["omni.note"] == f"launched with AWS_SECRET_ACCESS_KEY={REDACTED}"
    assert tags["aws_secret_access_key"] == REDACTED and tags["AWS_SESSION_TOKEN"] == REDACTED
    assert tags["omni.endpoint"] == f"https://ci:{REDACTED}@mlflow.example.com"
    assert tags["omni.run_key"] == "0123abcd"  # not a secret: kept
    assert params == {"hf_token": REDACTED, "max_new_tokens": "32", "tokenizer": "tiny://lm",
                      "source": f"https://data.example.com/x.parquet?token={REDACTED}&split=train",
                      "dataset": "digits@7e1da902"}
    artifact = tracker.client.download_artifacts(run_id, "config/pipeline.json", str(tmp_path / "download"))
    logged = json.loads(Path(artifact).read_text())
    assert logged == {"store": f"s3://minio:{REDACTED}@127.0.0.1:9000/bucket",
                      "credentials": {"user": REDACTED, "password": REDACTED},
                      "env": {"AWS_SESSION_TOKEN": REDACTED}, "log": [f"signed with {REDACTED}"],
                      "trainer": {"lr": 0.001, "max_new_tokens": 8}}
    [dataset_input] = run.inputs.dataset_inputs
    source = json.loads(dataset_input.dataset.source)
    assert source == {"uri": f"s3://minio:{REDACTED}@127.0.0.1:9000/bucket/datasets/digits/7e1",
                      "raw_source_uri": f"hf://org/digits?token={REDACTED}"}
    assert json.loads(dataset_input.dataset.profile) == {"note": f"key {REDACTED}", "rows": 8}
    assert dataset_input.dataset.digest == "7e1da902ecfa1abe"


@pytest.mark.parametrize(("key", "secret"), [
    ("aws_secret_access_key", True), ("AWS_SESSION_TOKEN", True), ("hf_token", True), ("HF_TOKEN", True),
    ("MLFLOW_TRACKING_PASSWORD", True), ("apiKey", True), ("PREFECT_API_KEY", True), ("client_secret", True),
    ("X-Amz-Signature", True), ("credentials", True),
    ("max_new_tokens", False), ("tokenizer", False), ("run_key", False), ("omni.cache_key", False),
    ("aws_access_key_id", False), ("PWD", False), ("token_file", False), ("TOKENIZERS_PARALLELISM", False),
])
def test_which_keys_look_secret(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


def test_redact_text_and_structures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")  # too short to hunt for: ordinary words stay
    assert redact_text("https://ghp_tokenonly@github.com/org/repo") == f"https://{REDACTED}@github.com/org/repo"
    assert redact_text("hf://org/x with hf_abcdefghijklmnop") == f"hf://org/x with {REDACTED}"
    assert redact_text("omni run --password=hunter22 --lr 1") == f"omni run --password={REDACTED} --lr 1"
    assert redact_text("s3://bucket/key@v1 and http://host:8080/p?x=1") == "s3://bucket/key@v1 and http://host:8080/p?x=1"
    assert redact_text("integration testing") == "integration testing"
    assert redact({"token": None, "secret": 3, "password": "", "auth": {"kind": "basic"}}) == {
        "token": None, "secret": 3, "password": "", "auth": {"kind": REDACTED}}


def test_registry_versions_keep_secrets_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_db: Callable[[Path], str]) -> None:
    """The register stage writes the registry through the client directly: its version tags,
    description and source are redacted too."""
    from omni_core.pipeline.stages.register import create_version, ensure_registered_model

    env_secret, uri_password = _secret("awsSecret"), _secret("uriPass")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", env_secret)
    tracker = Tracker(mlflow_db(tmp_path / "mlflow.db"))
    run_id = tracker.start_run("redact", run_name="eval", tags={})
    ensure_registered_model(tracker.client, "m", f"pipeline-{env_secret}")
    checkpoint = f"s3://minio:{uri_password}@127.0.0.1:9000/bucket/ckpt/global_step_2"
    version = create_version(tracker, "m", None, checkpoint, run_id=run_id,
                             tags={"omni.checkpoint_uri": checkpoint, "aws_secret_access_key": env_secret,
                                   "omni.run_key": "0123abcd"},
                             description=f"{checkpoint} (val/reward_mean 0.5)")
    data = (tmp_path / "mlflow.db").read_bytes()
    assert env_secret.encode() not in data and uri_password.encode() not in data
    stored = tracker.client.get_model_version("m", version.version)
    assert stored.tags["omni.run_key"] == "0123abcd" and stored.tags["aws_secret_access_key"] == REDACTED
    assert stored.tags["omni.checkpoint_uri"].endswith("@127.0.0.1:9000/bucket/ckpt/global_step_2")
    assert REDACTED in stored.tags["omni.checkpoint_uri"] and REDACTED in stored.source
