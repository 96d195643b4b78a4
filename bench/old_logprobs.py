"""The old log-probs of a single-update step: taken from the update forward vs recomputed, side by side.

    python bench/old_logprobs.py [--algo grpo,gspo] [--steps N] [--quick] [--json] [--seed N]

`tiny://lm` on the `digits` fixture (as `bench/learning.py`: a short SFT warm start, then RL with the
`digits` reward), with one optimizer step per batch (`trainer.ppo_epochs: 1`, no mini-batches). Two
`GRPOTrainer`s start from the same warm-started weights and seed: one takes the old log-probs from
the update forward (the default for this schedule), the other sets `recompute_old_logp = True` and
runs the extra no-grad forward. Their steps alternate, so load on the machine hits both alike.

Prints per algorithm the mean seconds of a whole step and of its learn part (advantages, old
log-probs, update) on each path, the step-time ratio (reused / recomputed), the recomputing path's
`timing_s/old_log_prob` share of its step, and the largest weight difference between the two after
the last step (the ratio is exactly 1 on both paths: it should stay at float rounding, < 1e-6).
`--json` prints one JSON object as the last line; `--quick` (fewer SFT and RL steps) runs in under
two minutes.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_pair(algorithm: str, setup: Any, model: Any, tokenizer: Any, rows: list[dict[str, Any]], steps: int,
             ) -> dict[str, Any]:
    from omni_core.training.grpo_loop import GRPOTrainer

    trainers = {}
    for path in ("reused", "recomputed"):
        trainer = GRPOTrainer(setup.stage(algorithm), rows, setup.seed, model=copy.deepcopy(model),
                              text_io=tokenizer)
        trainer.recompute_old_logp = path == "recomputed"
        trainers[path] = trainer
    step_s: dict[str, list[float]] = {path: [] for path in trainers}
    learn_s: dict[str, list[float]] = {path: [] for path in trainers}
    old_s: list[float] = []
    grad_norm_diff = 0.0
    for _ in range(steps):
        norms = {}
        for path, trainer in trainers.items():
            metrics = trainer.step()
            step_s[path].append(metrics["timing_s/step"])
            learn_s[path].append(metrics["timing_s/old_log_prob"] + metrics["timing_s/update_actor"])
            norms[path] = metrics["actor/grad_norm"]
            if path == "recomputed":
                old_s.append(metrics["timing_s/old_log_prob"])
        grad_norm_diff = max(grad_norm_diff, abs(norms["reused"] - norms["recomputed"]))
    a = trainers["reused"].model.state_dict()
    b = trainers["recomputed"].model.state_dict()
    weight_diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    for trainer in trainers.values():
        trainer.close()
    mean = {path: statistics.fmean(values) for path, values in step_s.items()}
    learn = {path: statistics.fmean(values) for path, values in learn_s.items()}
    return {
        "steps": steps,
        "step_s_reused": round(mean["reused"], 4),
        "step_s_recomputed": round(mean["recomputed"], 4),
        "step_time_ratio": round(mean["reused"] / mean["recomputed"], 4),
        "learn_s_reused": round(learn["reused"], 4),
        "learn_s_recomputed": round(learn["recomputed"], 4),
        "learn_time_ratio": round(learn["reused"] / learn["recomputed"], 4),
        "old_log_prob_share": round(statistics.fmean(old_s) / mean["recomputed"], 4),
        "max_weight_diff": weight_diff,
        "max_grad_norm_diff": grad_norm_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", default="grpo,gspo")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per path (default 30, 8 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from bench.learning_grpo import LearningSetup, load_rows, warm_start

    torch.set_num_threads(1)  # both paths on one core: their times compare, whatever else the machine runs
    steps = args.steps or (8 if args.quick else 30)
    setup = dataclasses.replace(LearningSetup(seed=args.seed), ppo_epochs=1, ppo_mini_batch_size=None,
                                sft_steps=20 if args.quick else 60)
    wall = time.perf_counter()
    train_rows, _ = load_rows(setup)
    model, tokenizer, _ = warm_start(setup, train_rows)
    results = {algo: run_pair(algo, setup, model, tokenizer, train_rows, steps) for algo in args.algo.split(",")}
    wall = time.perf_counter() - wall

    print(f"tiny://lm, digits, batch {setup.batch_size} prompts x {setup.n} responses, "
          f"{setup.max_new_tokens} new tokens, ppo_epochs 1, one mini-batch, {steps} steps per path, 1 thread")
    print(f"{'algo':6} {'step s reused':>14} {'recomputed':>11} {'ratio':>7} {'learn ratio':>12} "
          f"{'old-logp share':>15} {'max |dW|':>10}")
    for algo, r in results.items():
        print(f"{algo:6} {r['step_s_reused']:14.3f} {r['step_s_recomputed']:11.3f} {r['step_time_ratio']:7.3f} "
              f"{r['learn_time_ratio']:12.3f} {r['old_log_prob_share']:15.3f} {r['max_weight_diff']:10.2e}")
    print(f"wall {wall:.1f}s")
    if args.json:
        print(json.dumps({"bench": "old_logprobs", "quick": args.quick, "seed": args.seed, "wall_s": round(wall, 1),
                          **results}))


if __name__ == "__main__":
    main()
