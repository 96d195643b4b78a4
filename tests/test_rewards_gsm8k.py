"""The GSM8K strict reward (verl's) and the reward registry."""

from __future__ import annotations

import pytest

from omni_core.errors import ConfigError
from omni_core.rewards import as_score_dict, get_reward, register_reward, reward_names
from omni_core.rewards import registry as registry_module
from omni_core.rewards.gsm8k import compute_score, extract_solution


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("She has 16 - 3 - 4 = 9 eggs, 9 * 2 = 18.\n#### 18", "18", 1.0),
        ("#### 18", "18", 1.0),
        ("She earns 9 * 2 = 18 dollars.\n#### 19", "18", 0.0),
        ("The total is #### 1,250", "1250", 1.0),
        ("The total is #### 1,250", "1,250", 0.0),  # commas are removed before comparing
        ("It fell to #### -5", "-5", 1.0),
        ("It fell to #### -5", "5", 0.0),
        ("#### 2.5", "2.5", 1.0),
        ("#### 18.", "18", 0.0),  # strict: the trailing period is part of the number
        ("#### $18", "18", 0.0),  # "$" is not in the number pattern, so nothing is extracted
        ("####18", "18", 0.0),  # the space after #### is required
        ("The answer is 18.", "18", 0.0),
        ("", "18", 0.0),
    ],
)
def test_compute_score(response, truth, score):
    assert compute_score(response, truth) == score
    assert isinstance(compute_score(response, truth), float)


def test_multiple_answers_take_the_last():
    assert compute_score("#### 18 first guess, then #### 20", "20") == 1.0
    assert compute_score("#### 18 first guess, then #### 20", "18") == 0.0
    assert extract_solution("#### 1 #### 2 #### 3") == "3"


def test_only_the_last_300_characters_count():
    filler = "x" * 300
    assert compute_score("#### 18\n" + filler, "18") == 0.0  # answer before the last 300 chars
    assert compute_score("#### 18" + "x" * 293, "18") == 1.0  # exactly 300 chars: still inside
    assert compute_score("#### 18" + "x" * 294, "18") == 0.0  # "#" clipped off: no match
    assert compute_score("#### 7\n" + filler + "#### 18", "18") == 1.0
    # clipping can cut into a number: only the digits inside the window count
    assert extract_solution("#### 1234" + "y" * 293) is None
    assert extract_solution("#### 1234" + "y" * 291) == "1234"


def test_extra_info_and_format_score():
    assert compute_score("#### 3", "3", {"split": "test", "index": 0}) == 1.0
    assert compute_score("#### 4", "3", format_score=0.1) == 0.1
    assert compute_score("no answer", "3", format_score=0.1) == 0.0


def test_registry_by_name_and_data_source():
    assert get_reward("gsm8k") is compute_score
    assert get_reward("openai/gsm8k") is compute_score
    assert "gsm8k" in reward_names()


def test_unknown_reward_lists_known_names():
    with pytest.raises(ConfigError) as info:
        get_reward("nope")
    message = str(info.value)
    assert "gsm8k" in message and "openai/gsm8k" in message and "file.py:function" in message


def test_custom_reward_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        "def score(solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(ground_truth in solution_str), 'length': len(solution_str)}\n"
    )
    fn = get_reward(f"{path}:score")
    assert fn("the answer is 42", "42") == {"score": 1.0, "length": 16}
    with pytest.raises(ConfigError, match="no function 'missing'"):
        get_reward(f"{path}:missing")
    with pytest.raises(ConfigError, match="does not exist"):
        get_reward(f"{tmp_path / 'absent.py'}:score")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="boom"):
        get_reward(f"{broken}:score")


def test_register_reward_and_as_score_dict(monkeypatch):
    monkeypatch.setattr(registry_module, "_BY_NAME", dict(registry_module._BY_NAME))
    monkeypatch.setattr(registry_module, "_BY_DATA_SOURCE", dict(registry_module._BY_DATA_SOURCE))

    @register_reward("always_one", data_sources=["my/source"])
    def always_one(solution_str, ground_truth, extra_info=None):
        return 1

    assert get_reward("always_one") is always_one and get_reward("my/source") is always_one
    assert as_score_dict(1) == {"score": 1.0}
    assert as_score_dict({"score": 0.5, "accuracy": 1.0}) == {"score": 0.5, "accuracy": 1.0}
    with pytest.raises(ValueError):
        as_score_dict({"accuracy": 1.0})
