"""What separate_async buys on the Ray training-stage runner: the same GRPO work in `sync` and in
`separate_async` (max_staleness 1), and, with a slow reward, separate_async with async_reward on vs off.
Also sync with the rollout worker inside the trainer actor (the default without rollout resources)
against sync with a rollout actor of its own.

    python bench/async.py [--quick] [--json] [--steps N] [--repeats N] [--max-new-tokens N] [--ppo-epochs N]

Every run is `StageRunner(StageRun(...)).run()` on a local Ray cluster: `tiny://lm` on the digits task
(`omni_core.data.digits`), GRPO, same seed, same rows, same stage config apart from `execution`; each
actor (trainer, rollout worker, reward worker) has one CPU, so one torch/OMP thread. The per-step
figures are the runner's own metrics (`run.metrics`): `timing_s/step` (driver: from one step's end to
the next), `timing_s/gen` (rollout worker), `timing_s/reward`, and train = `timing_s/old_log_prob` +
`timing_s/update_actor` (trainer). The first `--warmup` steps (actor start-up, first forwards) and
the last step (the final checkpoint save; in separate_async also the step with nothing left to
overlap) are left out of the means. Runs are taken round-robin over the cases `--repeats` times, so a
change in the shared machine's load hits every case alike, and the kept steps of all repeats pooled.

1. Modes: `sync` vs `separate_async`, both with `async_reward: false` (the cheap `digits` reward is
   scored inline by the rollout worker; two actors, so they fit the two cores). The config (max_new_tokens,
   ppo_epochs) is picked so that gen and train take comparable time; both are reported.
   Targets: async_step / max(gen, train) <= 1.15 (the overlap hides the shorter of the two; gen here
   includes the inline reward), and sync_step / async_step >= 1.3. Also printed: `ideal_sync_over_async`
   = sync_step / max(sync's gen, sync's train), the speed-up the overlap would give if running both
   actors at once slowed neither, and how much slower gen and train are in separate_async than in
   sync: on a machine whose cores are already busy, two actors at once get less than two cores, and
   the overlap buys less than the ideal (or nothing). `parallel_capacity` measures that first: a fixed
   one-thread torch loop on two 1-CPU actors, one after the other vs at once (2.0 = two free cores);
   the speed-up separate_async can reach is about min(ideal_sync_over_async, parallel_capacity).
2. Colocated: `sync` as above with no rollout or reward resources (`in_trainer`: the rollout worker
   inside the trainer actor, one actor) vs `sync` (its own rollout actor): whole-run wall time (actor
   start-up included), the machine's busy CPU seconds over the run (/proc/stat) and step time. Figures:
   sync_wall_over_in_trainer, sync_cpu_over_in_trainer, sync_step_over_in_trainer.
3. Reward: separate_async (`--reward-batch-size` 4 prompts x `--reward-n` 2 responses) with a slow reward, `bench/slow_rewards.py:compute_score` (renders each
   response with PIL and reads it back with tesseract through `omni_core.rewards.ocr`, about 0.2 s a
   response), with `async_reward: true` (reward workers score batch k while the rollout worker
   generates k + 1) vs `false` (the rollout worker scores inline after generating).
   Figure: reward_off_step / reward_on_step.

Ray starts its worker processes at niceness +15 relative to the raylet (`RAY_worker_niceness`), so
under `nice -n -15` the actors would still run at niceness 0 on a shared machine; the bench sets
RAY_worker_niceness=0 (unless set) so that the actors run at the bench's own priority.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SLOW_REWARD = f"{ROOT / 'bench' / 'slow_rewards.py'}:compute_score"
ROWS = 32


def stage_spec(mode: str, async_reward: bool, reward: str, args: argparse.Namespace, in_trainer: bool = False) -> Any:
    from omni_core.config.models import RLStage

    slow = reward == SLOW_REWARD  # fewer responses: a tesseract call per response
    return RLStage.model_validate({
        "name": "rl", "data": "digits", "model": "tiny://lm", "reward": {"name": reward},
        "trainer": {"total_steps": args.steps, "batch_size": args.reward_batch_size if slow else args.batch_size,
                    "ppo_epochs": args.ppo_epochs},
        "rollout": {"n": args.reward_n if slow else args.n, "max_new_tokens": args.max_new_tokens},
        "execution": {"mode": mode, "max_staleness": 1, "async_reward": async_reward},
        "checkpoint": {"save_freq": 0},
        "resources": {"trainer": {"CPU": 1}} if in_trainer else {"trainer": {"CPU": 1}, "rollout": {"CPU": 1},
                                                                  "reward": {"CPU": 1}}})


def machine_cpu_s() -> float | None:
    """Busy core-seconds of the whole machine so far (/proc/stat), or None off Linux: the actors are
    other processes, started and ended inside a run."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:8]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def run_case(mode: str, async_reward: bool, reward: str, in_trainer: bool, args: argparse.Namespace,
             ) -> tuple[list[dict], float, float | None]:
    """One stage run; its per-step metrics, its wall time and the machine's busy CPU seconds (actor
    start-up included)."""
    from omni_core.data.digits import rotate_row
    from omni_core.storage import Store
    from omni_core.training.ray_stage import config_digest, rl_run_key
    from omni_core.training.runner import StageRun, StageRunner

    rows = [rotate_row(f"{i * 37 % 10000:04d}", "train", i) for i in range(ROWS)]
    stage = stage_spec(mode, async_reward, reward, args, in_trainer)
    with tempfile.TemporaryDirectory(prefix="omni-bench-async-") as tmp:
        run = StageRun("bench", stage, args.seed, Store(tmp), rows, "v1", rl_run_key(stage, args.seed, "v1"),
                       config_digest(stage, args.seed, "v1"), progress=lambda line: None)
        start, cpu = time.perf_counter(), machine_cpu_s()
        StageRunner(run).run()
        end_cpu = machine_cpu_s()
        return run.metrics, time.perf_counter() - start, None if cpu is None or end_cpu is None else end_cpu - cpu


