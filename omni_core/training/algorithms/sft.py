"""SFT: cross-entropy on the response tokens of (prompt, response) pairs (`omni_core.training.sft`).
The stage kind `sft` runs it; the response of a row is picked by `response`:

- `auto`: a preference pair's chosen response, else `extra_info.answer` (GSM8K's worked answer),
  else `reward_model.ground_truth` (the digits fixture's answer);
- `answer` / `ground_truth` / `chosen`: that one field (an error on a row without it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_core.training.algorithms import (
    LANGUAGE_MODEL,
    SUPERVISED,
    Algorithm,
    AlgorithmOptions,
    register_algorithm,
)


class SFTOptions(AlgorithmOptions):
    name: Literal["sft"] = Field("sft", description="Supervised fine-tuning on the response tokens.")
    response: Literal["auto", "answer", "ground_truth", "chosen"] = Field(
        "auto", description="Which field of a row is the target response (module docstring).")


# the trainer module imports this one (for the options), never the reverse: named, resolved when a stage runs


register_algorithm(Algorithm(
    name="sft", options=SFTOptions, trainer="omni_core.training.sft:build_trainer", data=SUPERVISED,
    model_kind=LANGUAGE_MODEL,
    stage_keys={"trainer": ("total_steps", "batch_size", "lr", "max_grad_norm", "max_prompt_tokens")},
    defaults={"trainer.lr": 3e-3, "trainer.batch_size": 32},
    progress=(("train/loss", "loss"), ("train/grad_norm", "grad_norm")),
    metrics={"train/loss": "cross-entropy on the response tokens", "train/lr": "learning rate",
             "train/grad_norm": "gradient norm before clipping"},
))
