"""The verl command as a Ray Job: submitted with Ray's `JobSubmissionClient` to the cluster's job
server (`ray.address`, the dashboard URL), followed until it ends.

- The submission id is deterministic (`submission_id`): a resubmission of the same training finds
  the pending, running or finished job instead of starting another; after a FAILED or STOPPED one
  the next attempt is `{id}-attempt-N` (and resumes from the last checkpoint: mirror.prepare_resume).
- `runtime_env.env_vars`: the command's env, `MLFLOW_TRACKING_URI` / `MLFLOW_RUN_ID` of the stage's
  MLflow run (verl's own `mlflow` logger then writes into it), and the credentials the job needs,
  forwarded by name from the driver's environment (never written to a pipeline file, a manifest or
  MLflow; `describe_env` shows them redacted).
- Entry point resources: `torchrun -m verl.trainer.sft_trainer` trains in the entrypoint's own
  processes, so an sft job asks for the node's GPUs (`entrypoint_num_gpus`; `entrypoint_resources`).
  Without any entrypoint resources Ray sets RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 on the
  entrypoint (ray job_manager.py), and verl's Worker then looks its device up in Ray's accelerator
  ids of a process that has none (KeyError / IndexError, seen in the CPU test). main_ppo's driver
  only places Ray actors, which ask for their own GPUs.
- `follow` polls the job's log: new lines go to a log file (kept as an artifact), verl's
  `step:N - ...` lines become progress ("step N of M"), and `on_poll` (the checkpoint mirror) runs
  between polls and once more at the end.
- Cancellation stops the job. An interruption that reaches `follow` itself (Ctrl-C while it runs in
  the main thread: KeyboardInterrupt) stops the job, waits until Ray reports it STOPPED, and
  re-raises. In a Prefect flow the stage runs in a task thread while the signal lands in the main
  thread (Prefect's process worker cancels a flow run by SIGTERM to the flow-run process; the flow
  engine's handler raises `TerminationSignal` there; Ctrl-C of `omni run` is KeyboardInterrupt
  there): the flow then calls `stop_followed()`, which stops every job this process follows and
  waits for STOPPED; the task thread's `follow` raises `JobCancelled` (an OmniError, so the stage is
  not retried and no `-attempt-N` is submitted).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.backends.verl.render import VerlCommand
from omni_core.errors import OmniError

ACTIVE = ("PENDING", "RUNNING", "SUCCEEDED")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# forwarded by name when the driver has them: the store's, MLflow's and the hub's credentials
FORWARDED_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL", "OMNI_S3_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL", "MLFLOW_TRACKING_USERNAME",
                 "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN")
LOG_SETTLE_READS = 3
LOG_SETTLE_S = 0.5
STEP_LINE = re.compile(r"(?<![A-Za-z0-9_])step:(\d+) - ")  # also right after a tqdm bar: "...]step:1 - "
# Ray's job supervisor writes this header (with the whole command) through a buffered file it closes after
# starting the entry point, so a job that fails fast can have it land after its own output, last in the log
RAY_HEADER = re.compile(r"^Running entrypoint for job \S+: .*\n?", re.MULTILINE)
TAIL_CHARS = 2000
_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
STOP_WAIT_S = 60.0  # Ray SIGTERMs the entrypoint's process group, SIGKILLs it after RAY_JOB_STOP_WAIT_TIME_S (3 s)

_following: dict[str, Any] = {}  # submission id -> client: the jobs this process is following
_cancelled: set[str] = set()  # ... and those stop_followed stopped
_lock = threading.Lock()


class JobCancelled(OmniError):
    """The driver was interrupted (Ctrl-C, the flow run cancelled) and stopped its Ray Job: not retried."""


@dataclass(frozen=True)
class VerlJob:
    submission_id: str
    submitted: bool  # False: an earlier submission of the same training was found
    status: str


def submission_id(pipeline: str, stage: str, run_key: str, attempt: int = 1) -> str:
    """The Ray submission id of one training (the same run key gives the same id)."""
    base = _ID_CHARS.sub("-", f"omni-verl-{pipeline}-{stage}-{run_key}")
    return base if attempt == 1 else f"{base}-attempt-{attempt}"


def runtime_env(command: VerlCommand, *, tracking_uri: str | None = None, mlflow_run_id: str | None = None,
                forward: tuple[str, ...] = FORWARDED_ENV, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    env_vars = dict(command.env)
    if tracking_uri:
        env_vars["MLFLOW_TRACKING_URI"] = tracking_uri
    if mlflow_run_id:
        env_vars["MLFLOW_RUN_ID"] = mlflow_run_id
    env_vars.update({name: environ[name] for name in forward if environ.get(name)})
    return {"env_vars": env_vars}


def describe_env(env: dict[str, Any], forward: tuple[str, ...] = FORWARDED_ENV) -> dict[str, Any]:
    """`env` for a plan or a log: forwarded values replaced by where they come from."""
    env_vars = {k: f"<from the driver's ${k}>" if k in forward else v for k, v in env.get("env_vars", {}).items()}
    return {**env, "env_vars": env_vars}


def job_status(client: Any, job_id: str) -> str | None:
    try:
        return str(client.get_job_status(job_id)).rsplit(".", 1)[-1]
    except RuntimeError:  # no such job: the job server answers 404
        return None


def entrypoint_resources(command: VerlCommand, n_gpus_per_node: int, device: str = "gpu") -> dict[str, float]:
    """`submit_job` keyword arguments for the entry point's own resources (module docstring); on CPU one CPU
    (any entrypoint resource keeps RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES out of the job's env)."""
    if device == "cpu":
        return {"entrypoint_num_cpus": 1}
    return {"entrypoint_num_gpus": n_gpus_per_node} if command.module.endswith("sft_trainer") else {}


def submit(client: Any, command: VerlCommand, *, pipeline: str, stage: str, run_key: str, env: dict[str, Any],
           resources: dict[str, float] | None = None) -> VerlJob:
    """Submit `command` unless a job of this training is pending, running or done (then return it).
    `resources`: entrypoint_num_gpus / entrypoint_num_cpus (see `entrypoint_resources`)."""
    attempt = 1
    while True:
        job_id = submission_id(pipeline, stage, run_key, attempt)
        status = job_status(client, job_id)
        if status is None:
            client.submit_job(entrypoint=command.entrypoint, submission_id=job_id, runtime_env=env, **(resources or {}))
            return VerlJob(job_id, True, "PENDING")
        if status in ACTIVE:
            return VerlJob(job_id, False, status)
        attempt += 1  # FAILED or STOPPED



def log_tail(log: str, chars: int = TAIL_CHARS) -> str:
    """The end of a job's log for an error message: the job's own last output, without Ray's header line."""
    return RAY_HEADER.sub("", log)[-chars:]

def follow(client: Any, job_id: str, *, total_steps: int, progress: Callable[[str], None] = print,
           on_poll: Callable[[], Any] | None = None, log_path: str | Path | None = None, poll_s: float = 1.0,
           timeout_s: float | None = None) -> str:
    """Poll until the job ends; returns its final status (SUCCEEDED, FAILED or STOPPED).

    A timeout stops the job (as cancelling the flow run should) and returns STOPPED."""
    seen, last_step, settled = 0, 0, 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed below
    with _lock:
        _following[job_id] = client
    try:
        while True:
            if job_id in _cancelled:
                with _lock:
                    _cancelled.discard(job_id)
                raise JobCancelled(f"Ray Job {job_id} was stopped: the run was interrupted or cancelled")
            status = job_status(client, job_id) or "PENDING"
            text = client.get_job_logs(job_id)
            new, seen = text[seen:], len(text)
            if log is not None and new:
                log.write(new)
                log.flush()
            for match in STEP_LINE.finditer(new):
                step = int(match.group(1))
                if step > last_step:
                    last_step = step
                    progress(f"step {step} of {total_steps}")
            if on_poll is not None:
                on_poll()
            if status in TERMINAL:
                # the job server may report the end before it has read the job's last output: read the
                # log until it stops growing (LOG_SETTLE_READS reads in a row with nothing new)
                settled = settled + 1 if not new else 0
                if settled >= LOG_SETTLE_READS:
                    return status
                time.sleep(LOG_SETTLE_S)
                continue
            if deadline is not None and time.monotonic() > deadline:
                stop(client, job_id)
                progress(f"job {job_id} ran over {timeout_s} s: stopped")
                return "STOPPED"
            time.sleep(poll_s)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # KeyboardInterrupt, Prefect's TerminationSignal, SystemExit
            stop(client, job_id, wait_s=STOP_WAIT_S)
        raise
    finally:
        with _lock:
            _following.pop(job_id, None)
        if log is not None:
            log.close()


def stop(client: Any, job_id: str, *, wait_s: float = 0.0) -> str | None:
    """Stop the job; a job that already ended is left as it is. With `wait_s`, wait (up to that long)
    until Ray reports it ended; returns its last status."""
    status = job_status(client, job_id)
    if status in ("PENDING", "RUNNING"):
        client.stop_job(job_id)
    deadline = time.monotonic() + wait_s
    while status not in (None, *TERMINAL) and time.monotonic() < deadline:
        time.sleep(0.2)
        status = job_status(client, job_id)
    return status


def stop_followed(wait_s: float = STOP_WAIT_S) -> dict[str, str | None]:
    """Stop every Ray Job this process is following (from any thread: the one an interruption landed
    in) and wait until each is STOPPED; their `follow` then raises JobCancelled. Returns id -> status."""
    with _lock:
        jobs = dict(_following)
        _cancelled.update(jobs)
    return {job_id: stop(client, job_id, wait_s=wait_s) for job_id, client in jobs.items()}
