"""Prefect set-up for the `omni` commands that run flows: the embedded API's home and quiet tracebacks.

Nothing here imports Prefect at module level: call `use_embedded_prefect()` before the first Prefect
import (Prefect reads its settings then), `quiet_prefect_tracebacks()` after.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from flows.cli_options import state
from omni_core.paths import OMNI_HOME


def use_embedded_prefect() -> str | None:
    """Without PREFECT_API_URL, Prefect runs its API in-process; keep its database under .omni/."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    home = os.environ.setdefault("PREFECT_HOME", str((OMNI_HOME / "prefect").resolve()))
    Path(home).mkdir(parents=True, exist_ok=True)  # Prefect does not create it: its SQLite open would fail
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The first start migrates a fresh database; on a busy 2-core machine that can exceed the 20 s default.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    return home


def start_embedded_prefect_api() -> Callable[[], None]:
    """Starts Prefect's temporary API server (the embedded default) now, in the background, and returns
    the function that waits until it answers (or raises why it did not start).

    Prefect starts that server (a subprocess importing all of Prefect's server: ~10 s of CPU) only at
    the flow's first API call, after this process has imported the flow's modules (torch, MLflow: as
    long again); started here, the two overlap on a second core. The flow's client then finds the
    server running (`SubprocessASGIServer` is one instance per process). Call it after
    `use_embedded_prefect()` and before importing the flow's modules."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    failure: list[BaseException] = []

    def start() -> None:
        try:
            server.start()
        except BaseException as exc:  # re-raised by wait(), in the main thread
            failure.append(exc)

    thread = threading.Thread(target=start, name="prefect-temporary-server", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if failure:
            raise failure[0]

    return wait


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
