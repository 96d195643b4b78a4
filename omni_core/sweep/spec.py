"""The sweep file: which keys of a pipeline file to vary, how to pick their values, what to compare.

W&B's sweep shape (`name`, `method`, `parameters`, `metric`, `run_cap`, `early_terminate`), with the
keys a pipeline platform adds: `seeds` (repeats of each setting), `select_on` / `report_on` (the eval
that picks the best and the one its score is reported on), `max_concurrent`. Every model forbids
unknown keys; the checks that need the pipeline (keys exist, stages log the metric) are in
omni_core.sweep.plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omni_core.config import read_yaml
from omni_core.config.loader import _format_error
from omni_core.config.names import MAX_NAME_LENGTH, NAME_PATTERN
from omni_core.errors import ConfigError

Goal = Literal["maximize", "minimize"]
NUMERIC_DISTRIBUTIONS = ("uniform", "log_uniform", "int_uniform")


class SweepFileError(ConfigError):
    """A sweep file that cannot be used; `errors` holds one `key.path: message` line per problem."""

    def __init__(self, source: str, errors: list[str]):
        self.source, self.errors = source, errors
        more = f" (+{len(errors) - 1} more: {'; '.join(errors[1:])})" if len(errors) > 1 else ""
        super().__init__(f"{source}: {errors[0]}{more}; fix the sweep file")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Parameter(_Strict):
    """One swept key: a list of `values`, or a `distribution` between `min` and `max`."""

    values: list[Any] | None = Field(None, description="The values to try (grid: every one; random and bayes: "
                                                        "one of them per variant).")
    distribution: Literal["categorical", "uniform", "log_uniform", "int_uniform"] | None = Field(
        None, description="categorical (needs values), uniform, log_uniform (min > 0) or int_uniform between "
                          "min and max (random and bayes only).")
    min: float | None = Field(None, description="Lower bound of a uniform, log_uniform or int_uniform distribution.")
    max: float | None = Field(None, description="Upper bound (inclusive) of the distribution.")

    @model_validator(mode="after")
    def _one_form(self) -> Parameter:
        if self.values is not None:
            if self.distribution not in (None, "categorical"):
                raise ValueError(f"give either values or distribution {self.distribution} with min/max, not both")
            if not self.values:
                raise ValueError("values is empty: list at least one value")
            if self.min is not None or self.max is not None:
                raise ValueError("min/max go with a uniform, log_uniform or int_uniform distribution, not values")
            return self
        if self.distribution in (None, "categorical"):
            raise ValueError("give values: [...] or a distribution (uniform, log_uniform, int_uniform) with min and max")
        if self.min is None or self.max is None:
            raise ValueError(f"distribution {self.distribution} needs min and max")
        if self.min >= self.max:
            raise ValueError(f"min {self.min:g} must be below max {self.max:g}")
        if self.distribution == "log_uniform" and self.min <= 0:
            raise ValueError(f"log_uniform needs min > 0 (got {self.min:g})")
        if self.distribution == "int_uniform" and (self.min != int(self.min) or self.max != int(self.max)):
            raise ValueError("int_uniform needs whole-number min and max")
        return self

    @property
    def numeric(self) -> bool:
        return self.values is None


class Metric(_Strict):
    name: str = Field("val/reward_mean", description="An eval stage's metric (verl's names: val/reward_mean, "
                                                     "val-core/SOURCE/reward/mean@N, eval_rewards/accuracies, ...).")
    goal: Goal = Field("maximize", description="Whether a higher (maximize) or lower (minimize) value is better.")
    stage: str | None = Field(None, description="The eval stage that logs it; default: the pipeline's last eval stage.")


class EarlyTerminate(_Strict):
    """ASHA: at rungs min_steps * eta^k of the training stage, a variant whose metric is below the
    (1 - 1/eta) quantile of the values other variants had at that rung is stopped."""

    type: Literal["asha"] = Field("asha", description="The early-stopping rule (asynchronous successive halving).")
    metric: str | None = Field(None, description="A per-step metric the training stage logs; default: its "
                                                 "algorithm's first headline metric (critic/score/mean for GRPO).")
    goal: Goal | None = Field(None, description="Default: minimize for a loss, else maximize.")
    stage: str | None = Field(None, description="The training stage (rl or sft) watched; default: the one the "
                                                "selecting eval scores.")
    min_steps: int = Field(ge=1, description="The first rung, in training steps.")
    eta: int = Field(3, ge=2, description="Reduction factor: rungs at min_steps * eta^k; about 1/eta of the "
                                          "variants pass each rung.")
    smooth: int = Field(1, ge=1, description="The rung value is the mean of the metric over this many steps up to "
                                             "the rung (per-step rewards are noisy).")
    mode: Literal["async", "sync"] = Field(
        "async", description="async: a variant is decided as soon as it reaches a rung, against the values seen so "
                             "far (decisions depend on timing); sync: against every variant of a lower index at that "
                             "rung, waiting for them (the same decisions every time).")


class HeldOutEval(_Strict):
    """An eval the sweep adds to every variant: the selecting eval stage on other rows."""

    name: str | None = Field(None, pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH,
                             description="The added stage's name; default: the selecting stage's name + _report.")
    data: str | None = Field(None, description="KEY:SPLIT; default: the selecting stage's.")
    skip_rows: int = Field(0, ge=0, description="Rows of the split left out first (those the selecting eval scores).")
    max_rows: int | None = Field(None, ge=1, description="Rows scored after them; null: the rest of the split.")


class SweepSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH, description="The sweep's name.")
    method: Literal["grid", "random", "bayes"] = Field(
        description="grid: every combination of values (in an order shuffled by seed); random: seeded draws; bayes: "
                    "Optuna's TPE sampler, each variant drawn from the finished ones.")
    seed: int | None = Field(None, description="Seeds the grid order, the random draws and the sampler; default: the "
                                               "pipeline's seed.")
    parameters: dict[str, Parameter] = Field(min_length=1, description="Dotted keys of the pipeline file "
                                                                       "(stages.rl.trainer.lr), each swept.")
    metric: Metric = Field(default_factory=Metric, description="What ranks the variants.")
    run_cap: int | None = Field(None, ge=1, description="Settings tried at most (each once per entry of seeds); "
                                                        "needed for random and bayes; grid: all combinations.")
    max_concurrent: int | None = Field(None, ge=1, description="Variants running at once; default: as many as the "
                                                               "Ray can place.")
    early_terminate: EarlyTerminate | None = Field(None, description="Stop variants early (ASHA).")
    seeds: list[int] | None = Field(None, min_length=1, description="Run each setting once per seed (the table "
                                                                    "shows the mean and spread).")
    select_on: str | None = Field(None, description="The eval stage whose metric picks the best; default: metric.stage.")
    report_on: str | HeldOutEval | None = Field(
        None, description="The eval stage the best score is reported on, or a held-out eval the sweep adds; "
                          "default: select_on (then the reported score is the one that chose it).")
    register_best: bool = Field(True, description="The best variant runs the pipeline's register stages (no other "
                                             "variant does).")

    @model_validator(mode="after")
    def _method_needs(self) -> SweepSpec:
        if self.method == "grid":
            ranged = [k for k, p in self.parameters.items() if p.numeric]
            if ranged:
                raise ValueError(f"parameters.{ranged[0]}: method grid takes values: [...] only; use method random "
                                 "or bayes for a distribution")
        elif self.run_cap is None:
            raise ValueError(f"run_cap: method {self.method} needs run_cap (how many settings to draw)")
        if self.seeds is not None and len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds: each seed once")
        if self.seeds is not None and "seed" in self.parameters:
            raise ValueError("parameters.seed: give seeds: [...] or sweep seed as a parameter, not both")
        return self

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


def load_sweep(path: str | Path) -> SweepSpec:
    if not Path(path).is_file():
        raise ConfigError(f"{path}: no such sweep file; check the path (an example: configs/sweep_demo.yaml)")
    data = read_yaml(path)
    return validate_sweep(data, str(path))


def validate_sweep(data: dict[str, Any], source: str = "<sweep>") -> SweepSpec:
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as exc:
        raise SweepFileError(source, [_format_error(err, data) for err in exc.errors()]) from None
