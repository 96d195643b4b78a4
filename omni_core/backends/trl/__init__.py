"""TRL as a training backend: an `sft` or `rl` stage with `backend: {name: trl, ...}` runs TRL's
SFTTrainer, GRPOTrainer or DPOTrainer on Ray Train (docs/trl.md).

- options.py   the `backend:` options (`TrlBackend`); pydantic only
- render.py    the stage's keys -> TRL's trainer and config fields (plain values, no TRL import)
- stage.py     what TRL cannot honour: config errors naming the key
- fields.py    TRL's config classes' fields, read from its source (`omni validate` checks the overrides)
- backend.py   the `Backend` protocol; runner.py the driver (Ray Train's TorchTrainer); worker.py what
               each Ray Train worker runs (imports TRL); data.py, rewards.py, checkpoints.py its parts
"""

from omni_core.backends.trl.options import TrlBackend
from omni_core.config.backends import BackendRecord, register_backend

register_backend(BackendRecord(
    name="trl", options=TrlBackend, implementation="omni_core.backends.trl.backend:BACKEND",
    usage="write backend: {name: trl, num_workers: N}",
    description="{name: trl, num_workers, use_gpu, resources_per_worker, num_threads, vllm_mode, overrides}: "
                "TRL's SFT / GRPO / DPO trainers on Ray Train"))

__all__ = ["TrlBackend"]
