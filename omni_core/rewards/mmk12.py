"""MMK12 reward (docs/reference/datasets.md#mmk12), as VeRL-Omni's `mmk12_reward.py` (MM-EUREKA style).

1. The answer is the stripped payload of the first `<answer>...</answer>`, or the whole response.
   Angle marks after a number (`30°`, `30^\\circ`, `30\\circ`) are dropped from response and truth.
2. Accuracy:
   - ground truth a single letter A-E (multiple choice): the last standalone capital A-E in the
     answer (not inside a word: `\\boxed{B}`, `answer: B`, `B`) decides, 1.0 if it matches else 0.0;
     if the answer has no such letter (the model wrote a value), 0.5 x math_verify(answer, text of
     the correct option), 0.0 when the options do not give that text;
   - otherwise math_verify(answer, ground truth) (`math_verify_pool`, gold first, timeout 20 s).
3. Format, two equal checks x `format_score` (0.3): exactly one `<answer>` and one `</answer>`;
   `\\boxed{` inside the first answer payload. So 0, 0.15 or 0.3.
4. `score = (accuracy + format) / (1 + format_score)`; returns {score, format_reward, accuracy}.

Options (`extra_info["options"]`), `parse_options`: a JSON string or the decoded value, either a dict
`{"A": "3", "B": "5"}` (what our MMK12 ingestion and VeRL-Omni's write; keys case-insensitive, a
key like "A." is read as "A") or a list, of `"A. 3"` lines (also `A) 3`, `A、3`, `A: 3`) or of bare
texts taken as A, B, C, ... in order. Anything else counts as no options.
"""

from __future__ import annotations

import json
import re
from typing import Any

from omni_core.rewards.math_verify_pool import math_verify_score
from omni_core.rewards.registry import register_reward

FORMAT_SCORE = 0.3
MATH_VERIFY_TIMEOUT_S = 20.0  # VeRL-Omni's default for this reward
LETTERS = "ABCDE"
_ANGLE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:°|\^\\circ|\\circ)")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{")
_CHOICE = re.compile(r"(?<![A-Za-z])([A-E])(?![A-Za-z])")
_OPTION_LINE = re.compile(r"^\s*([A-Ea-e])\s*[.)、:：]\s*(.+?)\s*$", re.DOTALL)


def normalize_angles(text: str) -> str:
    """`30°` / `30^\\circ` -> `30`, so math_verify compares plain numbers."""
    return _ANGLE.sub(r"\1", text)


def extract_answer(text: str) -> str | None:
    """The stripped payload of the first `<answer>...</answer>`, or None."""
    match = _ANSWER.search(text)
    return match.group(1).strip() if match else None


def last_choice_letter(text: str) -> str | None:
    """The last standalone capital A-E in `text`, or None."""
    letters = _CHOICE.findall(text)
    return letters[-1] if letters else None


def parse_options(options: Any) -> dict[str, str]:
    """`{letter: option text}` from a JSON string, dict or list (see the module docstring)."""
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError:
            return {}
    if isinstance(options, dict):
        parsed = {str(k).strip().rstrip(".):：、").upper(): str(v).strip() for k, v in options.items()}
        return {k: v for k, v in parsed.items() if len(k) == 1 and k in LETTERS}
    if isinstance(options, list | tuple):
        lines = [_OPTION_LINE.match(str(item)) for item in options]
        if options and all(lines):
            return {m.group(1).upper(): m.group(2) for m in lines if m is not None}
        return {LETTERS[i]: str(item).strip() for i, item in enumerate(options[: len(LETTERS)])}
    return {}


def format_reward(text: str, answer: str | None, format_score: float = FORMAT_SCORE) -> float:
    """`format_score` x (exactly one answer tag + `\\boxed{` inside the first one) / 2."""
    one_tag = answer is not None and text.count("<answer>") == 1 and text.count("</answer>") == 1
    boxed = answer is not None and _BOXED.search(answer) is not None
    return format_score * (int(one_tag) + int(boxed)) / 2


def accuracy_reward(content: str, truth: str, extra_info: dict[str, Any] | None, timeout: float) -> float:
    """1/0 for a letter (or 0.5 x math_verify of a value against the option's text), else math_verify."""
    if not (len(truth) == 1 and truth.upper() in LETTERS):
        return math_verify_score(content, truth, timeout=timeout)
    letter = last_choice_letter(content)
    if letter is not None:
        return 1.0 if letter == truth.upper() else 0.0
    option = parse_options((extra_info or {}).get("options")).get(truth.upper())
    return 0.5 * math_verify_score(content, normalize_angles(option), timeout=timeout) if option else 0.0


@register_reward("mmk12", data_sources=["mmk12"])
def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict[str, Any] | None = None,
    *,
    format_score: float = FORMAT_SCORE,
    math_verify_timeout: float = MATH_VERIFY_TIMEOUT_S,
    **kwargs: Any,
) -> dict[str, float]:
    """{"score", "format_reward", "accuracy"} for one MMK12 response (see the module docstring)."""
    text = normalize_angles(solution_str or "")
    truth = normalize_angles(str(ground_truth).strip())
    answer = extract_answer(text)
    accuracy = accuracy_reward(answer if answer is not None else text, truth, extra_info, math_verify_timeout)
    fmt = format_reward(text, answer, format_score)
    return {"score": (accuracy + fmt) / (1 + format_score), "format_reward": fmt, "accuracy": accuracy}
