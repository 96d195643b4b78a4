"""A pipeline run: the store, the MLflow parent run, and each stage run through the stage cache.

Orchestrators (the Prefect flow, a notebook) call `start`, then `run_stage` per stage once its
upstream stages have finished (passing their outcomes, or letting the run use the ones it ran
itself), then `finish`. All the work and all the lineage happen here, so the flow stays a thin
composition. For each stage `run_stage`:

1. starts an MLflow child run and asks the stage kind what the stage reads (`inputs`);
2. computes the cache key (`omni_core.pipeline.cache`) and, unless the stage is forced, looks for
   its record in the store: a record whose outputs are still there is a cache hit (no work);
3. otherwise runs the stage, then writes its record (last: the record commits the stage).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from omni_core.config import PipelineConfig, config_digest
from omni_core.config.models import AnyStage
from omni_core.errors import ConfigError
from omni_core.lineage import Tracker, git_commit
from omni_core.lineage.redact import redact_mapping
from omni_core.lineage.tracking import inherited_tags
from omni_core.pipeline import cache
from omni_core.pipeline.graph import StageGraph, check_data_flow
from omni_core.pipeline.params import check_force
from omni_core.pipeline.stages import StageKind, stage_kind
from omni_core.storage import Store

Progress = Callable[[str], None]
StepCallback = Callable[[int, int], None]  # (steps done, total steps)

# Where a stage's cached result stands: found (hit), not found (miss), redone on purpose (forced),
# or a stage that cannot be keyed without doing its work (uncached: it always runs).
HIT, MISS, FORCED, UNCACHED = "hit", "miss", "forced", "uncached"


def _no_steps(done: int, total: int) -> None:
    return None


@dataclass
class StageOutcome:
    name: str
    kind: str
    status: str  # "completed" | "reused" (no work was needed) | "failed" | "not_run" (upstream failed)
    seconds: float
    mlflow_run_id: str
    outputs: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    cache: str = ""  # HIT | MISS | FORCED | UNCACHED
    cache_key: str = ""
    note: str = ""  # where a cached result came from, or why the stage ran
    output_digest: str = ""
    record_uri: str = ""
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def cache_hit(self) -> bool:
        return self.cache == HIT

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "status": self.status, "seconds": round(self.seconds, 2),
                "mlflow_run_id": self.mlflow_run_id, "outputs": self.outputs, "error": self.error,
                "cache": self.cache, "cache_key": self.cache_key, "note": self.note,
                "output_digest": self.output_digest, "record_uri": self.record_uri, "report": self.report}


@dataclass
class StageContext:
    """What a stage kind's runner and hooks get: the run, the stage, its ancestors' outcomes."""

    run: PipelineRun
    stage: AnyStage
    upstream: dict[str, StageOutcome]  # every ancestor, in dependency order
    mlflow_run_id: str = ""
    force: bool = False
    on_step: StepCallback = _no_steps
    inputs: dict[str, Any] | None = None
    cache_key: str = ""
    report: dict[str, Any] = field(default_factory=dict)  # kept in the record, not digested

    @property
    def config(self) -> PipelineConfig:
        return self.run.config

    @property
    def store(self) -> Store:
        return self.run.store

    @property
    def tracker(self) -> Tracker:
        return self.run.tracker

    def progress(self, line: str) -> None:
        self.run.progress(line)

    def file_key(self, name: str) -> str:
        """A store key for a file that belongs to this stage's record (e.g. a plot)."""
        folder = cache.files_prefix(self.config.name, self.stage.name, self.cache_key or f"run-{self.mlflow_run_id}")
        return f"{folder}/{name}"


