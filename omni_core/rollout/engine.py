"""The rollout engine interface and its two schedulers (vLLM-Omni semantics, docs/reference/rollout.md).

Callers, from any thread or event loop, `submit` requests and get futures of results. One scheduler
thread owns the model and decides what runs together:

- request-level batching (`step_execution=False`, the default): whole compatible requests (same
  `compat_key`) run together, at most `max_num_seqs` of them; the scheduler waits up to
  `request_batch_max_wait_ms` for a batch to fill before it starts a partial one;
- step-level continuous batching (`step_execution=True`): each iteration advances every running
  request by one step (a denoising step, a decoded token), compatible ones in one forward; waiting
  requests join at step boundaries and finished ones leave, so up to `max_num_seqs` run at once.

An engine implements the hooks of the mode(s) it supports: `run_requests` for request-level,
`start` / `step` / `finish` for step-level. Results must not depend on what a request was batched
with: every random draw comes from the request's own `seed`.

`stats`: "batches" = what the scheduler ran (request-level batches, step-level groups of compatible
requests stepped together), "max_batch" = the most requests in one of them, "forwards" = model
forwards as the engine counts them (`DiffusionEngine`: transformer forwards, one per denoising step of
a batch, True-CFG's two branches in that one forward); an engine that does not count them leaves 0.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections.abc import Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from omni_core.errors import ConfigError
from omni_core.rollout.memory import keep_freed_memory


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 8
    step_execution: bool = False
    request_batch_max_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"rollout max_num_seqs={self.max_num_seqs}: must be at least 1")
        if self.request_batch_max_wait_ms < 0:
            raise ConfigError(f"rollout request_batch_max_wait_ms={self.request_batch_max_wait_ms}: must be >= 0")
        if self.step_execution and self.request_batch_max_wait_ms > 0:
            raise ConfigError("rollout step_execution=true and request_batch_max_wait_ms > 0: the two batching "
                              "modes are mutually exclusive (step-level admits requests at every step boundary); "
                              "set request_batch_max_wait_ms=0 or step_execution=false")


@dataclass
class RolloutRequest:
    """One generation: `prompt` is engine-specific (token ids and media, or a text prompt)."""

    prompt: Any
    sampling: Any  # the engine's sampling parameters (a frozen dataclass: part of the compat key)
    seed: int
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class RolloutResult:
    """`output`: token ids / image; `logprobs`: per token or per denoising step (1-D float32 tensor);
    `extra`: what a trainer needs to recompute them (e.g. the diffusion trajectory)."""

    request_id: str
    seed: int
    policy_version: int
    output: Any
    logprobs: Any
    extra: dict[str, Any] = field(default_factory=dict)
    text: str | None = None


@dataclass
class _Pending:
    request: RolloutRequest
    future: Future
    state: Any = None
    version: int = 0  # the policy version the request started with


_STOP = object()


class RolloutEngine:
    """Base of every engine: the request queue, the scheduler thread, futures, the policy version."""

    supports_step_execution = True

    def __init__(self, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        keep_freed_memory()  # the same activations every step: reuse their pages (see memory.py)
        if self.config.step_execution and not self.supports_step_execution:
            raise ConfigError(f"{type(self).__name__} does not support step_execution=true")
        self.policy_version = 0
        self.stats = {"batches": 0, "forwards": 0, "max_batch": 0}
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # held while the model runs: weights change only between batches
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"{type(self).__name__}-scheduler", daemon=True)
        self._thread.start()

    # ---- hooks -------------------------------------------------------------------------------

    def compat_key(self, request: RolloutRequest) -> Hashable:
        """Requests with equal keys may share a forward (same size, steps, guidance, ...)."""
        return request.sampling

    def run_requests(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        """Request-level: generate compatible requests together, results in the same order."""
        raise NotImplementedError

    def start(self, request: RolloutRequest) -> Any:
        """Step-level: the state of a newly admitted request."""
        raise NotImplementedError

    def step(self, requests: list[RolloutRequest], states: list[Any]) -> None:
        """Step-level: advance every state by one step, in place (compatible requests, one forward)."""
        raise NotImplementedError

    def is_done(self, state: Any) -> bool:
        raise NotImplementedError

    def finish(self, request: RolloutRequest, state: Any) -> RolloutResult:
        raise NotImplementedError

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Replace the policy's weights (a full state dict, or only the LoRA adapter's)."""
        raise NotImplementedError

    # ---- callers -----------------------------------------------------------------------------

    def submit(self, request: RolloutRequest) -> Future:
        """Queue `request`; thread-safe. The future resolves to a RolloutResult (or the error)."""
        if self._closed:
            raise RuntimeError("rollout engine is closed")
        future: Future = Future()
        self._queue.put(_Pending(request, future))
        return future

    async def agenerate(self, request: RolloutRequest) -> RolloutResult:
        return await asyncio.wrap_future(self.submit(request))

    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutResult]:
        """Submit all, wait for all; results in request order."""
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def update_weights(self, weights: dict[str, Any], version: int) -> None:
        """Load new policy weights between batches (step-level: between steps); results carry the
        version their request started with."""
        with self._lock:
            self.load_weights(weights)
            self.policy_version = version

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- scheduler ---------------------------------------------------------------------------

    def _loop(self) -> None:
        waiting: list[_Pending] = []
        running: list[_Pending] = []
        while True:
            block = not waiting and not running
            if not self._drain(waiting, block=block):
                for item in waiting + running:
                    item.future.set_exception(RuntimeError("rollout engine closed before the request ran"))
                return
            if self.config.step_execution:
                self._admit(waiting, running)
                if running:
                    self._step_once(running)
            elif waiting:
                batch = self._take_batch(waiting)
                if batch:
                    self._run_batch(batch)

    def _drain(self, waiting: list[_Pending], *, block: bool, timeout: float | None = None) -> bool:
        """Move queued requests to `waiting`; False once the engine is closing."""
        try:
            item = self._queue.get(block=block, timeout=timeout) if block or timeout else self._queue.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            if item.future.set_running_or_notify_cancel():
                waiting.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True

    def _take_batch(self, waiting: list[_Pending]) -> list[_Pending]:
        """The oldest request and up to max_num_seqs - 1 compatible ones, after waiting up to
        request_batch_max_wait_ms for the batch to fill."""
        key = self.compat_key(waiting[0].request)
        deadline = time.monotonic() + self.config.request_batch_max_wait_ms / 1000
        while True:
            batch = [p for p in waiting if self.compat_key(p.request) == key][: self.config.max_num_seqs]
            left = deadline - time.monotonic()
            if len(batch) >= self.config.max_num_seqs or left <= 0:
                break
            if not self._drain(waiting, block=False, timeout=left):
                self._queue.put(_STOP)  # seen again by the main loop, which fails what is left
                return []
        for p in batch:
            waiting.remove(p)
        return batch

    def _run_batch(self, batch: list[_Pending]) -> None:
        try:
            with self._lock:
                results = self.run_requests([p.request for p in batch])
                for r in results:
                    r.policy_version = self.policy_version
            self._count(len(batch))
        except BaseException as exc:  # the callers get the error; the engine keeps serving
            for p in batch:
                p.future.set_exception(exc)
            return
        for p, result in zip(batch, results, strict=True):
            p.future.set_result(result)

    def _admit(self, waiting: list[_Pending], running: list[_Pending]) -> None:
        while waiting and len(running) < self.config.max_num_seqs:
            item = waiting.pop(0)
            try:
                with self._lock:
                    item.state = self.start(item.request)
                    item.version = self.policy_version
            except BaseException as exc:
                item.future.set_exception(exc)
                continue
            running.append(item)

    def _step_once(self, running: list[_Pending]) -> None:
        groups = itertools.groupby(sorted(range(len(running)), key=lambda i: str(self.compat_key(running[i].request))),
                                   key=lambda i: str(self.compat_key(running[i].request)))
        for _, indices in groups:
            group = [running[i] for i in indices]
            try:
                with self._lock:
                    self.step([p.request for p in group], [p.state for p in group])
                self._count(len(group))
            except BaseException as exc:
                for p in group:
                    running.remove(p)
                    p.future.set_exception(exc)
        for p in [p for p in running if self.is_done(p.state)]:
            running.remove(p)
            try:
                with self._lock:
                    result = self.finish(p.request, p.state)
                result.policy_version = p.version
            except BaseException as exc:
                p.future.set_exception(exc)
                continue
            p.future.set_result(result)

    def _count(self, batch_size: int) -> None:
        self.stats["batches"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], batch_size)
