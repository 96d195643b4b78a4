"""verl as a training backend: options, rendering of verl's Hydra command, and the compose check.

    backend = VerlBackend(shared_dir="/mnt/shared", n_gpus_per_node=8)
    command = render(VerlTraining(task="gspo", model=..., train_files=[...], ...), backend,
                     backend.run_dir(pipeline, run_key, stage))
    compose(command, python)   # verl's own Hydra composition + validation, in verl's interpreter
"""

from omni_core.backends.verl.check import compose, compose_all
from omni_core.backends.verl.options import VerlBackend, VerlTraining
from omni_core.backends.verl.render import VerlCommand, hydra_value, render

__all__ = ["VerlBackend", "VerlCommand", "VerlTraining", "compose", "compose_all", "hydra_value", "render"]
