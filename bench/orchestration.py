"""What orchestration costs: the pipeline flow's overhead per stage, and the demo pipeline's first run,
fully cached re-run and empty run side by side.

    python bench/orchestration.py [--quick] [--json]

1. Per-stage overhead: the `pipeline` flow, in this process on Prefect's in-process API (warmed up
   first), runs a chain of N no-op stages (each `after:` the previous one) on a fresh store; the time
   between one stage's end and the next one's end (Prefect's task runs) is what a stage costs when
   it does nothing: the graph loop noticing the end, the Prefect task, the MLflow child run, the cache
   key, the record lookup and the record write. (The whole flow's time is no measure of this: its end
   waits in steps of about a second.) The no-op kind is registered here, for the bench only, through
   the stage registry: it takes the `ingest` kind's name (the config models know only the real kinds)
   and does nothing.
2. The demo pipeline (configs/demo.yaml), each run a fresh `omni run` process as a user would start
   it: `first` on an empty store, `cached` again on that store (every stage a cache hit), and `empty`:
   the same file with its stages replaced by one no-op stage (a pipeline needs one), i.e. the same
   start-up (Python, imports, Prefect, MLflow parent run) and no work. All share one Prefect home and
   MLflow database, which a warm-up run of the empty pipeline creates, so no measured run pays their
   one-off creation; fixtures and tiny models come from $OMNI_CACHE_DIR as in a user's runs.
   Wall time of each process, median over the repeats; also the flow run's own time (Prefect's log:
   from "Beginning flow run" to its final state) and the sum of its stages' times (`omni run`'s
   table), which leave out the interpreter start-up, the imports and the start of Prefect's
   in-process API, all of which vary by seconds from run to run on a shared machine. After each run
   the bench waits for the Ray processes it started to exit (a first run's local Ray cluster winds
   down after the process ends and would otherwise slow the next run).
   Target: cached - empty < 0.1 x (first - empty).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def register_noop_kind() -> None:
    """Bench-only: the `ingest` kind replaced by a stage that does nothing (production code unchanged)."""
    from omni_core.pipeline.stages import _KINDS, StageKind

    def noop(ctx: Any) -> dict[str, Any]:
        return {}

    # item assignment replaces the registered kind (register_stage refuses a second `ingest`)
    _KINDS["ingest"] = StageKind("ingest", noop)


def noop_chain(folder: Path, stages: int) -> Path:
    """A pipeline of `stages` no-op stages, each after the previous one."""
    path = folder / f"noop-{stages}.yaml"
    path.write_text(yaml.safe_dump({
        "name": f"noop-{stages}", "tracking_uri": f"sqlite:///{folder / 'mlflow.db'}",
        "datasets": {"d": {"source": "fixtures://gsm8k?rows=1", "converter": "gsm8k"}},
        "stages": [{"name": f"s{i}", "kind": "ingest", "datasets": ["d"], "after": [f"s{i - 1}"] if i else []}
                   for i in range(stages)],
    }))
    return path


def stage_overhead(folder: Path, stages: int, repeats: int) -> dict[str, Any]:
    os.environ["PREFECT_HOME"] = str(folder / "prefect")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.pop("PREFECT_API_URL", None)
    register_noop_kind()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import pipeline

    chain = noop_chain(folder, stages)
    calls = 0

    def run_chain() -> tuple[float, list[float]]:
        """Wall seconds of the flow call, and the gaps between consecutive stages' ends (Prefect's task runs)."""
        nonlocal calls
        calls += 1
        started = time.perf_counter()
        state = pipeline(pipeline_file=str(chain), overrides=[f"store={folder / f'store-{calls}'}"], return_state=True)
        seconds = time.perf_counter() - started
        assert state.is_completed(), state
        with get_client(sync_client=True) as client:
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
        ends = sorted(t.end_time for t in task_runs)
        assert len(ends) == stages, f"{len(ends)} task runs of {stages} stages"
        return seconds, [(b - a).total_seconds() for a, b in zip(ends, ends[1:], strict=False)]

    run_chain()  # warm-up: starts the in-process API, creates the databases, imports everything
    gaps, chains = [], []
    for _ in range(repeats):
        seconds, chain_gaps = run_chain()
        chains.append(seconds)
        gaps += chain_gaps
    return {"stage_overhead_ms_median": round(1000 * statistics.median(gaps), 1),
            "stage_overhead_ms_p90": round(1000 * statistics.quantiles(gaps, n=10)[-1], 1),
            "noop_chain_stages": stages, "noop_chain_repeats": repeats, "noop_chain_s": [round(s, 2) for s in chains]}


# ---- the demo pipeline, one process per run ------------------------------------------------------


def stage_seconds(stdout: str) -> float:
    """The sum of the `seconds` column of the stage table `omni run` prints (nan if not found)."""
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in stdout.splitlines() if line.startswith("│ ")]
    header = next((line for line in stdout.splitlines() if line.startswith("┃")), "")
    columns = [c.strip() for c in header.split("┃")[1:-1]]
    if "seconds" not in columns or not rows:
        return math.nan
    at = columns.index("seconds")
    return sum(float(r[at]) for r in rows if len(r) == len(columns) and r[at])


def flow_run_seconds(output: str) -> float:
    """From Prefect's log lines: the flow run's own time, "Beginning flow run" to "Finished in state"
    (after the in-process API has started; nan if not found)."""
    stamps = {}
    for line in output.splitlines():
        found = re.match(r"(\d\d):(\d\d):(\d\d\.\d+) \| \w+ +\| Flow run '[^']+' - (Beginning flow run|Finished in state)",
                         line)
        if found:
            h, m, sec, what = found.groups()
            if what == "Beginning flow run" or "Beginning flow run" in stamps:
                stamps.setdefault(what, int(h) * 3600 + int(m) * 60 + float(sec))  # the first run's
    if len(stamps) != 2:
        return math.nan
    return (stamps["Finished in state"] - stamps["Beginning flow run"]) % 86400


def ray_pids() -> set[int]:
    import psutil

    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "ray" in cmdline and any(n in cmdline for n in ("raylet", "gcs_server", "ray::", "dashboard", "ray/_private")):
            found.add(proc.pid)
    return found


def settle(before: set[int], timeout: float = 60) -> None:
    """Wait until the Ray processes a run started have exited: a local Ray cluster winds down after its
    driver exits, and on two cores that would slow whichever run comes next."""
    deadline = time.monotonic() + timeout
    while ray_pids() - before and time.monotonic() < deadline:
        time.sleep(0.5)


def omni_run(folder: Path, pipeline_file: Path, store: Path, noop: bool = False) -> tuple[float, float, float]:
    """Seconds of the `omni run` process (wall), of its flow run and of its stages (as it reports them)."""
    env = {**os.environ, "PREFECT_HOME": str(folder / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "COLUMNS": "250"}
    env.pop("PREFECT_API_URL", None)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *(["--noop"] if noop else []), "--",
               "run", str(pipeline_file), f"store={store}", f"tracking_uri=sqlite:///{folder / 'mlflow.db'}"]
    ray_before = ray_pids()
    started = time.perf_counter()
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    settle(ray_before)
    if result.returncode != 0:
        raise SystemExit(f"omni run {pipeline_file.name} failed ({result.returncode}):\n"
                         f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return seconds, flow_run_seconds(result.stdout + result.stderr), stage_seconds(result.stdout)


QUICK_DEMO_STEPS = {"sft": 6, "rl": 3}  # --quick: the demo's stages with a few training steps each


def demo_runs(folder: Path, repeats: int, quick: bool = False) -> dict[str, Any]:
    empty = folder / "empty.yaml"
    config = yaml.safe_load(DEMO.read_text())
    demo = DEMO
    if quick:  # the same stages, fewer training steps (the whole demo takes minutes on 2 cores)
        short = {**config, "stages": [
            {**s, "trainer": {**s.get("trainer", {}), "total_steps": QUICK_DEMO_STEPS[s["name"]]}}
            if s["name"] in QUICK_DEMO_STEPS else s for s in config["stages"]]}
        demo = folder / "demo-quick.yaml"
        demo.write_text(yaml.safe_dump(short))
    first_dataset = next(iter(config["datasets"]))
    config["stages"] = [{"name": "noop", "kind": "ingest", "datasets": [first_dataset]}]
    empty.write_text(yaml.safe_dump(config))

    warm_up = omni_run(folder, empty, folder / "store-warm-up", noop=True)[0]
    runs: dict[str, list[tuple[float, float, float]]] = {"first": [], "cached": [], "empty": []}
    for i in range(repeats):
        store = folder / f"store-{i}"
        runs["first"].append(omni_run(folder, demo, store))
        runs["cached"].append(omni_run(folder, demo, store))
        runs["empty"].append(omni_run(folder, empty, folder / f"store-empty-{i}", noop=True))
    wall, flow, stages = ({k: statistics.median(r[i] for r in v) for k, v in runs.items()} for i in range(3))

    def ratio(t: dict[str, float]) -> float:
        return round((t["cached"] - t["empty"]) / (t["first"] - t["empty"]), 3) if t["first"] > t["empty"] else math.nan

    return {"first_run_s": round(wall["first"], 2), "cached_rerun_s": round(wall["cached"], 2),
            "empty_run_s": round(wall["empty"], 2), "cached_work_over_first_work": ratio(wall),
            "target_met": bool(ratio(wall) < 0.1), "warm_up_run_s": round(warm_up, 2), "demo_repeats": repeats,
            "flow_run_s": {k: round(v, 2) for k, v in flow.items()},
            "flow_run_cached_work_over_first_work": ratio(flow),
            "stages_s": {k: round(v, 2) for k, v in stages.items()},
            "stages_cached_work_over_first_work": ratio(stages),
            "runs_s": {k: [round(r[0], 2) for r in v] for k, v in runs.items()}}


def child(argv: list[str]) -> None:
    """`omni ARGS...` in this process, with the bench's no-op kind when --noop comes first."""
    if argv and argv[0] == "--noop":
        register_noop_kind()
        argv = argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    sys.argv = ["omni", *argv]
    from flows.cli import main as omni_main

    omni_main()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer stages, one demo run of each kind, the demo's training a few steps")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    args = parser.parse_args()
    stages, repeats, demo_repeats = (10, 3, 1) if args.quick else (20, 5, 3)

    with tempfile.TemporaryDirectory(prefix="omni-bench-orch-") as tmp:
        folder = Path(tmp)
        (folder / "noop").mkdir()
        (folder / "demo").mkdir()
        figures = demo_runs(folder / "demo", demo_repeats, quick=args.quick)
        figures.update(stage_overhead(folder / "noop", stages, repeats))

    print(f"per-stage overhead (chains of {figures['noop_chain_stages']} no-op stages, x{figures['noop_chain_repeats']}):"
          f" median {figures['stage_overhead_ms_median']} ms, p90 {figures['stage_overhead_ms_p90']} ms between "
          f"consecutive stages' ends (whole chains: {figures['noop_chain_s']} s)")
    print(f"demo pipeline: first {figures['first_run_s']} s, cached re-run {figures['cached_rerun_s']} s, "
          f"empty {figures['empty_run_s']} s (median of {figures['demo_repeats']}; runs {figures['runs_s']}; "
          f"flow runs alone {figures['flow_run_s']}, their stages {figures['stages_s']})")
    print(f"cached work / first work = ({figures['cached_rerun_s']} - {figures['empty_run_s']}) / "
          f"({figures['first_run_s']} - {figures['empty_run_s']}) = {figures['cached_work_over_first_work']} "
          f"(target < 0.1: {'met' if figures['target_met'] else 'NOT met'}); "
          f"flow runs alone: {figures['flow_run_cached_work_over_first_work']}, "
          f"stages alone: {figures['stages_cached_work_over_first_work']}")
    if args.json:
        print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
