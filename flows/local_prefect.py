"""omni's local Prefect server: the embedded default's API, started once and reused.

Without PREFECT_API_URL, the first `omni run` / `omni ingest` in a directory starts `prefect server
start` on 127.0.0.1 (a free port) as a detached process with PREFECT_HOME=.omni/prefect, records it in
`.omni/prefect/omni-server.json` and points its own flow at it; later commands find it there and
reuse it, so they skip Prefect's temporary server (importing Prefect's server, starting it, migrating
its database: ~10 s of a cached re-run) and the UI stays at hand. `omni server stop` stops it.

- One server per PREFECT_HOME: the record is read and written under an exclusive lock
  (`omni-server.lock`, fcntl), so concurrent commands start one server and share it.
- A record whose process is gone (or is not a Prefect server any more) is stale: the next command
  starts a new server and replaces it.
- The server starts in the background: `start_local_server` returns at once, with a function that
  waits until the server answers (the caller imports its flow's modules meanwhile).
- OMNI_PREFECT_SERVER=temporary keeps Prefect's own temporary server per command (what the test
  suite uses, so no server outlives it).

Nothing here imports Prefect: it runs before Prefect reads its settings.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from omni_core.errors import OmniError

RECORD = "omni-server.json"
LOCK = "omni-server.lock"
LOG = "omni-server.log"
MODE_VARIABLE = "OMNI_PREFECT_SERVER"  # "local" (default) or "temporary"
START_TIMEOUT_S = float(os.environ.get("OMNI_PREFECT_SERVER_START_TIMEOUT", "180"))  # a fresh database migrates first


class LocalServerError(OmniError):
    """omni's local Prefect server did not start or does not answer."""


@dataclass
class LocalServer:
    pid: int
    port: int
    home: str
    started_at: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"


def wanted() -> bool:
    """A local server is used unless OMNI_PREFECT_SERVER=temporary."""
    mode = os.environ.get(MODE_VARIABLE, "local").strip().lower()
    if mode not in ("local", "temporary"):
        raise LocalServerError(f"{MODE_VARIABLE}={mode!r}: use 'local' (omni's reused Prefect server, the "
                               "default) or 'temporary' (Prefect's own server for each command)")
    return mode == "local"


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(home: Path) -> LocalServer | None:
    try:
        return LocalServer(**json.loads((home / RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


EXEC_WAIT_S = 5.0  # how long a just-spawned process may show no command line (see _alive)


def _alive(pid: int) -> bool:
    """The process exists and is a Prefect server (not a pid the system gave to something else)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not one we started
    if not Path("/proc/self").exists():
        return True  # no /proc: trust the pid
    # Popen returns once the exec has closed its close-on-exec pipe, before the kernel has placed the new
    # program's argv: a server spawned a moment ago by a concurrent command may still read an empty command
    # line (most did in a tight loop here), so an empty one is read again for a while. Zombies and kernel
    # threads, the other processes without one, are never our server.
    deadline = time.monotonic() + EXEC_WAIT_S
    while True:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False  # it exited meanwhile
        if stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:
            return False
        if cmdline != [b""] or time.monotonic() > deadline:
            return b"prefect" in cmdline and b"server" in cmdline
        time.sleep(0.02)


def _answers(server: LocalServer, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{server.api_url}/health", timeout=timeout) as response:  # noqa: S310 (127.0.0.1)
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(home: Path, port: int | None = None) -> LocalServer:
    port = port or _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for name in ("PREFECT_API_URL", "PREFECT_UI_URL", MODE_VARIABLE):
        env.pop(name, None)
    with open(home / LOG, "ab") as log:
        proc = subprocess.Popen(  # its own session: Ctrl-C in this terminal does not reach it
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, cwd=home, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    _spawned[proc.pid] = proc  # kept, so this process can tell when it exits (no zombie check needed)
    server = LocalServer(pid=proc.pid, port=port, home=str(home), started_at=time.time())
    tmp = home / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(server)))
    os.replace(tmp, home / RECORD)
    return server


_spawned: dict[int, subprocess.Popen] = {}


def _running(server: LocalServer) -> bool:
    proc = _spawned.get(server.pid)
    if proc is not None:
        return proc.poll() is None
    return _alive(server.pid)


def _claim(home: Path, port: int | None = None) -> LocalServer:
    """The recorded server if its process runs, else a new one (started, recorded; on `port` if given).
    Under the lock, so concurrent commands start one."""
    with _locked(home):
        server = _read(home)
        if server is not None and _running(server):
            return server
        return _spawn(home, port)


def start_local_server(home: str | Path) -> tuple[LocalServer, Callable[[], LocalServer]]:
    """Starts omni's local Prefect server for `home` (PREFECT_HOME) unless one runs, without waiting
    for it; returns the server (its URL is known at once) and the function that waits until it answers
    (LocalServerError with its log's tail if it does not within OMNI_PREFECT_SERVER_START_TIMEOUT
    seconds, default 180)."""
    home = Path(home).resolve()
    server = _claim(home)
    url = server.api_url  # the caller's Prefect reads it before the server answers: it must not change

    def wait() -> LocalServer:
        nonlocal server
        deadline = time.monotonic() + START_TIMEOUT_S
        restarted = False
        while not _answers(server):
            if not _running(server):
                if not restarted:  # a server that died before it answered: one more try, same port
                    restarted = True
                    server = _claim(home, server.port)
                    if server.api_url == url:
                        continue
                raise LocalServerError(f"omni's local Prefect server exited at start-up (or moved to another "
                                       f"port: run the command again); its log ({home / LOG}) ends:\n"
                                       f"{_tail(home / LOG)}")
            if time.monotonic() > deadline:
                raise LocalServerError(
                    f"omni's local Prefect server (pid {server.pid}, {server.url}) did not answer within "
                    f"{START_TIMEOUT_S:.0f} s; stop it with `omni server stop` and retry, or set "
                    f"{MODE_VARIABLE}=temporary. Its log ({home / LOG}) ends:\n{_tail(home / LOG)}")
            time.sleep(0.2)
        return server

    return server, wait


def running_server(home: str | Path) -> LocalServer | None:
    """The recorded server of `home` if it runs and answers; starts nothing."""
    server = _read(Path(home).resolve())
    return server if server is not None and _running(server) and _answers(server) else None


def stop_local_server(home: str | Path, timeout: float = 20.0) -> LocalServer | None:
    """Stops the recorded server of `home` (its whole process group) and removes the record; returns
    what was stopped, None when nothing ran."""
    home = Path(home).resolve()
    with _locked(home):
        server = _read(home)
        if server is None:
            return None
        running = _running(server)
        if running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _running(server) and time.monotonic() < deadline:
                _reap(server.pid)
                time.sleep(0.1)
            if _running(server):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(server.pid, signal.SIGKILL)
            _reap(server.pid)
        (home / RECORD).unlink(missing_ok=True)
        return server if running else None


def _reap(pid: int) -> None:
    proc = _spawned.get(pid)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
