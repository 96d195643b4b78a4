"""The embedded default vs the scaled-out stack, side by side in one run: the demo pipeline's time and
the per-stage overhead of a chain of no-op stages on each.

    python bench/scaled_out.py [--quick] [--json] [--baseline REV] [--rounds N]

The stack is the one tests/test_scaled_stack.py starts on 127.0.0.1 (its helpers in tests/): a fresh
Postgres cluster, `prefect server` on it with basic auth, `mlflow server --app-name basic-auth` on
it with artifacts on a moto S3 server with IAM auth, and a two-node Ray cluster with token auth. The embedded
default: Prefect's in-process API, sqlite MLflow, a local store, a local Ray.

1. Per-stage overhead (as bench/orchestration.py measures it): the `pipeline` flow, in a child
   process, runs a chain of N no-op stages (the bench-only kind of bench/orchestration.py) after a
   warm-up chain; the figure is the median gap between consecutive stages' ends (Prefect's task
   runs). On the stack the flow reports to the Prefect server and logs to the MLflow server, its
   store is on S3. Target: the stack's at most 2x the embedded default's.
   `--baseline REV`: the same chains also run with the code of git revision REV (extracted to a
   temporary folder), on the same stack, for a before/after side by side.
2. The demo pipeline (configs/demo.yaml), `omni run` as a fresh process, on an empty store: the
   embedded default vs the same file with `store=s3://...`, `tracking_uri=http://...` and
   `ray.address=HOST:PORT` on the stack. Wall seconds. Not in --quick (10 no-op stages x2, no Ray
   cluster: the no-op stages never touch Ray), which finishes in about two minutes.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
DEMO = ROOT / "configs" / "demo.yaml"


def overhead_child(folder: Path, stages: int, repeats: int, store: str, tracking_uri: str) -> None:
    """In a child process (Prefect's settings are per process): the chain's stage gaps, as JSON."""
    from bench.orchestration import noop_chain, register_noop_kind
    register_noop_kind()
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import pipeline

    chain = noop_chain(folder, stages)
    gaps: list[float] = []
    for i in range(repeats + 1):  # the first: warm-up
        state = pipeline(pipeline_file=str(chain), overrides=[f"store={store}/chain-{i}",
                                                              f"tracking_uri={tracking_uri}"], return_state=True)
        assert state.is_completed(), state
        deadline = time.monotonic() + 30
        with get_client(sync_client=True) as client:
            while True:  # task runs' states arrive as events, handled by the server a moment later
                runs = client.read_task_runs(flow_run_filter=FlowRunFilter(
                    id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
                if (len(runs) == stages and all(t.end_time for t in runs)) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        ends = sorted(t.end_time for t in runs)
        if i:
            gaps += [(b - a).total_seconds() for a, b in zip(ends, ends[1:], strict=False)]
    print(json.dumps({"median_ms": round(1000 * statistics.median(gaps), 1),
                      "p90_ms": round(1000 * statistics.quantiles(gaps, n=10)[-1], 1)}))


def overhead(env: dict[str, str], folder: Path, stages: int, repeats: int, store: str, tracking_uri: str,
             code: Path = ROOT) -> dict:
    """The chain in a child process running the code in `code` (this checkout, or a baseline's)."""
    folder.mkdir(parents=True, exist_ok=True)
    if code != ROOT:
        env = {**env, "PYTHONPATH": str(code)}
    out = subprocess.run([sys.executable, str(code / "bench" / "scaled_out.py"), "--overhead-child", str(folder),
                          str(stages), str(repeats), store, tracking_uri],
                         env=env, capture_output=True, text=True, timeout=1800, cwd=code)
    if out.returncode != 0:
        raise SystemExit(f"no-op chain failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def demo(env: dict[str, str], cwd: Path, overrides: list[str]) -> float:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(DEMO), *overrides], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"demo failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return round(seconds, 2)


def checkout(rev: str, folder: Path) -> Path:
    """The files of git revision `rev`, extracted into `folder`."""
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def start_stack(folder: Path, ray: bool = True) -> tuple[dict[str, str], dict[str, Any], list]:
    """Moto (IAM auth on), Postgres, then Prefect's and MLflow's servers (and the Ray cluster) started side by side."""
    from auth_servers import iam_moto, mlflow_server, prefect_server
    from postgres import start_postgres
    from ray_cluster import start_cluster

    stops: list = []
    moto = iam_moto(folder / "s3")  # S3 with IAM auth: only the key it issued is let in
    stops.append(moto.stop)
    s3 = moto.client_env()
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    moto.client().create_bucket(Bucket=bucket)
    pg = start_postgres(Path(f"/tmp/pgb{uuid.uuid4().hex[:6]}"))
    stops.append(pg.remove)
    for db in ("prefect", "mlflow", "mlflow_auth"):
        pg.createdb(db)

    def two_node_cluster() -> Any:
        cluster = start_cluster(head_cpus=1, token=secrets.token_hex(32))
        stops.append(cluster.stop)
        cluster.add_node(num_cpus=2)
        return cluster

    with ThreadPoolExecutor(3) as pool:
        prefect_ = pool.submit(prefect_server, folder / "prefect", pg.url("prefect", "postgresql+asyncpg"),
                               f"omni:{secrets.token_urlsafe(12)}")
        mlflow_ = pool.submit(mlflow_server, folder / "mlflow", pg.url("mlflow", "postgresql+psycopg"),
                              f"s3://{bucket}/mlflow", pg.url("mlflow_auth", "postgresql+psycopg"),
                              secrets.token_urlsafe(18), s3)
        cluster_ = pool.submit(two_node_cluster) if ray else None
        for future in (prefect_, mlflow_):
            if future.exception() is None:
                stops.append(future.result().stop)
        prefect, mlflow, cluster = prefect_.result(), mlflow_.result(), cluster_.result() if cluster_ else None
    env = {**os.environ, **s3, **prefect.client_env(), **mlflow.client_env(),
           **(cluster.driver_env({}) if cluster else {}), "COLUMNS": "200"}
    return env, {"bucket": bucket, "mlflow": mlflow.url, "ray": cluster.address if cluster else ""}, stops


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--overhead-child":
        folder, stages, repeats, store, tracking_uri = sys.argv[2:7]
        overhead_child(Path(folder), int(stages), int(repeats), store, tracking_uri)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 no-op stages x2, no demo, no Ray cluster")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--baseline", metavar="REV", help="also run the no-op chains with git revision REV's code")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the chains this many times, the order of the codes flipped each round; the "
                             "figures are the medians of the rounds' medians (default 1)")
    args = parser.parse_args()
    stages, repeats = (10, 2) if args.quick else (20, 3)
    figures: dict[str, Any] = {"noop_chain_stages": stages, "noop_chain_repeats": repeats, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="omni-bench-scaled-") as tmp:
        folder = Path(tmp)
        embedded = {**os.environ, "PREFECT_HOME": str(folder / "embedded-prefect"),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "COLUMNS": "200",
                    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
        for name in ("PREFECT_API_URL", "RAY_ADDRESS"):
            embedded.pop(name, None)
        codes = {"": ROOT}
        if args.baseline:
            codes["baseline_"] = checkout(args.baseline, folder / "baseline")
            figures["baseline"] = args.baseline
        started = time.perf_counter()
        env, where, stops = start_stack(folder / "stack", ray=not args.quick)
        figures["stack_start_s"] = round(time.perf_counter() - started, 1)
        try:
            rounds: dict[str, list[dict]] = {}
            for round_ in range(args.rounds):  # the order flips each round: a change in load hits both codes
                for prefix, code in (list if round_ % 2 == 0 else reversed)(list(codes.items())):
                    tag = f"{prefix}r{round_}-"
                    for where_, run_env, store, tracking in (
                            ("embedded", embedded, str(folder / f"{tag}noop-store"),
                             f"sqlite:///{folder / f'{tag}noop-mlflow.db'}"),
                            ("stack", env, f"s3://{where['bucket']}/{tag}noop", where["mlflow"])):
                        got = overhead(run_env, folder / f"{tag}noop-{where_}", stages, repeats, store, tracking, code)
                        rounds.setdefault(f"{prefix}{where_}_stage_overhead", []).append(got)
                        print(f"round {round_ + 1} {prefix.rstrip('_') or 'this checkout'} {where_}: "
                              f"{got['median_ms']} ms", flush=True)
            for name, got in rounds.items():
                figures[name] = {key: round(statistics.median(g[key] for g in got), 1) for key in got[0]}
                if args.rounds > 1:
                    figures[name]["rounds_ms"] = [g["median_ms"] for g in got]
            if not args.quick:
                (folder / "demo-embedded").mkdir()
                figures["embedded_demo_s"] = demo(embedded, folder / "demo-embedded", [
                    f"store={folder / 'demo-store'}", f"tracking_uri=sqlite:///{folder / 'demo-mlflow.db'}"])
                figures["stack_demo_s"] = demo(env, folder, [
                    f"store=s3://{where['bucket']}/demo", f"tracking_uri={where['mlflow']}",
                    f"ray.address={where['ray']}"])
        finally:
            for stop in reversed(stops):
                stop()
    for prefix in codes:
        ratio = (figures[f"{prefix}stack_stage_overhead"]["median_ms"]
                 / figures[f"{prefix}embedded_stage_overhead"]["median_ms"])
        figures[f"{prefix}stage_overhead_ratio"] = round(ratio, 2)
        print(f"{prefix.rstrip('_') or 'this checkout'}: per-stage overhead ({stages} no-op stages x{repeats}): "
              f"embedded {figures[f'{prefix}embedded_stage_overhead']['median_ms']} ms, "
              f"stack {figures[f'{prefix}stack_stage_overhead']['median_ms']} ms -> {round(ratio, 2)}x")
    figures["target_met"] = bool(figures["stage_overhead_ratio"] <= 2.0)
    print(f"target (stack <= 2x embedded): {'met' if figures['target_met'] else 'NOT met'}; "
          f"stack started in {figures['stack_start_s']} s")
    if "stack_demo_s" in figures:
        print(f"demo pipeline: embedded {figures['embedded_demo_s']} s, stack {figures['stack_demo_s']} s")
    if args.json:
        print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
