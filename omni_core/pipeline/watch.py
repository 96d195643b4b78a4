"""Step progress of work running elsewhere (a Ray actor), seen from the driver through MLflow.

The trainer logs its metrics per step to the stage's MLflow run; `StepWatcher` polls the history of
one metric and calls `on_step(step)` when it advances, so the driver (a Prefect task) can report
progress while it waits on the actor.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType

from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)


class StepWatcher:
    def __init__(self, tracking_uri: str, run_id: str, metric: str, on_step: Callable[[int], None],
                 interval_s: float = 1.0):
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.run_id, self.metric, self.on_step, self.interval_s = run_id, metric, on_step, interval_s
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"omni-steps-{run_id[:8]}", daemon=True)

    def __enter__(self) -> StepWatcher:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def poll(self) -> None:
        try:
            history = self.client.get_metric_history(self.run_id, self.metric)
            step = max((m.step for m in history), default=0)
            if step > self.seen:
                self.seen = step
                self.on_step(step)
        except Exception as exc:  # progress is best effort: never fail the stage over it
            log.debug("step progress of run %s: %s", self.run_id, exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()
