"""The sweep controller: the shared stages once, then the variants (at most `max_concurrent` at once),
ASHA on their training metric, records in the store, the ranking, and the winner's register stage.

Every pipeline run it starts goes through a `Launcher` (the Prefect layer's: a flow run per variant,
in a process of its own) and is told apart only by its mapping, its MLflow tags and the stages it
holds. A variant holds the stages downstream of the watched training stage until the controller has
decided all its rungs (`release`), so a pruned variant is never evaluated; a pruned variant is stopped
through its process (`stop`: SIGTERM, the pipeline's cancellation path: its actors and Ray Jobs end).

The controller reads each variant's training metric from MLflow (the training stage logs it per step),
finds a variant's runs by their `omni.sweep.*` tags, and writes each record when its status changes.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_core.config import validate_pipeline
from omni_core.errors import OmniError
from omni_core.lineage import Tracker
from omni_core.pipeline.graph import StageGraph
from omni_core.sweep.asha import Decision, Rungs, rung_value
from omni_core.sweep.plan import SweepPlan, Variant
from omni_core.sweep.space import Tried
from omni_core.sweep.state import COMPLETED, FAILED, FINAL, PENDING, PRUNED, RUNNING, SweepState

Progress = Callable[[str], None]
TAG = "omni.sweep"
SHARED, VARIANT, WINNER = "shared", "variant", "winner"


class SweepError(OmniError):
    """The sweep cannot go on (its shared stages failed, no variant completed, ...)."""


@dataclass
class RunRequest:
    """One pipeline run the controller asks for."""

    label: str  # v003 | shared | winner
    name: str  # the run's display name: SWEEP/v003
    data: dict[str, Any]  # the pipeline mapping
    tags: dict[str, str]  # MLflow tags of its pipeline run (its stage runs inherit omni.*)
    hold: list[str] = field(default_factory=list)  # stages that wait for `release()`


class LaunchedRun(Protocol):
    log_path: str

    def poll(self) -> int | None:
        """The exit status once the run's process ended, else None."""

    def release(self) -> None:
        """Let the held stages start."""

    def stop(self) -> None:
        """Cancel the run (its process gets SIGTERM: the pipeline's cancellation path)."""

    def summary(self) -> dict[str, Any] | None:
        """The pipeline summary of a run that ended (None if it wrote none)."""

    def ended(self, status: str, message: str) -> None:
        """How the sweep saw the run end (pruned, ...), for the orchestrator's record of it."""


class Launcher(Protocol):
    def launch(self, request: RunRequest) -> LaunchedRun: ...


@dataclass
class Live:
    """A running variant: its process and what the controller knows of its training so far."""

    variant: Variant
    run: LaunchedRun
    started: float
    rungs: list[int]
    training_runs: set[str] = field(default_factory=set)
    history: dict[int, float] = field(default_factory=dict)
    released: bool = False
    stopping: Decision | None = None
    stopped_at_rung: int | None = None


