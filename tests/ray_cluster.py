"""A real multi-node Ray cluster on 127.0.0.1 for tests: `ray start --head` and `ray start --address`
processes (each with `--block`, in its own process group and temp dir, with free ports), started
WITHOUT the driver's store and tracking variables (a cluster's nodes never saw the driver's shell)
and without this checkout on their PYTHONPATH; optionally with Ray's token authentication on."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ports import free_port

DRIVER_ONLY_PREFIXES = ("OMNI_S3_", "AWS_", "MLFLOW_", "PYTHONPATH", "RAY_ADDRESS", "PREFECT_")


# The GCS's health check of each raylet, quicker than Ray's default (a check every 3 s, a node declared
# dead after 5 failed ones: 15 s, more under load): a lost node's actors are reported dead after about
# 3 s, so the fault tests wait that long, not 15-30 s. A check still waits Ray's 10 s for an answer
# before it counts as failed, so a raylet slowed down by a busy machine is not declared dead sooner.
HEALTH_CHECK = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "600",
                "RAY_health_check_failure_threshold": "5"}


# `ray start` gives a node 30 s (hard-coded in ray/_private/node.py) to register with the GCS; on an
# overloaded machine (load ~10 on 2 cores) that is missed now and then, so a start failing so is retried once
RAY_START_TIMED_OUT = "timed out during startup"
RAY_PROCESS_DIED = "Some Ray subprocesses exited unexpectedly"  # `ray start --block`, then it kills the rest


def node_env(token: str | None) -> dict[str, str]:
    """The environment of a cluster node: the driver's without its S3, MLflow, Prefect and code settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(DRIVER_ONLY_PREFIXES)}
    env.update(HEALTH_CHECK)
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {"RAY_AUTH_MODE": "disabled"})
    return env


@dataclass
class RayCluster:
    temp: str
    port: int
    dashboard: int
    token: str | None
    nodes: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def job_server(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def driver_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for a driver process of this cluster (its token when auth is on)."""
        env = dict(os.environ if base is None else base)
        env.pop("RAY_ADDRESS", None)
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token} if self.token
                   else {"RAY_AUTH_MODE": "disabled"})
        return env

    def _start(self, args: list[str], name: str) -> subprocess.Popen:
        ray_bin = Path(sys.executable).with_name("ray")
        log = Path(self.temp) / f"{name}.log"
        ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                 f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
                 f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen([str(ray_bin), "start", "--block", "--node-ip-address=127.0.0.1",
                                     "--disable-usage-stats", f"--temp-dir={self.temp}", *ports, *args],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=node_env(self.token), cwd="/")
        self.nodes.append(proc)
        self.logs.append(log)
        return proc

    def add_node(self, num_cpus: int, resources: dict[str, float] | None = None, wait: float = 120) -> subprocess.Popen:
        before = {n["raylet"]["nodeId"] for n in self.alive_nodes()}  # (a node just lost may still count)
        proc = self._start([f"--address={self.address}", f"--num-cpus={num_cpus}",
                            f"--resources={json.dumps(resources or {})}"], f"node{len(self.nodes)}")
        deadline, retried = time.monotonic() + wait, False
        while not {n["raylet"]["nodeId"] for n in self.alive_nodes()} - before:
            if proc.poll() is not None or time.monotonic() > deadline:
                log = self.logs[-1].read_text()[-3000:]
                if not retried and proc.poll() is not None and RAY_START_TIMED_OUT in log:  # once (start_cluster)
                    retried = True
                    proc = self._start([f"--address={self.address}", f"--num-cpus={num_cpus}",
                                        f"--resources={json.dumps(resources or {})}"], f"node{len(self.nodes)}")
                    continue
                raise RuntimeError(f"ray worker node did not join: {log}")
            time.sleep(0.5)
        return proc

    def alive_nodes(self) -> list[dict]:
        """The cluster's alive nodes, from its dashboard (with the token when auth is on)."""
        import urllib.request

        request = urllib.request.Request(f"{self.job_server}/nodes?view=summary")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                body = r.read()
        except OSError:
            return []
        try:
            summary = json.loads(body)["data"]["summary"]
        except (ValueError, KeyError) as e:
            raise RuntimeError(f"port {self.dashboard} does not answer as this cluster's dashboard "
                               f"(taken by another server?): {body[:200]!r}") from e
        return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]

    def log_tails(self, chars: int = 3000) -> str:
        """Each node's `ray start --block` output, for a failing test's message (stop() removes it): from
        where it says which of its Ray processes died and how (it then kills the rest), else its end."""
        def told(text: str) -> str:
            died = text.find(RAY_PROCESS_DIED)
            return text[died:died + chars] if died >= 0 else text[-chars:]

        return "\n".join(f"--- {log.name} (exit {proc.poll()}):\n{told(log.read_text(errors='replace'))}"
                         for proc, log in zip(self.nodes, self.logs, strict=True) if log.exists())

    def lost_nodes(self, lines: int = 20) -> str:
        """What the GCS logged about nodes it declared dead (a raylet that missed its health checks, or
        exited), for a test that found a node gone."""
        said = [line for log in sorted(Path(self.temp).glob("session_*/logs/gcs_server.out"))
                for line in log.read_text(errors="replace").splitlines() if "Node is dead" in line or "marked dead" in line]
        return "\n".join(dict.fromkeys(said[-lines:])) or "(the GCS logged no dead node)"

    def stop(self) -> None:
        """Every node's process group, then any process of this cluster that left it (found by its
        temp dir on their command line); the temp dir. SIGKILL: the cluster is thrown away with its
        temp dir, so `ray start --block`'s orderly shutdown on SIGTERM (about 5 s a node) buys nothing."""
        import psutil

        for proc in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.nodes:
            proc.wait()
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(self.temp in part for part in p.info["cmdline"] or ()):
                    p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


def start_cluster(head_cpus: int = 1, head_resources: dict[str, float] | None = None,
                  token: str | None = None, wait: float = 120, _retry: bool = True) -> RayCluster:
    """A head node with its job server; add worker nodes with `add_node`."""
    cluster = RayCluster(tempfile.mkdtemp(prefix="rc", dir="/tmp"), free_port(), free_port(), token)
    head = cluster._start(["--head", f"--port={cluster.port}", f"--num-cpus={head_cpus}",
                           f"--resources={json.dumps(head_resources or {})}", "--include-dashboard=true",
                           "--dashboard-host=127.0.0.1", f"--dashboard-port={cluster.dashboard}",
                           f"--ray-client-server-port={free_port()}"], "head")
    deadline = time.monotonic() + wait
    while not cluster.alive_nodes():
        if head.poll() is not None or time.monotonic() > deadline:
            log = cluster.logs[0].read_text()[-3000:]
            cluster.stop()
            if _retry and head.poll() is not None and RAY_START_TIMED_OUT in log:
                return start_cluster(head_cpus, head_resources, token, wait, _retry=False)
            raise RuntimeError(f"ray head did not start: {log}")
        time.sleep(0.5)
    return cluster
