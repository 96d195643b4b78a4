"""LoRA through peft: one small spec (rank, alpha, dropout, target modules) for every adapter.

A pipeline says `lora: {rank: 32, alpha: 64}`; the adapter supplies the target modules unless the
spec names them. After `apply_lora` only the LoRA matrices are trainable; `lora_state_dict` is what
a trainer pushes to rollout workers (docs/reference/training-on-ray.md: with LoRA, only adapter weights move).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_core.errors import ModelError


class LoraSpec(BaseModel):
    """LoRA hyper-parameters. `target_modules`: module-name suffixes (a list) or one regex that
    must match whole module names (a string); None means the adapter's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | str | None = None

    @classmethod
    def parse(cls, value: LoraSpec | dict[str, Any]) -> LoraSpec:
        """A spec from a dict (as in a pipeline file); bad keys raise `ModelError` naming them."""
        if isinstance(value, LoraSpec):
            return value
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            problems = "; ".join(
                f"lora.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
            )
            raise ModelError(
                f"bad LoRA settings {value!r}: {problems}; allowed keys are rank, alpha, dropout, target_modules"
            ) from None


def apply_lora(module: torch.nn.Module, spec: LoraSpec, default_targets: list[str] | str) -> Any:
    """Wrap `module` in a peft model with LoRA on the targeted linear layers; everything else is
    frozen. LoRA B starts at zero, so the wrapped model computes exactly what `module` did."""
    from peft import LoraConfig, get_peft_model

    targets = spec.target_modules if spec.target_modules is not None else default_targets
    if isinstance(targets, str) and targets != "all-linear":
        targets = _expand_regex(module, targets)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=targets,
        bias="none",
    )
    try:
        with warnings.catch_warnings():  # peft calls a transformers accessor deprecated in v5
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(module, config)
    except ValueError as exc:  # peft: no module matched
        raise ModelError(f"LoRA target_modules {targets!r} match no layer of the model: {exc}") from exc


def _expand_regex(module: torch.nn.Module, pattern: str) -> list[str]:
    """The full names of the modules `pattern` matches whole.

    peft would take the regex itself, but for MoE models with a transformers-v5 weight conversion
    (Qwen3-Omni among them) peft rewrites a regex into bare leaf names (`q_proj`, ...), which then
    match every tower's layers too. Full names pass through that rewrite unchanged.
    """
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ModelError(
            f"LoRA target_modules {pattern!r} is not a valid regular expression: {exc}"
        ) from None
    names = [name for name, _ in module.named_modules() if name and regex.fullmatch(name)]
    if not names:
        raise ModelError(f"LoRA target_modules {pattern!r} match no module of the model")
    return names


def lora_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Only the adapter weights of a peft model (what weight sync sends with LoRA)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def trainable_parameter_count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
