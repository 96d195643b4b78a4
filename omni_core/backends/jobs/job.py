"""A trainer's command as a Ray Job (both external backends: verl's trainers, VeRL-Omni's recipes):
submitted with Ray's `JobSubmissionClient` to the cluster's job server (`ray.address`, the dashboard
URL), followed until it ends.

- The submission id is deterministic (`submission_id`): the training's run key and a digest of the
  rendered command (`command_digest`: its entry point, with every path under the shared path, and its
  own env), also kept in the job's metadata. A resubmission of the same training finds the pending,
  running or finished job instead of starting another; the same pipeline run against another store
  or shared path on the same cluster renders another command, hence submits a job of its own. After a
  FAILED or STOPPED one the next attempt is `{id}-attempt-N` (it resumes from the last checkpoint:
  mirror.prepare_resume).
- `runtime_env.env_vars`: the command's env, the file verl's file logger writes the metrics to
  (jobs.metrics: the driver relays them into the stage's MLflow run), and the credentials the job
  needs, forwarded by name from the driver's environment (never written to a pipeline file, a manifest
  or MLflow; `describe_env` shows them redacted).
- A job that failed for a reason a retry cannot change (a missing package or file, an import or
  Hydra composition error: the exception its entry point ended with) raises JobFailed, an OmniError
  the orchestrator does not retry (`permanent_failure`); a lost node or a killed trainer is retried.
- Entry point resources are the backend's to choose (`submit(resources=...)`; backend verl's
  `entrypoint_resources` says why an sft job asks for the node's GPUs).
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
- Helper jobs (a model merger, an adapter export after the training) run through `run_helper_job`:
  resubmitted under the same id after a failed one, followed like the training.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from omni_core.errors import OmniError

ACTIVE = ("PENDING", "RUNNING", "SUCCEEDED")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
# forwarded by name when the driver has them: the store's and the hub's credentials (the job does not talk
# to MLflow: the driver relays its metrics, jobs.metrics)
FORWARDED_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION",
                 "AWS_ENDPOINT_URL", "OMNI_S3_ENDPOINT_URL", "HF_TOKEN")
LOG_SETTLE_READS = 3
LOG_SETTLE_S = 0.5
STEP_LINE = re.compile(r"(?<![A-Za-z0-9_])step:(\d+) - ")  # also right after a tqdm bar: "...]step:1 - "
# Ray's job supervisor writes this header (with the whole command) through a buffered file it closes after
# starting the entry point, so a job that fails fast can have it land after its own output, last in the log
RAY_HEADER = re.compile(r"^Running entrypoint for job \S+: .*\n?", re.MULTILINE)
TAIL_CHARS = 2000
_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]+")
STOP_WAIT_S = 60.0  # Ray SIGTERMs the entrypoint's process group, SIGKILLs it after RAY_JOB_STOP_WAIT_TIME_S (3 s)

VERSION_PREFIX = "omni-verl-version="  # the line `version_probe` prints into a job's log
DIGEST_KEY = "omni.command_sha256"  # the job's metadata: its command's digest (`command_digest`)
DIGEST_CHARS = 8  # of it in the submission id

_following: dict[str, Any] = {}  # submission id -> client: the jobs this process is following
_cancelled: set[str] = set()  # ... and those stop_followed stopped
_lock = threading.Lock()


class JobCommand(Protocol):
    """What a backend submits: the shell entry point and the environment variables it needs."""

    @property
    def entrypoint(self) -> str: ...

    @property
    def env(self) -> dict[str, str]: ...


class JobCancelled(OmniError):
    """The driver was interrupted (Ctrl-C, the flow run cancelled) and stopped its Ray Job: not retried."""


class JobFailed(OmniError):
    """The job failed for a reason a retry cannot change (`permanent_failure`): not retried."""


# The exceptions a job's entry point can end with that another attempt would end with too. Read from the
# entry point's own output only: lines a Ray actor printed carry a "(Name pid=N)" prefix, and a worker
# killed mid-write (a lost node, a SIGKILLed trainer) may print anything there.
PERMANENT = {
    "ModuleNotFoundError": "a package is missing in the job's interpreter",
    "ImportError": "an import failed in the job's interpreter",
    "PackageNotFoundError": "a package is missing in the job's interpreter",
    "ConfigCompositionException": "verl's Hydra config refused the command",
    "MissingConfigException": "verl's Hydra config refused the command",
    "ConfigAttributeError": "verl's config has no such key",
    "FileNotFoundError": "a file the job reads does not exist",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
TORCHRUN_FAILURE = "ChildFailedError"  # torch.distributed.elastic's: a rank of `torchrun` (verl's sft_trainer) failed
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(?P<name>[A-Za-z_][\w]*(?:Error|Exception)):(?: (?P<message>.*))?$")
# `python -m MODULE` of a module that cannot be found prints one line, not a traceback
_MODULE_SPEC = re.compile(r"^\S+: (?:Error while finding module specification for '[^']+' \((?P<name>\w+): "
                          r"(?P<message>.*)\)|(?P<plain>No module named .*))$")
_NOT_FOUND = re.compile(r"^(?:/bin/sh|bash|sh)(?:: line \d+)?: (?:\d+: )?(?P<what>\S+): (?:not found|No such file or "
                        r"directory|Permission denied)$")


def permanent_failure(log: str) -> str | None:
    """Why a failed job would fail again (its entry point's last exception, or a shell that could not
    start its interpreter), or None (a lost node, a killed trainer: worth a retry)."""
    plain = _ANSI.sub("", RAY_HEADER.sub("", log))  # Ray colours its "(Name pid=N)" prefixes
    lines = [ln for ln in plain.splitlines() if ln.strip() and not ln.startswith("(")]
    for at, line in reversed(list(enumerate(lines[-300:]))):
        if found := _NOT_FOUND.match(line.strip()):
            return f"the shell could not run {found['what']} ({line.strip()})"
        if found := _MODULE_SPEC.match(line.strip()):
            reason = PERMANENT.get(found["name"] or "ModuleNotFoundError")
            return f"{reason}: {line.strip()[:500]}" if reason else None
        if found := _EXCEPTION_LINE.match(line.strip()):
            if found["name"] == TORCHRUN_FAILURE:
                # torchrun's own report of a rank that failed: a rank killed by a signal is worth a retry,
                # else the rank's own exception, printed above it, decides
                if any("Signal" in after for after in lines[-300:][at:]):
                    return None
                continue
            reason = PERMANENT.get(found["name"])
            return f"{reason}: {line.strip()[:500]}" if reason else None
    return None

@dataclass(frozen=True)
class VerlJob:
    submission_id: str
    submitted: bool  # False: an earlier submission of the same training was found
    status: str


def version_probe(python: str) -> list[str]:
    """Prints `omni-verl-version=X` into the job's log: the installed distribution's version, read without
    importing verl (~0.05 s here; an import costs seconds), so the run is tagged without a second job."""
    return [python, "-c", f"from importlib.metadata import version; print({VERSION_PREFIX!r} + version('verl'))"]


def command_digest(command: JobCommand) -> str:
    """What makes two submissions one job: the entry point (interpreter, every Hydra override, the paths
    under the shared path) and the command's own env; not the runtime env's forwarded credentials or
    metrics file, which belong to the driver and the attempt."""
    return hashlib.sha256(json.dumps([command.entrypoint, sorted(command.env.items())]).encode()).hexdigest()


def submission_id(pipeline: str, stage: str, run_key: str, digest: str, attempt: int = 1) -> str:
    """The Ray submission id of one training: its run key and its command's digest (`command_digest`)."""
    base = _ID_CHARS.sub("-", f"omni-verl-{pipeline}-{stage}-{run_key}-{digest[:DIGEST_CHARS]}")
    return base if attempt == 1 else f"{base}-attempt-{attempt}"


