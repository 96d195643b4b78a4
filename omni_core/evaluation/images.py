"""Scoring a text-to-image diffusion model (`SD3Model`, full or LoRA checkpoint) on prompt rows: `n`
images per prompt from our diffusion engine (`DiffusionEngine`, request-level batches of `batch_size`
prompts), with the trained stage's sampler settings (steps, guidance) and, by default, the
deterministic ODE sampler (`noise_level` 0); image j of row i starts from the noise of seed
`rollout_seed(seed, 0, i, j)`. Scored by the image reward (`jpeg_compressibility`, `ocr`,
`path.py:function`) on the uint8 image; verl's validation names; and a grid PNG of the first images
with their scores.
"""

from __future__ import annotations

import io
from typing import Any

from omni_core.evaluation.job import EvalJob

CELL = 128  # pixels per image in the grid (tiny models draw 32x32)


def generate_images(model: Any, rows: list[dict[str, Any]], sampler: dict[str, Any], n: int, batch_size: int,
                    seed: int) -> Any:
    """[len(rows) * n, C, H, W] images in [-1, 1]; image j of row i at i * n + j."""
    import torch

    from omni_core.rollout.diffusion import DiffusionEngine, DiffusionSampling
    from omni_core.rollout.engine import EngineConfig, RolloutRequest
    from omni_core.training.components import rollout_seed
    from omni_core.training.flow_grpo import prompt_text

    sampling = DiffusionSampling(num_steps=sampler["num_steps"], guidance_scale=sampler["guidance_scale"],
                                 noise_level=sampler["noise_level"], negative_prompt=sampler.get("negative_prompt", ""))
    engine = DiffusionEngine(model, EngineConfig(max_num_seqs=batch_size * n), return_prompt_embeds=False)
    images = []
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            requests = [RolloutRequest(prompt_text(row), sampling, seed=rollout_seed(seed, 0, start + i, j))
                        for i, row in enumerate(chunk) for j in range(n)]
            with engine._lock:  # request-level, in order: a run's numbers never depend on timing
                images += [r.output for r in engine.run_requests(requests)]
    finally:
        engine.close()
    return torch.stack(images)


def score_images(job: EvalJob, model: Any) -> dict[str, Any]:
    from omni_core.training.components import val_metrics
    from omni_core.training.flow_grpo import score_images as reward_images

    n, rows = job.settings["n"], job.rows
    images = generate_images(model, rows, job.sampler, n, job.settings["batch_size"], job.seed)
    repeated = [rows[i // n] for i in range(len(images))]
    scores = [float(s) for s in reward_images(images, repeated, job.reward)]
    records = [{"row": i // n, "score": score} for i, score in enumerate(scores)]
    metrics = val_metrics([{"row": repeated[i], "score": s} for i, s in enumerate(scores)], n)
    shown = min(job.settings["samples"], len(rows)) * n
    return {"metrics": metrics, "records": records,
            "grid_png": grid_png(images[:shown], [prompt_of(r) for r in repeated[:shown]], scores[:shown])
            if shown else None}


def prompt_of(row: dict[str, Any]) -> str:
    from omni_core.training.flow_grpo import prompt_text

    return prompt_text(row)


def grid_png(images: Any, prompts: list[str], scores: list[float], columns: int = 4) -> bytes:
    """The images in a grid, each captioned with its score and the start of its prompt, as PNG bytes."""
    from PIL import Image, ImageDraw

    from omni_core.models.diffusion import SD3Model

    pixels = SD3Model.to_uint8(images)
    columns = max(1, min(columns, len(pixels)))
    rows = -(-len(pixels) // columns)
    caption = 28
    grid = Image.new("RGB", (columns * CELL, rows * (CELL + caption)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (array, prompt, score) in enumerate(zip(pixels, prompts, scores, strict=True)):
        x, y = (i % columns) * CELL, (i // columns) * (CELL + caption)
        grid.paste(Image.fromarray(array).resize((CELL, CELL), Image.NEAREST), (x, y))
        draw.text((x + 2, y + CELL + 1), f"score {score:.4g}", fill="black")
        draw.text((x + 2, y + CELL + 14), prompt[:20], fill="dimgray")
    out = io.BytesIO()
    grid.save(out, format="PNG")
    return out.getvalue()
