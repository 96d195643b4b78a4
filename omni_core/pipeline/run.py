"""A pipeline run: the store, the MLflow parent run, and the stages executed in dependency order.

Orchestrators (the Prefect flow, a notebook) call `start`, then `run_stage` per stage, then
`finish`; all the work and all the lineage happen here, so the flow stays a thin composition.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omni_core.config import PipelineConfig, config_digest
from omni_core.lineage import Tracker, git_commit
from omni_core.pipeline.stages import stage_runner
from omni_core.storage import Store

Progress = Callable[[str], None]


@dataclass
class StageOutcome:
    name: str
    kind: str
    status: str  # "completed" | "reused" | "failed"
    seconds: float
    mlflow_run_id: str
    outputs: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class PipelineRun:
    config: PipelineConfig
    store: Store
    tracker: Tracker
    parent_run_id: str
    config_digest: str
    progress: Progress = print
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)

    @classmethod
    def start(cls, config: PipelineConfig, *, tags: dict[str, str] | None = None, progress: Progress = print
              ) -> PipelineRun:
        store = Store(config.store)
        store.check_writable()  # an unreachable or read-only store fails here, before any work
        tracker = Tracker(config.tracking_uri)
        digest = config_digest(config)
        run_tags = {"omni.pipeline": config.name, "omni.config_digest": digest, "omni.git_commit": git_commit(),
                    "omni.store": store.root, **(tags or {})}
        parent = tracker.start_run(config.name, run_name=config.name, tags=run_tags)
        tracker.log_dict(parent, config.model_dump(mode="json"), "config/pipeline.json")
        progress(f"pipeline {config.name}: MLflow run {parent} at {tracker.tracking_uri}")
        return cls(config, store, tracker, parent, digest, progress)

    def stage_tags(self, stage_name: str, kind: str) -> dict[str, str]:
        parent_tags = self.tracker.client.get_run(self.parent_run_id).data.tags
        inherited = {k: v for k, v in parent_tags.items() if k.startswith(("omni.", "prefect."))}
        return {**inherited, "omni.stage": stage_name, "omni.stage_kind": kind}

    def run_stage(self, name: str) -> StageOutcome:
        stage = self.config.stage(name)
        child = self.tracker.start_run(self.config.name, run_name=name, tags=self.stage_tags(name, stage.kind),
                                       parent_run_id=self.parent_run_id)
        started = time.perf_counter()
        try:
            outputs = stage_runner(stage.kind)(self, stage, child)
        except BaseException as exc:
            self.tracker.end_run(child, ok=False)
            self.outcomes[name] = StageOutcome(name, stage.kind, "failed", time.perf_counter() - started, child,
                                               error=str(exc))
            raise
        self.tracker.end_run(child, ok=True)
        status = "reused" if outputs.get("reused") else "completed"
        outcome = StageOutcome(name, stage.kind, status, time.perf_counter() - started, child, outputs)
        self.outcomes[name] = outcome
        return outcome

    def finish(self, ok: bool) -> dict[str, Any]:
        self.tracker.end_run(self.parent_run_id, ok=ok)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "pipeline": self.config.name,
            "store": self.store.root,
            "tracking_uri": self.tracker.tracking_uri,
            "mlflow_parent_run_id": self.parent_run_id,
            "config_digest": self.config_digest,
            "stages": [
                {"name": o.name, "kind": o.kind, "status": o.status, "seconds": round(o.seconds, 2),
                 "mlflow_run_id": o.mlflow_run_id, "outputs": o.outputs, "error": o.error}
                for o in self.outcomes.values()
            ],
        }