def runtime_env(command: JobCommand, *, metrics_file: str | Path | None = None, forward: tuple[str, ...] = FORWARDED_ENV,
                environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The job's env: the command's own, the file verl's file logger writes (`submit` sets it per submission
    id; a plan shows where) and the credentials forwarded by name."""
    from omni_core.backends.jobs.metrics import FILE_ENV

    environ = os.environ if environ is None else environ
    env_vars = dict(command.env)
    if metrics_file is not None:
        env_vars[FILE_ENV] = str(metrics_file)
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


def _job_digest(client: Any, job_id: str) -> str | None:
    try:
        return (client.get_job_info(job_id).metadata or {}).get(DIGEST_KEY)
    except RuntimeError:
        return None


def submit(client: Any, command: JobCommand, *, pipeline: str, stage: str, run_key: str, env: dict[str, Any],
           resources: dict[str, float] | None = None, metrics_dir: str | Path | None = None) -> VerlJob:
    """Submit `command` unless this job (its run key and command digest) is pending, running or done
    (then return it). `resources`: entrypoint_num_gpus / entrypoint_num_cpus (see `entrypoint_resources`);
    `metrics_dir`: where verl's file logger writes (jobs.metrics.metrics_file of the submission id)."""
    from omni_core.backends.jobs.metrics import FILE_ENV, metrics_file

    digest = command_digest(command)
    attempt = 1
    while True:
        job_id = submission_id(pipeline, stage, run_key, digest, attempt)
        status = job_status(client, job_id)
        if status is None:
            env_vars = dict(env.get("env_vars", {}))
            if metrics_dir is not None:  # verl's file logger opens the file, not its folder (the driver sees it)
                Path(metrics_dir).mkdir(parents=True, exist_ok=True)
                env_vars[FILE_ENV] = str(metrics_file(metrics_dir, job_id))
            client.submit_job(entrypoint=command.entrypoint, submission_id=job_id,
                              runtime_env={**env, "env_vars": env_vars}, metadata={DIGEST_KEY: digest},
                              **(resources or {}))
            return VerlJob(job_id, True, "PENDING")
        if status in ACTIVE and _job_digest(client, job_id) in (digest, None):
            return VerlJob(job_id, False, status)
        attempt += 1  # FAILED or STOPPED (or, against all odds, another command under this digest prefix)


