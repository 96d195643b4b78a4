"""The GSM8K strict reward (verl's), with verl's custom-reward signature."""

from __future__ import annotations

import pytest

from omni_core.rewards import default_compute_score, get_reward
from omni_core.rewards.gsm8k import compute_score, extract_solution

SOURCE = "openai/gsm8k"


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
    assert compute_score(SOURCE, response, truth) == score
    assert isinstance(compute_score(SOURCE, response, truth), float)


def test_verl_keyword_call_and_dispatch_by_data_source():
    kwargs = {"solution_str": "#### 18", "ground_truth": "18", "extra_info": {"split": "test", "index": 0}}
    assert compute_score(data_source=SOURCE, **kwargs) == 1.0
    assert default_compute_score(data_source=SOURCE, **kwargs) == 1.0
    assert get_reward("gsm8k") is compute_score and get_reward(SOURCE) is compute_score


def test_multiple_answers_take_the_last():
    assert compute_score(SOURCE, "#### 18 first guess, then #### 20", "20") == 1.0
    assert compute_score(SOURCE, "#### 18 first guess, then #### 20", "18") == 0.0
    assert extract_solution("#### 1 #### 2 #### 3") == "3"


def test_only_the_last_300_characters_count():
    filler = "x" * 300
    assert compute_score(SOURCE, "#### 18\n" + filler, "18") == 0.0  # answer before the last 300 chars
    assert compute_score(SOURCE, "#### 18" + "x" * 293, "18") == 1.0  # exactly 300 chars: still inside
    assert compute_score(SOURCE, "#### 18" + "x" * 294, "18") == 0.0  # "#" clipped off: no match
    assert compute_score(SOURCE, "#### 7\n" + filler + "#### 18", "18") == 1.0
    # clipping can cut into a number: only the digits inside the window count
    assert extract_solution("#### 1234" + "y" * 293) is None
    assert extract_solution("#### 1234" + "y" * 291) == "1234"


def test_format_score():
    assert compute_score(SOURCE, "#### 4", "3", format_score=0.1) == 0.1
    assert compute_score(SOURCE, "no answer", "3", format_score=0.1) == 0.0
