"""Math-Verify in a process pool: equality checks, the timeout path, concurrent callers."""

from __future__ import annotations

import importlib.util
import time

import pytest

from omni_core.errors import ConfigError
from omni_core.rewards import configure_math_verify, math_verify_score, score_batch, shutdown_math_verify

# Parsing this takes Math-Verify seconds (its own alarm fires at 5 s): a call that must time out.
PATHOLOGICAL = "\\boxed{" + "+".join(f"x^{{{i}}}" for i in range(3000)) + "}"


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("0.5", "\\frac{1}{2}", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("x = 5", "5", 1.0),
        ("\\boxed{7}", "8", 0.0),
        ("no number at all", "8", 0.0),
        ("\\boxed{3}", "\\frac{", 0.0),  # unparseable gold: 0, no exception
    ],
)
def test_math_verify_score(answer, gold, expected):
    assert math_verify_score(answer, gold) == expected


def test_timeout_returns_zero_without_hanging_and_the_pool_recovers():
    configure_math_verify(1)
    try:
        assert math_verify_score("1", "1") == 1.0  # the pool is up: its start-up is not timed below
        start = time.perf_counter()
        assert math_verify_score(PATHOLOGICAL, "1", timeout=0.5) == 0.0
        assert time.perf_counter() - start < 4.0  # the 0.5 s timeout, not Math-Verify's own 2 x 5 s
        assert math_verify_score("\\boxed{4}", "4") == 1.0  # a fresh pool answers the next call
    finally:
        configure_math_verify()
    with pytest.raises(ValueError):
        configure_math_verify(0)


def test_missing_math_verify_is_a_config_error(monkeypatch):
    shutdown_math_verify()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ConfigError, match="pip install 'math-verify"):
        math_verify_score("1", "1")


def test_concurrent_callers_survive_another_calls_timeout():
    """Calls in flight when another call's timeout kills the pool are retried on a fresh pool."""
    cases = [(PATHOLOGICAL[7:-1], "1", 0.0)]
    cases += [(f"\\frac{{{k}}}{{4}}", str(k / 4), 1.0) if k % 3 else (f"{k + 1}", f"{k}", 0.0) for k in range(1, 121)]
    items = [{"data_source": "mmk12", "solution_str": f"<answer>\\boxed{{{answer}}}</answer>", "ground_truth": truth,
              "math_verify_timeout": 0.5 if i == 0 else 30.0} for i, (answer, truth, _) in enumerate(cases)]
    results = score_batch(items, "mmk12", workers=4)
    assert [r["accuracy"] for r in results] == [expected for _, _, expected in cases]