class SweepController:
    def __init__(self, plan: SweepPlan, state: SweepState, launcher: Launcher, tracker: Tracker, *,
                 max_concurrent: int, sweep_run_id: str, progress: Progress = print, poll_s: float = 1.0):
        self.plan, self.state, self.launcher, self.tracker = plan, state, launcher, tracker
        self.max_concurrent, self.sweep_run_id, self.progress, self.poll_s = max_concurrent, sweep_run_id, progress, poll_s
        self.key = state.prefix.rsplit("/", 1)[-1]
        self.live: dict[int, Live] = {}
        asha = plan.asha
        self.rungs = Rungs(asha.eta, asha.goal, asha.mode) if asha else None
        for record in sorted(state.records.values(), key=lambda r: r["index"]):
            for step, value in (record.get("rungs") or {}).items():
                if self.rungs is not None:
                    self.rungs.record(int(step), int(record["index"]), float(value))

    # ---- tags and records ------------------------------------------------------------------------

    def tags(self, role: str, variant: Variant | None = None) -> dict[str, str]:
        tags = {f"{TAG}.id": self.key, f"{TAG}.name": self.plan.spec.name, f"{TAG}.role": role,
                f"{TAG}.run_id": self.sweep_run_id}
        if variant is not None:
            tags[f"{TAG}.variant"] = str(variant.index)
        return tags

    def record(self, variant: Variant) -> dict[str, Any]:
        return self.state.records.get(variant.index) or {
            "index": variant.index, "label": variant.label, "setting": variant.setting, "seed": variant.seed,
            "params": variant.params, "overrides": variant.overrides(), "status": PENDING, "attempts": 0,
            "rungs": {}}

    def save(self, variant: Variant, **fields: Any) -> dict[str, Any]:
        record = {**self.record(variant), **fields}
        self.state.save(record)
        return record

    # ---- the whole sweep -------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        """Runs what is not done yet; returns every variant's record, in index order."""
        self.run_shared()
        try:
            self.run_variants()
        except BaseException:
            self.stop_all("the sweep was interrupted")
            raise
        return [self.state.records[i] for i in sorted(self.state.records)]

    def run_shared(self) -> None:
        if not self.plan.shared or self.state.state.get("shared", {}).get("status") == COMPLETED:
            return
        self.progress(f"shared stages {', '.join(self.plan.shared)}: one run for all variants")
        request = RunRequest(SHARED, f"{self.plan.spec.name}/shared", self.plan.shared_data(), self.tags(SHARED))
        started = time.monotonic()
        run = self.launcher.launch(request)
        try:
            while (code := run.poll()) is None:
                time.sleep(self.poll_s)
        except BaseException:
            run.stop()
            raise
        summary = run.summary() or {}
        if code != 0:
            raise SweepError(f"the shared stages ({', '.join(self.plan.shared)}) failed: {_failure(summary, run)}; "
                             f"log: {run.log_path}")
        self.state.update(shared={"status": COMPLETED, "mlflow_run_id": summary.get("mlflow_parent_run_id", ""),
                                  "seconds": round(time.monotonic() - started, 1)})

    def run_variants(self) -> None:
        total = self.plan.n_variants
        done = sum(1 for r in self.state.records.values() if r["status"] in FINAL)
        if done:
            self.progress(f"resuming: {done} of {total} variants already finished (kept)")
        next_index = 0
        while True:
            while len(self.live) < self.max_concurrent:
                next_index = self._next_to_run(next_index)
                if next_index >= total:
                    break
                self.start(next_index)
                next_index += 1
            if not self.live:
                return
            time.sleep(self.poll_s)
            for index in list(self.live):
                self.watch(self.live[index])

    def _next_to_run(self, index: int) -> int:
        while index < self.plan.n_variants and self.state.records.get(index, {}).get("status") in FINAL:
            index += 1
        return index

    def variant_at(self, index: int) -> Variant:
        if index < len(self.plan.variants):
            return self.plan.variants[index]
        record = self.state.records.get(index)
        if record is not None:
            return self.plan.variant(index, record["params"])
        setting = index // len(self.plan.seeds)
        params = self.plan.space.ask(setting, self.tried(setting))
        for k in range(len(self.plan.seeds)):  # every seed of the setting gets the values now
            sibling = self.plan.variant(setting * len(self.plan.seeds) + k, params)
            if sibling.index not in self.state.records:
                self.save(sibling)
        return self.plan.variant(index, params)

    def tried(self, setting: int) -> list[Tried]:
        """The settings before `setting`, as the bayes sampler sees them (a setting: the mean of its seeds)."""
        out = []
        n = len(self.plan.seeds)
        for s in range(setting):
            records = [self.state.records.get(s * n + k) for k in range(n)]
            if not records[0]:
                continue
            statuses = {r["status"] if r else PENDING for r in records}
            params = records[0]["params"]
            if statuses == {COMPLETED}:
                out.append(Tried(params, COMPLETED, statistics.fmean(r["select"] for r in records if r)))
            elif PRUNED in statuses:
                out.append(Tried(params, PRUNED, None, {int(k): v for r in records if r
                                                                for k, v in (r.get("rungs") or {}).items()}))
            elif statuses == {FAILED}:
                out.append(Tried(params, FAILED))
            else:
                out.append(Tried(params, RUNNING))
        return out

    # ---- one variant -----------------------------------------------------------------------------

    def start(self, index: int) -> None:
        variant = self.variant_at(index)
        record = self.record(variant)
        data = self.plan.variant_data(variant)
        asha = self.plan.asha
        rungs, hold = [], []
        if asha is not None:
            total_steps = validate_pipeline(copy.deepcopy(data)).stage(asha.stage).trainer.total_steps
            rungs = [r for r in asha.rungs(total_steps) if str(r) not in (record.get("decided") or [])]
            hold = [n for n in StageGraph(self.plan.config).descendants(asha.stage) if n in self.plan.per_variant]
        values = ", ".join(f"{k}={_short(v)}" for k, v in variant.params.items())
        self.progress(f"{variant.label}: starting ({values}, seed {variant.seed})"
                      + (f"; attempt {record['attempts'] + 1}" if record["attempts"] else ""))
        run = self.launcher.launch(RunRequest(variant.label, f"{self.plan.spec.name}/{variant.label}", data,
                                              self.tags(VARIANT, variant), hold))
        live = Live(variant, run, time.monotonic(), rungs)
        if not rungs:
            live.released = True
            run.release()
        self.live[index] = live
        self.save(variant, status=RUNNING, attempts=record["attempts"] + 1, started_at=time.time(),
                  log=run.log_path, error="")

    def watch(self, live: Live) -> None:
        code = live.run.poll()
        if self.plan.asha is not None and live.stopping is None:
            self.read_history(live)
            self.decide_rungs(live)
        if code is None:
            code = live.run.poll()  # it may have ended while the history was read: the rungs saw its last steps
            if code is None:
                return
        self.finish(live, code)

    def read_history(self, live: Live) -> None:
        asha = self.plan.asha
        assert asha is not None
        client = self.tracker.client
        try:
            experiment = self.tracker.experiment_id(self.plan.config.name)
            found = client.search_runs([experiment], f"tags.`{TAG}.id` = '{self.key}' and tags.`{TAG}.variant` = "
                                                     f"'{live.variant.index}' and tags.`omni.stage` = '{asha.stage}'")
            for run in found:
                live.training_runs.add(run.data.tags.get("omni.cached_from_run") or run.info.run_id)
            for run_id in live.training_runs:
                for m in client.get_metric_history(run_id, asha.metric):
                    live.history[int(m.step)] = float(m.value)
        except Exception as exc:  # a busy tracking database: the next poll reads it
            self.progress(f"{live.variant.label}: reading {asha.metric} from MLflow failed ({exc}); retrying")

    def decide_rungs(self, live: Live) -> None:
        asha, rungs = self.plan.asha, self.rungs
        assert asha is not None and rungs is not None
        record = self.record(live.variant)
        while live.rungs:
            rung = live.rungs[0]
            value = rung_value(live.history, rung, asha.smooth)
            if value is None and max(live.history, default=0) > rung:
                # steps after the rung are logged, its own never will be (a training resumed from a checkpoint
                # past it, whose run was killed before it logged the step): nothing to decide on there
                live.rungs.pop(0)
                record = self.save(live.variant, decided=[*record.get("decided", []), str(rung)])
                self.progress(f"{live.variant.label}: rung step {rung}: no {asha.metric} logged there; goes on")
                continue
            if value is None or not rungs.ready(rung, live.variant.index, self.settled_below):
                return
            decision = rungs.decide(rung, live.variant.index, value)
            live.rungs.pop(0)
            record = self.save(live.variant, rungs={**record.get("rungs", {}), str(rung): value},
                               decided=[*record.get("decided", []), str(rung)])
            line = f"cutoff {decision.cutoff:.4g}" if decision.cutoff is not None else "the first there"
            if not decision.keep:
                self.progress(f"{live.variant.label}: pruned at step {rung}: {asha.metric} {value:.4g} < {line}")
                live.stopping, live.stopped_at_rung = decision, rung
                live.run.stop()
                return
            self.progress(f"{live.variant.label}: rung step {rung}: {asha.metric} {value:.4g} goes on ({line})")
        if not live.released:
            live.released = True
            live.run.release()

    def settled_below(self, rung: int, index: int) -> bool:
        """Variant `index` will record no value at `rung`: it ended before it, or trains fewer steps."""
        record = self.state.records.get(index)
        if record is None:
            return False
        if str(rung) in (record.get("rungs") or {}) or str(rung) in (record.get("decided") or []):
            return True
        return record["status"] in (COMPLETED, PRUNED, FAILED) and index not in self.live

    def finish(self, live: Live, code: int) -> None:
        del self.live[live.variant.index]
        summary = live.run.summary() or {}
        seconds = round(time.monotonic() - live.started, 1)
        asha = self.plan.asha
        base = {"finished_at": time.time(), "wall_s": seconds, "mlflow_run_id": summary.get("mlflow_parent_run_id", ""),
                "curve": sorted(live.history.items()), "curve_metric": asha.metric if asha else ""}
        if live.stopping is not None:
            decision = live.stopping
            message = (f"pruned at step {live.stopped_at_rung}: {asha.metric} {decision.value:.4g} below the rung's "
                       f"cutoff {decision.cutoff:.4g}" if asha and decision.cutoff is not None else "pruned")
            live.run.ended(PRUNED, message)
            self.save(live.variant, **base, status=PRUNED, steps=max(live.history, default=0),
                      pruned={"step": live.stopped_at_rung, "value": decision.value, "cutoff": decision.cutoff})
            self.tag_variant(base["mlflow_run_id"], live.variant, PRUNED)
            return
        if code != 0 or summary.get("status") != "completed":
            error = _failure(summary, live.run)
            self.progress(f"{live.variant.label}: failed after {seconds:.0f} s: {error} (log: {live.run.log_path})")
            self.save(live.variant, **base, status=FAILED, error=error)
            self.tag_variant(base["mlflow_run_id"], live.variant, FAILED)
            return
        stages = {s["name"]: s for s in summary["stages"]}
        select = _metric(stages[self.plan.select_stage], self.plan.metric)
        report = _metric(stages[self.plan.report_stage], self.plan.metric)
        trained = stages.get(self.plan.asha.stage if asha else "", {}).get("outputs", {})
        steps = trained.get("global_step") or _trained_steps(summary, self.plan)
        curve = base["curve"] or self.curve_of(stages)
        self.save(live.variant, **{**base, "curve": curve}, status=COMPLETED, select=select, report=report,
                  steps=steps, stage_runs={n: s["mlflow_run_id"] for n, s in stages.items()})
        self.tag_variant(base["mlflow_run_id"], live.variant, COMPLETED, select, report)
        self.progress(f"{live.variant.label}: completed in {seconds:.0f} s: {self.plan.metric} {select:.4g} on "
                      f"{self.plan.select_stage}, {report:.4g} on {self.plan.report_stage}")

    def curve_of(self, stages: dict[str, dict[str, Any]]) -> list[tuple[int, float]]:
        """The training curve a completed variant's stage report kept (without early stopping)."""
        for name in self.plan.per_variant:
            curve = stages.get(name, {}).get("report", {}).get("reward_curve")
            if curve:
                return [(int(s), float(v)) for s, v in curve["points"]]
        return []

    def tag_variant(self, run_id: str, variant: Variant, status: str, select: float | None = None,
                    report: float | None = None) -> None:
        """The variant's pipeline run in MLflow: its status, swept values and scores (MLflow's compare view)."""
        if not run_id:
            return
        self.tracker.set_tags(run_id, {f"{TAG}.status": status})
        self.tracker.log_params(run_id, {f"sweep.{k}": _short(v) for k, v in variant.params.items()})
        scores = {k: v for k, v in (("sweep/select", select), ("sweep/report", report)) if v is not None}
        if scores:
            self.tracker.log_metrics(run_id, scores, step=0, timestamp_ms=int(time.time() * 1000))

    def stop_all(self, why: str) -> None:
        """Every running variant stopped (its record stays `running`: a resumed sweep runs it again)."""
        for live in self.live.values():
            live.run.stop()
        deadline = time.monotonic() + 120
        while any(live.run.poll() is None for live in self.live.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        for live in self.live.values():
            live.run.ended("interrupted", why)
        self.live.clear()


def _metric(stage: dict[str, Any], name: str) -> float:
    from omni_core.pipeline.stages.eval import mlflow_metric_name

    metrics = stage.get("outputs", {}).get("metrics", {})
    if name in metrics:
        return float(metrics[name])
    by_mlflow = {mlflow_metric_name(k): v for k, v in metrics.items()}
    if mlflow_metric_name(name) in by_mlflow:
        return float(by_mlflow[mlflow_metric_name(name)])
    raise SweepError(f"stage {stage.get('name')} logged no {name} (it logged: {', '.join(sorted(metrics)) or 'nothing'})")


def _trained_steps(summary: dict[str, Any], plan: SweepPlan) -> int | None:
    for stage in summary["stages"]:
        if stage["name"] in plan.per_variant and "global_step" in stage.get("outputs", {}):
            return int(stage["outputs"]["global_step"])
    return None


def _failure(summary: dict[str, Any], run: LaunchedRun) -> str:
    failed = [s for s in summary.get("stages", []) if s.get("status") == "failed"]
    if failed:
        return f"stage {failed[0]['name']}: {failed[0]['error']}"
    try:
        with open(run.log_path, errors="replace") as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1][:500] if lines else "its process ended without a summary"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if not isinstance(value, str) else value
