"""The algorithm table: one registered record per training algorithm, parsed by the `algorithm:`
section of a training stage. Records are filled by plugins (omni_core.plugins: the built-in ones in
omni_core/training/algorithms/, others through the `omni_core.plugins` entry point group).

    register_algorithm(Algorithm(
        name="sft", options=SFTOptions, trainer="omni_core.training.algorithms.sft:build_sft_trainer",
        data=SUPERVISED, model_kind=LANGUAGE_MODEL,
        stage_keys={"trainer": ("total_steps", "batch_size", "lr", "max_grad_norm", "max_prompt_tokens")},
        progress=(("train/loss", "loss"),)))

A record holds everything the rest of the platform needs to know about an algorithm:

- `options`: the pydantic model of the stage's `algorithm:` section (its `name` picks the record);
  the trainer consumes it directly (`stage.algorithm`).
- `trainer`: "module:function" of the factory `(stage, rows, seed, *, model, text_io, rollout)` that
  builds the `Trainer` (omni_core.training.trainer); imported when the stage runs (`build_trainer`),
  so the record (and the config models) never import a trainer.
- `data`: what it trains on (`PROMPTS` + reward, preference `PAIRS`, `DIFFUSION_PROMPTS`, `SUPERVISED`
  prompt + response); `model_kind`: the model it trains (language model or text-to-image diffusion).
- `separate_async`: its rollout can run on separate rollout workers (`execution.mode: separate_async`;
  the trainer then has `learn(batch, rewards)`).
- `stage_keys`: the keys of the stage's trainer/rollout/reward sections it reads (`ALL` for a whole
  section; a section left out is not read, and setting its keys is an error); `defaults`: its own
  defaults for those keys (`"trainer.lr": 1e-3`).
- `progress`: the metrics shown on each step's progress line, with their short labels.
- `metrics`: every metric its trainer logs per step, with its meaning (the docs' metric reference is
  generated from these and RUNNER_METRICS; the tutorials' test checks a run logs no other).

Policy losses are open too: a function decorated with `@register_policy_loss(NAME)`
(omni_core.algorithms.policy_loss) is usable as `algorithm: {name: NAME}` with the policy-gradient
(GRPO) record, no record needed: that record's `more_names` names the policy-loss table.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from omni_core.errors import ConfigError
from omni_core.registry import Registry

ALL = "*"  # every key of a section
PROMPTS, PAIRS, DIFFUSION_PROMPTS, SUPERVISED = "prompts", "preference pairs", "diffusion prompts", "supervised"
LANGUAGE_MODEL, DIFFUSION_MODEL = "a language model", "a text-to-image diffusion model"

# Keys that belong in another section of the stage (the trainers' own spelling -> the stage's).
SET_ELSEWHERE = {"lr": "trainer.lr", "batch_size": "trainer.batch_size", "prompts_per_step": "trainer.batch_size",
                 "total_steps": "trainer.total_steps", "max_grad_norm": "trainer.max_grad_norm",
                 "ppo_epochs": "trainer.ppo_epochs", "group_size": "rollout.n", "reward": "reward.name",
                 "loss_mode": "algorithm.name"}


def resolve(spec: str, what: str) -> Any:
    """The object a "module:attribute" string names (torchtune's `_component_`), imported now."""
    module, sep, attribute = spec.partition(":")
    if not sep or not module or not attribute:
        raise ConfigError(f"{what}: {spec!r} is not 'module:attribute'")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{what}: {spec!r} cannot be loaded ({type(exc).__name__}: {exc}); check the module "
                          "and attribute names, and that its package is installed") from exc


