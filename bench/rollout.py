"""Rollout engines: the same work run serially, request-level batched (max_num_seqs 8 and 32) and step-level.

    python bench/rollout.py [--quick] [--json] [--device cpu|cuda] [--repeats N]

- diffusion: 64 requests x 10 denoising steps with True-CFG (guidance 4.5) on `tiny://sd3`
  (16 prompts x 4 seeds, as a FlowGRPO group would send them);
- ar: 64 prompts x 32 new tokens on `tiny://lm` (temperature 1.0).
Every mode gets the whole workload submitted at once; requests/s is best of `--repeats`, and each
mode's speed-up is over the serial figure of the same run (request_16 and request_64 show where the
curve flattens). Torch runs on `--threads` CPU threads (default 1, so the figures say what batching
buys, not how many cores there are). `--quick` uses 16 requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"serial": (1, False), "request_8": (8, False), "request_16": (16, False), "request_32": (32, False),
         "request_64": (64, False), "step_32": (32, True)}


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def diffusion_work(requests: int, device: str):
    from omni_core.models import load_model
    from omni_core.rollout import DiffusionEngine, DiffusionSampling, RolloutRequest

    model, _ = load_model("tiny://sd3", seed=0)
    model.transformer.to(device)
    model.text_encoder.to(device)
    sampling = DiffusionSampling(num_steps=10, guidance_scale=4.5)
    prompts = [f"a red sign that says {word}" for word in ("omni", "flow", "grpo", "verl") * 4]

    def make() -> list:
        return [RolloutRequest(prompts[i % len(prompts)], sampling, seed=i) for i in range(requests)]

    params = _count(model.transformer) + _count(model.text_encoder)
    return (lambda config: DiffusionEngine(model, config)), make, params


def ar_work(requests: int, device: str):
    from omni_core.models import load_model
    from omni_core.rollout import ARengine, ARSampling, RolloutRequest

    model, tokenizer = load_model("tiny://lm", seed=0)
    model.to(device).eval()
    sampling = ARSampling(temperature=1.0, max_new_tokens=32)
    texts = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(requests)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True) for t in texts]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]

    def make() -> list:
        return [RolloutRequest(prompts[i], sampling, seed=i) for i in range(requests)]

    return (lambda config: ARengine(model, tokenizer, config)), make, _count(model)


def measure(build, make, repeats: int) -> dict[str, float]:
    from omni_core.rollout import EngineConfig

    with build(EngineConfig(max_num_seqs=4)) as engine:  # warm-up: first forwards, allocator, caches
        engine.generate(make()[:4])
    out: dict[str, float] = {}
    for mode, (max_num_seqs, step) in MODES.items():
        best = float("inf")
        for _ in range(repeats):
            with build(EngineConfig(max_num_seqs=max_num_seqs, step_execution=step)) as engine:
                requests = make()
                start = time.perf_counter()
                engine.generate(requests)
                best = min(best, time.perf_counter() - start)
        out[f"{mode}_rps"] = round(len(requests) / best, 2)
        out[f"{mode}_speedup"] = round(out[f"{mode}_rps"] / out["serial_rps"], 2)
        print(f"  {mode:11s} {out[f'{mode}_rps']:8.2f} req/s   {out[f'{mode}_speedup']:.2f}x serial", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 requests per workload (under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=None, help="best of N per mode (default 2, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    requests = 16 if args.quick else 64
    repeats = args.repeats or (1 if args.quick else 2)
    figures: dict = {"device": args.device, "requests": requests, "threads": args.threads}
    for name, work in (("diffusion", diffusion_work), ("ar", ar_work)):
        build, make, params = work(requests, args.device)
        print(f"{name}: {requests} requests, model parameters {params:,} ({args.device})", flush=True)
        figures[name] = {"params": params, **measure(build, make, repeats)}
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
