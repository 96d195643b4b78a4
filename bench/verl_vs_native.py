"""A peer check: our native GRPO against verl's (backend verl, device cpu), same model, data and settings.

One pipeline, run twice side by side in one process: ingest the digits task -> sft (a warm start) -> rl
(GRPO from the sft checkpoint, the digits reward) -> eval of the rl checkpoint, once with `backend:
native` (our trainer on a local Ray) and once with `backend: {name: verl, device: cpu}` (verl 0.9.1's
sft_trainer and main_ppo as Ray Jobs on a `ray start --head --num-cpus 8`, verl's CPU rollout
`omni_cpu`). The GRPO settings map 1:1 (omni_core/backends/verl/render.py): n responses per prompt,
temperature 1, max new tokens, clip ratios 0.2/0.2, token-mean loss, no KL, group-std advantages, one
PPO epoch over one mini batch, lr, batch size, seed.

Reported: the rl stage's median step time of each (MLflow `timing_s/step`, both log verl's name) and
their ratio (target: native >= 2x verl's speed), the per-step `critic/score/mean` of both on one PNG
(bench/out/verl_vs_native.png), and the final eval rewards (`val/reward_mean`) with each one's gain over
its sft checkpoint (the eval's `baseline: true`: did GRPO help).

    python bench/verl_vs_native.py [--quick] [--json] [--sft-steps N] [--rl-steps N]

Needs the verl environment (`make setup` builds .venv-verl; or OMNI_VERL_PYTHON). `--quick`: 8 sft and
3 rl steps (the verl jobs' start-up, ~9 Ray processes importing torch and verl, dominates it).
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


def pipeline(backend: str, work: Path, ray_address: str, sft_steps: int, rl_steps: int) -> dict[str, Any]:
    from verl_env import verl_python

    def with_backend(stage: dict, overrides: list[str]) -> dict:
        if backend == "native":
            return stage
        return {**stage, "backend": {"name": "verl", "python": verl_python(), "shared_dir": str(work / "shared"),
                                     "device": "cpu", "overrides": overrides}}

    return {
        "name": f"peer-{backend}", "store": str(work / "store"), "tracking_uri": f"sqlite:///{work / 'mlflow.db'}",
        "ray": {"address": ray_address, **({"num_cpus": 2} if ray_address == "local" else {})}, "seed": 0,
        "datasets": {"digits": {"source": "fixtures://digits?rows=200", "converter": "digits"}},
        "stages": [
            {"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
            with_backend({"name": "sft", "kind": "sft", "after": ["ingest"], "model": "tiny://lm",
                          "data": "digits:train", "algorithm": {"name": "sft", "response": "ground_truth"},
                          "trainer": {"total_steps": sft_steps, "batch_size": 16, "lr": 3e-3}},
                         ["data.max_length=64"]),
            with_backend({"name": "rl", "kind": "rl", "after": ["sft"], "model": {"from": "sft"},
                          "data": "digits:train",
                          "algorithm": {"name": "grpo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                                        "loss_agg_mode": "token-mean", "kl_beta": 0.0, "adv_scale": "group"},
                          "rollout": {"n": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
                          "reward": {"name": "digits"},
                          "trainer": {"total_steps": rl_steps, "batch_size": 8, "lr": 1e-3, "ppo_epochs": 1,
                                      "ppo_mini_batch_size": 8, "max_prompt_tokens": 64}},
                         ["trainer.val_before_train=false"]),
            {"name": "eval", "kind": "eval", "after": ["rl"], "checkpoint_from": "rl", "data": "digits:test",
             "max_rows": 32, "max_new_tokens": 8, "samples": 4, "baseline": True},  # baseline: the sft checkpoint
        ]}


def run_one(backend: str, work: Path, ray_address: str, sft_steps: int, rl_steps: int) -> dict[str, Any]:
    from mlflow import MlflowClient
    from pipeline_runs import run_in_order

    from omni_core.config import validate_pipeline

    work.mkdir(parents=True)
    config = validate_pipeline(pipeline(backend, work, ray_address, sft_steps, rl_steps))
    started = time.perf_counter()
    run = run_in_order(config, progress=lambda line: print(f"[{backend}] {line}", flush=True))
    wall = time.perf_counter() - started
    client = MlflowClient(config.tracking_uri)
    rl_run = run.outcomes["rl"].mlflow_run_id

    def history(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(rl_run, name), key=lambda m: m.step)]

    step_times = history("timing_s/step")
    return {"step_s_median": statistics.median(step_times[1:] or step_times), "step_s": step_times,
            "score_mean": history("critic/score/mean"),
            "eval_reward": run.outcomes["eval"].outputs["metrics"]["val/reward_mean"],
            "eval_gain_over_sft": run.outcomes["eval"].outputs["metrics"]["val/reward_mean_gain"], "pipeline_s": wall}


def plot(native: dict, verl: dict, path: Path) -> None:
    from curves import plot_curves

    plot_curves({"native": native["score_mean"], "verl (device cpu)": verl["score_mean"]}, path, xlabel="GRPO step",
                ylabel="critic/score/mean", title="digits, tiny://lm: native vs verl GRPO")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sft-steps", type=int)
    parser.add_argument("--rl-steps", type=int)
    args = parser.parse_args(argv)
    sft_steps = args.sft_steps or (8 if args.quick else 60)
    rl_steps = args.rl_steps or (3 if args.quick else 20)
    from ray_cluster import start_cluster

    with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
        work = Path(tmp)
        os.environ.setdefault("OMNI_CACHE_DIR", str(work / "cache"))
        cluster = start_cluster(head_cpus=8, wait=300)  # verl's jobs run on their own head (idle meanwhile)
        try:
            native = run_one("native", work / "native", "local", sft_steps, rl_steps)
            import ray

            ray.shutdown()  # the native run's local Ray
            verl = run_one("verl", work / "verl", cluster.job_server, sft_steps, rl_steps)
        finally:
            cluster.stop()
    png = OUT / "verl_vs_native.png"
    plot(native, verl, png)
    result = {"sft_steps": sft_steps, "rl_steps": rl_steps,
              "native_step_s": round(native["step_s_median"], 3), "verl_step_s": round(verl["step_s_median"], 3),
              "native_speedup_vs_verl": round(verl["step_s_median"] / native["step_s_median"], 2),
              "native_score_mean": [round(v, 4) for v in native["score_mean"]],
              "verl_score_mean": [round(v, 4) for v in verl["score_mean"]],
              "native_eval_reward": round(native["eval_reward"], 4), "verl_eval_reward": round(verl["eval_reward"], 4),
              "native_eval_gain_over_sft": round(native["eval_gain_over_sft"], 4),
              "verl_eval_gain_over_sft": round(verl["eval_gain_over_sft"], 4),
              "native_pipeline_s": round(native["pipeline_s"], 1), "verl_pipeline_s": round(verl["pipeline_s"], 1),
              "png": str(png.relative_to(ROOT))}
    if not args.json:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
