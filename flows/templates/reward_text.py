"""A reward for `omni init`'s pipeline, with verl's signature: verl, VeRL-Omni and omni call it the same way.

`solution_str` is the model's response, `ground_truth` the row's `reward_model.ground_truth` (GSM8K: the
final number), `extra_info` the row's `extra_info` (question, answer, index, split). Return a float, or a
dict with "score" (and any other numbers, which eval stages report too). A verl stage loads the file in
verl's interpreter: keep to the standard library (or packages the Ray nodes have).
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the last number in the response is the ground truth; 0.1 for ending on another number
    (a small reward for the format, so a tiny model has something to learn from); 0.0 otherwise."""
    numbers = NUMBER.findall(solution_str.replace(",", ""))
    if not numbers:
        return 0.0
    return 1.0 if numbers[-1] == str(ground_truth).strip() else 0.1
