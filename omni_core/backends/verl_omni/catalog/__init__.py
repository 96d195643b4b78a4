"""The VeRL-Omni recipes: one JSON file per recipe family in this folder, read from the scripts of
verl-project/verl-omni at the commit the CUDA image pins (`VERL_OMNI_COMMIT`, infra/docker).

A recipe: its name, script, entry point (`python3 -m verl_omni.trainer.main_omni` ...), the variables
the script exports, its base overrides (the script's, in order, as bash expands them with no
variable set; a machine's folder stays `${NAME}`), the keys our pipeline substitutes (`substitutions`:
key -> what goes there), the model, algorithm, modalities, the hardware it was published on, the
dataset layout it reads, and `example`: the stage options that give back the script's own values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from omni_core.errors import ConfigError

VERL_OMNI_REPO = "verl-project/verl-omni"
VERL_OMNI_COMMIT = "a1139bafffb5b9711f0a6b6edff8ecaa60bfff30"  # infra/docker/cuda/Dockerfile VERL_OMNI_REF
_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Recipe:
    name: str
    family: str
    script: str  # path in verl-omni at VERL_OMNI_COMMIT
    python: str
    module: str
    env: dict[str, str]
    base: list[str]
    substitutions: dict[str, str]  # override key (no +/++) -> substitution kind (see render.SUBSTITUTIONS)
    env_drop: list[str]  # exported variables our job does not set, each with its reason in `notes`
    model: str
    algorithm: str
    modalities: str
    published: str  # the hardware of the script's header / README
    device: str  # gpu | npu
    data_layout: str
    dataset: str  # the dataset the recipe reads (our converter name: mmk12, avqa, omni_preference, ocr ...)
    example: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


@cache
def recipes() -> dict[str, Recipe]:
    out: dict[str, Recipe] = {}
    for path in sorted(_DIR.glob("*.json")):
        family = json.loads(path.read_text())
        for item in family["recipes"]:
            recipe = Recipe(family=path.stem, **item)
            if recipe.name in out:
                raise ConfigError(f"VeRL-Omni catalog: recipe {recipe.name!r} is in two families")
            out[recipe.name] = recipe
    return out


def get_recipe(name: str) -> Recipe:
    found = recipes()
    if name not in found:
        raise ConfigError(f"backend.recipe: {name!r} is not a VeRL-Omni recipe; `omni recipes list` shows "
                          f"the {len(found)} there are ({', '.join(sorted(found))})")
    return found[name]
