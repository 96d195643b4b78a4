"""The reward registry: names, data sources, custom `path.py:function` rewards, batch scoring."""

from __future__ import annotations

import threading
import time

import pytest

from omni_core.errors import ConfigError
from omni_core.rewards import (
    as_score_dict,
    default_compute_score,
    get_reward,
    register_reward,
    reward_data_sources,
    reward_names,
    score_batch,
)
from omni_core.rewards import registry as registry_module


def test_builtin_rewards_are_registered_by_name_and_data_source():
    assert {"gsm8k", "mmk12", "choice", "ocr", "jpeg_compressibility", "default"} <= set(reward_names())
    assert {"openai/gsm8k", "mmk12", "avqa_r1_6k", "flow_grpo/ocr", "jpeg_compressibility"} <= set(
        reward_data_sources())
    assert get_reward("choice") is get_reward("avqa_r1_6k")
    assert get_reward("default") is default_compute_score


def test_unknown_reward_and_data_source_list_the_known_ones():
    with pytest.raises(ConfigError) as info:
        get_reward("nope")
    message = str(info.value)
    assert "gsm8k" in message and "openai/gsm8k" in message and "file.py:function" in message
    with pytest.raises(ConfigError, match="no reward registered for data_source 'nope'.*avqa_r1_6k"):
        default_compute_score("nope", "x", "y")


def test_custom_reward_from_a_file_with_the_verl_signature(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(ground_truth in solution_str), 'source': data_source}\n"
    )
    fn = get_reward(f"{path}:score")
    assert fn("my/source", "the answer is 42", "42") == {"score": 1.0, "source": "my/source"}
    assert fn(data_source="d", solution_str="41", ground_truth="42", extra_info={}) == {"score": 0.0, "source": "d"}
    items = [{"data_source": "d", "solution_str": s, "ground_truth": "42"} for s in ("42", "x")]
    assert [r["score"] for r in score_batch(items, f"{path}:score")] == [1.0, 0.0]


def test_custom_reward_errors(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def old(solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"cannot be called as verl calls rewards.*data_source"):
        get_reward(f"{path}:old")
    with pytest.raises(ConfigError, match="no function 'missing'"):
        get_reward(f"{path}:missing")
    with pytest.raises(ConfigError, match="does not exist"):
        get_reward(f"{tmp_path / 'absent.py'}:score")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="boom"):
        get_reward(f"{broken}:score")


def test_register_reward_and_as_score_dict(monkeypatch):
    monkeypatch.setattr(registry_module, "_BY_NAME", registry_module._BY_NAME.copy())
    monkeypatch.setattr(registry_module, "_BY_DATA_SOURCE", registry_module._BY_DATA_SOURCE.copy())

    @register_reward("always_one", data_sources=["my/source"])
    def always_one(data_source, solution_str, ground_truth, extra_info=None):
        return 1

    assert get_reward("always_one") is always_one and get_reward("my/source") is always_one
    assert default_compute_score("my/source", "x", "y") == 1
    with pytest.raises(TypeError, match="signature"):
        register_reward("old_style")(lambda solution_str, ground_truth, extra_info=None: 1.0)
    assert as_score_dict(1) == {"score": 1.0}
    assert as_score_dict({"score": 0.5, "accuracy": 1.0}) == {"score": 0.5, "accuracy": 1.0}
    with pytest.raises(ValueError):
        as_score_dict({"accuracy": 1.0})


def test_score_batch_dispatches_by_data_source_and_keeps_order():
    items = [
        {"data_source": "openai/gsm8k", "solution_str": "#### 3", "ground_truth": "3"},
        {"data_source": "avqa_r1_6k", "solution_str": "<answer>B</answer>", "ground_truth": "<answer>C</answer>"},
        {"data_source": "openai/gsm8k", "solution_str": "#### 4", "ground_truth": "3", "extra_info": {"index": 2}},
        {"data_source": "avqa_r1_6k", "solution_str": "<answer> C </answer>", "ground_truth": "<answer>C</answer>"},
    ]
    expected = [1.0, 0.0, 0.0, 1.0]
    assert [r["score"] for r in score_batch(items)] == expected
    assert [r["score"] for r in score_batch(items, workers=3)] == expected
    assert score_batch(items[1:2])[0] == {"score": 0.0, "accuracy": 0.0}


def test_score_batch_runs_in_parallel_and_preserves_order():
    threads: set[int] = set()

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        threads.add(threading.get_ident())
        time.sleep(0.05 * (5 - int(solution_str)))  # early items finish last
        return float(solution_str)

    items = [{"data_source": "x", "solution_str": str(i), "ground_truth": ""} for i in range(5)]
    start = time.perf_counter()
    assert [r["score"] for r in score_batch(items, slow, workers=5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert time.perf_counter() - start < 0.5 * sum(0.05 * (5 - i) for i in range(5))
    assert len(threads) > 1
