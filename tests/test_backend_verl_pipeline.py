"""End to end with real verl: ingest GSM8K fixtures to an S3 store (moto) -> `sft` with `backend: verl`
on tiny://lm (3 steps, verl's SFT trainer on CPU as a Ray Job on a real `ray start --head`) -> `eval`
-> `register`, with a real MLflow server. Asserts verl's train/loss in our child run, the mirrored
checkpoints with manifests, verl's own Hugging Face weights committed as our checkpoint, and the
registered version's lineage down to the raw files.

The faults run the `pipeline` flow itself (`omni run` in a subprocess, Prefect's embedded API): the
trainer SIGKILLed once a step is mirrored and the shared path emptied, the flow's task retry resumes
from S3 to the same final weights as the uninterrupted run (one module-scoped run of the same stage
config serves both); and the flow-run process SIGTERMed (what Prefect's worker sends on cancel) while
the job runs stops the Ray Job."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient
from mlflow_server import mlflow_server  # noqa: F401 - fixture
from pipeline_runs import run_in_order
from test_backend_verl_job import ray_jobs  # noqa: F401 - fixture
from typer.testing import CliRunner
from verl_env import verl_python

from omni_core.backends.verl.job import STEP_LINE
from omni_core.config import validate_pipeline
from omni_core.storage import Store
from omni_core.training.checkpoint import LATEST, MANIFEST, checkpoint_steps, stage_prefix

pytestmark = pytest.mark.slow

GSM8K = {"gsm8k": {"source": "fixtures://gsm8k?rows=16&seed=7", "converter": "gsm8k"}}
TOTAL_STEPS = 3


def sft_stage(shared_dir: Path, **extra) -> dict:
    """The verl sft stage every run of this module trains (the same data, model, steps and seed, so the
    resumed run's weights can be compared with the uninterrupted run's); `extra`: keys that do not change
    the rendered command (`execution`'s retries, `name`/`after`) or, for the cancel test, the steps."""
    return {"name": "sft", "kind": "sft", "after": ["ingest"], "model": "tiny://lm", "data": "gsm8k:train",
            "trainer": {"total_steps": TOTAL_STEPS, "batch_size": 4, "lr": 1e-3},
            "checkpoint": {"save_freq": 1, "max_to_keep": None},
            "backend": {"name": "verl", "python": verl_python(), "shared_dir": str(shared_dir),
                        "device": "cpu", "overrides": ["data.max_length=512"]}, **extra}


@pytest.fixture(scope="module")
def verl_s3(moto_server, tmp_path_factory):
    """S3 (moto) settings for the whole module (the uninterrupted run is module-scoped) and a bucket."""
    import uuid

    import boto3

    home = tmp_path_factory.mktemp("verl-s3")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"OMNI_S3_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(home / "no-aws-config"),
                            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
                            "OMNI_CACHE_DIR": str(home / "cache")}.items():
            mp.setenv(name, value)
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            mp.delenv(var, raising=False)
        bucket = f"omni-verl-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield bucket


@pytest.fixture(scope="module")
def uninterrupted(ray_jobs, mlflow_server, verl_s3, tmp_path_factory):  # noqa: F811
    """ingest -> sft (verl) -> eval -> register, run once for the module without a fault."""
    store_uri = f"s3://{verl_s3}/store"
    config = validate_pipeline({
        "name": "verl-e2e", "store": store_uri, "tracking_uri": mlflow_server.url,
        "ray": {"address": ray_jobs.get_address()}, "datasets": GSM8K,
        "stages": [
            {"name": "ingest", "kind": "ingest", "datasets": ["gsm8k"]},
            sft_stage(tmp_path_factory.mktemp("verl-e2e") / "shared"),
            {"name": "eval", "kind": "eval", "after": ["sft"], "data": "gsm8k:test", "max_new_tokens": 8,
             "max_rows": 4, "samples": 2},
            {"name": "register", "kind": "register", "after": ["eval"], "model_name": "verl-e2e-sft"},
        ]})
    lines: list[str] = []
    run = run_in_order(config, progress=lines.append)
    return {"run": run, "lines": lines, "store_uri": store_uri}


