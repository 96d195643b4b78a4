"""FlowGRPO on `tiny://sd3` with the JPEG-compressibility reward (DDPO's, -(JPEG KB at quality 95)/500):
the training batches' mean reward per step, and the mean reward of a fixed evaluation set (held-out OCR
fixture prompts x fixed noise seeds, ODE sampler, 40 denoising steps).

Run through `python bench/learning.py --algo flow_grpo [--quick] [--json]`; this module holds the
training loop so that other code can reuse it (`run_flow`).

flow_grpo's SD3 recipe at toy scale: True-CFG w=4.5, SDE sampler with noise level 0.7 on 10 steps
(all trained), one prompt per step with a group of 4 images, lr 1e-2, clip 1e-4, no KL; full
fine-tune of the random-weight 85k-parameter transformer. LoRA (rank 8 on flow_grpo's attention
targets) does not move this random-weight model: its gradient norm stays <= 1e-7 at lr 1e-2 (the
output barely depends on the attention of a 0.02-std init), and the evaluation is unchanged after
40 steps even at lr 0.1.
Full: 40 training steps for each of the seeds `seed`, `seed + 1`, `seed + 2`. `quick`: 20 steps, one
seed (the full 40 steps do not fit in the two minutes of `bench/learning.py --quick` next to the
other algorithms). About 1.1 s per training step and 2.1 s per evaluation on one core.
At lr >= 1.5e-2 the policy collapses within 40 steps onto one saturated 2x2-patch pattern (every
image the same, ~1.1-1.35 KB): groups then have no reward spread and learning stops. With the KL
term at the OCR recipe's beta 0.04 nothing moves: these rewards differ by a few bytes, so the
advantages stay ~0.1 (the 1e-4 in their denominator exceeds the group std) and the KL dominates.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_core.training.flow_grpo import FlowGRPOConfig

MODEL = "tiny://sd3"
EVAL_SEEDS_PER_PROMPT = 2
CONFIG = FlowGRPOConfig(group_size=4, prompts_per_step=1, num_steps=10, guidance_scale=4.5, noise_level=0.7,
                        eval_num_steps=40, lr=1e-2)


@dataclass(frozen=True)
class FlowSetup:
    steps: int = 40
    eval_every: int = 10
    seeds: int = 3  # training seeds `seed`, `seed + 1`, ...

    @classmethod
    def quick(cls) -> FlowSetup:
        return cls(steps=20, seeds=1)


def ocr_rows(rows: int = 16, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, test) verl rows of the OCR prompts fixture, SD3 template (the user prompt only)."""
    from omni_core.data.fixtures import write_fixture
    from omni_core.data.ocr import OCRConverter

    converter = OCRConverter("sd3")
    with tempfile.TemporaryDirectory(prefix="omni-bench-ocr-") as tmp:
        paths = write_fixture("ocr", tmp, rows=rows, seed=seed)
        splits = {p.stem: p.read_text(encoding="utf-8").splitlines() for p in paths}
    return tuple(  # type: ignore[return-value]
        [converter.convert({"text": line}, split, i, raw=None) for i, line in enumerate(splits[split])]  # type: ignore[arg-type]
        for split in ("train", "test")
    )


def curve(seed: int, train: list[dict], test: list[dict], setup: FlowSetup = FlowSetup()
          ) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor]]:
    """Train `setup.steps` steps of `tiny://sd3` (its seed-0 build) with training seed `seed` (noise,
    prompt order); rewards in reward units. Also returns the evaluation images before and after."""
    from omni_core.models import load_model
    from omni_core.training.flow_grpo import FlowGRPOTrainer

    model, _ = load_model(MODEL, seed=0)
    trainer = FlowGRPOTrainer(CONFIG, train, seed, model=model)
    eval_rows = [row for row in test for _ in range(EVAL_SEEDS_PER_PROMPT)]
    eval_seeds = list(range(len(eval_rows)))
    start, cpu_start = time.perf_counter(), time.process_time()
    before, images_before = trainer.evaluate(eval_rows, eval_seeds)
    after, images_after = before, images_before
    train_curve, eval_curve = [], [[0, before.mean().item()]]
    for step in range(1, setup.steps + 1):
        train_curve.append([step, trainer.step()["critic/score/mean"]])
        if step % setup.eval_every == 0 or step == setup.steps:
            after, images_after = trainer.evaluate(eval_rows, eval_seeds)  # deterministic: ODE, fixed seeds
            eval_curve.append([step, after.mean().item()])
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    k = min(5, len(train_curve))
    final = {
        "eval_reward_before": round(before.mean().item(), 7),
        "eval_reward_after": round(after.mean().item(), 7),
        "eval_kb_before": round(-before.mean().item() * 500, 4),
        "eval_kb_after": round(-after.mean().item() * 500, 4),
        "eval_improved_fraction": round((after > before).float().mean().item(), 3),
        "train_reward_first5": round(sum(r for _, r in train_curve[:k]) / k, 7),
        "train_reward_last5": round(sum(r for _, r in train_curve[-k:]) / k, 7),
        "train_eval_s": round(seconds, 2),
        "train_eval_cpu_s": round(cpu_s, 2),
        "s_per_step": round(seconds / setup.steps, 3),
    }
    return {"train_reward": train_curve, "eval_reward": eval_curve, "final": final}, (images_before, images_after)


def run_flow(setup: FlowSetup, seed: int = 0) -> tuple[dict[str, Any], tuple[torch.Tensor, torch.Tensor]]:
    """Reward curves (`[step, mean reward]` pairs) and final figures per seed (`seed{N}`), their
    `summary`, and the `setup` (JSON-ready); plus the first seed's evaluation images before and after."""
    seeds = [seed + i for i in range(setup.seeds)]
    images = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # an 85k-parameter transformer: more threads only add synchronisation
    try:
        train, test = ocr_rows()
        out: dict[str, Any] = {"setup": {"model": MODEL, "reward": CONFIG.reward, "steps": setup.steps,
                                         "train_prompts": len(train),
                                         "eval_images": len(test) * EVAL_SEEDS_PER_PROMPT,
                                         "config": CONFIG.model_dump(), "seeds": seeds}}
        for s in seeds:
            out[f"seed{s}"], images[s] = curve(s, train, test, setup)
    finally:
        torch.set_num_threads(threads)
    finals = [out[f"seed{s}"]["final"] for s in seeds]
    out["summary"] = {
        "eval_kb_before_mean": round(sum(f["eval_kb_before"] for f in finals) / len(finals), 4),
        "eval_kb_after_mean": round(sum(f["eval_kb_after"] for f in finals) / len(finals), 4),
        "seeds_improved": sum(f["eval_reward_after"] > f["eval_reward_before"] for f in finals),
    }
    return out, images[seeds[0]]


def save_samples(images: tuple[torch.Tensor, torch.Tensor], path: Path, title: str) -> Path:
    """A 2-row grid of evaluation images: before (top) and after (bottom) training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    before, after = images
    n = before.shape[0]
    fig, axes = plt.subplots(2, n, figsize=(1.2 * n, 2.8), squeeze=False)
    for row, (label, batch) in enumerate((("before", before), ("after", after))):
        for col, image in enumerate(((batch.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()):
            axes[row][col].imshow(image)
            axes[row][col].set_xticks([])
            axes[row][col].set_yticks([])
        axes[row][0].set_ylabel(label)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
