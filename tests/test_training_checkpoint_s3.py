"""A checkpoint upload that fails half-way (the S3-compatible server on 127.0.0.1 goes away mid-write)
leaves the previous checkpoint as the latest, and the run recovers once storage is back.

The moto server keeps its objects in memory, so it cannot be stopped without losing the earlier
checkpoint; instead the store's endpoint is a TCP proxy in front of it (tests/tcp_proxy.py) that goes
down (connections cut, new ones refused) right after the first object of global_step_4 is written,
and comes back 3 s later. What happened on the server is read from moto directly, not through the proxy.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from tcp_proxy import TcpProxy

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

OUTAGE_S = 3.0
DOWN_AFTER = "/checkpoints/global_step_4/"  # the write that is cut: the last (step-4) checkpoint
ROWS = 32

# A graded reward (the share of digits in the response), so that the updates depend on what was
# generated: an untrained tiny model scores 0 with the digits reward, whatever it writes.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    text = str(solution_str)
    return sum(ch.isdigit() for ch in text) / max(1, len(text))
'''


@pytest.fixture(scope="module")
def proxy(moto_server: str) -> Iterator[TcpProxy]:
    target = urlsplit(moto_server)
    with TcpProxy(target.hostname or "127.0.0.1", target.port or 80) as p:
        yield p


@pytest.fixture(scope="module")
def ray_cluster(proxy: TcpProxy, tiny_model_env: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Ray for this module; its workers (the stage's actors) reach S3 through the proxy."""
    if ray.is_initialized():  # left over by another module: its workers would not reach the proxy
        ray.shutdown()
    env = {"OMNI_S3_ENDPOINT_URL": proxy.url, "OMNI_CACHE_DIR": str(tiny_model_env),
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "OMP_NUM_THREADS": "1",
           "AWS_CONFIG_FILE": str(tmp_path_factory.mktemp("aws") / "none"),
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path_factory.mktemp("aws") / "none")}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            mp.delenv(var, raising=False)
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # the workers inherit this env
        try:
            yield
        finally:
            ray.shutdown()


def _stage(reward: Path) -> Any:
    from omni_core.config.models import RLStage

    return RLStage.model_validate({
        "name": "rl", "data": "digits", "model": "tiny://lm", "reward": {"name": f"{reward}:compute_score"},
        "trainer": {"total_steps": 4, "batch_size": 4}, "rollout": {"n": 4, "max_new_tokens": 8},
        "execution": {"mode": "sync", "async_reward": False, "retry_backoff_s": 1.0, "max_failures": 3},
        "checkpoint": {"save_freq": 2}})


def _run(stage: Any, root: str, **kw: Any) -> Any:
    from omni_core.data.digits import rotate_row
    from omni_core.storage import Store
    from omni_core.training.ray_stage import config_digest, rl_run_key
    from omni_core.training.runner import StageRun

    rows = [rotate_row(f"{i * 37 % 10000:04d}", "train", i) for i in range(ROWS)]
    return StageRun("p", stage, 0, Store(root), rows, "v1", rl_run_key(stage, 0, "v1"),
                    config_digest(stage, 0, "v1"), **kw)