def kept(metrics: list[dict], warmup: int) -> list[dict]:
    """The steady-state steps: without the first `warmup` and the last (the final checkpoint)."""
    return metrics[warmup:-1]


def summarize(steps: list[dict]) -> dict[str, float]:
    def mean(key: str) -> float:
        return round(statistics.fmean(m.get(key, 0.0) for m in steps), 4)

    out = {"step_s": mean("timing_s/step"), "gen_s": mean("timing_s/gen"), "reward_s": mean("timing_s/reward"),
           "train_s": round(statistics.fmean(m["timing_s/old_log_prob"] + m["timing_s/update_actor"] for m in steps), 4),
           "old_log_prob_s": mean("timing_s/old_log_prob"), "update_actor_s": mean("timing_s/update_actor"),
           "update_weights_s": mean("timing_s/update_weights"),
           "staleness_mean": mean("training/off_policy/staleness_mean"),
           "step_median_s": round(statistics.median(m["timing_s/step"] for m in steps), 4), "steps": len(steps)}
    return out


def parallel_capacity(rounds: int = 3) -> dict[str, float]:
    """How much two 1-CPU actors get done at once vs one at a time: the same fixed torch loop (matmul
    + tanh on one thread) on two actors, alone (one after the other) and together; best of `rounds`.
    2.0 means two idle cores; about 1.0 means the machine runs them no faster than one after the other
    (busy or shared cores), and the overlap of gen and train cannot shorten a step."""
    import ray

    @ray.remote(num_cpus=1)
    class Spin:
        def work(self) -> float:
            import torch

            x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
            start = time.perf_counter()
            for _ in range(300):
                x = torch.tanh(x @ x / 16)
            return time.perf_counter() - start

    actors = [Spin.remote(), Spin.remote()]
    ray.get([a.work.remote() for a in actors])  # warm-up
    alone, together = float("inf"), float("inf")
    for _ in range(rounds):
        alone = min(alone, sum(ray.get(a.work.remote()) for a in actors))
        start = time.perf_counter()
        ray.get([a.work.remote() for a in actors])
        together = min(together, time.perf_counter() - start)
    for actor in actors:
        ray.kill(actor)
    return {"alone_s": round(alone, 3), "together_s": round(together, 3), "speedup": round(alone / together, 2)}


