"""Does training learn? Held-out reward before and after each algorithm, with curves saved as PNG.

    python bench/learning.py [--quick] [--json] [--algo grpo|gspo|all] [--seed N]

grpo/gspo: `omni_core.training.learning` (SFT warm start on the digit-reversal fixture, then RL on
`tiny://lm`), held-out mean reward sampled at temperature 1 (and greedy) every few steps. Prints
start, end and gain per algorithm, CPU seconds, and writes `bench/out/learning_<algo>[_seed<N>].png`.

Adding an algorithm: write a function `(quick: bool, seed: int) -> BenchCurve` and decorate it with
`@bench_run("name")`; `--algo name` and `--algo all` then run it, plot it and report it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

OUT = Path(__file__).resolve().parent / "out"


@dataclass
class BenchCurve:
    """One algorithm's run: the `primary` series is the held-out figure that start/end/gain report."""

    algorithm: str
    metric: str  # what the primary series measures, e.g. "held-out mean reward (sampled, mean@4)"
    steps: list[int]
    series: dict[str, list[float]]  # name -> values at `steps`; the first is the primary one
    cpu_s: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # more figures for --json

    @property
    def primary(self) -> list[float]:
        return next(iter(self.series.values()))

    def figures(self) -> dict[str, Any]:
        start, end = self.primary[0], self.primary[-1]
        out = {"start": round(start, 4), "end": round(end, 4), "gain": round(end - start, 4),
               "steps": self.steps[-1], "cpu_s": round(self.cpu_s, 1), "wall_s": round(self.wall_s, 1)}
        for name, values in list(self.series.items())[1:]:
            out[f"{name}_start"], out[f"{name}_end"] = round(values[0], 4), round(values[-1], 4)
        curves = {f"curve_{name}": [round(v, 3) for v in values] for name, values in self.series.items()}
        return {**out, **self.extra, "curve_steps": self.steps, **curves}


BenchRun = Callable[[bool, int], BenchCurve]
BENCH_RUNS: dict[str, BenchRun] = {}


def bench_run(name: str) -> Callable[[BenchRun], BenchRun]:
    """Register a learning benchmark under an algorithm name (`--algo name`)."""

    def wrap(fn: BenchRun) -> BenchRun:
        BENCH_RUNS[name] = fn
        return fn

    return wrap


# --- GRPO / GSPO on the digit-reversal fixture ------------------------------------------------------


@cache
def _warm_start(quick: bool, seed: int) -> tuple[Any, ...]:
    """One SFT warm start shared by the RL runs of this process."""
    from omni_core.training.learning import LearningSetup, load_rows, warm_start

    setup = LearningSetup.quick(seed=seed) if quick else LearningSetup(seed=seed)
    train, val = load_rows(setup)
    model, tokenizer, _ = warm_start(setup, train)
    return setup, model, tokenizer, train, val


def _rl_curve(algorithm: str, quick: bool, seed: int) -> BenchCurve:
    from omni_core.training.learning import learning_curve, state_digest

    setup, model, tokenizer, train, val = _warm_start(quick, seed)
    curve, trainer = learning_curve(algorithm, setup, model, tokenizer, train, val)
    return BenchCurve(
        algorithm=algorithm, metric=f"held-out mean reward, digits task (sampled mean@{setup.eval_samples})",
        steps=curve.steps, series={"sampled": curve.val_sampled, "greedy": curve.val_greedy},
        cpu_s=curve.cpu_s, wall_s=curve.wall_s,
        extra={"sft_steps": setup.sft_steps, "val_rows": len(val), "rollouts_per_step": setup.batch_size * setup.n,
               "clipfrac_mean": round(sum(curve.clipfrac) / len(curve.clipfrac), 4),
               "weights": state_digest(trainer.model)},
    )


@bench_run("grpo")
def grpo(quick: bool, seed: int) -> BenchCurve:
    return _rl_curve("grpo", quick, seed)


@bench_run("gspo")
def gspo(quick: bool, seed: int) -> BenchCurve:
    return _rl_curve("gspo", quick, seed)


# --- report -------------------------------------------------------------------------------------------


def plot(curve: BenchCurve, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for name, values in curve.series.items():
        ax.plot(curve.steps, values, marker="o", markersize=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out mean reward")
    ax.set_title(f"{curve.algorithm}: {curve.metric}", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (well under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--algo", default="all", choices=[*BENCH_RUNS, "all"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: threads only add sync overhead (and stall on a busy machine)
    OUT.mkdir(parents=True, exist_ok=True)
    figures: dict[str, Any] = {"quick": args.quick, "seed": args.seed}
    for name in BENCH_RUNS if args.algo == "all" else [args.algo]:
        curve = BENCH_RUNS[name](args.quick, args.seed)
        path = OUT / (f"learning_{name}.png" if args.seed == 0 else f"learning_{name}_seed{args.seed}.png")
        plot(curve, path)
        fig = curve.figures()
        figures[name] = fig
        others = "  ".join(f"{k.removesuffix('_start')} {fig[k]:.3f} -> {fig[k.replace('_start', '_end')]:.3f}"
                           for k in fig if k.endswith("_start") and k != "start")
        print(f"{name:6s} {curve.metric}: {fig['start']:.3f} -> {fig['end']:.3f} (gain {fig['gain']:+.3f}) "
              f"in {fig['steps']} steps; {others}; {fig['cpu_s']:.0f} CPU s, {fig['wall_s']:.0f} s; {path}",
              flush=True)
    figures["total_cpu_s"] = round(time.process_time(), 1)  # the whole process: imports, SFT, RL, plots
    print(f"total: {figures['total_cpu_s']:.0f} CPU s")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(main())
