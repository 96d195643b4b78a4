"""Math-Verify in a process pool with a per-call timeout (docs/reference/rewards.md#math-verify).

Math-Verify's `parse`/`verify` time out with `signal.alarm`, which only works in a main thread. So
they never run in this process: each call goes to a worker process of a spawn-context pool (whose
tasks run in the worker's main thread, where the alarm works), and the caller waits at most
`timeout` seconds. A call that overruns returns 0.0 and the pool's workers are killed (a
`future.result(timeout=...)` does not stop the task, and a stuck worker would block every later
call); the next call builds a fresh pool. Any other failure also scores 0.0.

Callers may be threads (`score_batch`): a semaphore lets at most `workers` calls be in flight, so a
call's timeout is not spent waiting in the queue behind other calls; a call whose pool was killed
under it by another call's timeout is retried on the fresh pool.

Scoring is verl's (`verl/utils/reward_score/math_verify.py`): the gold is wrapped in `\\boxed{}` and
parsed as LaTeX; the answer is parsed as expression and LaTeX; `verify(gold, answer)`, gold first.
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing
import os
import threading
from concurrent.futures import CancelledError, ProcessPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from omni_core.errors import ConfigError

DEFAULT_TIMEOUT_S = 30.0
_RETRIES = 3  # attempts when another call's timeout killed the pool under this one
_STARTUP_TIMEOUT_S = 120.0

_lock = threading.Lock()
_pool: ProcessPoolExecutor | None = None
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))
_workers = DEFAULT_WORKERS
_slots = threading.BoundedSemaphore(_workers)


def _init_worker() -> None:
    """Import Math-Verify once per worker; keep its timeout warnings (whole inputs) out of the logs."""
    import math_verify  # noqa: F401

    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _ready() -> bool:
    return True


def _verify(gold: str, answer: str) -> float:
    """Runs in a worker: 1.0 if `answer` is mathematically equal to `gold`, else 0.0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = parse("\\boxed{" + gold + "}", (LatexExtractionConfig(),))
    answer_parsed = parse(answer, (ExprExtractionConfig(), LatexExtractionConfig()))
    if not gold_parsed or not answer_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, answer_parsed) else 0.0


def _get_pool() -> ProcessPoolExecutor:
    """The live pool, started (all workers spawned and Math-Verify imported) before it is returned."""
    global _pool
    with _lock:
        if _pool is None:
            if importlib.util.find_spec("math_verify") is None:  # a setup error, not a 0 score
                raise ConfigError("math_verify_score needs the package math-verify: pip install 'math-verify>=0.9'")
            pool = ProcessPoolExecutor(max_workers=_workers, initializer=_init_worker,
                                       mp_context=multiprocessing.get_context("spawn"))
            # warm every worker now, so the start-up does not count against a call's timeout
            wait([pool.submit(_ready) for _ in range(_workers)], timeout=_STARTUP_TIMEOUT_S)
            _pool = pool
        return _pool


def _kill(pool: ProcessPoolExecutor) -> None:
    """Drop `pool` (if it is still the live one) and kill its workers."""
    global _pool
    with _lock:
        if _pool is pool:
            _pool = None
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def math_verify_score(answer: str, gold: str, timeout: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if Math-Verify finds `answer` equal to `gold`; 0.0 if not, on timeout, or on any failure.

    Arguments are in verl's order (model output, ground truth); `verify` gets the gold first.
    """
    with _slots:
        for _ in range(_RETRIES):
            pool = _get_pool()
            try:
                future = pool.submit(_verify, str(gold), str(answer))
            except RuntimeError:  # shut down by another call's timeout: use a fresh pool
                _kill(pool)
                continue
            try:
                return float(future.result(timeout=timeout))
            except FutureTimeout:
                _kill(pool)
                return 0.0
            except (BrokenProcessPool, CancelledError):  # killed under us by another call's timeout (its
                _kill(pool)  # shutdown cancels the calls still queued): retry on a fresh pool
            except Exception:  # an error inside Math-Verify scores 0
                return 0.0
    return 0.0


def configure_math_verify(workers: int | None = None) -> None:
    """Set the number of worker processes (None: min(4, CPUs)); the pool restarts on next use."""
    global _workers, _slots
    workers = DEFAULT_WORKERS if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    shutdown_math_verify()
    _workers, _slots = workers, threading.BoundedSemaphore(workers)


def shutdown_math_verify() -> None:
    """Stop the worker processes (they are started again on the next call)."""
    with _lock:
        pool = _pool
    if pool is not None:
        _kill(pool)
