"""The MMK12 reward: multiple choice, values instead of letters, math_verify answers, format score."""

from __future__ import annotations

import json

import pytest

from omni_core.rewards.mmk12 import compute_score, format_reward, last_choice_letter, parse_options

OPTIONS = json.dumps({"A": "3", "B": "5", "C": "\\frac{1}{2}", "D": "30°"})


def score(response: str, truth: str, options: object = OPTIONS) -> dict[str, float]:
    return compute_score("mmk12", response, truth, {"split": "test", "index": 0, "options": options})


def expect(result: dict[str, float], accuracy: float, fmt: float) -> None:
    assert result["accuracy"] == pytest.approx(accuracy)
    assert result["format_reward"] == pytest.approx(fmt)
    assert result["score"] == pytest.approx((accuracy + fmt) / 1.3)


@pytest.mark.parametrize(
    ("response", "truth", "accuracy"),
    [
        ("<think>5 is B</think><answer>\\boxed{B}</answer>", "B", 1.0),
        ("<answer>\\boxed{C}</answer>", "B", 0.0),
        ("<answer>\\boxed{b}</answer>", "b", 0.0),  # lowercase is no choice letter: a value, not option text
        ("<answer>A or rather \\boxed{B}</answer>", "B", 1.0),  # the last standalone letter counts
        ("<answer>\\boxed{B} not A</answer>", "B", 0.0),
        ("<answer>\\boxed{Cat}</answer>", "C", 0.0),  # a letter inside a word is not a choice
    ],
)
def test_multiple_choice_letter(response, truth, accuracy):
    expect(score(response, truth), accuracy, 0.3)


@pytest.mark.parametrize(
    ("response", "truth", "accuracy"),
    [
        ("<answer>\\boxed{5}</answer>", "B", 0.5),  # the value of option B
        ("<answer>\\boxed{4}</answer>", "B", 0.0),
        ("<answer>\\boxed{0.5}</answer>", "C", 0.5),  # math_verify: 0.5 == \frac{1}{2}
        ("<answer>\\boxed{30^\\circ}</answer>", "D", 0.5),  # angle marks dropped on both sides
    ],
)
def test_value_instead_of_letter_gets_half_credit(response, truth, accuracy):
    expect(score(response, truth), accuracy, 0.3)


def test_value_instead_of_letter_with_other_option_forms():
    as_lines = json.dumps(["A. 3", "B. 5", "C. 7"])
    expect(score("<answer>\\boxed{5}</answer>", "B", as_lines), 0.5, 0.3)
    expect(score("<answer>\\boxed{5}</answer>", "B", ["3", "5"]), 0.5, 0.3)  # bare texts: A, B, ...
    expect(score("<answer>\\boxed{5}</answer>", "B", None), 0.0, 0.3)  # no options: nothing to compare
    expect(compute_score("mmk12", "<answer>\\boxed{5}</answer>", "B"), 0.0, 0.3)  # no extra_info


@pytest.mark.parametrize(
    ("response", "truth", "accuracy"),
    [
        ("<answer>\\boxed{0.5}</answer>", "\\frac{1}{2}", 1.0),  # decimal vs LaTeX fraction
        ("<answer>\\boxed{\\frac{1}{2}}</answer>", "0.5", 1.0),
        ("<answer>\\boxed{\\dfrac{3}{4}}</answer>", "0.75", 1.0),
        ("<answer>\\boxed{0.6}</answer>", "\\frac{1}{2}", 0.0),
        ("<answer>\\boxed{2\\sqrt{2}}</answer>", "\\sqrt{8}", 1.0),
        ("<answer>\\boxed{30^\\circ}</answer>", "30", 1.0),
        ("<answer>\\boxed{12}</answer>", "13", 0.0),
    ],
)
def test_free_form_answers_use_math_verify(response, truth, accuracy):
    expect(score(response, truth), accuracy, 0.3)


@pytest.mark.parametrize(
    ("response", "fmt"),
    [
        ("<think>x</think><answer>\\boxed{5}</answer>", 0.3),  # one tag, boxed inside
        ("<answer>5</answer>", 0.15),  # one tag, no box
        ("<answer>\\boxed{5}</answer><answer>5</answer>", 0.15),  # two tags, box in the first
        ("<answer>5</answer><answer>\\boxed{5}</answer>", 0.0),  # two tags, box only in the second
        ("\\boxed{5} <answer>", 0.0),  # no complete tag
        ("The answer is \\boxed{5}", 0.0),
    ],
)
def test_format_score(response, fmt):
    expect(score(response, "5"), 1.0, fmt)  # the first answer payload (or the text) is 5 each time


def test_no_answer_tag_scores_the_whole_response():
    expect(score("So the answer is B.", "B"), 1.0, 0.0)
    expect(score("B at first, but it is C.", "B"), 0.0, 0.0)
    expect(score("The result is 0.5", "\\frac{1}{2}"), 1.0, 0.0)
    expect(score("", "B"), 0.0, 0.0)


def test_verl_keyword_call_and_options():
    result = compute_score(data_source="mmk12", solution_str="<answer>\\boxed{A}</answer>", ground_truth=" A ",
                           extra_info={"options": OPTIONS})
    assert result == {"score": pytest.approx(1.0), "format_reward": pytest.approx(0.3), "accuracy": 1.0}
    assert parse_options(OPTIONS)["C"] == "\\frac{1}{2}"
    assert parse_options({"a.": "1", "B": 2, "F": "x", "AB": "y"}) == {"A": "1", "B": "2"}
    assert parse_options(["A) 1", "B、2", "C: 3"]) == {"A": "1", "B": "2", "C": "3"}
    assert parse_options("not json") == {} and parse_options(7) == {}
    assert last_choice_letter("\\boxed{D}") == "D" and last_choice_letter("\\frac{1}{2}") is None
    assert format_reward("<answer>\\boxed{1}</answer>", "\\boxed{1}", format_score=0.5) == 0.5
