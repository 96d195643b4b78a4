"""The SD3 transformer forward alone, by batch size: where request-level batching's ceiling is.

    python bench/sd3_forward.py [--quick] [--json] [--repeats N] [--threads N] [--no-compile]

`tiny://sd3` through `sd3_inference_forward` (the rollout engine's forward), one torch thread, the
rollout engine's memory setting (`keep_freed_memory`). Rows are what the engine puts in one forward:
a request with True-CFG is two rows (uncond, cond). Per request-step:
- serial: two B=1 forwards (the published serial baseline: CFG as two forwards);
- packed: one B=2 forward (the engine at max_num_seqs 1);
- request_32: a 64-row forward / 32 (the engine at max_num_seqs 32).
`ceiling_32` = serial / request_32: what request-level batching at 32 can reach at most over the
serial baseline when everything outside the forward costs nothing (bench/rollout.py measures the
engine itself). The same with the forward under `torch.compile` (inductor, static shapes; its
compile time is not counted), unless --no-compile. CPU milliseconds (process time), best of
`--repeats` rounds, each round alternating eager and compiled. `attention_ms_per_row`: one joint
attention of the model's shape (image and text tokens, its heads) alone, per row at B=1 and B=64.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = (1, 2, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer forwards per figure (under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the best (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    from omni_core.models import load_model
    from omni_core.models.diffusion import sd3_inference_forward
    from omni_core.rollout.memory import keep_freed_memory

    hf_logging.disable_progress_bar()
    keep_freed_memory()
    model, _ = load_model("tiny://sd3", seed=0)
    transformer = model.transformer
    cond, uncond = model.encode_prompt(["a red sign that says omni"]), model.encode_prompt([""])
    generator = torch.Generator().manual_seed(0)

    def inputs(rows: int) -> tuple:
        half = max(1, rows // 2)
        embeds = torch.cat([uncond.embeds.expand(half, -1, -1), cond.embeds.expand(rows - half, -1, -1)])
        pooled = torch.cat([uncond.pooled.expand(half, -1), cond.pooled.expand(rows - half, -1)])
        x = torch.randn(rows, model.channels, model.sample_size, model.sample_size, generator=generator)
        return x, torch.full((rows,), 500.0), embeds[:rows].contiguous(), pooled[:rows].contiguous()

    forwards = {"eager": sd3_inference_forward}
    if not args.no_compile:
        forwards["compiled"] = torch.compile(sd3_inference_forward, dynamic=False)
    batch = {rows: inputs(rows) for rows in ROWS}
    calls = {1: 60, 2: 60, 64: 4} if args.quick else {1: 300, 2: 300, 64: 20}
    t = time.perf_counter()
    for forward in forwards.values():  # warm-up (and compile, one graph per shape)
        for rows in ROWS:
            for _ in range(3):
                forward(transformer, *batch[rows])
    warm_s = time.perf_counter() - t
    best: dict[str, dict[int, float]] = {name: {} for name in forwards}
    for _ in range(args.repeats):
        for name, forward in forwards.items():
            for rows in ROWS:
                ms = cpu_ms_per_call(forward, (transformer, *batch[rows]), calls[rows])
                best[name][rows] = min(best[name].get(rows, ms), ms)
    figures: dict = {"threads": args.threads, "repeats": args.repeats, "warm_up_s": round(warm_s, 1)}
    for name, ms in best.items():
        serial, packed, request_32 = 2 * ms[1], ms[2], ms[64] / 32
        figures[name] = {"forward_ms": {str(rows): round(v, 3) for rows, v in ms.items()},
                         "per_request_step_ms": {"serial": round(serial, 3), "packed": round(packed, 3),
                                                 "request_32": round(request_32, 3)},
                         "ceiling_32": round(serial / request_32, 2), "ceiling_32_over_packed": round(packed / request_32, 2)}
        print(f"{name:9s} forward CPU ms: B=1 {ms[1]:.2f}  B=2 {ms[2]:.2f}  B=64 {ms[64]:.1f}   per request-step: "
              f"serial {serial:.2f}  packed {packed:.2f}  request_32 {request_32:.2f}   "
              f"ceiling {serial / request_32:.2f}x serial")
    if "compiled" in best:
        figures["compiled_speedup"] = {str(rows): round(best["eager"][rows] / best["compiled"][rows], 2) for rows in ROWS}
        x = batch[64]
        figures["compiled_max_abs_diff"] = float((forwards["compiled"](transformer, *x)
                                                  - sd3_inference_forward(transformer, *x)).abs().max())
        print(f"compiled over eager: {figures['compiled_speedup']}  max |diff| {figures['compiled_max_abs_diff']:.1e}")
    figures["attention_ms_per_row"] = attention_per_row(transformer, model, calls, args.repeats)
    print(f"attention alone, CPU ms per row: {figures['attention_ms_per_row']}")
    if args.json:
        print(json.dumps(figures))


def attention_per_row(transformer, model, calls: dict[int, int], repeats: int) -> dict[str, float]:
    """`scaled_dot_product_attention` over [image; text] tokens with the transformer's heads, per row:
    the part of the forward whose cost batching cannot share."""
    config = transformer.config
    tokens = (model.sample_size // config.patch_size) ** 2 + model.max_text_length
    best: dict[str, float] = {}
    for rows in (1, 64):
        q, k, v = (torch.randn(rows, config.num_attention_heads, tokens, config.attention_head_dim) for _ in range(3))
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
        for _ in range(repeats):
            ms = cpu_ms_per_call(torch.nn.functional.scaled_dot_product_attention, (q, k, v), calls[rows]) / rows
            best[str(rows)] = round(min(best.get(str(rows), ms), ms), 4)
    return best


def cpu_ms_per_call(fn, args: tuple, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn(*args)
    return (time.process_time() - start) / calls * 1000


if __name__ == "__main__":
    main()
