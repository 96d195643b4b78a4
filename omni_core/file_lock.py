"""An exclusive lock between the processes of one machine, on a file beside what it guards.

fcntl's flock, from the standard library: the kernel releases it when its holder dies, so a killed
run leaves no stale lock behind (a lock file holding a pid would need a liveness check), and it needs
no dependency. It guards what only one process may do at once on a local file: the first creation of
a sqlite database (MLflow's, Prefect's) that several `omni` runs open together."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[None]:
    """Holds an exclusive lock on `path` (created if missing) for the with-block; waits for it, or
    (`wait=False`) raises BlockingIOError when another process holds it."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
