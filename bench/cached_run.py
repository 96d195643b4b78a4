"""A cached `omni run configs/demo.yaml` (every stage reused) vs a hello-world Prefect flow on Prefect's
temporary server, side by side in one run.

    python bench/cached_run.py [--quick] [--json] [--repeats N]

1. In a fresh directory, `omni run` of the demo once (a fresh store: every stage runs; this starts
   omni's local Prefect server, flows/local_prefect.py, in the background as any first run does).
2. Then, alternating (the order flips each round, so the machine's load hits all alike), each a
   fresh process timed from start to exit:
   - `hello`: a one-task Prefect flow in its own PREFECT_HOME without PREFECT_API_URL, i.e. on
     Prefect's temporary server (what every command paid before omni kept a server);
   - `cached`: `omni run` of the same demo file again: every stage a cache hit, on the local server;
   - `cached_temporary`: the same with OMNI_PREFECT_SERVER=temporary (Prefect's temporary server, as
     `omni run` did before).
   Median wall seconds and CPU seconds (the child's user + system) of each; target: cached / hello < 0.5.
3. `omni server stop`: the bench leaves no server behind.

`--quick` trains 2 sft and 1 rl step in the first run (same cached path) and takes 2 rounds; the full
run trains the demo as shipped and takes `--repeats` rounds (default 5).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
QUICK_OVERRIDES = ["stages.sft.trainer.total_steps=2", "stages.rl.trainer.total_steps=1"]

HELLO = '''
from prefect import flow, task


@task
def hello() -> str:
    return "hello"


@flow
def hello_flow() -> str:
    return hello()


if __name__ == "__main__":
    print(hello_flow())
'''


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child and its children that it waited for, output) of one process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return round(wall, 2), round(cpu, 2), out.stdout + out.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds, a 2-step sft and 1-step rl first run")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--repeats", type=int, default=None, help="rounds of the three (default 5, quick 2)")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    overrides = QUICK_OVERRIDES if args.quick else []
    base = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_UI_URL",
                                                               "OMNI_PREFECT_SERVER", "RAY_ADDRESS")}
    base.pop("PYTHONDONTWRITEBYTECODE", None)  # as `make demo`: compiled modules are cached
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [base.get("PYTHONPATH")])])
    base["COLUMNS"] = "200"
    figures: dict = {"quick": args.quick, "repeats": repeats, "load_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="omni-bench-cached-") as tmp:
        folder = Path(tmp)
        work = folder / "demo"
        work.mkdir()
        shutil.copy(DEMO, work / "demo.yaml")
        (folder / "hello.py").write_text(HELLO)
        omni = [sys.executable, "-m", "flows.cli"]
        run = [*omni, "run", "demo.yaml", *overrides]
        try:
            first_wall, first_cpu, _ = timed(run, work, base)
            figures["first_run_s"] = first_wall
            print(f"first run (every stage runs; starts the local server): {first_wall} s", flush=True)
            contenders = {
                "hello": ([sys.executable, str(folder / "hello.py")], folder,
                          {**base, "PREFECT_HOME": str(folder / "hello-prefect"),
                           "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # as omni sets for its temporary server:
                           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}),  # a busy machine
                "cached": (run, work, base),
                "cached_temporary": (run, work, {**base, "OMNI_PREFECT_SERVER": "temporary"}),
            }
            walls: dict[str, list[float]] = {name: [] for name in contenders}
            cpus: dict[str, list[float]] = {name: [] for name in contenders}
            for round_ in range(repeats):
                names = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
                for name in names:
                    command, cwd, env = contenders[name]
                    wall, cpu, output = timed(command, cwd, env)
                    if name.startswith("cached") and output.count("already committed; nothing to do") != 6:
                        raise SystemExit(f"{name}: not every stage was a cache hit:\n{output[-3000:]}")
                    walls[name].append(wall)
                    cpus[name].append(cpu)
                    print(f"round {round_ + 1} {name:17s} {wall:6.2f} s wall, {cpu:6.2f} CPU s", flush=True)
        finally:
            stop = subprocess.run([*omni, "server", "stop", "--json"], cwd=work, env=base, capture_output=True,
                                  text=True, timeout=120)
            figures["server_stopped"] = stop.returncode == 0 and '"stopped"' in stop.stdout
    for name in walls:
        figures[f"{name}_s"] = round(statistics.median(walls[name]), 2)
        figures[f"{name}_cpu_s"] = round(statistics.median(cpus[name]), 2)
        figures[f"{name}_runs_s"] = walls[name]
    figures["cached_over_hello"] = round(figures["cached_s"] / figures["hello_s"], 3)
    figures["cached_temporary_over_hello"] = round(figures["cached_temporary_s"] / figures["hello_s"], 3)
    figures["cached_over_hello_cpu"] = round(figures["cached_cpu_s"] / figures["hello_cpu_s"], 3)
    figures["target_met"] = figures["cached_over_hello"] < 0.5
    figures["load_end"] = round(os.getloadavg()[0], 2)
    print(f"median of {repeats}: hello-world flow (temporary server) {figures['hello_s']} s, cached omni run "
          f"{figures['cached_s']} s (local server), {figures['cached_temporary_s']} s (temporary server)")
    print(f"cached / hello: {figures['cached_over_hello']} (target < 0.5: "
          f"{'met' if figures['target_met'] else 'NOT met'}); with the temporary server "
          f"{figures['cached_temporary_over_hello']}; load {figures['load_start']} -> {figures['load_end']}")
    if args.json:
        print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