def run_helper_job(client: Any, entry: str, job_id: str, env: dict[str, Any], poll_s: float = 1.0,
                   num_cpus: float = 1) -> tuple[str, str]:
    """Run `entry` as a Ray Job named `job_id` plus its entry's digest, after a training (resubmitted under
    the same id after a failed or stopped one, found when it is pending, running or done) and follow it;
    (final status, its log)."""
    digest = hashlib.sha256(entry.encode()).hexdigest()
    job_id = f"{job_id}-{digest[:DIGEST_CHARS]}"
    status = job_status(client, job_id)
    if status in (None, "FAILED", "STOPPED"):
        if status is not None:
            client.delete_job(job_id)
        client.submit_job(entrypoint=entry, submission_id=job_id, runtime_env=env, entrypoint_num_cpus=num_cpus,
                          metadata={DIGEST_KEY: digest})
    if status != "SUCCEEDED":  # a job found done is not followed again (its log is whole)
        status = follow(client, job_id, total_steps=0, progress=lambda _: None, poll_s=poll_s)
    return status, client.get_job_logs(job_id)


def probe_interpreter(client: Any, python: str, poll_s: float = 0.5) -> tuple[str | None, str]:
    """(verl's version, None when it has none, and the probe's log) of `python` where the cluster runs
    jobs: a small Ray Job (`version_probe`, no resources), kept on the cluster by its id, so one probe
    answers every later stage until it failed."""
    status, log = run_helper_job(client, shlex.join(version_probe(python)), "omni-verl-probe", {}, poll_s, num_cpus=0)
    found = re.search(rf"^{VERSION_PREFIX}(\S+)$", log, re.MULTILINE)
    return (found.group(1) if status == "SUCCEEDED" and found else None), log


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
