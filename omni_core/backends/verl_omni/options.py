"""`backend: {name: verl_omni, ...}` on an `rl` stage: a VeRL-Omni recipe (`recipe: NAME`, from
`omni recipes list`) or an imported script's command (`entry_point: MODULE` with its `overrides`), run
as a Ray Job on the cluster at `ray.address`.

The recipe options (`RecipeOptions`: rollout_n, max_num_seqs, lora_rank, total_steps, ...) may be
written here directly, as `omni recipes show` prints them; the stage's own keys that mean the same
(`rollout.n`, `lora.rank`, `trainer.total_steps`, ...) map onto them too (stage.py).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, SerializerFunctionWrapHandler, field_validator, model_serializer, model_validator

from omni_core.backends.jobs.options import JobBackendOptions
from omni_core.backends.verl_omni.render import RecipeOptions

# the keys of `backend:` that are not recipe options
BACKEND_ONLY = ("name", "recipe", "entry_point", "python", "shared_dir", "entrypoint_resources")


class VerlOmniBackend(JobBackendOptions, RecipeOptions):
    """`backend: {name: verl_omni, recipe: NAME, shared_dir: PATH, ...}` (shared_dir, entrypoint_resources:
    the base's; by default no entry point resources: the recipe's driver only places Ray actors)."""

    decides_stage_keys: ClassVar[bool] = True  # the recipe decides what the stage's keys mean
    brings_model: ClassVar[bool] = True  # without `model:` the recipe's own model trains

    name: Literal["verl_omni"] = Field("verl_omni", description="A VeRL-Omni recipe as a Ray Job.")
    recipe: str | None = Field(None, description="A VeRL-Omni recipe (`omni recipes list`).")
    entry_point: str | None = Field(None, description="Instead of a recipe: the module an imported script runs "
                                                      "(`omni recipes import run_x.sh` writes it), e.g. "
                                                      "verl_omni.trainer.main_omni.")
    python: str | None = Field(None, description="The interpreter that has verl-omni on the cluster; default: the "
                                                 "recipe's (python3, the CUDA image's /opt/venv).")

    @field_validator("entry_point")
    @classmethod
    def _module_name(cls, value: str | None) -> str | None:
        """It becomes `python -m MODULE` in the Ray Job's shell line: a dotted module name and nothing else."""
        if value is not None and not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", value):
            raise ValueError(f"backend.entry_point {value!r} is not a Python module name (e.g. "
                             "verl_omni.trainer.main_omni)")
        return value

    @model_validator(mode="after")
    def _recipe_or_entry_point(self) -> VerlOmniBackend:
        if bool(self.recipe) == bool(self.entry_point):
            raise ValueError("a verl_omni backend names either a recipe (`omni recipes list`) or an entry_point with "
                             "its overrides (`omni recipes import run_x.sh` writes one), not both, not neither")
        if self.recipe:
            from omni_core.backends.verl_omni.catalog import get_recipe
            from omni_core.errors import ConfigError

            try:
                get_recipe(self.recipe)
            except ConfigError as exc:  # names the recipes there are
                raise ValueError(str(exc).removeprefix("backend.")) from None
        return self

    @model_serializer(mode="wrap")
    def _dump_what_is_set(self, handler: SerializerFunctionWrapHandler) -> dict:
        """Options left unset (None, no overrides, no env) are not dumped: the recipe decides them."""
        return {k: v for k, v in handler(self).items() if v is not None and v != [] and v != {}}

    def options(self) -> dict:
        """The recipe options set here (for render.render_recipe)."""
        return self.model_dump(exclude=set(BACKEND_ONLY), exclude_none=True)

    def dump_stage(self, stage: Any, data: dict[str, Any]) -> dict[str, Any]:
        """The recipe decides the rest: only what the file set is dumped (and so in the run key)."""
        given = set(stage.keys_given())
        if "model" not in stage.model_fields_set:  # the recipe's own model
            data.pop("model", None)
        for key in ("num_cpus", "resources"):  # refused when set (backend.nnodes / n_gpus_per_node place it)
            if key not in stage.model_fields_set:
                data.pop(key, None)
        for section in ("algorithm", "trainer", "rollout", "reward", "execution", "checkpoint", "lora"):
            if isinstance(data.get(section), dict):
                data[section] = {k: v for k, v in data[section].items()
                                 if k == "name" and section == "algorithm" or f"{section}.{k}" in given}
        return data
