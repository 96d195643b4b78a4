"""The verl command as a Ray Job on a real `ray start --head` (127.0.0.1, its own temp dir): the job's
python is the verl environment; the log is tailed into progress ("step N of M") and a file; each new
checkpoint is mirrored into the store while the job runs; verl logs into our MLflow run through the
runtime env; a resubmission finds the finished job, and one after a stopped job is `-attempt-2`; a
Ctrl-C while following stops the job."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from test_backend_verl_cpu import CPU_ENV, CPU_OVERRIDES
from verl_env import verl_python

from omni_core.backends.verl import VerlBackend, VerlCommand, VerlTraining, render
from omni_core.backends.verl.export import export_dataset, stage_model
from omni_core.backends.verl.job import (
    describe_env,
    entrypoint_resources,
    follow,
    runtime_env,
    stop,
    submission_id,
    submit,
)
from omni_core.backends.verl.mirror import mirror_new
from omni_core.config import DatasetConfig
from omni_core.data import ingest
from omni_core.storage import Store
from omni_core.training.checkpoint import checkpoint_steps

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_jobs():
    """A JobSubmissionClient on a `ray start --head --block` of our own (own temp dir, process group)."""
    import psutil
    from ray.job_submission import JobSubmissionClient

    temp = tempfile.mkdtemp(prefix="rv", dir="/tmp")  # short: Ray's socket paths live under it
    dashboard = _free_port()
    head_log = open(Path(temp) / "head.log", "wb")  # noqa: SIM115 - closed with the head below
    head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                             f"--port={_free_port()}", "--num-cpus=2", "--node-ip-address=127.0.0.1",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--include-dashboard=true",
                             # the agents' default ports (52365, ...) are taken when another head runs
                             f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
                             f"--runtime-env-agent-port={_free_port()}", f"--metrics-export-port={_free_port()}",
                             f"--temp-dir={temp}"], stdout=head_log, stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.monotonic() + 240  # a cold start on a loaded 2-core machine
        while True:  # up once it takes a job: the dashboard answers before its job agent is ready
            try:
                client = JobSubmissionClient(f"http://127.0.0.1:{dashboard}")
                client.submit_job(entrypoint="true", submission_id="warm-up")
                break
            except Exception:
                if time.monotonic() > deadline or head.poll() is not None:
                    pytest.fail(f"the Ray job server did not start (head exit {head.poll()}): "
                                f"{(Path(temp) / 'head.log').read_text()[-2000:]}")
                time.sleep(1)
        yield client
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        for proc in psutil.process_iter(["cmdline"]):
            if any(temp in part for part in proc.info["cmdline"] or ()):
                proc.kill()
        head_log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_verl_job_runs_on_ray_with_progress_mirroring_and_mlflow(ray_jobs, tmp_path, omni_cache):
    store = Store(str(tmp_path / "store"))
    ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=16&seed=7", converter="gsm8k"),
           progress=lambda _: None)
    backend = VerlBackend(python=verl_python(), shared_dir=str(tmp_path / "shared"), overrides=CPU_OVERRIDES,
                          env=CPU_ENV)
    export = export_dataset(store, "gsm8k", None, backend.shared_dir, "sft")
    run_dir = backend.run_dir("gsm8k-sft", "k1", "sft")
    command = render(VerlTraining(task="sft", model=stage_model("tiny://lm", backend.shared_dir),
                                  train_files=export.files["train"], total_steps=2, batch_size=4, lr=1e-3,
                                  save_freq=1, max_length=512), backend, run_dir)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking)
    run = client.create_run(client.create_experiment("verl-job"))
    env = runtime_env(command, tracking_uri=tracking, mlflow_run_id=run.info.run_id,
                      environ={"AWS_SECRET_ACCESS_KEY": "not-in-any-file", "UNRELATED": "x"})
    assert env["env_vars"]["AWS_SECRET_ACCESS_KEY"] == "not-in-any-file" and "UNRELATED" not in env["env_vars"]
    assert "not-in-any-file" not in str(describe_env(env))

    assert entrypoint_resources(command, 8) == {"entrypoint_num_gpus": 8}
    cpu = {"entrypoint_num_cpus": 1}  # no GPUs here; any entrypoint resource keeps Ray's NOSET variable off
    job = submit(ray_jobs, command, pipeline="gsm8k-sft", stage="sft", run_key="k1", env=env, resources=cpu)
    assert job.submitted and job.submission_id == submission_id("gsm8k-sft", "sft", "k1") == "omni-verl-gsm8k-sft-sft-k1"
    lines: list[str] = []
    root = "runs/gsm8k-sft/k1/sft"
    status = follow(ray_jobs, job.submission_id, total_steps=2, progress=lines.append, poll_s=0.5,
                    on_poll=lambda: mirror_new(run_dir, store, root), log_path=tmp_path / "job.log", timeout_s=400)
    log = (tmp_path / "job.log").read_text()
    assert status == "SUCCEEDED", log[-3000:]
    assert lines == ["step 1 of 2", "step 2 of 2"]
    assert "Saving checkpoint to" in log
    assert list(run_dir.glob("hydra/*/.hydra/config.yaml"))  # Hydra's run folder beside the checkpoints
    assert checkpoint_steps(store, root) == {1: True, 2: True}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
    info = ray_jobs.get_job_info(job.submission_id)
    assert info.runtime_env["env_vars"]["MLFLOW_RUN_ID"] == run.info.run_id

    again = submit(ray_jobs, command, pipeline="gsm8k-sft", stage="sft", run_key="k1", env=env, resources=cpu)
    assert (again.submission_id, again.submitted, again.status) == (job.submission_id, False, "SUCCEEDED")

    # a stopped (or failed) job is not found again: the next submission is attempt 2
    sleeper = VerlCommand("sft", "sleep", "none", ["sleep", "120"], [], {}, str(run_dir))
    first = submit(ray_jobs, sleeper, pipeline="p", stage="s", run_key="k2", env={})
    deadline = time.monotonic() + 60
    while ray_jobs.get_job_status(first.submission_id).value == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    stop(ray_jobs, first.submission_id)
    while ray_jobs.get_job_status(first.submission_id).value not in ("STOPPED", "FAILED"):
        time.sleep(0.5)
    second = submit(ray_jobs, sleeper, pipeline="p", stage="s", run_key="k2", env={})
    assert second.submitted and second.submission_id == "omni-verl-p-s-k2-attempt-2"

    # Ctrl-C while following in the main thread: the job is stopped (and STOPPED) before it re-raises
    def interrupt_once_running() -> None:
        if ray_jobs.get_job_status(second.submission_id).value == "RUNNING":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        follow(ray_jobs, second.submission_id, total_steps=0, progress=lambda _: None, poll_s=0.2,
               on_poll=interrupt_once_running, timeout_s=120)
    assert ray_jobs.get_job_status(second.submission_id).value == "STOPPED"
