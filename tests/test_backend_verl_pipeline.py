"""End to end with real verl: ingest GSM8K fixtures to an S3 store (moto) -> `sft` with `backend: verl`
on tiny://lm (2 steps, verl's SFT trainer on CPU as a Ray Job on a real `ray start --head`) -> `eval`
-> `register`, with a real MLflow server. Asserts verl's train/loss in our child run, the mirrored
checkpoints with manifests, the merged Hugging Face weights committed as our checkpoint, and the
registered version's lineage down to the raw files."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time

import psutil
import pytest
from mlflow import MlflowClient
from mlflow_server import mlflow_server  # noqa: F401 - fixture
from pipeline_runs import run_in_order
from test_backend_verl_cpu import CPU_ENV, CPU_OVERRIDES
from test_backend_verl_job import ray_jobs  # noqa: F401 - fixture
from typer.testing import CliRunner
from verl_env import verl_python

from omni_core.backends.verl.job import STEP_LINE
from omni_core.config import validate_pipeline
from omni_core.storage import Store
from omni_core.training.checkpoint import MANIFEST, checkpoint_steps, stage_prefix

pytestmark = pytest.mark.slow


def test_ingest_sft_on_verl_eval_register(ray_jobs, mlflow_server, s3_env, s3_bucket, tmp_path, omni_cache):  # noqa: F811
    store_uri = f"s3://{s3_bucket}/store"
    config = validate_pipeline({
        "name": "verl-e2e", "store": store_uri, "tracking_uri": mlflow_server.url,
        "ray": {"address": ray_jobs.get_address()},
        "datasets": {"gsm8k": {"source": "fixtures://gsm8k?rows=16&seed=7", "converter": "gsm8k"}},
        "stages": [
            {"name": "ingest", "kind": "ingest", "datasets": ["gsm8k"]},
            {"name": "sft", "kind": "sft", "after": ["ingest"], "model": "tiny://lm", "data": "gsm8k:train",
             "trainer": {"total_steps": 2, "batch_size": 4, "lr": 1e-3}, "checkpoint": {"save_freq": 1},
             "backend": {"name": "verl", "python": verl_python(), "shared_dir": str(tmp_path / "shared"),
                         "overrides": [*CPU_OVERRIDES, "data.max_length=512"], "env": CPU_ENV,
                         "entrypoint_resources": {"entrypoint_num_cpus": 1}}},
            {"name": "eval", "kind": "eval", "after": ["sft"], "data": "gsm8k:test", "max_new_tokens": 8,
             "max_rows": 4, "samples": 2},
            {"name": "register", "kind": "register", "after": ["eval"], "model_name": "verl-e2e-sft"},
        ]})
    lines: list[str] = []
    run = run_in_order(config, progress=lines.append)
    sft = run.outcomes["sft"]
    out = sft.outputs
    assert out["backend"] == "verl" and out["global_step"] == 2 and not out["reused"]
    assert "stage sft: step 1 of 2" in lines and "stage sft: step 2 of 2" in lines, \
        "\n".join(line for line in lines if line.startswith("stage sft"))

    client = MlflowClient(mlflow_server.url)
    losses = client.get_metric_history(sft.mlflow_run_id, "train/loss")
    assert sorted(m.step for m in losses) == [1, 2]  # verl's own mlflow logger, in our child run
    tags = client.get_run(sft.mlflow_run_id).data.tags
    assert tags["omni.verl.version"] == "0.9.1"
    assert tags["omni.verl.submission_id"] == f"omni-verl-verl-e2e-sft-{out['run_key']}"
    assert "-m verl.trainer.sft_trainer" in tags["omni.verl.command"]
    artifacts = [a.path for a in client.list_artifacts(sft.mlflow_run_id, "verl")]
    assert "verl/command.json" in artifacts and any(p.endswith(".log") for p in artifacts)

    store = Store(store_uri)
    root = stage_prefix("verl-e2e", out["run_key"], "sft")
    assert checkpoint_steps(store, root) == {1: True, 2: True}  # both mirrored, each with its manifest
    final = store.read_json(f"{root}/checkpoints/global_step_2/{MANIFEST}")
    assert final["source"] == "verl" and final["weights"] == "model.safetensors"
    paths = {f["path"] for f in final["files"]}
    assert {"model.safetensors", "config.json", "model_world_size_1_rank_0.pt"} <= paths
    assert out["weights_sha256"] == next(f["sha256"] for f in final["files"] if f["path"] == "model.safetensors")
    assert out["checkpoint_uri"] == final["uri"]

    evaluated = run.outcomes["eval"].outputs
    assert evaluated["weights_sha256"] == out["weights_sha256"] and "val/reward_mean" in evaluated["metrics"]

    from flows.cli import app

    chain = CliRunner().invoke(app, ["lineage", "models:/verl-e2e-sft@candidate", "--json", "--tracking-uri",
                                     mlflow_server.url, "--store", store_uri])
    assert chain.exit_code == 0, (chain.output, chain.exception)
    lineage = json.loads(chain.stdout)
    assert lineage["checkpoint"]["uri"] == final["uri"] and lineage["checkpoint"]["sha256"] == out["weights_sha256"]
    assert lineage["checkpoint"]["store_check"]["status"] == "ok"
    [training] = lineage["training"]
    assert training["run_id"] == sft.mlflow_run_id and training["algorithm"] == "sft"
    [dataset] = lineage["datasets"]
    manifest = store.read_json(f"datasets/gsm8k/{dataset['version']}/_manifest.json")
    assert dataset["raw_source_uri"] == "fixtures://gsm8k?rows=16&seed=7"
    assert dataset["raw_files"] == [{"path": f["path"], "sha256": f["sha256"]} for f in manifest["raw_files"]]
    assert dataset["raw_files"]


# ---- the fault: the trainer SIGKILLed, the shared path emptied, the retry resumes from S3 ---------------


def _kill_trainer_after(run_dir, step: int, killed: list[int], stop: threading.Event) -> None:
    """SIGKILL verl's trainer process (torchrun's worker) once verl's latest file names `step`."""
    latest = run_dir / "latest_checkpointed_iteration.txt"
    while not stop.is_set():
        if latest.is_file() and (text := latest.read_text().strip()) and int(text) >= step:
            for proc in psutil.process_iter(["cmdline"]):
                cmd = " ".join(proc.info["cmdline"] or ())
                if "verl.trainer.sft_trainer" in cmd and "torch.distributed.run" not in cmd and str(run_dir) in cmd:
                    proc.send_signal(signal.SIGKILL)
                    killed.append(int(text))
            if killed:
                return
        time.sleep(0.05)


