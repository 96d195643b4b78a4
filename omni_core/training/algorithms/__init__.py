"""Training algorithms: one registered record each, as the stage kinds are.

    register_algorithm(Algorithm(
        name="sft", options=SFTOptions, trainer=build_sft_trainer, data=SUPERVISED, model_kind=LANGUAGE_MODEL,
        stage_keys={"trainer": ("total_steps", "batch_size", "lr", "max_grad_norm", "max_prompt_tokens")},
        progress=(("train/loss", "loss"),)))

A record holds everything the rest of the platform needs to know about an algorithm:

- `options`: the pydantic model of the stage's `algorithm:` section (its `name` picks the record);
  the trainer consumes it directly (`stage.algorithm`).
- `trainer(stage, rows, seed, model, text_io, rollout)`: builds the `Trainer` (omni_core.training.trainer).
- `data`: what it trains on (`PROMPTS` + reward, preference `PAIRS`, `DIFFUSION_PROMPTS`, `SUPERVISED`
  prompt + response); `model_kind`: the model it trains (language model or text-to-image diffusion).
- `separate_async`: its rollout can run on separate rollout workers (`execution.mode: separate_async`;
  the trainer then has `learn(batch, rewards)`).
- `stage_keys`: the keys of the stage's trainer/rollout/reward sections it reads (`ALL` for a whole
  section; a section left out is not read, and setting its keys is an error); `defaults`: its own
  defaults for those keys (`"trainer.lr": 1e-3`).
- `progress`: the metrics shown on each step's progress line, with their short labels.

Adding an algorithm: one module in this package that defines its options model and trainer factory
and calls `register_algorithm`, plus its import at the end of this file. Policy losses are open: a
function decorated with `@register_policy_loss(NAME)` (omni_core.algorithms.policy_loss) is usable as
`algorithm: {name: NAME}` with the policy-gradient (GRPO) trainer, no record needed.

This package imports pydantic only (trainers are imported by the factories when a stage runs), so the
config models can use it without loading torch or Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from omni_core.registry import Registry

ALL = "*"  # every key of a section
PROMPTS, PAIRS, DIFFUSION_PROMPTS, SUPERVISED = "prompts", "preference pairs", "diffusion prompts", "supervised"
LANGUAGE_MODEL, DIFFUSION_MODEL = "a language model", "a text-to-image diffusion model"

# Keys that belong in another section of the stage (the trainers' own spelling -> the stage's).
SET_ELSEWHERE = {"lr": "trainer.lr", "batch_size": "trainer.batch_size", "prompts_per_step": "trainer.batch_size",
                 "total_steps": "trainer.total_steps", "max_grad_norm": "trainer.max_grad_norm",
                 "ppo_epochs": "trainer.ppo_epochs", "group_size": "rollout.n", "reward": "reward.name",
                 "loss_mode": "algorithm.name"}


class AlgorithmOptions(BaseModel):
    """The base of every algorithm's options model: `name` plus the algorithm's own keys. A key of
    another algorithm fails naming the algorithms that have it; a key of another section of the stage
    fails naming where it goes; any other unknown key fails as unknown."""

    model_config = ConfigDict(extra="forbid")
    name: str
    set_elsewhere: ClassVar[dict[str, str]] = SET_ELSEWHERE

    @model_validator(mode="before")
    @classmethod
    def _keys_of_other_sections_or_algorithms(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for key, where in cls.set_elsewhere.items():
            if key in data:
                raise ValueError(f"`{key}` is not an algorithm option; set {where} in the stage instead")
        name = str(data.get("name", cls.model_fields["name"].default))
        errors = []
        for key in data:
            if key in cls.model_fields:
                continue
            owners = [n for n, record in _ALGORITHMS.items() if key in record.options.model_fields]
            if owners:
                takes = ", ".join(k for k in cls.model_fields if k != "name") or "no options"
                errors.append(InitErrorDetails(type=PydanticCustomError(
                    "not_an_option", "not an option of {name} (it is one of {owners}); {name} takes: {takes}",
                    {"name": name, "owners": ", ".join(owners), "takes": takes}), loc=(key,), input=data[key]))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return data

    def options(self) -> dict[str, Any]:
        """The options by key, without `name`."""
        return {k: v for k, v in self.model_dump().items() if k != "name"}


TrainerFactory = Callable[..., Any]  # (stage, rows, seed, *, model, text_io, rollout) -> Trainer


@dataclass(frozen=True)
class Algorithm:
    name: str
    options: type[AlgorithmOptions]
    trainer: TrainerFactory
    data: str
    model_kind: str = LANGUAGE_MODEL
    separate_async: bool = False
    stage_keys: dict[str, tuple[str, ...] | str] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    progress: tuple[tuple[str, str], ...] = ()

    def reads(self, section: str, key: str) -> bool:
        keys = self.stage_keys.get(section, ())
        return keys == ALL or key in keys


_ALGORITHMS: Registry[Algorithm] = Registry(
    "algorithm", hint="add a module with register_algorithm(Algorithm(...)) to omni_core/training/algorithms/, "
                      "or a policy loss with @register_policy_loss(NAME)")


def register_algorithm(record: Algorithm, *aliases: str) -> Algorithm:
    """Register `record` under its name (and `aliases`: other names of the same trainer and options)."""
    for name in (record.name, *aliases):
        _ALGORITHMS.add(name, record)
    return record


def algorithm_names() -> list[str]:
    return _ALGORITHMS.names()


def get_algorithm(name: str) -> Algorithm:
    """The record registered as `name`; a registered policy loss runs the policy-gradient (GRPO) one.
    ConfigError naming the known algorithms otherwise."""
    if name in _ALGORITHMS:
        return _ALGORITHMS[name]
    from omni_core.algorithms.policy_loss import policy_loss_names

    if name in policy_loss_names():
        return _ALGORITHMS["grpo"]
    return _ALGORITHMS.get(name)


def parse_options(data: Any, default: str) -> AlgorithmOptions:
    """The options model of the `algorithm:` section `data` (a dict, or options already parsed)."""
    if isinstance(data, AlgorithmOptions):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError("must be a mapping with at least `name:`")
    name = data.get("name", default)
    from omni_core.errors import ConfigError

    try:
        record = get_algorithm(str(name))
    except ConfigError as exc:
        raise ValidationError.from_exception_data("algorithm", [InitErrorDetails(
            type=PydanticCustomError("unknown_algorithm", "{message}", {"message": str(exc)}), loc=("name",),
            input=name)]) from None
    return record.options.model_validate({**data, "name": name})


from omni_core.training.algorithms import flow_grpo, grpo, preference, sft  # noqa: E402,F401  (register them)