def _objects(s3: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix`, read from moto itself (not through the proxy)."""
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]
    return {k[len(prefix):]: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _sha(manifest: dict[str, Any], path: str) -> str:
    return next(f["sha256"] for f in manifest["files"] if f["path"] == path)


@pytest.mark.usefixtures("ray_cluster")
def test_checkpoint_upload_cut_half_way_keeps_the_previous_checkpoint_and_the_run_recovers(
        proxy: TcpProxy, s3_client: Any, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        mlflow_db: Any) -> None:
    from omni_core.lineage import Tracker
    from omni_core.training.checkpoint import LATEST, MANIFEST, load_training_state, stage_prefix
    from omni_core.training.runner import StageRunner

    monkeypatch.setenv("OMNI_S3_ENDPOINT_URL", proxy.url)  # the driver's stores go through the proxy too
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    stage = _stage(reward)
    t0 = time.monotonic()
    messages: list[str] = []

    # The uninterrupted run (same seed, another prefix) runs beside the interrupted one (the actors'
    # start-up dominates); the interrupted one waits before its step 4 until it is done, so the outage
    # cannot touch it.
    clean = StageRunner(_run(stage, f"s3://{s3_bucket}/clean",
                             progress=lambda m: messages.append(f"{time.monotonic() - t0:5.1f} [clean] {m}")))
    expected: dict[str, Any] = {}
    clean_error: list[BaseException] = []
    clean_done = threading.Event()

    def run_clean() -> None:
        try:
            expected.update(clean.run())
        except BaseException as exc:  # reported by the asserts below
            clean_error.append(exc)
        finally:
            clean_done.set()

    clean_thread = threading.Thread(target=run_clean, name="clean-run", daemon=True)
    clean_thread.start()

    # The interrupted run: the proxy goes down when the request after the first global_step_4 PUT arrives
    # (so that PUT finished and nothing after it reached moto), and comes back OUTAGE_S later; while it
    # is down, what moto holds is looked at.
    first_put: list[str] = []
    while_down: dict[str, Any] = {}

    def look_while_down() -> None:
        while_down["latest"] = _objects(s3_client, s3_bucket, f"{root}/{LATEST}")
        while_down["step4"] = sorted(_objects(s3_client, s3_bucket, step4))

    def on_request(method: str, path: str) -> None:
        if proxy.outages:
            return
        if first_put:
            proxy.outage(OUTAGE_S, look_while_down)
        elif method == "PUT" and DOWN_AFTER in path and "/cut/" in path:
            first_put.append(unquote(path.split("?", 1)[0].split(DOWN_AFTER, 1)[1]))

    tracker = Tracker(mlflow_db(tmp_path / "mlflow.db"))
    mlflow_run_id = tracker.start_run("checkpoint-s3", run_name="rl", tags={})
    run = _run(stage, f"s3://{s3_bucket}/cut", tracker=tracker, mlflow_run_id=mlflow_run_id)
    root = f"cut/{stage_prefix(run.pipeline, run.run_key, stage.name)}"
    step4 = f"{root}/checkpoints/global_step_4/"
    failures = stage.execution.max_failures
    at_failure: dict[str, Any] = {}

    def progress(message: str) -> None:
        messages.append(f"{time.monotonic() - t0:5.1f} [cut] {message}")
        if f"restart 1/{failures}" in message:  # the driver saw the failed write; nothing restarted yet
            at_failure["latest"] = _objects(s3_client, s3_bucket, f"{root}/{LATEST}")
            at_failure["step4"] = sorted(_objects(s3_client, s3_bucket, step4))

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if step == 3:
            clean_done.wait(timeout=300)

    run.progress, run.on_step = progress, on_step
    proxy.on_request = on_request
    runner = StageRunner(run)
    try:
        manifest = runner.run()
    finally:
        proxy.on_request = None
        proxy.wait_up(OUTAGE_S + 5)
        clean_thread.join(timeout=300)
        print(f"{time.monotonic() - t0:.1f}s, {runner.recoveries} recoveries:\n" + "\n".join(messages))

    # the cut happened half-way through global_step_4: while the storage was away, and after the
    # trainer gave up on it, the previous checkpoint is the latest, and global_step_4 holds the one
    # file whose PUT finished before the cut, and no manifest
    assert first_put and proxy.outages == 1, proxy.requests
    assert while_down == {"latest": {"": b"2\n"}, "step4": first_put}
    assert at_failure == {"latest": {"": b"2\n"}, "step4": first_put}, messages
    assert any("storage error in an actor" in m and "global_step_4/" in m and f"restart 1/{failures}" in m
               for m in messages), messages
    assert any("[cut] stage rl: resuming at step 2/4" in m for m in messages), messages

    # it recovered, and trained exactly what the uninterrupted run trained
    assert runner.recoveries >= 1
    assert manifest["global_step"] == 4
    assert not clean_error, clean_error
    assert expected, "the uninterrupted run did not finish"
    assert clean.recoveries == 0 and expected["global_step"] == 4
    assert _sha(manifest, "state/policy.json") == _sha(expected, "state/policy.json")  # the policy is the weights
    assert _sha(manifest, manifest["weights"]) == _sha(expected, expected["weights"])
    step2 = json.loads(_objects(s3_client, s3_bucket, f"{root}/checkpoints/global_step_2/{MANIFEST}")[""])
    assert _sha(step2, step2["weights"]) != _sha(manifest, manifest["weights"])  # steps 3-4 trained

    # the leftovers of the failed attempt were replaced: global_step_4 holds exactly its manifest's
    # files, each matching its sha256, and is the latest; global_step_2 is still there (max_to_keep 2)
    objects = _objects(s3_client, s3_bucket, step4)
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    assert set(objects) == set(listed) | {MANIFEST}
    assert {p: hashlib.sha256(objects[p]).hexdigest() for p in listed} == listed
    assert json.loads(objects[MANIFEST])["files"] == manifest["files"]
    assert _objects(s3_client, s3_bucket, f"{root}/{LATEST}") == {"": b"4\n"}
    steps = {k.split("/", 1)[0] for k in _objects(s3_client, s3_bucket, f"{root}/checkpoints/")}
    assert steps == {"global_step_2", "global_step_4"}
    assert load_training_state(run.store, manifest).info["global_step"] == 4

    # the recovery is on the stage's MLflow run
    data = tracker.client.get_run(mlflow_run_id).data
    assert data.tags["omni.recoveries"] == str(runner.recoveries)
    assert "storage error" in data.tags["omni.recovery.1"] and "global_step_4/" in data.tags["omni.recovery.1"]
    history = tracker.client.get_metric_history(mlflow_run_id, "training/recoveries")
    assert sorted(m.value for m in history) == [float(i) for i in range(1, runner.recoveries + 1)]
