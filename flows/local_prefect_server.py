"""The process of omni's local Prefect server (flows/local_prefect.py starts it): Prefect's own
`prefect server start`, run in this process, and a thread that stops it once it went unused for its
record's `idle_minutes` (None: it stays until `omni server stop`).

Used means any of: an omni command that claimed it still runs (the record's `clients`), a connection
is open to its port (a browser on its UI, which polls the API; a flow run's client), or a command
claimed it within the period. The decision is taken under the record's lock, the one a command holds
while it finds the server and adds itself, so a server never stops under a command that just found it:
that command is a live client. The server also stops at once when its PREFECT_HOME is deleted (a
temporary folder cleaned up) or its record no longer names it (`omni server stop` lost track of it).

Run as `python -m flows.local_prefect_server prefect server start --host ... --port ...`: the
arguments after the module's name are Prefect's own, so the process reads as a `prefect server`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from flows.local_prefect import LocalServer, forget, locked, read_record

SHUTDOWN_GRACE_S = 30.0  # after SIGTERM, how long Prefect may take to shut down before the process exits


def _client_runs(client: list[float]) -> bool:
    """The command [pid, claimed at] still runs: its pid is a process created before its claim."""
    import psutil

    pid, claimed_at = int(client[0]), client[1]
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= claimed_at + 1
    except psutil.Error:
        return False


def _connected(port: int) -> bool:
    """A TCP connection to this server's port is open (its own process's sockets: no privilege needed)."""
    import psutil

    return any(c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
               for c in psutil.Process().net_connections(kind="tcp"))


def in_use(server: LocalServer) -> bool:
    return any(_client_runs(c) for c in server.clients) or _connected(server.port)


def stop_reason(home: Path, last_active: float) -> tuple[str | None, float]:
    """Why this server should stop now (None: it stays), and when it was last seen in use."""
    if not home.is_dir():
        return "its PREFECT_HOME was deleted", last_active
    try:
        with locked(home, create=False):
            server = read_record(home)
            if server is None or server.pid != os.getpid():
                return "its record no longer names it", last_active
            now = time.time()
            if server.idle_minutes is None or in_use(server):
                return None, now
            if now - max(last_active, server.last_used) < server.idle_minutes * 60:
                return None, last_active
            forget(home, server)  # under the lock: the next command starts a new server
            return f"unused for {server.idle_minutes:g} min", last_active
    except FileNotFoundError:
        return "its PREFECT_HOME was deleted", last_active


def watch(home: Path) -> None:
    last_active = time.time()
    entry = ""
    while True:
        server = read_record(home)
        if server is not None and server.pid == os.getpid():
            entry = server.entry
            poll_s = min(10.0, max(0.5, (server.idle_minutes or 1.0) * 60 / 20))
        else:
            poll_s = 1.0
        time.sleep(poll_s)
        reason, last_active = stop_reason(home, last_active)
        if reason is None:
            continue
        if entry and not home.exists():  # no record left to say where its registry file is
            Path(entry).unlink(missing_ok=True)
        print(f"omni: stopping the local Prefect server ({reason})", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler: Prefect shuts down cleanly
        time.sleep(SHUTDOWN_GRACE_S)
        os._exit(0)


def main() -> None:
    home = Path(os.environ["PREFECT_HOME"]).resolve()
    threading.Thread(target=watch, args=(home,), name="omni-idle-stop", daemon=True).start()
    sys.argv = sys.argv[1:]  # ["prefect", "server", "start", ...]: Prefect's command line
    from prefect.cli import app

    sys.exit(app())


if __name__ == "__main__":
    main()
