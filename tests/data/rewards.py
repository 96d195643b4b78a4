"""Custom rewards for tests, loaded through the `path.py:function` reward spec (verl's signature)."""


def by_length(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    """Varies between responses of one group, so GRPO advantages are non-zero."""
    return len(solution_str.split()) / 10.0


def constant(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return 1.0
