"""The order in which the test modules start: the longest first.

`make test` runs the modules on pytest-xdist workers, each module whole on one worker, taken in
collection order (`--dist loadfile --no-loadscope-reorder`). A long module that starts last keeps one
worker busy while the others sit idle, so conftest.py sorts the modules by how long they took
(longest first; `module_durations.json`, setup + call + teardown of all their tests, in seconds). A
module not listed there counts as `UNKNOWN_SLOW_S` if one of its tests is marked `slow`, else as 0;
ties keep the file order, and a module's tests keep theirs. So the short unit-test modules fill in at
the end, whichever worker finishes first.

Refresh the file after adding or changing heavy tests (the numbers only need to be right relative to
each other): `python -m pytest -n 3 --record-module-durations`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("module_durations.json")
UNKNOWN_SLOW_S = 60.0


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def recorded() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def sort_items(items: list[pytest.Item]) -> None:
    """Sort `items` in place: modules by descending weight, a stable sort (see the module's docstring)."""
    known = recorded()
    slow = {module_of(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def weight(item: pytest.Item) -> float:
        module = module_of(item.nodeid)
        return known.get(module, UNKNOWN_SLOW_S if module in slow else 0.0)

    items.sort(key=lambda item: -weight(item))


class DurationRecorder:
    """Sums each module's test durations (in the xdist controller: the reports of every worker) and, at
    the end of the run, writes those of the modules without a failure to `DURATIONS` (the others keep
    their recorded number: a failure's time says nothing)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.failed: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = module_of(report.nodeid)
        self.seconds[module] += report.duration
        if report.failed:
            self.failed.add(module)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        passed = {module: round(s, 1) for module, s in self.seconds.items() if module not in self.failed}
        if passed:
            merged = {**recorded(), **passed}
            DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
