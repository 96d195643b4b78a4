"""omni's local Prefect server: the embedded default's API, started on first need, reused, and
stopped once unused.

Without PREFECT_API_URL, the first `omni run` / `omni ingest` in a directory starts `prefect server
start` on 127.0.0.1 (a free port, else the port its last server had) as a detached process with
PREFECT_HOME=.omni/prefect, records it in `.omni/prefect/omni-server.json` and points its own flow at
it; later commands find it there and reuse it, so they skip Prefect's temporary server (importing
Prefect's server, starting it, migrating its database: ~10 s of a cached re-run) and the UI stays at
hand. The server stops itself after OMNI_PREFECT_SERVER_IDLE_MINUTES (default 30) without use
(flows/local_prefect_server.py says what counts as use); `omni server start` starts one that stays
until `omni server stop`.

- One server per PREFECT_HOME: the record is read and written under an exclusive lock
  (`omni-server.lock`, fcntl), so concurrent commands start one server and share it; a command that
  uses it adds itself to the record's `clients` under that lock, and the server decides to stop under
  it too, so it never stops under a command that just found it.
- A record whose process is gone (or is not a Prefect server any more) is stale: the next command
  starts a new server and replaces it.
- Every server started is also listed in the user's registry (`$OMNI_CACHE_DIR/prefect-servers/`, one
  file naming its PREFECT_HOME), so `omni server status` shows every server omni started on this
  machine and `omni server stop --all` stops them; a server that went away is pruned from it.
- The server starts in the background: `start_local_server` returns at once, with a function that
  waits until the server answers (the caller imports its flow's modules meanwhile).
- Its UI calls its API at the relative `/api` (PREFECT_UI_API_URL): on whatever address the browser
  used (Prefect's default, built from host and port settings that `--port` does not set, pointed the
  UI at 127.0.0.1:4200).
- OMNI_PREFECT_SERVER=temporary keeps Prefect's own temporary server per command (what the test
  suite uses, so no server outlives it).

Nothing here imports Prefect: it runs before Prefect reads its settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omni_core.errors import OmniError
from omni_core.file_lock import file_lock
from omni_core.paths import cache_dir

RECORD = "omni-server.json"
LOCK = "omni-server.lock"
LOG = "omni-server.log"
LAST_PORT = "omni-server.port"  # the port of the last server of this PREFECT_HOME: its links work again
MODE_VARIABLE = "OMNI_PREFECT_SERVER"  # "local" (default) or "temporary"
IDLE_VARIABLE = "OMNI_PREFECT_SERVER_IDLE_MINUTES"
DEFAULT_IDLE_MINUTES = 30.0
UI_API_URL = "/api"  # relative: the UI calls the API on the address the browser used (a tunnel's too)
START_TIMEOUT_S = float(os.environ.get("OMNI_PREFECT_SERVER_START_TIMEOUT", "180"))  # a fresh database migrates first


class LocalServerError(OmniError):
    """omni's local Prefect server did not start or does not answer."""


@dataclass
class LocalServer:
    pid: int
    port: int
    home: str
    started_at: float
    idle_minutes: float | None = None  # stops after this long unused; None: stays until `omni server stop`
    last_used: float = 0.0  # when a command last claimed it
    clients: list[list[float]] = field(default_factory=list)  # [pid, claimed at] of the commands that claimed it
    entry: str = ""  # its file in the registry

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def stops(self) -> str:
        """When it stops, in words."""
        if self.idle_minutes is None:
            return "stays until `omni server stop`"
        return f"stops after {self.idle_minutes:g} min without use"


def wanted() -> bool:
    """A local server is used unless OMNI_PREFECT_SERVER=temporary."""
    mode = os.environ.get(MODE_VARIABLE, "local").strip().lower()
    if mode not in ("local", "temporary"):
        raise LocalServerError(f"{MODE_VARIABLE}={mode!r}: use 'local' (omni's reused Prefect server, the "
                               "default) or 'temporary' (Prefect's own server for each command)")
    return mode == "local"


