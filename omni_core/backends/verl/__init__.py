"""verl as a training backend: options, rendering of verl's Hydra command, and the compose check;
registered as backend `verl` (implementation: backend.py, run through omni_core.backends.jobs).

    backend = VerlBackend(shared_dir="/mnt/shared", n_gpus_per_node=8)
    command = render(VerlTraining(task="gspo", model=..., train_files=[...], ...), backend,
                     backend.run_dir(pipeline, run_key, stage))
    compose(command, python)   # verl's own Hydra composition + validation, in verl's interpreter
"""

from omni_core.backends.verl.check import compose, compose_all
from omni_core.backends.verl.options import VerlBackend, VerlTraining
from omni_core.backends.verl.render import VerlCommand, hydra_value, render
from omni_core.config.backends import BackendRecord, register_backend

register_backend(BackendRecord(
    name="verl", options=VerlBackend, implementation="omni_core.backends.verl.backend:BACKEND",
    usage="write backend: {name: verl, shared_dir: PATH} (shared_dir: a path every Ray node sees)",
    description="{name: verl, shared_dir, python, nnodes, n_gpus_per_node, overrides, env}: verl's trainer as a Ray Job"))

__all__ = ["VerlBackend", "VerlCommand", "VerlTraining", "compose", "compose_all", "hydra_value", "render"]
