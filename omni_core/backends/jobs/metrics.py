"""verl's metrics, from the job to the stage's MLflow run, on every tracking URI.

A job's trainer logs through verl's `file` logger (`trainer.logger=[console,file]`) into a JSON-lines
file on the shared path (`VERL_FILE_LOGGER_PATH`: `{metrics dir}/{submission id}.jsonl`, one per job,
since verl opens it for writing, emptied, at every start), and the driver that follows the job relays
each new line into the stage's run with our own MLflow client. Why not verl's `mlflow` logger: the
job's interpreter has only `mlflow-skinny`, which has no SQL store, so on the embedded default
(`sqlite:///...`) verl logged "Proceeding without MLflow tracking" and the run got no metric at all;
and with the run's id in the job's environment, a job could not be found again by a driver whose run
is another (a second run of the same stage after a driver was killed). The relay writes the names
verl's own MLflow logger wrote (`_MlflowLoggingAdapter._sanitize_key`: `@` -> `_at_`, other characters
MLflow refuses -> `_`), so dashboards and our readers (val-core/..._at_N) see what they saw.

A job that succeeded without logging the metric its task always logs (`critic/score/mean`,
`train/loss`) fails its stage with MetricsMissing (not retried): a training whose metrics are gone is
not passed silently.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from omni_core.errors import OmniError

FILE_ENV = "VERL_FILE_LOGGER_PATH"
LOGGER = "file"  # verl's logger name for it (verl/utils/tracking.py FileLogger)
BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics a call
_INVALID = re.compile(r"[^/\w.\- :]")
_SLASHES = re.compile(r"/+")


class MetricsMissing(OmniError):
    """A job succeeded but its stage's run received none of the metrics its trainer always logs."""


def metrics_file(metrics_dir: str | Path, job_id: str) -> Path:
    return Path(metrics_dir) / f"{job_id}.jsonl"


def mlflow_key(name: str) -> str:
    """The metric's name as verl's MLflow logger writes it (module docstring)."""
    return _INVALID.sub("_", _SLASHES.sub("/", name.replace("@", "_at_")))


class MetricsRelay:
    """Follows one job's metrics file and logs its new lines into `run_id` (`poll` between the job's
    polls, and once after it ended). `logged` holds every name it logged."""

    def __init__(self, client: Any, run_id: str, path: str | Path):
        self.client, self.run_id, self.path = client, run_id, Path(path)
        self.offset = 0
        self.logged: set[str] = set()

    def poll(self) -> int:
        """Relay the complete lines written since the last poll; returns how many metrics it logged."""
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return 0
        end = chunk.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offset += end
        metrics = [metric for line in chunk[:end].splitlines() if line.strip() for metric in self._metrics(line)]
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + BATCH])
        self.logged.update(m.key for m in metrics)
        return len(metrics)

    @staticmethod
    def _metrics(line: bytes) -> list[Any]:
        from mlflow.entities import Metric

        try:
            record = json.loads(line)
            step, data = int(record["step"]), record["data"]
        except (ValueError, KeyError, TypeError):
            return []  # not one of the logger's records
        now = int(time.time() * 1000)
        return [Metric(mlflow_key(name), float(value), now, step) for name, value in data.items()
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)]

    def require(self, names: tuple[str, ...], what: str) -> None:
        """MetricsMissing unless the run received at least one of `names` (none asked: nothing to check)."""
        if names and not self.logged & set(names):
            where = (f"its metrics file {self.path} holds {len(self.logged)} other metrics" if self.logged
                     else f"its metrics file {self.path} {'is empty' if self.path.exists() else 'was never written'}")
            raise MetricsMissing(
                f"{what} succeeded, but its MLflow run received none of {', '.join(names)} ({where}); verl logs them "
                f"through its file logger: keep {LOGGER!r} in trainer.logger if backend.overrides sets it")
