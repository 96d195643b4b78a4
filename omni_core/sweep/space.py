"""The settings a sweep tries, drawn by Optuna's samplers (grid, seeded random, TPE) through ask/tell.

Grid and random settings are all drawn up front from the seed, so they never depend on what finished
first. A bayes setting is asked when a variant is about to start, from a study rebuilt from the
settings tried before it (finished ones with their score) and a sampler seeded by (seed, index): the
same finished trials give the same next setting, also in a resumed sweep.

A `values: [...]` parameter is a categorical choice of an index into its values (Optuna keeps choices
of plain types only; a value may be a list here).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from typing import Any

from omni_core.sweep.spec import Parameter, SweepSpec
from omni_core.sweep.state import COMPLETED, FAILED, PRUNED, RUNNING


@dataclass
class Tried:
    """A setting tried before the one asked for: its values and, when finished, its score."""

    params: dict[str, Any]
    state: str  # COMPLETED | PRUNED | FAILED | RUNNING
    value: float | None = None
    intermediate: dict[int, float] | None = None


def _optuna() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _distribution(param: Parameter) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if param.values is not None:
        return CategoricalDistribution(list(range(len(param.values))))
    assert param.min is not None and param.max is not None
    if param.distribution == "int_uniform":
        return IntDistribution(int(param.min), int(param.max))
    return FloatDistribution(param.min, param.max, log=param.distribution == "log_uniform")


class Space:
    def __init__(self, spec: SweepSpec, seed: int):
        self.spec, self.seed = spec, seed
        self.keys = list(spec.parameters)
        self.distributions = {key: _distribution(p) for key, p in spec.parameters.items()}

    @property
    def grid_size(self) -> int:
        return math.prod(len(p.values or ()) for p in self.spec.parameters.values())

    def size(self) -> int | None:
        """How many settings the sweep tries (bayes: its run_cap)."""
        if self.spec.method == "grid":
            return min(self.grid_size, self.spec.run_cap or self.grid_size)
        return self.spec.run_cap

    def up_front(self) -> list[dict[str, Any]] | None:
        """Every setting of a grid or random sweep, in the order they run; None for bayes."""
        if self.spec.method == "bayes":
            return None
        optuna = _optuna()
        if self.spec.method == "grid":
            grid = {key: list(range(len(p.values or ()))) for key, p in self.spec.parameters.items()}
            sampler = optuna.samplers.GridSampler(grid, seed=self.seed)
        else:
            sampler = optuna.samplers.RandomSampler(seed=self.seed)
        study = optuna.create_study(sampler=sampler)
        n = self.size()
        assert n is not None
        return [self._values(study.ask(self.distributions).params) for _ in range(n)]

    def ask(self, index: int, tried: list[Tried]) -> dict[str, Any]:
        """The bayes setting number `index`, given the settings tried before it (in index order)."""
        optuna = _optuna()
        direction = "maximize" if self.spec.metric.goal == "maximize" else "minimize"
        sampler = optuna.samplers.TPESampler(seed=_derived_seed(self.seed, index))
        study = optuna.create_study(sampler=sampler, direction=direction)
        states = {COMPLETED: optuna.trial.TrialState.COMPLETE, PRUNED: optuna.trial.TrialState.PRUNED,
                  FAILED: optuna.trial.TrialState.FAIL, RUNNING: optuna.trial.TrialState.RUNNING}
        for t in tried:
            study.add_trial(optuna.trial.create_trial(
                params=self._choices(t.params), distributions=self.distributions, state=states[t.state],
                value=t.value if t.state == COMPLETED else None, intermediate_values=t.intermediate or {}))
        return self._values(study.ask(self.distributions).params)

    def _values(self, optuna_params: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key in self.keys:
            param, chosen = self.spec.parameters[key], optuna_params[key]
            out[key] = param.values[chosen] if param.values is not None else chosen
        return out

    def _choices(self, params: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key in self.keys:
            param = self.spec.parameters[key]
            out[key] = param.values.index(params[key]) if param.values is not None else params[key]
        return out


def _derived_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:4], "big")


def grid_points(spec: SweepSpec) -> list[dict[str, Any]]:
    """Every combination of a grid's values in file order (for messages and checks, not the run order)."""
    keys = list(spec.parameters)
    return [dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*(spec.parameters[k].values or () for k in keys))]