def test_ingest_sft_on_verl_eval_register(uninterrupted, mlflow_server, ray_jobs):  # noqa: F811
    run, lines, store_uri = uninterrupted["run"], uninterrupted["lines"], uninterrupted["store_uri"]
    sft = run.outcomes["sft"]
    out = sft.outputs
    assert out["backend"] == "verl" and out["global_step"] == TOTAL_STEPS and not out["reused"]
    assert [f"stage sft: step {n} of 3" for n in (1, 2, 3)] == [ln for ln in lines if " of 3" in ln], \
        "\n".join(line for line in lines if line.startswith("stage sft"))

    client = MlflowClient(mlflow_server.url)
    losses = client.get_metric_history(sft.mlflow_run_id, "train/loss")
    assert sorted(m.step for m in losses) == [1, 2, 3]  # verl's own mlflow logger, in our child run
    tags = client.get_run(sft.mlflow_run_id).data.tags
    assert tags["omni.verl.version"] == "0.9.1"
    assert tags["omni.verl.submission_id"] == f"omni-verl-verl-e2e-sft-{out['run_key']}"
    assert "-m verl.trainer.sft_trainer" in tags["omni.verl.command"]
    artifacts = [a.path for a in client.list_artifacts(sft.mlflow_run_id, "verl")]
    assert "verl/command.json" in artifacts and any(p.endswith(".log") for p in artifacts)

    store = Store(store_uri)
    root = stage_prefix("verl-e2e", out["run_key"], "sft")
    assert checkpoint_steps(store, root) == {1: True, 2: True, 3: True}  # all mirrored, each with its manifest
    final = store.read_json(f"{root}/checkpoints/global_step_3/{MANIFEST}")
    assert final["source"] == "verl" and final["weights"] == "model.safetensors"
    paths = {f["path"] for f in final["files"]}
    assert {"model.safetensors", "config.json", "model_world_size_1_rank_0.pt"} <= paths
    # backend.hf_model: save (default): verl wrote the weights with its checkpoint, committed as they are,
    # and no merger job ran
    by_path = {f["path"]: f["sha256"] for f in final["files"]}
    assert by_path["model.safetensors"] == by_path["huggingface/model.safetensors"]
    assert not [j for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith(tags["omni.verl.submission_id"] + "-merge")]
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


# ---- the pipeline flow in a subprocess (`omni run`, Prefect's embedded API) ----------------------------


def _omni_run(workdir: Path, config: dict) -> tuple[subprocess.Popen, Path]:
    """`omni run` of `config` in its own session (its Prefect server child is cleaned up with it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "pipeline.yaml").write_text(yaml.safe_dump(config))
    out = workdir / "omni-run.log"
    env = {**os.environ, "PREFECT_HOME": str(workdir / "prefect"), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "pipeline.yaml"], cwd=workdir, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _end(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of its session (Prefect's server)


def _trainers(shared_dir: Path) -> list[psutil.Process]:
    """verl's trainer processes (torchrun's workers) of runs under `shared_dir`."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if "verl.trainer.sft_trainer" in cmd and "torch.distributed.run" not in cmd and str(shared_dir) in cmd:
            found.append(proc)
    return found


def _kill_after_mirrored(store: Store, pipeline: str, shared_dir: Path, step: int, seen: dict,
                         stop: threading.Event) -> None:
    """Once verl's latest file names `step`: SIGSTOP the trainer (so it cannot finish meanwhile); once the
    store shows the step mirrored: SIGKILL it and empty the shared path (a new cluster), so the retry
    has to restore the checkpoint from S3."""
    frozen: list[psutil.Process] = []
    while not stop.is_set():
        if not frozen:
            for latest_file in shared_dir.glob(f"runs/{pipeline}/*/sft/{LATEST}"):
                text = latest_file.read_text().strip()
                if text.isdigit() and int(text) >= step:
                    frozen = _trainers(shared_dir)
                    for proc in frozen:
                        proc.send_signal(signal.SIGSTOP)
        else:
            latest = [k for k in store.list(f"runs/{pipeline}") if k.endswith(f"/sft/{LATEST}")]
            if latest and int(store.read_text(latest[0]).strip()) >= step:
                seen["mirrored"] = int(store.read_text(latest[0]).strip())
                seen["root"] = latest[0].rsplit("/", 1)[0]
                for proc in frozen:
                    proc.send_signal(signal.SIGKILL)
                psutil.wait_procs(frozen, timeout=30)
                shutil.rmtree(shared_dir, ignore_errors=True)
                seen["killed"] = True
                return
        time.sleep(0.05)


