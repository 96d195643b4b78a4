"""Does training learn? Held-out figures before and after each algorithm, with curves saved as PNG.

    python bench/learning.py [--algo grpo,gspo,dpo,mpo,flow_grpo | all] [--quick] [--json] [--seed N]

grpo/gspo: `bench/learning_grpo.py` (SFT warm start on the digit-reversal fixture, then RL on
`tiny://lm`), held-out mean reward sampled at temperature 1 (and greedy) every few steps.
dpo/mpo: `bench/learning_preference.py` (`tiny://lm` on the Omni-Preference fixture), reward accuracy
on the held-out pairs, overall and per modality, after every step.
flow_grpo: `bench/learning_flow.py` (`tiny://sd3`, JPEG-compressibility reward), mean reward of a
fixed evaluation set (ODE sampling) every 10 steps, and of the training batches.

Runs the chosen algorithms (default all) in turn, writes `bench/out/learning_<algo>[_seed<N>].png`
(flow_grpo also `learning_flow_grpo_samples[_seed<N>].png`), prints a summary table, and with
`--json` prints one JSON object of all figures, keyed by algorithm, as the last line. `--quick`
shortens every run so that `--quick` with all algorithms takes under two minutes.

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # `bench.learning_*` when run as a script
OUT = ROOT / "bench" / "out"


@dataclass
class BenchCurve:
    """One algorithm's run: the `primary` series is the held-out figure that start/end/gain report."""

    algorithm: str
    metric: str  # what the primary series measures, e.g. "held-out mean reward (sampled, mean@4)"
    steps: list[int]
    series: dict[str, list[float]]  # name -> held-out values at `steps`; the first is the primary one
    train_steps: int
    cpu_s: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)  # more figures for --json
    note: str = ""  # one line of further figures for the summary table
    ylabel: str = "held-out mean reward"
    ylim: tuple[float, float] | None = (0, 1.05)
    hline: float | None = None  # a target line on the held-out plot
    fmt: str = ".3f"  # how the table prints start/end/gain
    train_curves: dict[str, list[list[float]]] = field(default_factory=dict)  # name -> [step, value] pairs
    train_ylabel: str = ""
    more_plots: dict[str, Callable[[Path], Any]] = field(default_factory=dict)  # file suffix -> writer

    @property
    def primary(self) -> list[float]:
        return next(iter(self.series.values()))

    def figures(self) -> dict[str, Any]:
        start, end = self.primary[0], self.primary[-1]
        digits = 7 if self.fmt.endswith("6f") else 4
        out = {"metric": self.metric, "start": round(start, digits), "end": round(end, digits),
               "gain": round(end - start, digits), "steps": self.train_steps, "cpu_s": round(self.cpu_s, 1),
               "wall_s": round(self.wall_s, 1)}
        curves = {f"curve_{name}": [round(v, digits) for v in values] for name, values in self.series.items()}
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
    from bench.learning_grpo import LearningSetup, load_rows, warm_start

    setup = LearningSetup.quick(seed=seed) if quick else LearningSetup(seed=seed)
    train, val = load_rows(setup)
    model, tokenizer, _ = warm_start(setup, train)
    return setup, model, tokenizer, train, val


def _rl_curve(algorithm: str, quick: bool, seed: int) -> BenchCurve:
    from bench.learning_grpo import learning_curve, state_digest

    setup, model, tokenizer, train, val = _warm_start(quick, seed)
    curve, trainer = learning_curve(algorithm, setup, model, tokenizer, train, val)
    greedy = curve.val_greedy
    return BenchCurve(
        algorithm=algorithm, metric=f"held-out mean reward, digits task (sampled mean@{setup.eval_samples})",
        steps=curve.steps, series={"sampled": curve.val_sampled, "greedy": greedy}, train_steps=curve.steps[-1],
        cpu_s=curve.cpu_s, wall_s=curve.wall_s, note=f"greedy {greedy[0]:.3f} -> {greedy[-1]:.3f}",
        extra={"greedy_start": round(greedy[0], 4), "greedy_end": round(greedy[-1], 4),
               "sft_steps": setup.sft_steps, "val_rows": len(val), "rollouts_per_step": setup.batch_size * setup.n,
               "clipfrac_mean": round(sum(curve.clipfrac) / len(curve.clipfrac), 4),
               "weights": state_digest(trainer.model)},
    )


@bench_run("grpo")
def grpo(quick: bool, seed: int) -> BenchCurve:
    return _rl_curve("grpo", quick, seed)


@bench_run("gspo")
def gspo(quick: bool, seed: int) -> BenchCurve:
    return _rl_curve("gspo", quick, seed)


