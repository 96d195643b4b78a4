"""A `ray start --head --block` with its job server on 127.0.0.1, for the modules that submit Ray Jobs
(tests/test_training_job.py, tests/verl_jobs.py): its own temp dir and process group, so stopping it
touches no other Ray on the machine, and free ports for the agents (their defaults, 52365 and on, are
taken when another head runs: the other pytest-xdist worker's, a developer's own Ray).

It counts as up once it has taken a job: the dashboard answers before its job agent is ready. A head
whose job agent never comes (seen once in a full suite run: `No available agent to submit job` for
240 s while the head lived; a free port can be taken by another process before the agent binds it)
is stopped and started again once, on fresh ports; a second failure fails with both heads' logs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

START_WAIT_S = 150.0  # a cold start on a loaded 2-core machine (usually 5-20 s)


@dataclass
class JobHead:
    proc: subprocess.Popen
    temp: str
    address: str  # the job server's http://127.0.0.1:PORT
    client: Any  # a ray.job_submission.JobSubmissionClient on it

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the head's own output and of its dashboard agent's log."""
        parts = []
        for path in (Path(self.temp) / "head.log", *Path(self.temp).glob("session_latest/logs/dashboard_agent*.log")):
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """The head's process group, then any Ray process of this head that left it (workers, a job's
        driver: found by the head's temp dir on their command line)."""
        import psutil

        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for proc in psutil.process_iter(["cmdline"]):
            if any(self.temp in part for part in proc.info["cmdline"] or ()):
                proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


def _start(num_cpus: int, prefix: str, wait: float) -> tuple[JobHead, bool]:
    from ray.job_submission import JobSubmissionClient

    temp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # short: Ray's socket paths live under it
    dashboard = free_port()
    with open(Path(temp) / "head.log", "wb") as log:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
                                 f"--port={free_port()}", f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1",
                                 "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                                 "--include-dashboard=true", f"--dashboard-agent-listen-port={free_port()}",
                                 f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                                 f"--metrics-export-port={free_port()}", f"--temp-dir={temp}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # no token to hand out in a test
    head = JobHead(proc, temp, f"http://127.0.0.1:{dashboard}", None)
    deadline = time.monotonic() + wait
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            head.client = JobSubmissionClient(head.address)
            head.client.submit_job(entrypoint="true", submission_id="warm-up")
        except Exception:
            time.sleep(1)
            continue
        while str(head.client.get_job_status("warm-up")).rsplit(".", 1)[-1] in ("PENDING", "RUNNING"):
            time.sleep(0.5)
        head.client.delete_job("warm-up")
        return head, True
    return head, False


def start_job_head(num_cpus: int, prefix: str, wait: float = START_WAIT_S) -> JobHead:
    """A head with `num_cpus` logical CPUs whose job server has taken a job (the module docstring)."""
    failures = []
    for _ in range(2):
        head, up = _start(num_cpus, prefix, wait)
        if up:
            return head
        failures.append(f"head exit {head.proc.poll()}:\n{head.log_tail()}")
        head.stop()
    pytest.fail("the Ray job server did not start, twice:\n" + "\n=====\n".join(failures))