@dataclass
class PipelineRun:
    config: PipelineConfig
    store: Store
    tracker: Tracker
    parent_run_id: str
    config_digest: str
    progress: Progress = print
    force: frozenset[str] = frozenset()
    git_commit: str = ""
    outcomes: dict[str, StageOutcome] = field(default_factory=dict)
    # the parent run's tags as logged (redacted), kept so a stage needs no request to read them back
    parent_tags: dict[str, str] = field(default_factory=dict)
    graph: StageGraph = field(init=False)

    def __post_init__(self) -> None:
        self.graph = StageGraph(self.config)

    @classmethod
    def start(cls, config: PipelineConfig, *, tags: dict[str, str] | None = None, progress: Progress = print,
              force: Iterable[str] = ()) -> PipelineRun:
        forced = check_force(config, force)
        check_data_flow(config)
        store = Store(config.store)
        store.check_writable()  # an unreachable or read-only store fails here, before any work
        tracker = Tracker(config.tracking_uri)
        digest = config_digest(config)
        commit = git_commit()
        run_tags = {"omni.pipeline": config.name, "omni.config_digest": digest, "omni.git_commit": commit,
                    "omni.store": store.root, **(tags or {})}
        if forced:
            run_tags["omni.force"] = ",".join(sorted(forced))
        parent = tracker.start_run(config.name, run_name=config.name, tags=run_tags)
        tracker.log_dict(parent, config.model_dump(mode="json"), "config/pipeline.json")
        progress(f"pipeline {config.name}: MLflow run {parent} at {tracker.tracking_uri}")
        return cls(config, store, tracker, parent, digest, progress, forced, commit,
                   parent_tags=redact_mapping(run_tags))

    def stage_tags(self, stage_name: str, kind: str) -> dict[str, str]:
        if not self.parent_tags:
            self.parent_tags = self.tracker.client.get_run(self.parent_run_id).data.tags
        return {**inherited_tags(self.parent_tags), "omni.stage": stage_name, "omni.stage_kind": kind}

    # ---- one stage -----------------------------------------------------------------------------

    def run_stage(self, name: str, upstream: Mapping[str, StageOutcome] | None = None, *,
                  on_step: StepCallback | None = None) -> StageOutcome:
        """Runs (or takes from the cache) stage `name`. `upstream`: the outcomes of its ancestors
        (default: the ones this run has); each must have finished."""
        stage = self.config.stage(name)
        kind = stage_kind(stage.kind)
        ctx = StageContext(self, stage, self._ancestors(name, upstream), force=name in self.force,
                           on_step=on_step or _no_steps)
        # on a tracking server the child run is created on a thread while the stage's cache key and
        # record lookup proceed (they need no run id); `_run` waits for it before the stage's own work
        run_id = self.tracker.start_run_soon(self.config.name, run_name=name, tags=self.stage_tags(name, stage.kind),
                                             parent_run_id=self.parent_run_id)
        started = time.perf_counter()
        try:
            outcome = self._run(kind, ctx, started, run_id)
        except BaseException as exc:
            if not ctx.mlflow_run_id and run_id.done() and run_id.exception() is None:
                ctx.mlflow_run_id = run_id.result()
            if ctx.mlflow_run_id:
                self.tracker.end_run_later(ctx.mlflow_run_id, ok=False)
            self.outcomes[name] = StageOutcome(name, stage.kind, "failed", time.perf_counter() - started,
                                               ctx.mlflow_run_id, error=_message(exc), cache_key=ctx.cache_key)
            raise
        # the closing tags and status go in the background on a tracking server; finish() waits for them
        self.tracker.end_run_later(ctx.mlflow_run_id, ok=True)
        self.outcomes[name] = outcome
        return outcome

    def _ancestors(self, name: str, upstream: Mapping[str, StageOutcome] | None) -> dict[str, StageOutcome]:
        known = self.outcomes if upstream is None else upstream
        wanted = self.graph.ancestors(name)
        missing = [a for a in wanted if a not in known or known[a].status not in ("completed", "reused")]
        if missing:
            raise ConfigError(f"stage {name}: its upstream stage(s) {', '.join(missing)} have not finished; "
                              "run them first (after:)")
        return {a: known[a] for a in wanted}

    def _key_parts(self, kind: StageKind, ctx: StageContext) -> dict[str, Any]:
        stage = ctx.stage
        config = stage.model_dump(mode="json", exclude={"name", "after", *kind.volatile_config})
        upstream = {d: ctx.upstream[d].output_digest for d in stage.after}
        return cache.key_inputs(kind=stage.kind, kind_version=kind.version, config=config, upstream=upstream,
                                inputs=ctx.inputs or {})

    def _run(self, kind: StageKind, ctx: StageContext, started: float, run_id: Future[str]) -> StageOutcome:
        name = ctx.stage.name
        ctx.inputs = kind.inputs(ctx)
        parts: dict[str, Any] | None = None
        state, note = UNCACHED, "its inputs cannot be digested without doing the work; it always runs"
        if ctx.inputs is not None:
            parts = self._key_parts(kind, ctx)
            ctx.cache_key = cache.cache_key(parts)
            if ctx.force:
                state, note = FORCED, f"forced (--force {name}); cache key {ctx.cache_key}"
            else:
                record, history = self._lookup(name, ctx.cache_key)
                if record is not None and kind.verify(ctx, record.outputs):
                    ctx.mlflow_run_id = run_id.result()
                    self.tracker.set_tags(ctx.mlflow_run_id, {"omni.cache_key": ctx.cache_key}, later=True)
                    return self._reuse(kind, ctx, record, started)
                state, note = MISS, self._why_miss(name, ctx.cache_key, parts, record, history)
        ctx.mlflow_run_id = run_id.result()
        if ctx.cache_key:
            self.tracker.set_tags(ctx.mlflow_run_id, {"omni.cache_key": ctx.cache_key}, later=True)
        self.progress(f"stage {name}: running ({note})")
        outputs = kind.run(ctx)
        output_digest = cache.digest(kind.digest(outputs))
        reused = bool(outputs.get("reused"))
        self.tracker.set_tags(ctx.mlflow_run_id, {"omni.cache_hit": str(reused).lower(), "omni.stage_cache": state},
                              later=True)
        seconds = time.perf_counter() - started
        record_uri = ""
        if parts is not None:
            record_uri = cache.save_record(self.store, cache.StageRecord(
                pipeline=self.config.name, stage=name, kind=ctx.stage.kind, cache_key=ctx.cache_key, key_inputs=parts,
                outputs=outputs, output_digest=output_digest, seconds=round(seconds, 3),
                mlflow_run_id=ctx.mlflow_run_id, tracking_uri=self.tracker.tracking_uri, report=ctx.report,
                git_commit=self.git_commit))
        return StageOutcome(name, ctx.stage.kind, "reused" if reused else "completed", seconds, ctx.mlflow_run_id,
                            outputs, cache=state, cache_key=ctx.cache_key, note=note, output_digest=output_digest,
                            record_uri=record_uri, report=ctx.report)

    def _reuse(self, kind: StageKind, ctx: StageContext, record: cache.StageRecord, started: float) -> StageOutcome:
        name = ctx.stage.name
        self.tracker.set_tags(ctx.mlflow_run_id, {"omni.cache_hit": "true", "omni.stage_cache": HIT,
                                                  "omni.cached_from_run": record.mlflow_run_id}, later=True)
        kind.reuse(ctx, record)
        note = f"cache hit {record.cache_key}: result of {record.finished_at} (MLflow run {record.mlflow_run_id})"
        self.progress(f"stage {name}: {note} is already committed; nothing to do")
        return StageOutcome(name, ctx.stage.kind, "reused", time.perf_counter() - started, ctx.mlflow_run_id,
                            {**record.outputs, "reused": True}, cache=HIT, cache_key=record.cache_key, note=note,
                            output_digest=cache.digest(kind.digest(record.outputs)),
                            record_uri=self.store.uri(cache.record_key(self.config.name, name, record.cache_key)),
                            report=record.report)

    def _lookup(self, name: str, key: str) -> tuple[cache.StageRecord | None, Future[dict[str, float]] | None]:
        """The stage's record under `key` (None: a miss) and, on S3, the listing of its earlier records
        (what `_why_miss` reads), started beside the record's GET: a miss then waits for one round trip,
        not two (a hit leaves the listing unread). A local store lists only on a miss."""
        history = None
        if self.store.root.startswith("s3://"):
            history = _background().submit(cache.record_times, self.store, self.config.name, name)
        return cache.load_record(self.store, self.config.name, name, key), history

    def _why_miss(self, name: str, key: str, parts: dict[str, Any], record: cache.StageRecord | None,
                  history: Future[dict[str, float]] | None = None) -> str:
        if record is not None:
            return f"cache key {key}: the recorded outputs are gone from the store"
        times = history.result() if history is not None else None
        previous = cache.latest_record(self.store, self.config.name, name, times)
        if previous is None:
            return f"cache key {key}: no earlier record of this stage"
        return f"cache key {key}: changed since {previous.cache_key}: {cache.explain_change(previous.key_inputs, parts)}"

    # ---- the end -------------------------------------------------------------------------------

    def stage_failed(self, name: str, error: BaseException | str) -> None:
        """Records a stage that failed where this object could not see it (e.g. another process)."""
        if name not in self.outcomes or self.outcomes[name].status != "failed":
            stage = self.config.stage(name)
            self.outcomes[name] = StageOutcome(name, stage.kind, "failed", 0.0, "", error=_message(error))

    def cancel(self) -> dict[str, str | None]:
        """On an interruption (Ctrl-C, Prefect's cancel SIGTERM) in the thread that received it: every
        registered backend stops what it runs outside this process (a job backend's Ray Jobs) and waits
        until it stopped. Returns job -> status."""
        from omni_core.config.backends import backend_names, backend_of_name

        stopped: dict[str, str | None] = {}
        cancels = {type(backend).cancel: backend for backend in map(backend_of_name, backend_names())}
        for backend in cancels.values():  # backends that share their job machinery cancel once
            stopped.update(backend.cancel())
        return stopped

    def finish(self, ok: bool) -> dict[str, Any]:
        try:
            self.tracker.flush()  # every stage's closing tags and status are in MLflow before the run ends
        except BaseException:
            self.tracker.end_run(self.parent_run_id, ok=False)
            raise
        self.tracker.end_run(self.parent_run_id, ok=ok)
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """Every stage in dependency order; stages that never started are `not_run`, naming why."""
        failed = {n for n, o in self.outcomes.items() if o.status == "failed"}
        stages = []
        for name in self.graph.order:
            outcome = self.outcomes.get(name)
            if outcome is None:
                blocked = self.graph.blocked_by(name, failed)
                why = f"upstream stage {', '.join(blocked)} failed" if blocked else "not started"
                outcome = StageOutcome(name, self.config.stage(name).kind, "not_run", 0.0, "", error=why)
            stages.append(outcome.to_json())
        return {
            "pipeline": self.config.name,
            "status": "failed" if failed else "completed",
            "store": self.store.root,
            "tracking_uri": self.tracker.tracking_uri,
            "mlflow_experiment_id": self.tracker.experiment_id(self.config.name),
            "mlflow_parent_run_id": self.parent_run_id,
            "config_digest": self.config_digest,
            "forced": sorted(self.force),
            "stages": stages,
        }


_BACKGROUND: ThreadPoolExecutor | None = None
_BACKGROUND_LOCK = threading.Lock()


def _background() -> ThreadPoolExecutor:
    """Threads for a stage's store requests that overlap others (one set per process)."""
    global _BACKGROUND
    with _BACKGROUND_LOCK:
        if _BACKGROUND is None:
            _BACKGROUND = ThreadPoolExecutor(4, thread_name_prefix="omni-store")
        return _BACKGROUND


def _message(error: BaseException | str) -> str:
    if isinstance(error, str):
        return error
    return str(error) or type(error).__name__
