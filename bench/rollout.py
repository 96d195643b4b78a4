"""Rollout engines: the same work run serially, request-level batched (max_num_seqs 8 and 32) and step-level.

    python bench/rollout.py [--quick] [--json] [--device cpu|cuda] [--repeats N] [--threads N] [--plain-forward]
                           [--workload diffusion,ar]

- diffusion: 64 requests x 10 denoising steps with True-CFG (guidance 4.5) on `tiny://sd3`
  (16 prompts x 4 seeds, as a FlowGRPO group would send them);
- ar: 64 prompts x 32 new tokens on `tiny://lm` (temperature 1.0).
Every mode gets the whole workload submitted at once; requests/s is best of `--repeats`, the repeats
taken round-robin over the modes (so a change in machine load hits every mode alike), and each mode's
speed-up is over the serial figure of the same run (request_16 and request_64 show where the curve
flattens); requests per CPU second (the process's CPU time, best of the repeats) come with them, as
on a shared machine they move less with the load. Torch runs on `--threads` CPU threads (default 1, so the figures say what batching buys,
not how many cores there are). `--quick` uses 16 requests.

Diffusion's `serial` is the serial baseline of the published 2.09x (docs/reference/published-figures.md): one
request at a time, B=1 forwards, True-CFG as two forwards per step (conditional, then
unconditional). `serial_packed_cfg` is one request at a time through the engine itself
(max_num_seqs 1), both CFG branches in one batch-2 forward; `request_32_over_packed_cfg` is
request_32 over it. The engine's forwards are `sd3_inference_forward`; `--plain-forward` runs the
diffusers forward instead (the figures before it existed).
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

# mode -> (max_num_seqs, step_execution, model variant)
MODES = {"serial": (1, False, None), "request_8": (8, False, None), "request_16": (16, False, None),
         "request_32": (32, False, None), "request_64": (64, False, None), "step_32": (32, True, None)}
SPLIT_CFG = "split_cfg"
PACKED_CFG = "serial_packed_cfg"


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def split_cfg(model):
    """`model` with True-CFG as two forwards (conditional, then unconditional), as the published serial
    baseline runs it (docs/reference/published-figures.md); the same numbers as one packed forward up to float rounding."""
    import dataclasses

    from omni_core.models import SD3Model

    class SplitCFG(SD3Model):
        def velocity(self, x, sigma, cond, *, uncond=None, guidance_scale=1.0, inference_kernels=False):
            if uncond is None or guidance_scale == 1.0:
                return super().velocity(x, sigma, cond, inference_kernels=inference_kernels)
            v_c = super().velocity(x, sigma, cond, inference_kernels=inference_kernels)
            v_u = super().velocity(x, sigma, uncond, inference_kernels=inference_kernels)
            return v_u + guidance_scale * (v_c - v_u)

    return SplitCFG(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model)})


def diffusion_work(requests: int, device: str, plain_forward: bool = False):
    from omni_core.models import load_model
    from omni_core.rollout import DiffusionEngine, DiffusionSampling, RolloutRequest

    model, _ = load_model("tiny://sd3", seed=0)
    model.transformer.to(device)
    model.text_encoder.to(device)
    split = split_cfg(model)
    sampling = DiffusionSampling(num_steps=10, guidance_scale=4.5)
    prompts = [f"a red sign that says {word}" for word in ("omni", "flow", "grpo", "verl") * 4]

    def make() -> list:
        return [RolloutRequest(prompts[i % len(prompts)], sampling, seed=i) for i in range(requests)]

    def build(config, variant=None):
        return DiffusionEngine(split if variant == SPLIT_CFG else model, config, inference_kernels=not plain_forward)

    params = _count(model.transformer) + _count(model.text_encoder)
    modes = {"serial": (1, False, SPLIT_CFG), PACKED_CFG: (1, False, None),
             **{mode: spec for mode, spec in MODES.items() if mode != "serial"}}
    return build, make, params, modes


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

    return (lambda config, variant=None: ARengine(model, tokenizer, config)), make, _count(model), MODES


def measure(build, make, repeats: int, modes: dict[str, tuple]) -> dict[str, float]:
    from omni_core.rollout import EngineConfig

    with build(EngineConfig(max_num_seqs=4)) as engine:  # warm-up: first forwards, allocator, caches
        engine.generate(make()[:4])
    best = dict.fromkeys(modes, float("inf"))
    best_cpu = dict.fromkeys(modes, float("inf"))
    for _ in range(repeats):  # round-robin: load changes on a shared machine hit every mode alike
        for mode, (max_num_seqs, step, variant) in modes.items():
            with build(EngineConfig(max_num_seqs=max_num_seqs, step_execution=step), variant) as engine:
                requests = make()
                start, start_cpu = time.perf_counter(), time.process_time()
                engine.generate(requests)
                best[mode] = min(best[mode], time.perf_counter() - start)
                best_cpu[mode] = min(best_cpu[mode], time.process_time() - start_cpu)
    out: dict[str, float] = {}
    for mode in modes:  # per CPU second: the process's CPU time (all its threads), less noisy under load
        out[f"{mode}_rps"] = round(len(requests) / best[mode], 2)
        out[f"{mode}_speedup"] = round(out[f"{mode}_rps"] / out["serial_rps"], 2)
        out[f"{mode}_per_cpu_s"] = round(len(requests) / best_cpu[mode], 2)
        out[f"{mode}_cpu_speedup"] = round(out[f"{mode}_per_cpu_s"] / out["serial_per_cpu_s"], 2)
        print(f"  {mode:16s} {out[f'{mode}_rps']:8.2f} req/s   {out[f'{mode}_speedup']:5.2f}x serial   "
              f"{out[f'{mode}_per_cpu_s']:8.2f} req/CPU-s   {out[f'{mode}_cpu_speedup']:5.2f}x", flush=True)
    if PACKED_CFG in modes:
        out["request_32_over_packed_cfg"] = round(out["request_32_rps"] / out[f"{PACKED_CFG}_rps"], 2)
        out["request_32_over_packed_cfg_cpu"] = round(out["request_32_per_cpu_s"] / out[f"{PACKED_CFG}_per_cpu_s"], 2)
        print(f"  request_32 over {PACKED_CFG}: {out['request_32_over_packed_cfg']:.2f}x "
              f"({out['request_32_over_packed_cfg_cpu']:.2f}x per CPU second)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 requests per workload (under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=None, help="best of N per mode (default 2, quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--workload", default="diffusion,ar", help="which workloads, comma-separated")
    parser.add_argument("--plain-forward", action="store_true",
                        help="diffusion engine on the diffusers forward, not sd3_inference_forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    requests = 16 if args.quick else 64
    repeats = args.repeats or (1 if args.quick else 2)
    figures: dict = {"device": args.device, "requests": requests, "threads": args.threads,
                     "diffusion_forward": "plain" if args.plain_forward else "inference"}
    works = {"diffusion": lambda n, d: diffusion_work(n, d, args.plain_forward), "ar": ar_work}
    chosen = [w.strip() for w in args.workload.split(",") if w.strip()]
    if not chosen or any(w not in works for w in chosen):
        parser.error(f"--workload {args.workload!r}: use a comma-separated subset of {', '.join(works)}")
    for name, work in ((w, works[w]) for w in chosen):
        build, make, params, modes = work(requests, args.device)
        print(f"{name}: {requests} requests, model parameters {params:,} ({args.device})", flush=True)
        figures[name] = {"params": params, **measure(build, make, repeats, modes)}
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