# --- DPO / MPO on the Omni-Preference fixture -------------------------------------------------------


def _preference_curve(loss_mode: str, quick: bool, seed: int) -> BenchCurve:
    from bench.learning_preference import PreferenceSetup, modalities, run_preference

    setup = PreferenceSetup.quick() if quick else PreferenceSetup()
    run = run_preference(loss_mode, setup, seed)
    steps = [step for step, _ in run["validation"]]
    first, last = run["validation"][0][1], run["validation"][-1][1]
    names = modalities(last)
    series = {"all": [m["val/reward_accuracy"] for _, m in run["validation"]]}
    series |= {name: [m[f"val/{name}/reward_accuracy"] for _, m in run["validation"]] for name in names}
    reached = next((step for step, acc in zip(steps, series["all"], strict=True) if acc >= 0.9), None)
    per_modality = {name: {"pairs": run["held_out_pairs_per_modality"].get(name, 0),
                           "heldout_acc_start": round(first[f"val/{name}/reward_accuracy"], 4),
                           "heldout_acc_end": round(last[f"val/{name}/reward_accuracy"], 4),
                           "reward_margin_end": round(last[f"val/{name}/reward_margin"], 4)} for name in names}
    return BenchCurve(
        algorithm=loss_mode, metric=f"held-out reward accuracy, Omni-Preference fixture ({run['held_out_pairs']} pairs)",
        steps=steps, series=series, train_steps=setup.steps, cpu_s=run["cpu_s"], wall_s=run["wall_s"],
        note=(f"first >= 0.9 at step {reached}; "
              + ", ".join(f"{n} {m['heldout_acc_start']:.2f} -> {m['heldout_acc_end']:.2f}" for n, m in per_modality.items())
              + f"; margin {last['val/reward_margin']:.2f}"),
        ylabel="held-out reward accuracy", ylim=(-0.05, 1.05), hline=0.9,
        train_curves={f"{loss_mode}_loss": run["train_loss"]}, train_ylabel=f"actor/{loss_mode}_loss (train)",
        extra={"heldout_acc_start": round(series["all"][0], 4), "heldout_acc_end": round(series["all"][-1], 4),
               "first_step_acc_ge_0.9": reached, "per_modality": per_modality,
               "reward_margin_end": round(last["val/reward_margin"], 4),
               "chosen_rewards_end": round(last["val/chosen_rewards"], 4),
               "rejected_rewards_end": round(last["val/rejected_rewards"], 4),
               "val_loss_start": round(first[f"val/{loss_mode}_loss"], 4),
               "val_loss_end": round(last[f"val/{loss_mode}_loss"], 4),
               "train_loss_first": round(run["train_loss"][0][1], 4), "train_loss_last": round(run["train_loss"][-1][1], 4),
               "model": run["model"], "fixture_rows_per_modality": setup.rows, "train_pairs": run["train_pairs"],
               "held_out_pairs": run["held_out_pairs"], "batch_size": setup.batch_size, "lr": setup.lr},
    )


@bench_run("dpo")
def dpo(quick: bool, seed: int) -> BenchCurve:
    return _preference_curve("dpo", quick, seed)


@bench_run("mpo")
def mpo(quick: bool, seed: int) -> BenchCurve:
    return _preference_curve("mpo", quick, seed)


# --- FlowGRPO on tiny://sd3 with the JPEG-compressibility reward ----------------------------------------


@bench_run("flow_grpo")
def flow_grpo(quick: bool, seed: int) -> BenchCurve:
    from bench.learning_flow import FlowSetup, run_flow, save_samples

    setup = FlowSetup.quick() if quick else FlowSetup()
    result, images = run_flow(setup, seed)
    seeds = result["setup"]["seeds"]
    runs = [result[f"seed{s}"] for s in seeds]
    steps = [step for step, _ in runs[0]["eval_reward"]]
    mean = [sum(run["eval_reward"][i][1] for run in runs) / len(runs) for i in range(len(steps))]
    series = {"eval" if len(seeds) == 1 else "eval, mean of seeds": mean}
    if len(seeds) > 1:
        series |= {f"eval, seed {s}": [v for _, v in run["eval_reward"]] for s, run in zip(seeds, runs, strict=True)}
    finals = {f"seed{s}": run["final"] for s, run in zip(seeds, runs, strict=True)}
    summary = result["summary"]
    title = f"flow_grpo evaluation images, seed {seeds[0]}: before / after {setup.steps} steps"
    return BenchCurve(
        algorithm="flow_grpo",
        metric=f"eval reward -(JPEG KB)/500, {result['setup']['eval_images']} images, ODE 40 steps, tiny://sd3",
        steps=steps, series=series, train_steps=setup.steps,
        cpu_s=sum(f["train_eval_cpu_s"] for f in finals.values()), wall_s=sum(f["train_eval_s"] for f in finals.values()),
        note=(f"eval {summary['eval_kb_before_mean']:.3f} -> {summary['eval_kb_after_mean']:.3f} KB, "
              f"{summary['seeds_improved']}/{len(seeds)} seeds better, images better "
              + "/".join(f"{f['eval_improved_fraction']:.0%}" for f in finals.values())),
        ylabel="-(JPEG KB)/500 (eval)", ylim=None, fmt=".6f",
        train_curves={f"train batches, seed {s}": run["train_reward"] for s, run in zip(seeds, runs, strict=True)},
        train_ylabel="critic/score/mean (train batches)",
        more_plots={"_samples": lambda path: save_samples(images, path, title)},
        extra={**summary, "seeds": seeds, "per_seed": finals, "train_prompts": result["setup"]["train_prompts"],
               "eval_images": result["setup"]["eval_images"], "config": result["setup"]["config"]},
    )


