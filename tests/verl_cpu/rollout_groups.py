"""Run by verl's interpreter (tests/test_verl_cpu_rollout.py), never imported by ours: the CPU rollout's
server (omni_core/backends/verl/runtime/omni_verl_cpu_rollout.py) on a tiny model, driven as verl's agent
loop drives it (concurrent `generate` calls), printing what it did as one JSON line.

    python rollout_groups.py MODEL_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "omni_core" / "backends" / "verl" / "runtime"))

import omni_verl_cpu_rollout as rollout  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

PROMPT = [3, 17, 42, 9, 11]
TRAIN = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
VAL = {**TRAIN, "temperature": 0.0}


def server(model: str):
    config = OmegaConf.create({
        "_target_": "verl.workers.config.RolloutConfig", "name": rollout.NAME, "n": 4, "temperature": 1.0,
        "top_p": 1.0, "top_k": -1, "prompt_length": 16, "response_length": 6,
        "val_kwargs": {"_target_": "verl.workers.config.SamplingConfig", "n": 1, "temperature": 0.0, "top_p": 1.0,
                       "top_k": -1}})
    made = rollout.CPURolloutServer(config, OmegaConf.create({"_target_": "verl.workers.config.HFModelConfig",
                                                              "path": model}), 0)
    made.batches = []
    forward = made.model.forward

    def counting(*args, **kwargs):
        made.batches.append(int(kwargs["input_ids"].shape[0]))
        return forward(*args, **kwargs)

    made.model.forward = counting
    return made


async def send(srv, params: dict, count: int, delays: list[float] | None = None) -> list:
    async def one(i: int):
        await asyncio.sleep((delays or [0.0] * count)[i])
        out = await srv.generate(PROMPT, dict(params), request_id=f"r{i}")
        return out.token_ids, [round(x, 6) for x in out.log_probs]

    return await asyncio.gather(*(one(i) for i in range(count)))


def recomputed(srv, tokens: list[int]) -> list[float]:
    """Each response token's log-prob from one forward of prompt + response (what verl's actor computes)."""
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(srv.model(input_ids=ids).logits[0].float(), -1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]


async def main(model: str) -> dict:
    at_once = server(model)
    together = await send(at_once, TRAIN, 4)
    staggered = server(model)
    apart = await send(staggered, TRAIN, 4, delays=[0.3, 0.0, 0.2, 0.1])  # another arrival order and timing
    greedy = server(model)
    await send(greedy, VAL, 1)
    short = server(model)
    rollout.GROUP_WAIT_S = 1.0
    partial = await send(short, TRAIN, 3)  # a group that never fills
    diff = max(abs(a - b) for tokens, logps in together for a, b in zip(logps, recomputed(at_once, tokens), strict=True))
    return {"together": sorted(together), "apart": sorted(apart), "batches": at_once.batches,
            "staggered_batches": staggered.batches, "greedy_batches": greedy.batches,
            "partial": len(partial), "partial_batches": short.batches, "logprob_diff_max": diff}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