def test_a_killed_trainer_is_retried_by_the_flow_and_resumes_from_s3_to_the_same_weights(
        uninterrupted, ray_jobs, mlflow_server, verl_s3, tmp_path):  # noqa: F811
    """The stage runs inside the `pipeline` flow (`omni run`): its trainer is paused once it saved step 1
    and SIGKILLed once that step is mirrored to S3, and the shared path is deleted; the flow's task retry (`execution.max_failures: 1`)
    resubmits `-attempt-2`, which restores the mirrored checkpoint from S3 and resumes with verl's
    resume_mode=auto. The final merged weights are byte-identical to the uninterrupted run's: verl's SFT
    on CPU is deterministic here (one rank, gloo, the same staged model, verl's DistributedSampler
    shuffling with its fixed seed 0 and the epoch, and the restored optimizer state, lr scheduler and
    data cursor carry the run on exactly)."""
    store_uri = f"s3://{verl_s3}/store"
    shared = tmp_path / "shared"
    config = {"name": "verl-fault", "store": store_uri, "tracking_uri": mlflow_server.url,
              "ray": {"address": ray_jobs.get_address()}, "datasets": GSM8K,
              "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["gsm8k"]},
                         sft_stage(shared, execution={"max_failures": 1, "retry_backoff_s": 1.0})]}
    store = Store(store_uri)
    seen: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_after_mirrored, args=(store, "verl-fault", shared, 1, seen, stop),
                              daemon=True)
    killer.start()
    proc, out = _omni_run(tmp_path / "run", config)
    try:
        code = _end(proc, timeout=600)
    finally:
        stop.set()
    log = out.read_text()
    assert seen.get("killed"), f"the trainer was never killed:\n{log[-3000:]}"
    assert code == 0, log[-4000:]
    mirrored, root = seen["mirrored"], seen["root"]
    assert "stage sft: verl resumes from global_step_" in log, log[-4000:]
    resumed = int(log.split("stage sft: verl resumes from global_step_")[1].split()[0])
    assert resumed >= mirrored  # restored from the mirror (the shared path was empty)

    run_key = root.split("/")[2]
    attempt2 = f"omni-verl-verl-fault-sft-{run_key}-attempt-2"
    client = MlflowClient(mlflow_server.url)
    [retried] = client.search_runs([client.get_experiment_by_name("verl-fault").experiment_id],
                                   f"tags.`omni.verl.submission_id` = '{attempt2}'")
    local = client.download_artifacts(retried.info.run_id, f"verl/{attempt2}.log", str(tmp_path))
    steps = [int(s) for s in STEP_LINE.findall(Path(local).read_text())]
    assert steps and min(steps) == resumed + 1 and max(steps) == TOTAL_STEPS  # resumed, not restarted

    # the restored optimizer state and data cursor are the mirrored bytes (restore checks every sha256)
    restored = store.read_json(f"{root}/checkpoints/global_step_{resumed}/{MANIFEST}")
    by_path = {f["path"]: f["sha256"] for f in restored["files"]}
    from omni_core.storage import file_digest

    run_dir = shared / "runs" / "verl-fault" / run_key / "sft"
    for name in ("optim_world_size_1_rank_0.pt", "data_0.pt"):
        assert file_digest(run_dir / f"global_step_{resumed}" / name)[1] == by_path[name]
    # ... and the final weights are the uninterrupted run's, byte for byte
    final = store.read_json(f"{root}/checkpoints/global_step_{TOTAL_STEPS}/{MANIFEST}")
    weights = next(f["sha256"] for f in final["files"] if f["path"] == "model.safetensors")
    assert weights == uninterrupted["run"].outcomes["sft"].outputs["weights_sha256"]


def test_cancelling_the_flow_run_stops_the_ray_job(ray_jobs, mlflow_server, verl_s3, tmp_path):  # noqa: F811
    """Prefect's process worker cancels a flow run by SIGTERM to the flow-run process (its runner's
    graceful kill); Prefect's flow engine turns it into TerminationSignal in the flow's thread, while
    the stage follows its job in a task thread. The flow stops the Ray Job and waits for STOPPED before
    the process goes; the trainer is gone with it."""
    shared = tmp_path / "shared"
    config = {"name": "verl-cancel", "store": f"s3://{verl_s3}/store", "tracking_uri": mlflow_server.url,
              "ray": {"address": ray_jobs.get_address()}, "datasets": GSM8K,
              "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["gsm8k"]},
                         {**sft_stage(shared), "trainer": {"total_steps": 500, "batch_size": 4, "lr": 1e-3}}]}
    proc, out = _omni_run(tmp_path / "run", config)
    try:
        deadline = time.monotonic() + 400
        while not _trainers(shared):
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.2)
        [job] = [j for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith("omni-verl-verl-cancel-sft-")]
        assert ray_jobs.get_job_status(job.submission_id).value == "RUNNING"
        trainers = _trainers(shared)
        proc.send_signal(signal.SIGTERM)  # what Prefect's worker sends the flow-run process on cancel
        code = proc.wait(timeout=120)
    finally:
        _end(proc, timeout=0)
    log = out.read_text()
    assert code != 0, log[-3000:]
    assert ray_jobs.get_job_status(job.submission_id).value == "STOPPED", log[-3000:]  # before the process went
    gone, alive = psutil.wait_procs(trainers, timeout=30)
    assert not alive and not _trainers(shared)
