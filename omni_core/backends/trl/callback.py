"""The transformers callback a trl stage's workers add to TRL's trainer (omni_core.backends.trl.worker)."""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from omni_core.backends.trl.metrics import STEP_METRIC, SUMMARY_KEYS


class OmniCallback(TrainerCallback):
    """TRL's metrics per step to the stage's MLflow run (rank 0, TRL's names, plus `timing_s/step`); each
    saved `checkpoint-N` committed to the store (every rank; not the final step: that is the model). A
    resumed worker group does not log again the steps the run already has."""

    def __init__(self, worker: Any, resumed: int):
        self.worker, self.started = worker, 0.0
        self.skip_until = max(resumed, worker.logged_steps())
        self.step_s: dict[int, float] = {}
        self.last: dict[str, float] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_s[state.global_step] = time.perf_counter() - self.started

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        step, logs = state.global_step, logs or {}
        if SUMMARY_KEYS & logs.keys() or step not in self.step_s:  # the end-of-training summary is not a step's
            return
        metrics = {k: float(v) for k, v in logs.items() if isinstance(v, int | float)}
        metrics[STEP_METRIC] = self.step_s[step]
        self.last = metrics
        if step > self.skip_until:
            self.worker.log(metrics, step)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step < args.max_steps:  # the final step is committed as the model
            self.worker.commit(state.global_step, self.last)
