"""Learning curve of FlowGRPO on `tiny://sd3` with the JPEG-compressibility reward (DDPO's,
-(JPEG KB at quality 95)/500): the training batches' mean reward per step, and the mean reward of a
fixed evaluation set (held-out OCR fixture prompts x fixed noise seeds, ODE sampler, 40 steps).

    python bench/learning_flow.py [--quick] [--json]

flow_grpo's SD3 recipe at toy scale: True-CFG w=4.5, SDE sampler with noise level 0.7 on 10 steps
(all trained), one prompt per step with a group of 4 images, lr 1e-2, clip 1e-4, no KL; full
fine-tune of the random-weight 85k-parameter transformer. LoRA (rank 8 on flow_grpo's attention
targets) does not move this random-weight model: its gradient norm stays <= 1e-7 at lr 1e-2 (the
output barely depends on the attention of a 0.02-std init), and the evaluation is unchanged after
40 steps even at lr 0.1.
`--quick`: one seed, 40 steps (about a minute on 2 CPU cores); otherwise seeds 0, 1, 2.
At lr >= 1.5e-2 the policy collapses within 40 steps onto one saturated 2x2-patch pattern (every
image the same, ~1.1-1.35 KB): groups then have no reward spread and learning stops. With the KL
term at the OCR recipe's beta 0.04 nothing moves: these rewards differ by a few bytes, so the
advantages stay ~0.1 (the 1e-4 in their denominator exceeds the group std) and the KL dominates.
Writes bench/out/learning_flow.png (curves) and bench/out/learning_flow_samples.png (evaluation
images before and after training, seed 0).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omni_core.data.fixtures import write_fixture
from omni_core.data.ocr import OCRConverter
from omni_core.models import load_model
from omni_core.training.flow_grpo import FlowGRPOConfig, FlowGRPOTrainer

OUT = Path(__file__).resolve().parent / "out"
STEPS = 40
EVAL_EVERY = 10
EVAL_SEEDS_PER_PROMPT = 2
CONFIG = FlowGRPOConfig(group_size=4, prompts_per_step=1, num_steps=10, guidance_scale=4.5, noise_level=0.7,
                        eval_num_steps=40, lr=1e-2)


def ocr_rows(rows: int = 16, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, test) verl rows of the OCR prompts fixture, SD3 template (the user prompt only)."""
    converter = OCRConverter("sd3")
    with tempfile.TemporaryDirectory(prefix="omni-bench-ocr-") as tmp:
        paths = write_fixture("ocr", tmp, rows=rows, seed=seed)
        splits = {p.stem: p.read_text(encoding="utf-8").splitlines() for p in paths}
    return tuple(  # type: ignore[return-value]
        [converter.convert({"text": line}, split, i, raw=None) for i, line in enumerate(splits[split])]  # type: ignore[arg-type]
        for split in ("train", "test")
    )


def curve(seed: int, train: list[dict], test: list[dict]) -> dict[str, Any]:
    """Train STEPS steps of `tiny://sd3` (its seed-0 build) with training seed `seed` (noise, prompt
    order); rewards in reward units."""
    model, _ = load_model("tiny://sd3", seed=0)
    trainer = FlowGRPOTrainer(CONFIG, model, train, seed=seed)
    eval_rows = [row for row in test for _ in range(EVAL_SEEDS_PER_PROMPT)]
    eval_seeds = list(range(len(eval_rows)))
    before, images_before = trainer.evaluate(eval_rows, eval_seeds)
    train_curve, eval_curve = [], [[0, before.mean().item()]]
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(1, STEPS + 1):
        train_curve.append([step, trainer.step()["critic/score/mean"]])
        if step % EVAL_EVERY == 0:
            eval_curve.append([step, trainer.evaluate(eval_rows, eval_seeds)[0].mean().item()])
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    after, images_after = trainer.evaluate(eval_rows, eval_seeds)
    first5 = sum(r for _, r in train_curve[:5]) / 5
    last5 = sum(r for _, r in train_curve[-5:]) / 5
    final = {
        "eval_reward_before": round(before.mean().item(), 7),
        "eval_reward_after": round(after.mean().item(), 7),
        "eval_kb_before": round(-before.mean().item() * 500, 4),
        "eval_kb_after": round(-after.mean().item() * 500, 4),
        "eval_improved_fraction": round((after > before).float().mean().item(), 3),
        "train_reward_first5": round(first5, 7),
        "train_reward_last5": round(last5, 7),
        "train_eval_s": round(seconds, 2),
        "train_eval_cpu_s": round(cpu_s, 2),
        "s_per_step": round(seconds / STEPS, 3),
    }
    return {"train_reward": train_curve, "eval_reward": eval_curve, "final": final}, (images_before, images_after)


