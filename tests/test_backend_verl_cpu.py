"""Real verl on CPU: verl 0.9.1's SFT trainer (`torchrun -m verl.trainer.sft_trainer`, the command
`render` gives) trains a tiny Qwen3 (`tiny://lm`) on a GSM8K export, writes `global_step_N/` and
`latest_checkpointed_iteration.txt`, logs `train/loss` through its file logger (VERL_FILE_LOGGER_PATH),
which our relay (omni_core/backends/jobs/metrics.py) writes into our MLflow run (a real `mlflow
server`), and, SIGKILLed after a checkpoint that was mirrored to
S3 (moto) and then deleted from the shared path, resumes from the restored copy with resume_mode=auto.
CPU support is the product's `backend.device: cpu` (omni_core/backends/verl/cpu.py: the `cpu` platform
of backends/verl/runtime/ loaded through verl's `VERL_USE_EXTERNAL_MODULES` hook)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from mlflow_server import MlflowServer
from verl_env import verl_python

from omni_core.backends.jobs.export import export_dataset, stage_model
from omni_core.backends.jobs.metrics import MetricsRelay
from omni_core.backends.jobs.mirror import mirror_new, prepare_resume
from omni_core.backends.verl import VerlBackend, VerlTraining, render
from omni_core.config import DatasetConfig
from omni_core.data import ingest
from omni_core.storage import Store
from omni_core.training.checkpoint import latest_checkpoint

STEPS = 3
JOB_TIMEOUT_S = 300


def _run(argv: list[str], env: dict[str, str], log: Path, kill_after_step: int | None = None,
         latest: Path | None = None) -> tuple[int, int | None]:
    """Run the job (its own process group); with `kill_after_step`, SIGKILL the trainer (torchrun's worker
    process, which torchrun starts in a session of its own) as soon as `latest` names that step or a
    later one; torchrun then fails the job. Returns (exit code, the step latest named at the kill)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent,
                                start_new_session=True)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    killed_at = None
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"verl job ran over {JOB_TIMEOUT_S} s: {log.read_text()[-3000:]}")
            if kill_after_step is not None and latest is not None and latest.is_file():
                text = latest.read_text().strip()
                if text and int(text) >= kill_after_step:
                    killed_at = int(text)
                    for worker in psutil.Process(proc.pid).children(recursive=True):
                        worker.send_signal(signal.SIGKILL)
                    proc.wait(timeout=60)
                    break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
    return proc.returncode, killed_at


def test_sft_trains_checkpoints_logs_to_mlflow_and_resumes_after_a_kill(
        tmp_path, mlflow_server: MlflowServer, omni_cache, s3_bucket):
    store = Store(str(tmp_path / "store"))
    ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=24&seed=5", converter="gsm8k"),
           progress=lambda _: None)
    backend = VerlBackend(python=verl_python(), shared_dir=str(tmp_path / "shared"), device="cpu")
    export = export_dataset(store, "gsm8k", None, backend.shared_dir, "sft")
    run_dir = backend.run_dir("gsm8k-sft", "k0", "sft")
    command = render(VerlTraining(task="sft", model=stage_model("tiny://lm", backend.shared_dir),
                                  train_files=export.files["train"], val_files=export.files["test"],
                                  total_steps=STEPS, batch_size=4, lr=1e-3, save_freq=1, max_length=512,
                                  resume_mode="auto", seed=0), backend, run_dir)

    client = MlflowClient(mlflow_server.url)
    run = client.create_run(client.create_experiment("verl-sft"))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), **command.env}
    files = [tmp_path / "metrics" / f"attempt-{n}.jsonl" for n in (1, 2)]  # one per job, as `submit` names them
    files[0].parent.mkdir()
    log = tmp_path / "job.log"
    latest = run_dir / "latest_checkpointed_iteration.txt"

    started = time.monotonic()
    code, killed_at = _run(command.argv, {**env, "VERL_FILE_LOGGER_PATH": str(files[0])}, log, kill_after_step=1,
                           latest=latest)
    first_s = time.monotonic() - started
    assert killed_at is not None, f"the job ended (exit {code}) before checkpointing step 1: {log.read_text()[-3000:]}"
    assert code != 0 and killed_at < STEPS
    for step in range(1, killed_at + 1):
        folder = run_dir / f"global_step_{step}"
        assert (folder / "model_world_size_1_rank_0.pt").is_file()
        assert (folder / "optim_world_size_1_rank_0.pt").is_file() and (folder / "data_0.pt").is_file()

    # mirrored to S3, then the shared path loses the run (a new cluster); the retry restores it first
    mirrors = Store(f"s3://{s3_bucket}/omni")
    assert mirror_new(run_dir, mirrors, "runs/gsm8k-sft/k0/sft") == list(range(1, killed_at + 1))
    shutil.rmtree(run_dir)
    assert prepare_resume(run_dir, mirrors, "runs/gsm8k-sft/k0/sft") == killed_at

    started = time.monotonic()
    code, _ = _run(command.argv, {**env, "VERL_FILE_LOGGER_PATH": str(files[1])}, log)
    second_s = time.monotonic() - started
    assert code == 0, log.read_text()[-3000:]
    assert latest.read_text().strip() == str(STEPS)
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == [f"global_step_{s}" for s in range(killed_at, STEPS + 1)]

    assert mirror_new(run_dir, mirrors, "runs/gsm8k-sft/k0/sft") == list(range(killed_at + 1, STEPS + 1))
    manifest = latest_checkpoint(mirrors, "runs/gsm8k-sft/k0/sft")
    assert manifest["global_step"] == STEPS
    assert {"model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt", "data_0.pt"} <= {
        f["path"] for f in manifest["files"]}

    # the second process trained only the steps after the checkpoint it resumed from
    relays = [MetricsRelay(client, run.info.run_id, path) for path in files]
    for relay in relays:
        assert relay.poll() > 0 and relay.poll() == 0  # every line once
    second = [json.loads(line)["step"] for line in files[1].read_text().splitlines()]
    assert sorted(set(second)) == list(range(killed_at + 1, STEPS + 1))
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert {m.step for m in history} == set(range(1, STEPS + 1))
    assert client.get_metric_history(run.info.run_id, "val/loss")
    print(f"verl sft on CPU: first job {first_s:.1f} s (killed after step {killed_at}), "
          f"resumed job {second_s:.1f} s (steps {killed_at + 1}..{STEPS})")
