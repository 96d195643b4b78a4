"""A whole sweep, start to end: its state in the store, its MLflow run, the controller, the winner's
register stage, and the comparison (store, MLflow). The orchestrator (flows/sweep.py) supplies the
launcher and publishes the report; a notebook could do the same with a launcher of its own."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.config import config_digest
from omni_core.lineage import Tracker
from omni_core.lineage.model_registry import set_version_tags
from omni_core.storage import Store
from omni_core.sweep import plots, report
from omni_core.sweep.controller import (
    TAG,
    WINNER,
    Launcher,
    Progress,
    RunRequest,
    SweepController,
    SweepError,
)
from omni_core.sweep.plan import SweepPlan, current_values
from omni_core.sweep.state import COMPLETED, SweepState, sweep_key


@dataclass
class SweepResult:
    spec: dict[str, Any]  # the plan's summary (spec.json)
    records: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    headline: dict[str, Any]
    markdown: str
    plots: dict[str, bytes]
    registered: dict[str, Any] | None
    report_uri: str
    sweep_run_id: str


def plan_summary(plan: SweepPlan) -> dict[str, Any]:
    """What spec.json keeps of the plan (and what the comparison and `omni sweep status` read)."""
    asha = plan.asha
    return {
        "name": plan.spec.name, "pipeline": plan.config.name, "pipeline_file": plan.pipeline_file,
        "overrides": plan.overrides, "sweep": plan.spec.dump(), "method": plan.spec.method, "seed": plan.seed,
        "seeds": plan.seeds, "parameters": {k: p.model_dump(exclude_none=True) for k, p in plan.spec.parameters.items()},
        "metric": plan.metric, "goal": plan.goal, "select_stage": plan.select_stage, "report_stage": plan.report_stage,
        "shared": plan.shared, "per_variant": plan.per_variant, "register": plan.register,
        "n_variants": plan.n_variants, "store": plan.config.store, "tracking_uri": plan.config.tracking_uri,
        "spec_digest": config_digest(plan.spec.dump())[:16], "defaults": current_values(plan),
        "asha": None if asha is None else {
            "stage": asha.stage, "metric": asha.metric, "goal": asha.goal, "min_steps": asha.min_steps,
            "eta": asha.eta, "smooth": asha.smooth, "mode": asha.mode,
            "rungs": asha.rungs(plan.config.stage(asha.stage).trainer.total_steps)},
    }


def open_state(plan: SweepPlan) -> SweepState:
    store = Store(plan.config.store)
    store.check_writable()
    key = sweep_key(plan.spec.dump(), plan.config.model_dump(mode="json"))
    return SweepState.open(store, plan.config.name, plan.spec.name, key, plan_summary(plan))


def sweep_run(tracker: Tracker, plan: SweepPlan, state: SweepState) -> str:
    """The sweep's MLflow run (in the pipeline's experiment), created once and reused on resume."""
    if state.state.get("mlflow_run_id"):
        return state.state["mlflow_run_id"]
    spec = state.spec
    run_id = tracker.start_run(plan.config.name, run_name=f"sweep:{plan.spec.name}", tags={
        f"{TAG}.id": state.prefix.rsplit("/", 1)[-1], f"{TAG}.name": plan.spec.name, f"{TAG}.role": "sweep",
        f"{TAG}.spec_digest": spec["spec_digest"], f"{TAG}.method": plan.spec.method, f"{TAG}.seed": str(plan.seed),
        f"{TAG}.store": state.store.uri(state.prefix)})
    tracker.log_params(run_id, {"method": plan.spec.method, "seed": plan.seed, "metric": plan.metric,
                                "select_on": plan.select_stage, "report_on": plan.report_stage,
                                "n_variants": plan.n_variants, "seeds": json.dumps(plan.seeds),
                                **{f"space.{k}": json.dumps(v) for k, v in spec["parameters"].items()}})
    tracker.log_dict(run_id, spec, "sweep.json")
    state.update(mlflow_run_id=run_id)
    return run_id


def register_winner(controller: SweepController, state: SweepState, head: dict[str, Any]) -> dict[str, Any] | None:
    """The best variant runs the pipeline's register stages (its other stages are cache hits); its model
    version gets the sweep's tags. Once: a resumed sweep finds it in state.json."""
    plan, best = controller.plan, head["best"]
    if best is None or not plan.register or not plan.spec.register_best:
        return None
    done = state.state.get("registered")
    if done and done.get("variant") == best["variant"]:
        return done
    variant = plan.variant(best["index"], best["params"])
    controller.progress(f"{variant.label} is the best: registering it ({', '.join(plan.register)})")
    run = controller.launcher.launch(RunRequest(
        WINNER, f"{plan.spec.name}/{variant.label}-register", plan.variant_data(variant, register=True),
        controller.tags(WINNER, variant)))
    run.release()
    while (code := run.poll()) is None:
        time.sleep(controller.poll_s)
    summary = run.summary() or {}
    if code != 0:
        raise SweepError(f"the best variant {variant.label} did not register: {summary.get('status', 'no summary')}; "
                         f"log: {run.log_path}")
    registered = [s["outputs"] for s in summary["stages"] if s["name"] in plan.register and s["outputs"].get("version")]
    if not registered:
        return None
    outputs = registered[0]
    tags = {f"{TAG}.id": controller.key, f"{TAG}.name": plan.spec.name, f"{TAG}.spec_digest": state.spec["spec_digest"],
            f"{TAG}.run_id": controller.sweep_run_id, f"{TAG}.variant": variant.label, f"{TAG}.rank": "1",
            f"{TAG}.metric": plan.metric, f"{TAG}.select_on": plan.select_stage, f"{TAG}.report_on": plan.report_stage,
            f"{TAG}.score_select": repr(best["select"]), f"{TAG}.score_report": repr(best["report"]),
            f"{TAG}.n_variants": str(head["variants"]), f"{TAG}.n_completed": str(head[COMPLETED]),
            f"{TAG}.n_pruned": str(head["pruned"]), f"{TAG}.method": plan.spec.method, f"{TAG}.seed": str(plan.seed),
            f"{TAG}.overrides": json.dumps(variant.overrides())}
    set_version_tags(controller.tracker.client, outputs["model_name"], outputs["version"], tags)
    done = {"variant": variant.label, "model_name": outputs["model_name"], "version": outputs["version"],
            "promoted": outputs.get("promoted"), "mlflow_run_id": summary.get("mlflow_parent_run_id", "")}
    state.update(registered=done)
    controller.progress(f"registered {outputs['model_name']} version {outputs['version']} "
                        f"({'champion' if outputs.get('promoted') else 'candidate'})")
    return done