def configured_idle_minutes() -> float:
    """OMNI_PREFECT_SERVER_IDLE_MINUTES: how long a server started by a command may go unused."""
    raw = os.environ.get(IDLE_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_IDLE_MINUTES
    try:
        minutes = float(raw)
    except ValueError:
        minutes = math.nan
    if not (math.isfinite(minutes) and minutes > 0):
        raise LocalServerError(f"{IDLE_VARIABLE}={raw!r}: give the minutes without use after which omni's local "
                               f"Prefect server stops (a number > 0; default {DEFAULT_IDLE_MINUTES:g}); "
                               "`omni server start` starts one that stays")
    return minutes


@contextlib.contextmanager
def locked(home: Path, create: bool = True) -> Iterator[None]:
    """The lock of `home`'s record; `create=False` does not create a missing home (FileNotFoundError)."""
    if create:
        home.mkdir(parents=True, exist_ok=True)
    with file_lock(home / LOCK):
        yield


def read_record(home: Path) -> LocalServer | None:
    try:
        return LocalServer(**json.loads((home / RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _write(home: Path, server: LocalServer) -> None:
    tmp = home / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(asdict(server)))
    os.replace(tmp, home / RECORD)


def forget(home: Path, server: LocalServer) -> None:
    """Removes `server`'s record and registry file (under `home`'s lock)."""
    (home / RECORD).unlink(missing_ok=True)
    if server.entry:
        Path(server.entry).unlink(missing_ok=True)


EXEC_WAIT_S = 5.0  # how long a just-spawned process may show no command line (see _alive)


def _exists(pid: int) -> bool:
    """A process of this user has this pid (another user's is not one omni started here)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _alive(pid: int) -> bool:
    """The process exists and is a Prefect server (not a pid the system gave to something else)."""
    if not _exists(pid):
        return False
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


def _free_port(preferred: int | None = None) -> int:
    """`preferred` if it is free, else a port the system picks."""
    for port in ((preferred,) if preferred else ()) + (0,):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise AssertionError("unreachable: port 0 always binds")


def _last_port(home: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int((home / LAST_PORT).read_text())
    return None


def registry() -> Path:
    """The user's list of the servers omni started: one file per server, naming its PREFECT_HOME."""
    return cache_dir("prefect-servers")


def _spawn(home: Path, port: int | None, idle: float | None) -> LocalServer:
    port = port or _free_port(_last_port(home))
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": UI_API_URL}
    for name in ("PREFECT_API_URL", "PREFECT_UI_URL", MODE_VARIABLE):
        env.pop(name, None)
    with open(home / LOG, "ab") as log:
        # flows/local_prefect_server.py runs `prefect server start` (the arguments after its name) with
        # its idle stop; its own session: Ctrl-C in this terminal does not reach it
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.local_prefect_server", "prefect", "server", "start", "--host", "127.0.0.1",
             "--port", str(port)],
            env=env, cwd=home, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    _spawned[proc.pid] = proc  # kept, so this process can tell when it exits (no zombie check needed)
    (home / LAST_PORT).write_text(str(port))
    entry = registry() / f"{hashlib.sha256(str(home).encode()).hexdigest()[:16]}.json"
    entry.write_text(json.dumps({"home": str(home)}))
    return LocalServer(pid=proc.pid, port=port, home=str(home), started_at=time.time(), idle_minutes=idle,
                       entry=str(entry))


_spawned: dict[int, subprocess.Popen] = {}


def _running(server: LocalServer) -> bool:
    proc = _spawned.get(server.pid)
    if proc is not None:
        return proc.poll() is None
    return _alive(server.pid)


def _claim(home: Path, idle: float | None, port: int | None = None) -> LocalServer:
    """The recorded server if its process runs, else a new one (started, recorded; on `port` if given)
    that stops after `idle` minutes unused; with this process added to its clients, and made to stay if
    `idle` is None. Under the lock, so concurrent commands start one, and the server cannot decide to
    stop while one finds it."""
    with locked(home):
        server = read_record(home)
        if server is None or not _running(server):
            server = _spawn(home, port, idle)
        now = time.time()
        server.clients = [c for c in server.clients if c[0] != os.getpid() and _exists(int(c[0]))] + [[os.getpid(), now]]
        server.last_used = now
        if idle is None:
            server.idle_minutes = None
        _write(home, server)
        return server


def start_local_server(home: str | Path, stay: bool = False) -> tuple[LocalServer, Callable[[], LocalServer]]:
    """Starts omni's local Prefect server for `home` (PREFECT_HOME) unless one runs, without waiting
    for it; returns the server (its URL is known at once) and the function that waits until it answers
    (LocalServerError with its log's tail if it does not within OMNI_PREFECT_SERVER_START_TIMEOUT
    seconds, default 180). `stay`: it does not stop when unused (`omni server start`)."""
    home = Path(home).resolve()
    idle = None if stay else configured_idle_minutes()
    server = _claim(home, idle)
    url = server.api_url  # the caller's Prefect reads it before the server answers: it must not change

    def wait() -> LocalServer:
        nonlocal server
        deadline = time.monotonic() + START_TIMEOUT_S
        restarted = False
        while not _answers(server):
            if not _running(server):
                if not restarted:  # a server that died before it answered: one more try, same port
                    restarted = True
                    server = _claim(home, idle, server.port)
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
    server = read_record(Path(home).resolve())
    return server if server is not None and _running(server) and _answers(server) else None


def registered_servers() -> list[LocalServer]:
    """Every server in the registry whose process runs, oldest first; files of servers that went away
    (killed, the machine restarted, their folder deleted) are removed."""
    servers = []
    for entry in sorted(registry().glob("*.json")):
        try:
            home = Path(json.loads(entry.read_text())["home"])
            with locked(home, create=False):  # a deleted folder is not created again
                server = read_record(home)
                if server is not None and server.entry == str(entry) and _running(server):
                    servers.append(server)
                    continue
                entry.unlink(missing_ok=True)
        except FileNotFoundError:
            entry.unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours: left alone
    return sorted(servers, key=lambda s: s.started_at)


def stop_local_server(home: str | Path, timeout: float = 20.0) -> LocalServer | None:
    """Stops the recorded server of `home` (its whole process group) and removes its record and
    registry file; returns what was stopped, None when nothing ran."""
    home = Path(home).resolve()
    with locked(home):
        server = read_record(home)
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
        forget(home, server)
        return server if running else None


def stop_all_servers() -> list[LocalServer]:
    """Stops every server in the registry; returns those stopped."""
    return [s for s in (stop_local_server(server.home) for server in registered_servers()) if s is not None]


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