class AlgorithmOptions(BaseModel):
    """The base of every algorithm's options model: `name` plus the algorithm's own keys. A key of
    another algorithm fails naming the algorithms that have it; a key of another section of the stage
    fails naming where it goes; any other unknown key fails as unknown."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="The algorithm.")
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


@dataclass(frozen=True)
class Algorithm:
    name: str
    options: type[AlgorithmOptions]
    trainer: str  # "module:function" of the trainer factory, imported when the stage runs
    data: str
    model_kind: str = LANGUAGE_MODEL
    separate_async: bool = False
    stage_keys: dict[str, tuple[str, ...] | str] = field(default_factory=dict)
    defaults: dict[str, Any] = field(default_factory=dict)
    progress: tuple[tuple[str, str], ...] = ()
    metrics: dict[str, str] = field(default_factory=dict)  # name -> meaning, per step
    # "module:function" returning more names this record trains (the GRPO record: every registered policy loss)
    more_names: str | None = None

    def reads(self, section: str, key: str) -> bool:
        keys = self.stage_keys.get(section, ())
        return keys == ALL or key in keys

    def build_trainer(self, stage: Any, rows: list[dict[str, Any]], seed: int, **parts: Any) -> Any:
        """The trainer of `stage`: the factory `trainer` names, imported now."""
        return resolve(self.trainer, f"algorithm {self.name}: trainer")(stage, rows, seed, **parts)


# What the stage runner logs per step for every algorithm (omni_core/training/runner.py)
RUNNER_METRICS = {
    "timing_s/step": "wall seconds of the step",
    "timing_s/actor_step": "seconds of a step's work in the trainer actor, on steps it runs whole there (DPO, MPO, "
                           "FlowGRPO, colocated GRPO); the rest of `timing_s/step` is the driver's",
    "timing_s/save_checkpoint": "seconds to commit a checkpoint, on the steps that save one",
    "training/recoveries": "restarts after a lost actor or a failed checkpoint write so far (logged when one happens)",
}

_ALGORITHMS: Registry[Algorithm] = Registry(
    "algorithm", hint="add a module with register_algorithm(Algorithm(...)) to omni_core/training/algorithms/ "
                      "or to a plugin package (docs/concepts/plugins.md), or a policy loss with @register_policy_loss(NAME)")


def register_algorithm(record: Algorithm, *aliases: str) -> Algorithm:
    """Register `record` under its name (and `aliases`: other names of the same trainer and options)."""
    for name in (record.name, *aliases):
        _ALGORITHMS.add(name, record)
    return record


def algorithm_names() -> list[str]:
    return _ALGORITHMS.names()


def algorithm_records() -> list[tuple[str, Algorithm]]:
    return _ALGORITHMS.items()


def get_algorithm(name: str) -> Algorithm:
    """The record registered as `name`; a registered policy loss runs the policy-gradient (GRPO) one.
    ConfigError naming the known algorithms otherwise."""
    if name in _ALGORITHMS:
        return _ALGORITHMS[name]
    for _, record in _ALGORITHMS.items():
        if record.more_names and name in resolve(record.more_names, f"algorithm {record.name}: more_names")():
            return record
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
    try:
        record = get_algorithm(str(name))
    except ConfigError as exc:
        raise ValidationError.from_exception_data("algorithm", [InitErrorDetails(
            type=PydanticCustomError("unknown_algorithm", "{message}", {"message": str(exc)}), loc=("name",),
            input=name)]) from None
    return record.options.model_validate({**data, "name": name})


# What a model URI (`model`) or an adapter name (`adapter`) trains, where that is known without loading
# anything: filled by the adapters' registration (omni_core.models.adapters, a built-in plugin).
_MODEL_KINDS: Registry[str] = Registry("model kind")


def register_model_kind(what: str, name: str, kind: str) -> None:
    """`what` is "model" (a model URI, e.g. tiny://lm) or "adapter" (an adapter name); `kind` LANGUAGE_MODEL
    or DIFFUSION_MODEL."""
    if _MODEL_KINDS.get(f"{what}:{name}", None) != kind:  # the same again (a module reloaded) is no clash
        _MODEL_KINDS.add(f"{what}:{name}", kind)


def model_kind(what: str, name: str) -> str | None:
    """The kind registered for a model URI or adapter name, or None (not known before loading it)."""
    return _MODEL_KINDS.get(f"{what}:{name}", None)


# The dataset converters whose rows are preference pairs (dpo/mpo data): filled by the converters'
# registration (omni_core.data, a built-in plugin; a converter sets `preference_pairs = True`).
_PAIR_CONVERTERS: Registry[bool] = Registry("preference-pair converter")


def register_pair_converter(name: str) -> None:
    _PAIR_CONVERTERS.add(name, True)  # `add`, not a lookup: a lookup would load the plugins from inside one


def pair_converters() -> list[str]:
    """The names of the registered converters that write preference pairs."""
    return _PAIR_CONVERTERS.names()


def describe_algorithms(schema: dict[str, Any]) -> None:
    """JSON-schema hook of the `algorithm:` field: its description lists the registered algorithms."""
    names = ", ".join(algorithm_names())
    schema["description"] = (f"`name` picks the algorithm ({names}, or a registered policy loss); "
                             "the other keys are its options.")


def describe_trainer_defaults(schema: dict[str, Any]) -> None:
    """JSON-schema hook of the `trainer:` field: the defaults each algorithm sets for its keys."""
    by_defaults: dict[str, list[str]] = {}
    for name, record in algorithm_records():
        own = ", ".join(f"{k.split('.', 1)[1]} {v}" for k, v in sorted(record.defaults.items())
                        if k.startswith("trainer."))
        by_defaults.setdefault(own or "the section's defaults", []).append(name)
    schema["description"] = "Defaults by algorithm: " + "; ".join(
        f"{', '.join(names)}: {own}" for own, names in by_defaults.items()) + "."