def run(quick: bool, seed: int = 0) -> dict[str, Any]:
    """Reward curves (`[step, mean reward]` pairs) and final figures per seed, plus their summary
    (JSON-ready). `quick`: `seed` only; otherwise `seed`, `seed + 1`, `seed + 2`."""
    return run_with_images(quick, seed)[0]


def run_with_images(quick: bool, seed: int = 0) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor]]:
    """`run`, and the evaluation images of the first seed before and after training."""
    seeds = [seed] if quick else [seed, seed + 1, seed + 2]
    images = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # an 85k-parameter transformer: more threads only add synchronisation
    try:
        train, test = ocr_rows()
        out: dict[str, Any] = {"setup": {"model": "tiny://sd3", "reward": CONFIG.reward, "steps": STEPS,
                                         "train_prompts": len(train),
                                         "eval_images": len(test) * EVAL_SEEDS_PER_PROMPT,
                                         "config": CONFIG.model_dump(), "seeds": seeds}}
        for s in seeds:
            out[f"seed{s}"], images[s] = curve(s, train, test)
    finally:
        torch.set_num_threads(threads)
    finals = [out[f"seed{s}"]["final"] for s in seeds]
    out["summary"] = {
        "eval_kb_before_mean": round(sum(f["eval_kb_before"] for f in finals) / len(finals), 4),
        "eval_kb_after_mean": round(sum(f["eval_kb_after"] for f in finals) / len(finals), 4),
        "seeds_improved": sum(f["eval_reward_after"] > f["eval_reward_before"] for f in finals),
    }
    return out, images[seeds[0]]


def save_plots(result: dict[str, Any], images: tuple[torch.Tensor, torch.Tensor], out_dir: Path = OUT) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / ".gitignore").exists():
        (out_dir / ".gitignore").write_text("*\n")
    seeds = result["setup"]["seeds"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for seed in seeds:
        data = result[f"seed{seed}"]
        line = ax.plot(*zip(*data["train_reward"], strict=True), alpha=0.5, label=f"train batches, seed {seed}")
        ax.plot(*zip(*data["eval_reward"], strict=True), marker="o", color=line[0].get_color(),
                label=f"eval (ODE, 40 steps), seed {seed}")
    ax.set(title="FlowGRPO on tiny://sd3: JPEG compressibility", xlabel="step",
           ylabel="critic/score/mean = -(JPEG KB)/500")
    ax.legend(fontsize=7)
    fig.tight_layout()
    curve_path = out_dir / "learning_flow.png"
    fig.savefig(curve_path, dpi=100)
    plt.close(fig)

    before, after = images
    n = before.shape[0]
    fig, axes = plt.subplots(2, n, figsize=(1.2 * n, 2.8), squeeze=False)
    for row, (label, images) in enumerate((("before", before), ("after", after))):
        for col, image in enumerate(((images.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()):
            axes[row][col].imshow(image)
            axes[row][col].set_xticks([])
            axes[row][col].set_yticks([])
        axes[row][0].set_ylabel(label)
    fig.suptitle(f"evaluation images, seed {seeds[0]}: before / after {STEPS} steps", fontsize=9)
    fig.tight_layout()
    grid_path = out_dir / "learning_flow_samples.png"
    fig.savefig(grid_path, dpi=100)
    plt.close(fig)
    return [curve_path, grid_path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 40 steps (about a minute)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the results last")
    args = parser.parse_args()
    result, images = run_with_images(args.quick)
    setup = result["setup"]
    print(f"tiny://sd3, FlowGRPO + JPEG compressibility, {setup['train_prompts']} train prompts, "
          f"{setup['eval_images']} eval images, {setup['steps']} steps:")
    for seed in setup["seeds"]:
        f = result[f"seed{seed}"]["final"]
        print(f"  seed {seed}: eval JPEG {f['eval_kb_before']:.3f} KB -> {f['eval_kb_after']:.3f} KB "
              f"(reward {f['eval_reward_before']:.6f} -> {f['eval_reward_after']:.6f}, "
              f"{f['eval_improved_fraction']:.0%} of images better); train batches "
              f"{f['train_reward_first5']:.6f} (first 5) -> {f['train_reward_last5']:.6f} (last 5); "
              f"{f['train_eval_s']:.1f} s")
    for path in save_plots(result, images):
        print(f"  plot: {path}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
