"""Prefect set-up for the `omni` commands that run flows: the embedded API's home, omni's local
Prefect server (flows/local_prefect.py) and quiet tracebacks.

Nothing here imports Prefect at module level: call `use_embedded_prefect()` and `start_embedded_api()`
before the first Prefect import (Prefect reads its settings then), `quiet_prefect_tracebacks()` after.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from flows.cli_options import state
from omni_core.file_lock import file_lock
from omni_core.paths import OMNI_HOME

if TYPE_CHECKING:
    from flows.local_prefect import LocalServer


def embedded_home() -> str:
    """The embedded default's PREFECT_HOME: $PREFECT_HOME, else .omni/prefect."""
    return os.environ.get("PREFECT_HOME") or str((OMNI_HOME / "prefect").resolve())


def use_embedded_prefect() -> str | None:
    """Without PREFECT_API_URL, Prefect runs its API in-process; keep its database under .omni/."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    home = os.environ.setdefault("PREFECT_HOME", embedded_home())
    Path(home).mkdir(parents=True, exist_ok=True)  # Prefect does not create it: its SQLite open would fail
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The first start migrates a fresh database; on a busy 2-core machine that can exceed the 20 s default.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    return home


def start_embedded_api(home: str | None) -> Callable[[], LocalServer | None]:
    """On the embedded default (`home` from `use_embedded_prefect()`): omni's local Prefect server for
    `home`, found or started in the background, with this process's PREFECT_API_URL and PREFECT_UI_URL
    pointing at it. Returns the function to call before the flow: it waits until the server answers
    and returns it. With a user's PREFECT_API_URL (home None) or OMNI_PREFECT_SERVER=temporary
    (Prefect's own temporary server per command) it does nothing and returns None."""
    from flows import local_prefect

    if home is None or not local_prefect.wanted():
        return lambda: None
    server, wait = local_prefect.start_local_server(home)
    os.environ["PREFECT_API_URL"] = server.api_url
    os.environ["PREFECT_UI_URL"] = server.url
    return wait


def use_running_api(home: str | None) -> str | None:
    """For commands that only read the API (`omni status`): omni's local server of `home` when it runs
    (PREFECT_API_URL set to it); None otherwise (Prefect then starts its temporary server on the same
    database). Starts nothing."""
    from flows import local_prefect

    if home is None or not local_prefect.wanted():
        return None
    server = local_prefect.running_server(home)
    if server is None:
        return None
    os.environ["PREFECT_API_URL"] = server.api_url
    os.environ["PREFECT_UI_URL"] = server.url
    return server.url


def start_embedded_prefect_once(home: str | None) -> None:
    """The first `omni` run on a fresh PREFECT_HOME (or after a Prefect upgrade) starts Prefect's
    temporary server under a lock beside its database, so that one process creates and migrates the
    database and registers Prefect's blocks; several runs started together otherwise each migrate the
    same sqlite file at once and fail (`NoSuchTableError: block`). The server started here is the one
    the flow then uses (Prefect keeps one per process); later runs find the marker and skip the lock."""
    if home is None:
        return
    import prefect
    from prefect.server.api.server import SubprocessASGIServer

    marker = Path(home) / f".omni-migrated-{prefect.__version__}"
    if marker.exists():
        return
    with file_lock(Path(home) / "prefect.db.lock"):
        if not marker.exists():
            SubprocessASGIServer().start()
            marker.touch()


class _WithoutTracebacks(logging.Formatter):
    """Wraps a console formatter so log records print without their traceback (the CLI prints one line)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def quiet_prefect_tracebacks() -> None:
    """Prefect logs a failed run's traceback to the console; keep it for its API/UI, drop it here unless --debug."""
    if state.debug:
        return
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)] + [logging.getLogger()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _WithoutTracebacks):
                handler.setFormatter(_WithoutTracebacks(handler.formatter))