# --- report -------------------------------------------------------------------------------------------


def plot(curve: BenchCurve, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if curve.train_curves else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), dpi=100, squeeze=False)
    ax = axes[0][0]
    for i, (name, values) in enumerate(curve.series.items()):
        ax.plot(curve.steps, values, marker="o", markersize=3, label=name, linewidth=2 if i == 0 else 1,
                alpha=1 if i == 0 else 0.7)
    if curve.hline is not None:
        ax.axhline(curve.hline, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="step", ylabel=curve.ylabel)
    ax.set_title(f"{curve.algorithm}: {curve.metric}", fontsize=8)
    if curve.ylim:
        ax.set_ylim(*curve.ylim)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    if curve.train_curves:
        ax = axes[0][1]
        for name, points in curve.train_curves.items():
            ax.plot(*zip(*points, strict=True), marker=".", label=name, alpha=0.7)
        ax.set(xlabel="step", ylabel=curve.train_ylabel)
        ax.set_title(f"{curve.algorithm}: training", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_algos(text: str) -> list[str]:
    names = list(BENCH_RUNS) if text == "all" else [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCH_RUNS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown algorithm(s) {unknown}; choose from {', '.join(BENCH_RUNS)} or all")
    return names


def table(curves: list[BenchCurve], paths: dict[str, Path]) -> str:
    rows = [("algo", "held-out start", "end", "gain", "steps", "CPU s", "wall s", "curve", "")]
    for c in curves:
        f = c.figures()
        rows.append((c.algorithm, f"{f['start']:{c.fmt}}", f"{f['end']:{c.fmt}}", f"{f['gain']:+{c.fmt}}",
                     str(f["steps"]), f"{f['cpu_s']:.0f}", f"{f['wall_s']:.0f}",
                     str(paths[c.algorithm].relative_to(ROOT)), c.note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows]
    metrics = [f"  {c.algorithm}: {c.metric}" for c in curves]
    return "\n".join([*lines, "held-out metric:", *metrics])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (all algorithms under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--algo", default="all", type=parse_algos,
                        help=f"comma-separated, from {','.join(BENCH_RUNS)}; or all (default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: threads only add sync overhead (and stall on a busy machine)
    OUT.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    figures: dict[str, Any] = {"quick": args.quick, "seed": args.seed}
    curves, paths = [], {}
    suffix = "" if args.seed == 0 else f"_seed{args.seed}"
    for name in args.algo:
        curve = BENCH_RUNS[name](args.quick, args.seed)
        paths[name] = OUT / f"learning_{name}{suffix}.png"
        plot(curve, paths[name])
        for extra_suffix, write in curve.more_plots.items():
            write(OUT / f"learning_{name}{extra_suffix}{suffix}.png")
        fig = curve.figures()
        figures[name] = fig
        curves.append(curve)
        print(f"{name}: {fig['start']:{curve.fmt}} -> {fig['end']:{curve.fmt}} (gain {fig['gain']:+{curve.fmt}}) "
              f"in {fig['steps']} steps, {fig['wall_s']:.0f} s; {curve.note}", flush=True)
    figures["total_cpu_s"] = round(time.process_time(), 1)  # the whole process: imports, data, training, plots
    figures["total_wall_s"] = round(time.perf_counter() - start, 1)  # after imports
    print(table(curves, paths))
    print(f"total: {figures['total_cpu_s']:.0f} CPU s, {figures['total_wall_s']:.0f} s wall after imports")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    sys.exit(main())
