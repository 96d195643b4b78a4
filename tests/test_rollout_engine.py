"""The engine schedulers (request-level and step-level) on an engine whose "model" is arithmetic,
so what is asserted is only the scheduling: who runs with whom, when, and which result goes where."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from omni_core.errors import ConfigError
from omni_core.rollout import EngineConfig, RolloutEngine, RolloutRequest, RolloutResult


@dataclass(frozen=True)
class Steps:
    n: int


class ArithmeticEngine(RolloutEngine):
    """Output = seed * 10 + number of steps taken; records the batches it ran."""

    def __init__(self, config: EngineConfig, gate: threading.Event | None = None):
        self.batches: list[list[str]] = []
        self.gate = gate
        super().__init__(config)

    def run_requests(self, requests):
        if self.gate is not None:
            self.gate.wait(10)
        self.batches.append([r.request_id for r in requests])
        if any(r.seed < 0 for r in requests):
            raise ValueError("negative seed")
        return [RolloutResult(r.request_id, r.seed, 0, r.seed * 10 + r.sampling.n, [0.0] * r.sampling.n)
                for r in requests]

    def start(self, request):
        if request.seed < 0:
            raise ValueError("negative seed")
        return {"taken": 0}

    def step(self, requests, states):
        self.batches.append([r.request_id for r in requests])
        for state in states:
            state["taken"] += 1

    def is_done(self, state):
        return state["taken"] >= state.get("n", 0) or False

    def finish(self, request, state):
        return RolloutResult(request.request_id, request.seed, 0, request.seed * 10 + state["taken"], [])

    def load_weights(self, weights):
        self.weights = weights


class StepEngine(ArithmeticEngine):
    def start(self, request):
        state = super().start(request)
        state["n"] = request.sampling.n
        return state


def _req(i: int, n: int = 3) -> RolloutRequest:
    return RolloutRequest(prompt=f"p{i}", sampling=Steps(n), seed=i, request_id=f"r{i}")


def test_request_level_packs_compatible_requests_up_to_max_num_seqs():
    gate = threading.Event()
    with ArithmeticEngine(EngineConfig(max_num_seqs=4), gate=gate) as engine:
        first = engine.submit(_req(0))  # holds the model until the others are queued
        futures = [engine.submit(_req(i, n=3 if i % 2 else 5)) for i in range(1, 12)]
        gate.set()
        results = [first.result(10)] + [f.result(10) for f in futures]
    assert [r.output for r in results] == [0 * 10 + 3] + [i * 10 + (3 if i % 2 else 5) for i in range(1, 12)]
    steps = {f"r{i}": (3 if i % 2 or i == 0 else 5) for i in range(12)}
    assert all(len(b) <= 4 for b in engine.batches)
    assert sorted(sum(engine.batches, [])) == sorted(steps)
    for batch in engine.batches:  # never mixes incompatible sampling
        assert len({steps[r] for r in batch}) == 1
    assert max(len(b) for b in engine.batches) == 4
    # stats: batches run, the largest one; forwards are the engine's to count (this one counts none)
    assert engine.stats == {"batches": len(engine.batches), "forwards": 0, "max_batch": 4}


def test_wait_lets_a_partial_batch_fill():
    with ArithmeticEngine(EngineConfig(max_num_seqs=2, request_batch_max_wait_ms=5_000)) as engine:
        a = engine.submit(_req(1))
        threading.Timer(0.2, lambda: engine.submit(_req(2))).start()
        a.result(10)
    assert engine.batches == [["r1", "r2"]]


def test_a_failing_batch_fails_its_requests_and_the_engine_goes_on():
    gate = threading.Event()
    with ArithmeticEngine(EngineConfig(max_num_seqs=2), gate=gate) as engine:
        bad, good = engine.submit(_req(-1)), engine.submit(_req(5))
        gate.set()
        with pytest.raises(ValueError, match="negative seed"):
            bad.result(10)
        later = engine.submit(_req(7)).result(10)
    assert later.output == 73
    shared = any("r-1" in b and "r5" in b for b in engine.batches)
    assert (good.exception(10) is not None) == shared  # only a request batched with the failure fails


def test_step_level_interleaves_and_admits_at_step_boundaries():
    with StepEngine(EngineConfig(max_num_seqs=3, step_execution=True)) as engine:
        futures = [engine.submit(_req(i, n=1 + i % 3)) for i in range(7)]
        results = [f.result(10) for f in futures]
    assert [r.output for r in results] == [i * 10 + 1 + i % 3 for i in range(7)]
    assert engine.stats["batches"] == len(engine.batches)  # one per group of compatible requests stepped
    assert max(len(b) for b in engine.batches) <= 3
    # every request took exactly its own number of steps, in batches shared with others
    for i in range(7):
        assert sum(f"r{i}" in b for b in engine.batches) == 1 + i % 3
    assert any(len(b) > 1 for b in engine.batches)


def test_step_level_failure_is_isolated():
    with StepEngine(EngineConfig(max_num_seqs=2, step_execution=True)) as engine:
        bad, good = engine.submit(_req(-3)), engine.submit(_req(4, n=2))
        with pytest.raises(ValueError):
            bad.result(10)
        assert good.result(10).output == 42


def test_policy_version_is_carried_by_results():
    with ArithmeticEngine(EngineConfig()) as engine:
        assert engine.generate([_req(1)])[0].policy_version == 0
        engine.update_weights({"w": 1}, version=3)
        assert engine.generate([_req(2)])[0].policy_version == 3 and engine.weights == {"w": 1}


def test_asyncio_callers():
    async def main(engine):
        return await asyncio.gather(*(engine.agenerate(_req(i)) for i in range(6)))

    with ArithmeticEngine(EngineConfig(max_num_seqs=8)) as engine:
        results = asyncio.run(main(engine))
    assert [r.output for r in results] == [i * 10 + 3 for i in range(6)]


def test_modes_are_mutually_exclusive_and_closed_engines_refuse():
    with pytest.raises(ConfigError, match="mutually exclusive"):
        EngineConfig(step_execution=True, request_batch_max_wait_ms=10)
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    engine = ArithmeticEngine(EngineConfig())
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(_req(1))
