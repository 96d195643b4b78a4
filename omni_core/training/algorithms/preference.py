"""DPO and MPO on preference pairs (`omni_core.training.preference.PreferenceTrainer`): a weighted sum
of pairwise losses on the policy/reference log-ratios of chosen and rejected responses, plus an SFT
term for MPO. Loss types are resolved through `omni_core.algorithms.preference`'s registry."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from omni_core.training.algorithms import (
    LANGUAGE_MODEL,
    PAIRS,
    Algorithm,
    AlgorithmOptions,
    register_algorithm,
)

MPO_LOSS_TYPES = ("sigmoid", "bco_pair", "sft")
MPO_LOSS_WEIGHTS = (0.8, 0.2, 1.0)
SFT = "sft"  # the one loss type that is not a function of the log-ratios


class PreferenceOptions(AlgorithmOptions):
    """VeRL-Omni's `actor.omni_loss` names where they exist."""

    name: Literal["dpo", "mpo"] = Field("dpo", description="dpo: one pairwise loss; mpo: a weighted sum of loss "
                                                           "types with an SFT term (docs/reference/formulas.md#preference-losses-and-sft).")
    loss_type: str | list[str] | None = Field(
        None, description="dpo: sigmoid | ipo | bco_pair (default sigmoid); mpo: a list (default sigmoid, bco_pair, sft)")
    loss_weights: list[float] | None = Field(None, description="One per loss type; mpo default 0.8, 0.2, 1.0.")
    beta: float = Field(0.1, gt=0, description="Weight of the log-ratios in the implicit reward (DPO's beta).")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative DPO: the chance a pair's preference "
                                                                   "label is flipped.")
    average_log_prob: bool = Field(False, description="Length-normalised sequence log-probs.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    modality_weights: dict[str, Annotated[float, Field(ge=0)]] | None = Field(
        None, description="Chance of each modality per training batch; absent modalities weigh 1.")

    @property
    def loss_types(self) -> list[str]:
        if self.loss_type is None:
            return ["sigmoid"] if self.name == "dpo" else list(MPO_LOSS_TYPES)
        return [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)

    @property
    def weights(self) -> list[float]:
        if self.loss_weights is not None:
            return list(self.loss_weights)
        if self.name == "mpo" and self.loss_type is None:
            return list(MPO_LOSS_WEIGHTS)
        return [1.0] * len(self.loss_types)

    @model_validator(mode="after")
    def _check_losses(self) -> PreferenceOptions:
        types = self.loss_types
        if self.loss_type is not None:
            from omni_core.algorithms.preference import get_preference_loss
            from omni_core.errors import ConfigError

            for name in types:
                if name != SFT:
                    try:
                        get_preference_loss(name)
                    except ConfigError as exc:
                        raise ValueError(f"loss_type: {exc}") from None
        if len(self.weights) != len(types):
            raise ValueError(f"loss_weights: {len(types)} loss types ({', '.join(types)}) but "
                             f"{len(self.weights)} loss_weights; give one weight each")
        if self.name == "dpo" and (len(types) != 1 or types[0] == SFT):
            raise ValueError(f"loss_type: dpo takes one pairwise loss type (sigmoid, ipo, bco_pair), not {types}; "
                             "for a weighted list use name: mpo")
        return self


# the trainer module imports this one (for the options), never the reverse: named, resolved when a stage runs


_TRAINER_KEYS = ("total_steps", "batch_size", "lr", "max_grad_norm")
_DEFAULTS = {"trainer.lr": 1e-3, "trainer.batch_size": 8}
for _name in ("dpo", "mpo"):
    register_algorithm(Algorithm(
        name=_name, options=PreferenceOptions, trainer="omni_core.training.preference:build_trainer", data=PAIRS,
        model_kind=LANGUAGE_MODEL,
        stage_keys={"trainer": _TRAINER_KEYS}, defaults=_DEFAULTS,
        progress=((f"actor/{_name}_loss", "loss"), ("actor/reward_accuracy", "reward_acc"),
                  ("actor/reward_margin", "margin")),
        metrics={
            f"actor/{_name}_loss": "the step's preference loss (docs/reference/formulas.md#preference-losses-and-sft)",
            "actor/{loss_type}_loss": "each loss type's own term (sigmoid, ipo, bco_pair, sft), when there are several",
            "actor/chosen_rewards": "mean implicit reward beta * (log pi - log ref) of the chosen responses",
            "actor/rejected_rewards": "the same, of the rejected responses",
            "actor/reward_accuracy": "share of pairs whose chosen reward beats the rejected one",
            "actor/reward_margin": "mean chosen - rejected reward",
            "actor/grad_norm": "gradient norm before clipping",
            "actor/lr": "learning rate",
            "timing_s/ref": "seconds of the step's reference log-probs: a lookup once a run that sees every "
                            "pair has computed them (each pair's once, in fixed chunks)",
        }))
