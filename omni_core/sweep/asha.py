"""ASHA's stopping rule at a rung, and when a variant may be decided there.

The rule is Ray Tune's AsyncHyperBand (`_Bracket.on_result`): a variant reaching a rung is stopped
when its value is worse than the (1 - 1/eta) quantile of the values recorded at that rung before it;
the first to arrive always goes on. It is a few lines, written here rather than taken from Optuna's
SuccessiveHalvingPruner because that pruner keeps its rung values in trial attributes private to it,
which a resumed sweep would have to forge from its records.

`async` decides a variant as soon as its value is known, against what the others recorded so far (the
decisions depend on which variant got there first). `sync` decides variant i at a rung against every
variant of a lower index that reaches it, waiting for their values: the same decisions every time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


def rung_value(history: dict[int, float], rung: int, smooth: int) -> float | None:
    """The mean of the metric over the `smooth` steps up to `rung` (steps from 1), None until all are logged."""
    steps = range(max(1, rung - smooth + 1), rung + 1)
    if not all(s in history for s in steps):
        return None
    return float(np.mean([history[s] for s in steps]))


@dataclass
class Decision:
    keep: bool
    value: float
    cutoff: float | None  # None: the first value at the rung


def cutoff(earlier: list[float], eta: int, goal: str) -> float | None:
    """The value a newcomer must reach (maximize: at least; minimize: at most), from the earlier ones."""
    if not earlier:
        return None
    quantile = (1 - 1 / eta) * 100 if goal == "maximize" else 100 / eta
    return float(np.nanpercentile(earlier, quantile))


def decide(value: float, earlier: list[float], eta: int, goal: str) -> Decision:
    line = cutoff(earlier, eta, goal)
    if line is None:
        return Decision(True, value, None)
    keep = value >= line if goal == "maximize" else value <= line
    return Decision(keep, value, line)


@dataclass
class Rungs:
    """The values recorded at each rung (rung step -> variant index -> value), in arrival order."""

    eta: int
    goal: str
    mode: str
    values: dict[int, dict[int, float]] = field(default_factory=dict)

    def record(self, rung: int, variant: int, value: float) -> None:
        self.values.setdefault(rung, {})[variant] = value

    def ready(self, rung: int, variant: int, settled_below: Callable[[int, int], bool]) -> bool:
        """Whether `variant` can be decided at `rung`: always in async mode; in sync mode once every
        variant of a lower index recorded a value there or never will (`settled_below(rung, index)`)."""
        if self.mode == "async":
            return True
        known = self.values.get(rung, {})
        return all(u in known or settled_below(rung, u) for u in range(variant))

    def decide(self, rung: int, variant: int, value: float) -> Decision:
        """The decision, then the value is recorded (a stopped variant's value counts for later ones)."""
        known = self.values.get(rung, {})
        if self.mode == "sync":
            earlier = [v for u, v in known.items() if u < variant]
        else:
            earlier = [v for u, v in known.items() if u != variant]
        decision = decide(value, earlier, self.eta, self.goal)
        self.record(rung, variant, value)
        return decision