def compare(state: SweepState) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any], dict[str, bytes]]:
    """(records, rows, headline, plots) of the sweep as its records stand."""
    spec = state.spec
    records = [state.records[i] for i in sorted(state.records)]
    defaults = spec.get("defaults")
    rows = report.rows(spec, records, spec["goal"], defaults)
    head = report.headline(spec, records, spec["goal"])
    return records, rows, head, plots.all_plots(spec, records)


def publish(state: SweepState, tracker: Tracker, run_id: str, registered: dict[str, Any] | None) -> SweepResult:
    """The comparison into the store (report/) and onto the sweep's MLflow run (metrics, artifacts)."""
    records, rows, head, pngs = compare(state)
    extra = []
    if registered:
        extra.append(f"Registered: `{registered['model_name']}` version {registered['version']} "
                     f"({'champion' if registered.get('promoted') else 'candidate'}).")
    text = report.markdown(state.spec, rows, head, pngs, extra)
    files = {"comparison.json": json.dumps({"headline": head, "rows": rows, "records": records}, indent=2, default=str),
             "comparison.csv": report.to_csv(rows), "summary.md": text}
    for name, body in files.items():
        state.store.write_text(state.report_key(name), body)
    for name, png in pngs.items():
        state.store.write_bytes(state.report_key(name), png)
    best = head["best"] or {}
    metrics = {"variants": head["variants"], "completed": head[COMPLETED], "pruned": head["pruned"],
               "failed": head["failed"], **({"best_select": best["select"], "best_report": best["report"]} if best else {})}
    tracker.log_metrics(run_id, {k: float(v) for k, v in metrics.items()}, step=0, timestamp_ms=int(time.time() * 1000))
    with tempfile.TemporaryDirectory() as folder:
        for name, body in files.items():
            (Path(folder) / name).write_text(body)
        for name, png in pngs.items():
            (Path(folder) / name).write_bytes(png)
        tracker.client.log_artifacts(run_id, folder)
    if best:
        tracker.set_tags(run_id, {f"{TAG}.best_variant": best["variant"]})
    return SweepResult(state.spec, records, rows, head, text, pngs, registered, state.store.uri(state.report_key("")),
                       run_id)


def run_sweep(plan: SweepPlan, launcher: Launcher, *, max_concurrent: int, progress: Progress = print,
              poll_s: float = 1.0) -> SweepResult:
    state = open_state(plan)
    tracker = Tracker(plan.config.tracking_uri)
    run_id = sweep_run(tracker, plan, state)
    controller = SweepController(plan, state, launcher, tracker, max_concurrent=max_concurrent, sweep_run_id=run_id,
                                 progress=progress, poll_s=poll_s)
    ok = False
    try:
        controller.run()
        _, _, head, _ = compare(state)
        if head["best"] is None:
            raise SweepError(f"no variant of sweep {plan.spec.name} completed; `omni sweep status {plan.spec.name}` "
                             "shows why each ended")
        registered = register_winner(controller, state, head)
        result = publish(state, tracker, run_id, registered)
        ok = True
        return result
    finally:
        tracker.end_run(run_id, ok=ok)
