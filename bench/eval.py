"""Eval throughput: the eval stage's engines against plain per-call loops, side by side in one run.

    python bench/eval.py [--quick] [--json] [--threads N] [--workload text,images,overhead]

- text: `tiny://lm`, 512 GSM8K test prompts (the fixture's rows, repeated to 512), 64 new tokens,
  greedy, batch size 64: the eval stage's text path (`omni_core.evaluation.text.generate_responses`;
  for a text-only Qwen3 model such as this one, `omni_core.rollout.lean_decode`, else `ARengine`)
  against a plain HF `model.generate` loop over the same batches (left-padded, greedy, the same
  max_new_tokens and rows). The responses are compared too (greedy is argmax in both), and for
  `lean_decode` its speculation reported: decode forwards and tokens a row gains per forward.
- images: `tiny://sd3`, 64 OCR prompts, 6 denoising steps with True-CFG (guidance 4.5), ODE
  (noise_level 0), batch size 64: the eval stage's `DiffusionEngine` path
  (`omni_core.evaluation.images.generate_images`) against a per-prompt loop (one image at a time,
  the conditional and unconditional branches as two forwards: a diffusers-style pipeline call).

- overhead: configs/demo.yaml run in this process (a fresh store and MLflow database, local Ray):
  for each of its eval stages, the stage's wall time, the Ray task's own time, the model load inside
  it and the scoring; fixed overhead = stage time - scoring time, as a share of the stage time.

Both sides run in this process on `--threads` torch threads (default 1), alternating, best of
`--repeats` wall times; the ratio is engine throughput over loop throughput. `--quick`: 128 text
prompts, 16 images.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gsm8k_rows(count: int) -> list[dict[str, Any]]:
    import tempfile

    from omni_core.config import DatasetConfig
    from omni_core.data.ingest import ingest
    from omni_core.storage import Store

    with tempfile.TemporaryDirectory(prefix="omni-bench-eval-") as tmp:
        store = Store(tmp)
        version = ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=200&seed=0", converter="gsm8k"),
                         progress=lambda _: None)
        rows = version.rows(store, "test") or version.rows(store, "train")
    return [rows[i % len(rows)] for i in range(count)]


def hf_generate_loop(model: Any, tokenizer: Any, rows: list[dict[str, Any]], settings: dict[str, Any]) -> list[str]:
    """The plain loop: one `model.generate` per batch of prompts (left-padded), greedy."""
    from omni_core.training.components import encode_prompts, left_pad

    texts = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for start in range(0, len(rows), settings["batch_size"]):
        prompts = encode_prompts(tokenizer, rows[start:start + settings["batch_size"]], settings["max_prompt_tokens"])
        ids, mask = left_pad(prompts, pad)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings["max_new_tokens"],
                                 do_sample=False, pad_token_id=pad)
        texts += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return texts


def bench_text(prompts: int, repeats: int) -> dict[str, Any]:
    from omni_core.evaluation.text import generate_responses
    from omni_core.models import load_model

    rows = gsm8k_rows(prompts)
    model, tokenizer = load_model("tiny://lm", seed=0)
    settings = {"n": 1, "batch_size": 64, "max_prompt_tokens": 256, "max_new_tokens": 64, "temperature": 1.0,
                "top_p": 1.0, "greedy": True}
    times: dict[str, list[float]] = {"engine": [], "hf_generate": []}
    outputs: dict[str, list[str]] = {}
    for _ in range(repeats):
        for name in times:
            t = time.perf_counter()
            outputs[name] = (generate_responses(model, tokenizer, rows, settings, seed=0) if name == "engine"
                             else hf_generate_loop(model, tokenizer, rows, settings))
            times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    same = sum(a == b for a, b in zip(outputs["engine"], outputs["hf_generate"], strict=True))
    return {"prompts": prompts, "new_tokens": 64, "batch_size": 64, "engine_s": best["engine"],
            "hf_generate_s": best["hf_generate"], "engine_prompts_per_s": prompts / best["engine"],
            "hf_generate_prompts_per_s": prompts / best["hf_generate"],
            "speedup": best["hf_generate"] / best["engine"], "same_responses": f"{same}/{prompts}",
            **speculation(model, tokenizer, rows, settings)}


def speculation(model: Any, tokenizer: Any, rows: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """How `lean_decode`'s drafts fared on the text path's batches (one more, untimed, pass): decode forwards
    after the prefills, and tokens a row gained per forward (1.0 without speculation)."""
    from omni_core.evaluation.text import sampling_of
    from omni_core.rollout import lean_decode
    from omni_core.training.components import encode_prompts

    if not lean_decode.supports(model, tokenizer):
        return {}
    stats: dict[str, int] = {}
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for start in range(0, len(rows), settings["batch_size"]):
        prompts = encode_prompts(tokenizer, rows[start:start + settings["batch_size"]], settings["max_prompt_tokens"])
        lean_decode.decode(model, prompts, sampling_of(settings), [0] * len(prompts), [eos], pad, stats=stats)
    return {"decode_forwards": stats["forwards"], "tokens_per_forward": stats["tokens"] / stats["row_steps"]}


def per_prompt_loop(model: Any, rows: list[dict[str, Any]], sampler: dict[str, Any], seed: int) -> torch.Tensor:
    """One image at a time, conditional and unconditional branches as two forwards per step, Euler ODE:
    what a diffusers pipeline call per prompt does."""
    from omni_core.models.diffusion import PromptEmbeds
    from omni_core.rollout.diffusion import draw_noise
    from omni_core.training.components import rollout_seed
    from omni_core.training.flow_grpo import prompt_text

    sigmas = model.sigmas(sampler["num_steps"]).to(model.device)
    shape = (model.channels, model.sample_size, model.sample_size)
    images = []
    with torch.no_grad():
        uncond = model.encode_prompt([sampler["negative_prompt"]])
        for i, row in enumerate(rows):
            cond = model.encode_prompt([prompt_text(row)])
            x = draw_noise([torch.Generator().manual_seed(rollout_seed(seed, 0, i, 0))], shape, model.device)
            for j in range(sampler["num_steps"]):
                v_c = model.velocity(x, sigmas[j], PromptEmbeds(cond.embeds, cond.pooled))
                v_u = model.velocity(x, sigmas[j], PromptEmbeds(uncond.embeds, uncond.pooled))
                v = v_u + sampler["guidance_scale"] * (v_c - v_u)
                x = x + (sigmas[j + 1] - sigmas[j]) * v
            images.append(x[0].clamp(-1, 1))
    return torch.stack(images)


def bench_images(prompts: int, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "bench"))
    from learning_flow import ocr_rows

    from omni_core.evaluation.images import generate_images
    from omni_core.models import load_model

    train, test = ocr_rows(rows=max(prompts, 16))
    pool = test + train
    rows = [pool[i % len(pool)] for i in range(prompts)]
    model, _ = load_model("tiny://sd3", seed=0)
    sampler = {"num_steps": 6, "guidance_scale": 4.5, "noise_level": 0.0, "negative_prompt": ""}
    times: dict[str, list[float]] = {"engine": [], "per_prompt": []}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name in times:
            t = time.perf_counter()
            outputs[name] = (generate_images(model, rows, sampler, 1, 64, seed=0) if name == "engine"
                             else per_prompt_loop(model, rows, sampler, seed=0))
            times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    return {"prompts": prompts, "num_steps": 6, "guidance_scale": 4.5, "batch_size": 64, "engine_s": best["engine"],
            "per_prompt_s": best["per_prompt"], "engine_images_per_s": prompts / best["engine"],
            "per_prompt_images_per_s": prompts / best["per_prompt"],
            "speedup": best["per_prompt"] / best["engine"],
            "max_abs_diff": float((outputs["engine"] - outputs["per_prompt"]).abs().max())}


def bench_overhead() -> dict[str, Any]:
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from pipeline_runs import run_in_order

    from omni_core.config import load_pipeline

    with tempfile.TemporaryDirectory(prefix="omni-bench-eval-demo-") as tmp:
        config = load_pipeline(ROOT / "configs" / "demo.yaml", [f"store={tmp}/store",
                                                                f"tracking_uri=sqlite:///{tmp}/mlflow.db"])
        run = run_in_order(config, progress=lambda line: None)
    out = {}
    for name, outcome in run.outcomes.items():
        if outcome.kind != "eval":
            continue
        timings = outcome.report["eval"]["timings"]
        stage_s = outcome.seconds
        out[name] = {"stage_s": stage_s, "task_s": timings["task_s"], "load_s": timings["load_s"],
                     "score_s": timings["score_s"], "outside_task_s": stage_s - timings["task_s"],
                     "fixed_overhead_s": stage_s - timings["score_s"],
                     "fixed_overhead_share": (stage_s - timings["score_s"]) / stage_s}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workload", default="text,images")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    result: dict[str, Any] = {"threads": args.threads, "repeats": args.repeats}
    if "text" in args.workload:
        result["text"] = bench_text(128 if args.quick else 512, args.repeats)
        t = result["text"]
        print(f"text:   engine {t['engine_prompts_per_s']:.1f} prompts/s, HF generate loop "
              f"{t['hf_generate_prompts_per_s']:.1f} prompts/s: {t['speedup']:.2f}x (same responses "
              f"{t['same_responses']}; {t.get('tokens_per_forward', 1.0):.2f} tokens per row and decode forward)")
    if "images" in args.workload:
        result["images"] = bench_images(16 if args.quick else 64, args.repeats)
        i = result["images"]
        print(f"images: engine {i['engine_images_per_s']:.2f} images/s, per-prompt loop "
              f"{i['per_prompt_images_per_s']:.2f} images/s: {i['speedup']:.2f}x (max |diff| {i['max_abs_diff']:.2e})")
    if "overhead" in args.workload:
        result["overhead"] = bench_overhead()
        for name, o in result["overhead"].items():
            print(f"overhead {name}: stage {o['stage_s']:.1f} s = Ray task start, job, logging "
                  f"{o['outside_task_s']:.1f} s + model load {o['load_s']:.1f} s + scoring {o['score_s']:.1f} s: "
                  f"fixed overhead {o['fixed_overhead_share']:.0%}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
