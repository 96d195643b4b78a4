"""VeRL-Omni recipes as a training backend: the recipe catalog, rendering of a recipe's command, the
export in the layouts recipes read; registered as backend `verl_omni` (implementation: backend.py,
run through omni_core.backends.jobs)."""

from omni_core.backends.verl_omni.options import VerlOmniBackend
from omni_core.config.backends import BackendRecord, register_backend

register_backend(BackendRecord(
    name="verl_omni", options=VerlOmniBackend, implementation="omni_core.backends.verl_omni.backend:BACKEND",
    usage="write backend: {name: verl_omni, recipe: NAME, shared_dir: PATH} (`omni recipes list` shows the recipes)",
    description="{name: verl_omni, recipe, shared_dir, ...}: a VeRL-Omni recipe as a Ray Job"))