def test_a_killed_trainer_is_resubmitted_and_resumes_from_the_mirror(
        ray_jobs, mlflow_server, s3_env, s3_bucket, tmp_path, omni_cache):  # noqa: F811
    from omni_core.backends.verl import mirror
    from omni_core.backends.verl.runner import VerlJobError, run_verl_stage
    from omni_core.config import DatasetConfig
    from omni_core.data import ingest
    from omni_core.lineage import Tracker
    from omni_core.storage import file_digest

    store = Store(f"s3://{s3_bucket}/store")
    dv = ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=16&seed=7", converter="gsm8k"),
                progress=lambda _: None)
    config = validate_pipeline({
        "name": "verl-fault", "store": f"s3://{s3_bucket}/store", "ray": {"address": ray_jobs.get_address()},
        "datasets": {"gsm8k": {"source": "fixtures://gsm8k?rows=16&seed=7", "converter": "gsm8k"}},
        "stages": [{"name": "sft", "kind": "sft", "model": "tiny://lm", "data": "gsm8k:train",
                    "trainer": {"total_steps": 3, "batch_size": 4, "lr": 1e-3},
                    "checkpoint": {"save_freq": 1, "max_to_keep": None},
                    "backend": {"name": "verl", "python": verl_python(), "shared_dir": str(tmp_path / "shared"),
                                "overrides": [*CPU_OVERRIDES, "data.max_length=512"], "env": CPU_ENV,
                                "entrypoint_resources": {"entrypoint_num_cpus": 1}}}]})
    stage = config.stage("sft")
    tracker = Tracker(mlflow_server.url)
    run_id = tracker.start_run("verl-fault", "sft", {})
    lines: list[str] = []
    kw = dict(pipeline="verl-fault", stage=stage, seed=0, store=store, dataset="gsm8k", version=dv.version,
              split="train", run_key="k1", ray_address=ray_jobs.get_address(), tracking_uri=mlflow_server.url,
              mlflow_run_id=run_id, tracker=tracker, progress=lines.append, log_dir=tmp_path / "logs", poll_s=0.5)
    run_dir = stage.backend.run_dir("verl-fault", "k1", "sft")
    root = stage_prefix("verl-fault", "k1", "sft")

    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_trainer_after, args=(run_dir, 1, killed, stop), daemon=True)
    killer.start()
    try:
        with pytest.raises(VerlJobError, match="ended FAILED"):
            run_verl_stage(**kw)
    finally:
        stop.set()
    assert killed, "the trainer was never killed"
    mirrored = mirror.mirrored_latest(store, root)
    assert mirrored is not None and mirrored >= killed[0]  # mirrored before the kill was noticed
    shutil.rmtree(stage.backend.shared_dir)  # a new cluster: nothing on the shared path

    result = run_verl_stage(**kw)  # the stage's retry
    assert f"stage sft: verl resumes from global_step_{mirrored}" in lines
    assert result["global_step"] == 3 and result["submission_id"] == "omni-verl-verl-fault-sft-k1-attempt-2"
    second = (tmp_path / "logs" / "omni-verl-verl-fault-sft-k1-attempt-2.log").read_text()
    steps = [int(s) for s in STEP_LINE.findall(second)]
    assert steps and min(steps) == mirrored + 1 and max(steps) == 3  # resumed, not restarted from step 0
    # the restored optimizer state and data cursor are the mirrored bytes (restore checks every sha256)
    restored = store.read_json(f"{root}/checkpoints/global_step_{mirrored}/{MANIFEST}")
    by_path = {f["path"]: f["sha256"] for f in restored["files"]}
    for name in ("optim_world_size_1_rank_0.pt", "data_0.pt"):
        assert file_digest(run_dir / f"global_step_{mirrored}" / name)[1] == by_path[name]
    losses = MlflowClient(mlflow_server.url).get_metric_history(run_id, "train/loss")
    assert {m.step for m in losses} >= {1, 2, 3}
