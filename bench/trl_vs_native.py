"""Backend trl against our native trainer: the same stages, side by side in one run.

A native sft warm start on the digits task, then one pipeline per backend, each: GRPO from that sft
checkpoint (the digits reward, n responses per prompt, temperature 1, 8 new tokens, clip 0.2/0.2,
token-mean loss, no KL, group-std advantages, one pass, constant lr; omni_core/backends/trl/render.py maps
them 1:1 onto GRPOConfig) -> eval of its checkpoint (32 test rows x 4 sampled responses), and DPO on the
Omni-Preference fixture pairs from tiny://lm (beta 0.1, sigmoid). Backends: `native` (our trainer on
Ray), `trl` with 1 and with 2 Ray Train workers (one DDP group). One local Ray of 2 CPUs for all.

Reported, per backend: the median `timing_s/step` of each stage after its first step (both backends log
it; TRL's is its trainer's step in the worker: generation, reward and update; native's the driver's wall
from step to step, which also holds the driver's MLflow write and Ray calls) and TRL's over native's
(goal: native >= 2x, i.e. TRL's step at least twice native's, on a CPU); for GRPO also TRL's over
native's work in its trainer actor (the sum of its `timing_s/gen`, `reward`, `old_log_prob`, `ref`,
`update_actor` and `update_weights`: timed where TRL's step is); the eval reward (`val/reward_mean`); the GRPO reward
per step of each (native `critic/score/mean`, TRL `reward`: the batch's mean reward) in one PNG
(bench/out/trl_vs_native.png); and for TRL the backend's own fixed cost per stage: Ray Train's start
(`trl/start_s`: controller and worker processes until the train function runs), the workers' setup
(`trl/setup_s`: model, data mapping, TRL's trainer), of which the data mapping (`trl/data_s`), and the
checkpoint commits (`trl/checkpoint_s` + `trl/final_commit_s`), as a share of a two-minute job (goal:
<= 10%); beside it the same share with the driver's import of Ray Train added (`trl/driver_import_s`: paid
by a process's first trl stage only, here trl-1's grpo).

    python bench/trl_vs_native.py [--quick] [--json] [--sft-steps N] [--steps N]

`--quick`: 8 sft steps and 4 GRPO / DPO steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
OUT = ROOT / "bench" / "out"
BACKENDS = {"native": "native", "trl-1": {"name": "trl", "num_workers": 1}, "trl-2": {"name": "trl", "num_workers": 2}}
JOB_S = 120.0  # "a two-minute job"
# native GRPO's step, in its trainer actor: what TRL's `timing_s/step` (its callback's on_step_begin to
# on_step_end, in the worker) also holds; native's own `timing_s/step` is the driver's wall from step to
# step, which adds the driver's MLflow write and Ray calls
NATIVE_STEP_PARTS = ("gen", "reward", "old_log_prob", "ref", "update_actor", "update_weights")
FIXED = ("start", "setup", "checkpoint", "final_commit")  # trl/{name}_s: the backend's own cost per stage
DATASETS = {"digits": {"source": "fixtures://digits?rows=200", "converter": "digits"},
            "pairs": {"source": "fixtures://omni_preference?rows=24&seed=0", "converter": "omni_preference"}}


def base(name: str, work: Path) -> dict[str, Any]:
    return {"name": name, "store": str(work / "store"), "tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
            "ray": {"address": "local", "num_cpus": 2}, "seed": 0, "datasets": DATASETS,
            "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits", "pairs"]}]}


def sft_pipeline(work: Path, steps: int) -> dict[str, Any]:
    config = base("bench-sft", work)
    config["stages"].append({"name": "sft", "kind": "sft", "after": ["ingest"], "model": "tiny://lm",
                             "data": "digits:train", "algorithm": {"name": "sft", "response": "ground_truth"},
                             "trainer": {"total_steps": steps, "batch_size": 16, "lr": 3e-3}})
    return config


def backend_pipeline(label: str, work: Path, sft_checkpoint: str, steps: int) -> dict[str, Any]:
    backend = BACKENDS[label]
    config = base(f"bench-{label}", work)
    config["stages"] += [
        {"name": "grpo", "kind": "rl", "after": ["ingest"], "model": sft_checkpoint, "data": "digits:train",
         "algorithm": {"name": "grpo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg_mode": "token-mean",
                       "kl_beta": 0.0, "adv_scale": "group"},
         "rollout": {"n": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8}, "reward": {"name": "digits"},
         "trainer": {"total_steps": steps, "batch_size": 8, "lr": 1e-3}, "backend": backend},
        {"name": "eval", "kind": "eval", "after": ["grpo"], "checkpoint_from": "grpo", "data": "digits:test",
         "max_rows": 32, "max_new_tokens": 8, "greedy": False, "n": 4, "samples": 2},
        {"name": "dpo", "kind": "rl", "after": ["ingest"], "model": "tiny://lm", "data": "pairs:train",
         "algorithm": {"name": "dpo", "beta": 0.1}, "trainer": {"total_steps": steps, "batch_size": 8, "lr": 1e-3},
         "backend": backend},
    ]
    return config


def run_backend(label: str, work: Path, sft_checkpoint: str, steps: int) -> dict[str, Any]:
    from mlflow import MlflowClient

    from omni_core.config import validate_pipeline
    from omni_core.pipeline.run import PipelineRun

    config = validate_pipeline(backend_pipeline(label, work, sft_checkpoint, steps))
    walls: dict[str, float] = {}
    run = PipelineRun.start(config, progress=lambda line: print(f"[{label}] {line}", flush=True))
    ok = False
    try:  # tests/pipeline_runs.py's run_in_order, each stage timed
        for stage in config.ordered_stages():
            started = time.perf_counter()
            run.run_stage(stage.name)
            walls[stage.name] = time.perf_counter() - started
        ok = True
    finally:
        run.finish(ok)
    client = MlflowClient(config.tracking_uri)

    def history(stage: str, name: str) -> list[float]:
        run_id = run.outcomes[stage].mlflow_run_id
        return [m.value for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]

    out: dict[str, Any] = {"eval_reward": run.outcomes["eval"].outputs["metrics"]["val/reward_mean"]}
    for stage in ("grpo", "dpo"):
        steps_s = history(stage, "timing_s/step")
        out[stage] = {"step_s": statistics.median(steps_s[1:] or steps_s), "wall_s": walls[stage],
                      "steps_s": sum(steps_s)}
        if label == "native":  # the step's work in the trainer actor, as TRL's step is timed
            if stage == "grpo":
                parts = [history(stage, f"timing_s/{part}") for part in NATIVE_STEP_PARTS]
                work = [sum(values) for values in zip(*(p for p in parts if p), strict=True)]
            else:  # dpo runs its whole step in the actor
                work = history(stage, "timing_s/actor_step")
            out[stage]["work_s"] = statistics.median(work[1:] or work)
        if label != "native":
            fixed = {name: (history(stage, f"trl/{name}_s") or [0.0])[-1] for name in (*FIXED, "data", "driver_import")}
            out[stage]["fixed_s"] = fixed
            out[stage]["fixed_total_s"] = sum(fixed[name] for name in FIXED)
    out["reward_curve"] = history("grpo", "critic/score/mean" if label == "native" else "reward")
    return out


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    from curves import plot_curves

    plot_curves({label: figures["reward_curve"] for label, figures in results.items()}, path, xlabel="GRPO step",
                ylabel="mean reward of the step's batch", title="digits, tiny://lm: native vs TRL's GRPOTrainer")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sft-steps", type=int)
    parser.add_argument("--steps", type=int)
    args = parser.parse_args(argv)
    sft_steps = args.sft_steps or (8 if args.quick else 40)
    steps = args.steps or (4 if args.quick else 12)
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("OMNI_CACHE_DIR", str(work / "cache"))
        from pipeline_runs import run_in_order

        from omni_core.config import validate_pipeline

        sft = run_in_order(validate_pipeline(sft_pipeline(work, sft_steps)), progress=print)
        checkpoint = sft.outcomes["sft"].outputs["checkpoint_uri"]
        results = {label: run_backend(label, work, checkpoint, steps) for label in BACKENDS}
    png = OUT / "trl_vs_native.png"
    plot(results, png)
    native = results["native"]
    result: dict[str, Any] = {"sft_steps": sft_steps, "steps": steps, "load_1min": round(os.getloadavg()[0], 1),
                              "png": str(png.relative_to(ROOT))}
    for label, figures in results.items():
        result[f"{label}_eval_reward"] = round(figures["eval_reward"], 4)
        result[f"{label}_grpo_reward"] = [round(v, 4) for v in figures["reward_curve"]]
        for stage in ("grpo", "dpo"):
            result[f"{label}_{stage}_step_s"] = round(figures[stage]["step_s"], 3)
            result[f"{label}_{stage}_wall_s"] = round(figures[stage]["wall_s"], 1)
            if "work_s" in figures[stage]:
                result[f"{label}_{stage}_work_s"] = round(figures[stage]["work_s"], 3)
            if label == "native":
                continue
            result[f"{label}_{stage}_step_over_native"] = round(figures[stage]["step_s"] / native[stage]["step_s"], 2)
            if "work_s" in native[stage]:
                result[f"{label}_{stage}_step_over_native_work"] = round(figures[stage]["step_s"] / native[stage]["work_s"], 2)
            fixed = figures[stage]["fixed_s"]
            result[f"{label}_{stage}_fixed_s"] = {k: round(v, 2) for k, v in fixed.items()}
            result[f"{label}_{stage}_fixed_share_of_2min"] = round(figures[stage]["fixed_total_s"] / JOB_S, 3)
            # the process's first trl stage also imports Ray Train in the driver (not a per-stage cost)
            result[f"{label}_{stage}_fixed_share_with_driver_import"] = round(
                (figures[stage]["fixed_total_s"] + fixed["driver_import"]) / JOB_S, 3)
    if not args.json:
        for key, value in result.items():
            print(f"{key:36s} {value}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
