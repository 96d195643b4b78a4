"""Which interpreter runs a verl stage's Ray Job: one decision, made here, for the command the job runs
and for the check that composes it before anything is submitted (precheck.py).

- `backend.python` set: the job runs it. The check composes with it when it has verl on this machine;
  when it has none here (an interpreter of the cluster's image), with this checkout's `.venv-verl`
  as a stand-in, and says so.
- `backend.python` left out: this checkout's `.venv-verl` when it has verl (a laptop after `make
  setup`), else `python3` (the CUDA image puts verl's venv on PATH).

Whether the job's interpreter has verl where the job runs (the Ray nodes) is asked of the cluster
before the first submission (jobs.job.probe_interpreter): a stage whose interpreter has none there
is refused with one message naming `backend.python`, and no job is submitted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_VERL_PYTHON = Path(__file__).resolve().parents[3] / ".venv-verl" / "bin" / "python"
IMAGE_PYTHON = "python3"
PROBE_TIMEOUT_S = 60

# the version, then the newest mtime of verl's Hydra config files (what composition reads), without importing
# verl; bytecode is left out: a verl process's first import writes __pycache__ there, which changes no verdict
PROBE = """
import importlib.util, os
from importlib.metadata import version
spec = importlib.util.find_spec("verl")
config = os.path.join(os.path.dirname(spec.origin), "trainer", "config")
newest = max((os.stat(os.path.join(d, f)).st_mtime_ns for d, _, fs in os.walk(config) if "__pycache__" not in d
              for f in fs if not f.endswith(".pyc")), default=0)
print(version("verl"), newest)
"""


@dataclass(frozen=True)
class Interpreter:
    """The job's interpreter and what checks its command here."""

    job: str  # what the Ray Job runs
    origin: str  # where that choice comes from: backend.python, .venv-verl, or the image default
    check: str | None  # the interpreter that composes the command on this machine (None: no verl here)
    check_origin: str  # "verl 0.9.1 of .venv-verl (/path)", or why there is none
    install: str = ""  # the check interpreter's verl install (path, version, config mtime): the compose cache's key

    @property
    def checked_by_job_interpreter(self) -> bool:
        return self.check is not None and os.path.realpath(self.check) == os.path.realpath(self.job)


def _probe(python: str) -> tuple[str, str] | None:
    """(verl's version, its config files' newest mtime) for `python`, or None when it has no verl here."""
    found = shutil.which(python) if os.sep not in python else (python if os.access(python, os.X_OK) else None)
    if not found:
        return None
    try:
        proc = subprocess.run([found, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = proc.stdout.split()
    return (fields[0], fields[1]) if proc.returncode == 0 and len(fields) == 2 else None


_resolved: dict[tuple[str | None, str], Interpreter] = {}


def resolve(backend_python: str | None) -> Interpreter:
    """The interpreter decision for a stage whose `backend.python` is `backend_python` (None: left out);
    probed once per process."""
    key = (backend_python, str(REPO_VERL_PYTHON))
    if key not in _resolved:
        _resolved[key] = _resolve(backend_python)
    return _resolved[key]


def _resolve(backend_python: str | None) -> Interpreter:
    repo = str(REPO_VERL_PYTHON)
    repo_probe = _probe(repo)
    if backend_python is None:
        job, origin = (repo, ".venv-verl") if repo_probe else (IMAGE_PYTHON, f"the default ({IMAGE_PYTHON})")
    else:
        job, origin = backend_python, "backend.python"
    job_probe = repo_probe if job == repo else _probe(job)
    for python, probed, where in ((job, job_probe, origin), (repo, repo_probe, ".venv-verl")):
        if probed:
            return Interpreter(job, origin, python, f"verl {probed[0]} of {where} ({python})",
                               f"{os.path.realpath(python)} {' '.join(probed)}")
    return Interpreter(job, origin, None, f"neither the job's interpreter ({job}, {origin}) nor {repo} has verl "
                                          "installed here (`make setup` builds .venv-verl)")


def how_to_set(address: str) -> str:
    """What to set `backend.python` to, for a message that refuses the job's interpreter."""
    local = resolve(None)
    here = (f"on this machine `make setup` built {REPO_VERL_PYTHON} (leave backend.python out to use it, "
            "when the Ray nodes are this machine)") if local.job == str(REPO_VERL_PYTHON) else \
        "on this machine `make setup` builds .venv-verl"
    return (f"set backend.python to an interpreter that has verl on the Ray nodes of {address}: {here}; in the "
            f"CUDA image it is {IMAGE_PYTHON}")
