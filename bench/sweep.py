"""Sweeps: the demo sweep against the same variants run one after another, and the controller's own
cost per variant.

    python bench/sweep.py [--quick] [--json] [--only demo|controller]

1. `demo`: in a fresh directory, `omni sweep configs/demo.yaml configs/sweep_demo.yaml` (8 variants,
   ASHA on, two at once on the sweep's one Ray), and the same 8 variants one after another (half before
   the sweep, half after), each an `omni run configs/demo.yaml <its overrides>` in a fresh directory (a fresh store and MLflow
   database: every stage runs). Wall seconds and CPU seconds (the whole process tree, Ray's workers
   included, sampled) of each side; target: sweep / sequential <= 0.5 (wall).
   Also the sweep's best variant against the variant with the demo's own settings, on the held-out eval.
2. `controller`: a grid over `stages.eval.batch_size` (a key outside the eval's cache key) of a tiny
   pipeline (ingest -> rl 1 step -> eval 1 row): after the first variant every stage of every variant
   is a cache hit, so the variants do nothing. The sweep process's own CPU seconds (psutil, sampled; not
   its variants' processes nor its Ray's) for N and 8 variants; the controller's cost per variant = the difference / (N - 8) (the fixed cost of
   starting Prefect, Ray and MLflow cancels out), target <= 0.2 s. N = 64.

Both sides share one omni local Prefect server (started by the first command, stopped at the end).
`--quick`: the demo with 2 sft and 4 rl steps, ASHA off, 2 variants; the controller with 6 vs 2 variants.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
SWEEP = ROOT / "configs" / "sweep_demo.yaml"
QUICK_OVERRIDES = ["stages.sft.trainer.total_steps=2", "stages.rl.trainer.total_steps=4",
                   "stages.eval.max_rows=16", "stages.eval_sft.max_rows=16"]

TINY = {
    "name": "bench-controller", "ray": {"address": "local", "num_cpus": 2}, "seed": 0,
    "datasets": {"digits": {"source": "fixtures://digits?rows=16&seed=0", "converter": "digits"}},
    "stages": [
        {"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
        {"name": "rl", "kind": "rl", "after": ["ingest"], "model": "tiny://lm", "data": "digits:train",
         "rollout": {"n": 2, "max_new_tokens": 4}, "reward": {"name": "digits"},
         "trainer": {"total_steps": 1, "batch_size": 2}},
        {"name": "eval", "kind": "eval", "after": ["rl"], "data": "digits:test", "max_rows": 1, "max_new_tokens": 4,
         "samples": 0},
    ],
}


def env_for(prefect_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_UI_URL", "OMNI_PREFECT_SERVER",
                                                             "RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.update(PREFECT_HOME=str(prefect_home), COLUMNS="200", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return env


def timed(command: list[str], cwd: Path, env: dict[str, str]) -> dict[str, Any]:
    """Wall s; CPU s of the whole process tree (every descendant sampled every 0.2 s with psutil, the last
    sample of each kept: Ray's workers are the raylet's children, which rusage never sees; a process
    that lived under 0.2 s is missed); CPU s of the process alone (the sweep's controller)."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[tuple[int, float], float] = {}  # (pid, its start time) -> CPU s
    own = [0.0]

    def sample() -> None:
        try:
            root = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in tree:
                try:
                    times = p.cpu_times()
                    seen[(p.pid, p.create_time())] = times.user + times.system
                except psutil.Error:
                    pass
            own[0] = seen.get((root.pid, root.create_time()), own[0])
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate(timeout=7200)
    sampler.join(timeout=5)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{output[-4000:]}")
    return {"wall_s": round(wall, 1), "cpu_s": round(sum(seen.values()), 1), "own_cpu_s": round(own[0], 2),
            "output": output}


def omni(*args: str) -> list[str]:
    return [sys.executable, "-m", "flows.cli", *args]


def demo_figures(folder: Path, env: dict[str, str], quick: bool) -> dict[str, Any]:
    sweep = yaml.safe_load(SWEEP.read_text())
    overrides = QUICK_OVERRIDES if quick else []
    if quick:
        sweep["parameters"] = {"stages.rl.trainer.lr": {"values": [1e-3, 3e-3]}}
        sweep["report_on"] = {**sweep["report_on"], "max_rows": 16}
        sweep.pop("early_terminate")
    (folder / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    sweep_args = [str(DEMO), str(folder / "sweep.yaml"), *overrides]
    planned = subprocess.run(omni("sweep", *sweep_args, "--dry-run", "--json"), cwd=folder, env=env, capture_output=True,
                             text=True, timeout=300)
    if planned.returncode != 0:
        raise SystemExit(f"the sweep's dry run failed:\n{planned.stderr[-3000:]}")
    variants = json.loads(planned.stdout)["variants"]
    sequential: dict[str, Any] = {"wall_s": 0.0, "cpu_s": 0.0, "runs": []}

    def one_after_another(chunk: list[dict[str, Any]]) -> None:
        for variant in chunk:  # the same variants, one after another, each with a fresh store
            run_dir = folder / f"seq-{variant['label']}"
            run_dir.mkdir()
            done = timed(omni("run", str(DEMO), *overrides, *variant["overrides"]), run_dir, env)
            sequential["wall_s"] += done["wall_s"]
            sequential["cpu_s"] += done["cpu_s"]
            sequential["runs"].append(done["wall_s"])
            print(f"omni run {variant['label']} ({' '.join(variant['overrides'])}): {done['wall_s']} s wall, "
                  f"{done['cpu_s']} CPU s", flush=True)

    # half of the runs before the sweep and half after: a load that drifts meanwhile weighs on both sides
    half = len(variants) // 2
    one_after_another(variants[:half])
    work = folder / "sweep"
    work.mkdir()
    print(f"sweep of the demo ({'quick' if quick else 'as shipped'}) ...", flush=True)
    swept = timed(omni("sweep", *sweep_args), work, env)
    print(swept["output"][-2500:], flush=True)
    one_after_another(variants[half:])
    [spec] = (work / ".omni" / "store" / "sweeps").glob("*/*/*/spec.json")
    table = json.loads((spec.parent / "report" / "comparison.json").read_text())
    records = table["records"]
    default = next((r for r in table["rows"] if r.get("note")), None)
    best = table["headline"]["best"]
    return {
        "variants": len(records), "pruned": table["headline"]["pruned"],
        "sweep_wall_s": swept["wall_s"], "sweep_cpu_s": swept["cpu_s"],
        "sequential_wall_s": round(sequential["wall_s"], 1), "sequential_cpu_s": round(sequential["cpu_s"], 1),
        "sequential_runs_s": sequential["runs"],
        "wall_ratio": round(swept["wall_s"] / sequential["wall_s"], 3),
        "cpu_ratio": round(swept["cpu_s"] / sequential["cpu_s"], 3),
        "best_variant": best["variant"], "best_params": best["params"], "best_select": best["select"],
        "best_report": best["report"], "report_stage": json.loads(spec.read_text())["report_stage"],
        "default_variant": default["variant"] if default else None,
        "default_status": default["status"] if default else None,
        "default_select": default.get("eval") if default else None,
        "default_report": default.get(json.loads(spec.read_text())["report_stage"]) if default else None,
    }


def controller_figures(folder: Path, env: dict[str, str], quick: bool) -> dict[str, Any]:
    counts = (2, 6) if quick else (8, 64)
    own = {}
    for n in counts:
        work = folder / f"controller-{n}"
        work.mkdir()
        (work / "pipeline.yaml").write_text(yaml.safe_dump(TINY))
        (work / "sweep.yaml").write_text(yaml.safe_dump({
            "name": f"noop-{n}", "method": "grid", "max_concurrent": 2, "register_best": False,
            "parameters": {"stages.eval.batch_size": {"values": list(range(1, n + 1))}}}))
        print(f"controller: {n} variants ...", flush=True)
        done = timed(omni("sweep", "pipeline.yaml", "sweep.yaml"), work, env)
        if f"{n} variants, {n} completed" not in done["output"]:
            raise SystemExit(f"the {n}-variant sweep did not complete every variant:\n{done['output'][-3000:]}")
        own[n] = done
        print(f"controller: {n} variants in {done['wall_s']} s, the sweep process's own CPU {done['own_cpu_s']} s",
              flush=True)
    small, large = counts
    per = (own[large]["own_cpu_s"] - own[small]["own_cpu_s"]) / (large - small)
    return {"variants": list(counts), "own_cpu_s": [own[n]["own_cpu_s"] for n in counts],
            "wall_s": [own[n]["wall_s"] for n in counts], "cpu_per_variant_s": round(per, 3),
            "own_cpu_per_variant_all_in_s": round(own[large]["own_cpu_s"] / large, 3),
            "target_met": per <= 0.2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 demo variants (short training), 2 vs 6 no-op variants")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--only", choices=("demo", "controller"), help="one of the two figures")
    args = parser.parse_args()
    figures: dict[str, Any] = {"quick": args.quick, "load_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="omni-bench-sweep-") as tmp:
        folder = Path(tmp)
        env = env_for(folder / "prefect")
        try:
            if args.only in (None, "demo"):
                figures["demo"] = demo_figures(folder, env, args.quick)
            if args.only in (None, "controller"):
                figures["controller"] = controller_figures(folder, env, args.quick)
        finally:
            subprocess.run(omni("server", "stop"), cwd=folder, env=env, capture_output=True, timeout=120)
            shutil.rmtree(folder / "prefect", ignore_errors=True)
    figures["load_end"] = round(os.getloadavg()[0], 2)
    if "demo" in figures:
        d = figures["demo"]
        print(f"demo sweep: {d['variants']} variants ({d['pruned']} pruned) in {d['sweep_wall_s']} s wall, "
              f"{d['sweep_cpu_s']} CPU s; one after another: {d['sequential_wall_s']} s wall, {d['sequential_cpu_s']} "
              f"CPU s; ratio {d['wall_ratio']} wall (target <= 0.5), {d['cpu_ratio']} CPU")
        print(f"best {d['best_variant']} {d['best_params']}: {d['best_select']} selected, {d['best_report']} on "
              f"{d['report_stage']}; the demo's own settings ({d['default_variant']}, {d['default_status']}): "
              f"{d['default_select']} / {d['default_report']}")
    if "controller" in figures:
        c = figures["controller"]
        print(f"controller: {c['cpu_per_variant_s']} CPU s per variant ({c['variants'][0]} vs {c['variants'][1]} "
              f"variants: {c['own_cpu_s']} s); all in: {c['own_cpu_per_variant_all_in_s']} s per variant")
    if args.json:
        print(json.dumps(figures, sort_keys=True, default=str))


if __name__ == "__main__":
    main()
