"""The AVQA multiple-choice reward: exact match of the first <answer> payloads."""

from __future__ import annotations

import pytest

from omni_core.rewards import get_reward
from omni_core.rewards.choice import compute_score, extract_answer

TRUTH = "<answer>B</answer>"


@pytest.mark.parametrize(
    ("response", "truth", "accuracy"),
    [
        ("<think>the dog barks</think><answer>B</answer>", TRUTH, 1.0),
        ("<answer>\n B \n</answer>", TRUTH, 1.0),  # whitespace around the payload is stripped
        ("<answer>C</answer>", TRUTH, 0.0),
        ("<answer>b</answer>", TRUTH, 0.0),  # exact match: case counts
        ("<answer>B.</answer>", TRUTH, 0.0),
        ("<answer>B</answer> <answer>C</answer>", TRUTH, 1.0),  # the first tag counts
        ("<answer>C</answer> <answer>B</answer>", TRUTH, 0.0),
        ("B", TRUTH, 0.0),  # no tag
        ("", TRUTH, 0.0),
        ("<answer>B</answer>", "B", 1.0),  # a ground truth without the tag is taken whole
        ("no tag", "", 0.0),
    ],
)
def test_choice(response, truth, accuracy):
    assert compute_score("avqa_r1_6k", response, truth) == {"score": accuracy, "accuracy": accuracy}


def test_registered_for_avqa_and_verl_keywords():
    assert get_reward("avqa_r1_6k") is compute_score
    assert compute_score(data_source="avqa_r1_6k", solution_str=TRUTH, ground_truth=TRUTH,
                         extra_info={"options": "{}"})["score"] == 1.0
    assert extract_answer("x <answer> A </answer>") == "A" and extract_answer("none") is None