CASES = {  # name: (mode, async_reward, reward, rollout worker inside the trainer)
    "sync": ("sync", False, "digits", False),
    "async": ("separate_async", False, "digits", False),
    "in_trainer": ("sync", False, "digits", True),
    "reward_on": ("separate_async", True, SLOW_REWARD, False),
    "reward_off": ("separate_async", False, SLOW_REWARD, False),
}


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, float]]:
    import ray

    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=4, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    cases = [c for c in CASES if args.no_reward is False or not c.startswith("reward")]
    capacity = parallel_capacity()
    print(f"  parallel capacity: two 1-CPU actors' fixed work one after the other {capacity['alone_s']:.3f}s, "
          f"at once {capacity['together_s']:.3f}s: {capacity['speedup']:.2f}x (2.0 = two free cores)", flush=True)
    pooled: dict[str, list[dict]] = {c: [] for c in cases}
    walls: dict[str, list[float]] = {c: [] for c in cases}
    cpus: dict[str, list[float]] = {c: [] for c in cases}
    try:
        for repeat in range(args.repeats):  # round-robin over the cases
            for case in cases:
                metrics, wall, cpu = run_case(*CASES[case], args=args)
                if cpu is not None:
                    cpus[case].append(round(cpu, 1))
                steady = kept(metrics, args.warmup)
                pooled[case] += steady
                walls[case].append(round(wall, 1))
                part = summarize(steady)
                print(f"  [{repeat + 1}/{args.repeats}] {case:10s} wall {wall:6.1f}s  step {part['step_s']:.3f}s  "
                      f"gen {part['gen_s']:.3f}s  reward {part['reward_s']:.3f}s  train {part['train_s']:.3f}s  "
                      f"staleness {part['staleness_mean']:.1f}", flush=True)
    finally:
        ray.shutdown()
    out: dict[str, Any] = {c: {**summarize(pooled[c]), "wall_s": walls[c], "cpu_s": cpus[c]} for c in cases}
    return out, capacity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat (under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--steps", type=int, default=None, help="total_steps per run (default 9, quick 5)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per case, round-robin (default 2, quick 1)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step (default 8)")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (default 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="response length (default 64)")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over each batch (default 1)")
    parser.add_argument("--reward-batch-size", type=int, default=4, help="prompts per step, slow-reward part (default 4)")
    parser.add_argument("--reward-n", type=int, default=2, help="responses per prompt, slow-reward part (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reward", action="store_true", help="skip the async_reward on/off part")
    args = parser.parse_args()
    args.steps = args.steps or (5 if args.quick else 9)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.steps < args.warmup + 2:
        parser.error(f"--steps must be at least --warmup + 2 ({args.warmup + 2})")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print(f"tiny://lm, digits, GRPO: {args.steps} steps x {args.batch_size} prompts x {args.n} responses x "
          f"{args.max_new_tokens} new tokens, ppo_epochs {args.ppo_epochs}; 1 CPU per actor; means over steps "
          f"{args.warmup + 1}..{args.steps - 1} of {args.repeats} run(s) per case", flush=True)
    cases, capacity = measure(args)
    sync, asyn = cases["sync"], cases["async"]
    figures: dict[str, Any] = {
        "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup, "batch_size": args.batch_size,
        "n": args.n, "max_new_tokens": args.max_new_tokens, "ppo_epochs": args.ppo_epochs,
        "sync_step_s": sync["step_s"], "async_step_s": asyn["step_s"],
        "gen_s": asyn["gen_s"], "train_s": asyn["train_s"], "sync_gen_s": sync["gen_s"], "sync_train_s": sync["train_s"],
    }
    # what the overlap would give if running both at once did not slow either (idle cores)
    figures["ideal_sync_over_async"] = round(sync["step_s"] / max(sync["gen_s"] + sync["reward_s"], sync["train_s"]), 3)
    figures["parallel_capacity"] = capacity["speedup"]
    figures["parallel_capacity_alone_s"], figures["parallel_capacity_together_s"] = capacity["alone_s"], capacity["together_s"]
    figures["async_over_max_gen_train"] = round(asyn["step_s"] / max(asyn["gen_s"] + asyn["reward_s"], asyn["train_s"]), 3)
    figures["sync_over_async"] = round(sync["step_s"] / asyn["step_s"], 3)
    figures["target_async_overlap_met"] = figures["async_over_max_gen_train"] <= 1.15
    figures["target_speedup_met"] = figures["sync_over_async"] >= 1.3
    print(f"\n{'case':11s} {'step_s':>8s} {'median':>8s} {'gen_s':>8s} {'reward_s':>8s} {'train_s':>8s} "
          f"{'weights_s':>9s} {'stale':>5s} {'steps':>5s}  wall_s")
    for name, c in cases.items():
        print(f"{name:11s} {c['step_s']:8.3f} {c['step_median_s']:8.3f} {c['gen_s']:8.3f} {c['reward_s']:8.3f} "
              f"{c['train_s']:8.3f} {c['update_weights_s']:9.3f} {c['staleness_mean']:5.1f} {c['steps']:5d}  {c['wall_s']}")
    print(f"\nasync_step / max(gen + inline reward, train) = {asyn['step_s']:.3f} / "
          f"{max(asyn['gen_s'] + asyn['reward_s'], asyn['train_s']):.3f} = {figures['async_over_max_gen_train']} "
          f"(target <= 1.15: {'met' if figures['target_async_overlap_met'] else 'NOT met'})")
    print(f"sync_step / async_step = {sync['step_s']:.3f} / {asyn['step_s']:.3f} = {figures['sync_over_async']} "
          f"(target >= 1.3: {'met' if figures['target_speedup_met'] else 'NOT met'}); with sync's own gen and train "
          f"times, i.e. if overlapping did not slow either: sync_step / max(gen, train) = {figures['ideal_sync_over_async']}; "
          f"gen and train in async over sync: {asyn['gen_s'] / sync['gen_s']:.2f}x, {asyn['train_s'] / sync['train_s']:.2f}x")
    colocated = cases["in_trainer"]
    figures.update({"in_trainer_step_s": colocated["step_s"], "in_trainer_wall_s": colocated["wall_s"],
                    "sync_step_over_in_trainer": round(sync["step_s"] / colocated["step_s"], 3),
                    "sync_wall_over_in_trainer": round(statistics.fmean(sync["wall_s"])
                                                       / statistics.fmean(colocated["wall_s"]), 3),
                    "sync_cpu_over_in_trainer": round(statistics.fmean(sync["cpu_s"]) / statistics.fmean(colocated["cpu_s"]), 3)
                    if sync["cpu_s"] and colocated["cpu_s"] else None})
    print(f"sync with its own rollout actor over sync with the rollout worker inside the trainer: wall "
          f"{figures['sync_wall_over_in_trainer']}x, machine CPU {figures['sync_cpu_over_in_trainer']}x (start-up "
          f"included: {sync['cpu_s']} vs {colocated['cpu_s']} CPU s), step {figures['sync_step_over_in_trainer']}x")
    if "reward_on" in cases:
        on, off = cases["reward_on"], cases["reward_off"]
        figures.update({"reward_batch_size": args.reward_batch_size, "reward_n": args.reward_n,
                        "reward_on_step_s": on["step_s"], "reward_off_step_s": off["step_s"],
                        "reward_s": on["reward_s"], "reward_gen_s": on["gen_s"], "reward_train_s": on["train_s"],
                        "reward_off_over_on": round(off["step_s"] / on["step_s"], 3)})
        print(f"slow reward (tesseract), separate_async: async_reward off / on step = {off['step_s']:.3f} / "
              f"{on['step_s']:.3f} = {figures['reward_off_over_on']} (reward {on['reward_s']:.3f}s, "
              f"gen {on['gen_s']:.3f}s, train {on['train_s']:.3f}s per step)")
    figures["cases"] = cases
    if args.json:
        print(json.dumps(figures, sort_keys=True))


if __name__ == "__main__":
    main()
