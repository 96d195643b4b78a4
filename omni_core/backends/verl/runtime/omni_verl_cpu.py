"""A `cpu` platform for verl 0.9.1: verl's trainers (sft_trainer, main_ppo) on one CPU rank with gloo.

Runs inside verl's interpreter, never in ours: `backend: {name: verl, device: cpu}` puts this folder on
the job's PYTHONPATH and names the module first in `VERL_USE_EXTERNAL_MODULES`, and `import verl`
imports it in every process of the job (omni_core/backends/verl/cpu.py renders that). verl 0.9.1 has no
CPU platform (`utils/device.py` delegates to `verl.plugin.platform`, whose registry knows cuda, npu and
rocm, and falls back to cuda), so this module:

- registers a `cpu` platform in `verl.plugin.platform` and makes it the current one: gloo, one
  "device", `torch.cpu` as the device module, with no-op stand-ins for the `torch.cuda` calls verl
  makes that `torch.cpu` lacks (memory statistics, caches, seeds);
- replaces verl's process-group set-up, which builds the backend string `cpu:gloo,cpu:gloo` (torch
  rejects a device listed twice), with a plain gloo group;
- makes verl's `aggressive_empty_cache` a no-op: it releases an accelerator's cached memory after a full
  `gc.collect()` (sft_trainer calls it at every epoch and every save, the actor worker once at start-up),
  and a CPU has no such cache, while the collection of a process that imported torch, transformers and
  verl costs a good share of a tiny model's training step (the weights are the same byte for byte).

The job also needs (rendered with device cpu): `VERL_ENGINE_DEVICE=cuda` (verl registers its FSDP engine
for cuda and npu only; the engine itself then runs on the platform's device), strategy fsdp2 (fsdp1
needs an accelerator), `attn_implementation=sdpa` (the default is flash_attention_2) and
`trainer.device=cpu`. main_ppo's rollout is `omni_verl_cpu_rollout.py`, next to this file.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed
import verl.utils.distributed as verl_distributed
import verl.utils.memory_utils as verl_memory_utils
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform


def _noop(*_args, **_kwargs):
    return None


def _zero(*_args, **_kwargs):
    return 0


class _CPUDeviceModule(SimpleNamespace):
    """`torch.cpu` plus the `torch.cuda` functions verl calls on its device module."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name.startswith(("memory_", "max_memory", "reset_", "mem_get_info")):
            return (lambda *a, **k: (0, 0)) if name == "mem_get_info" else _zero
        if name in ("manual_seed", "manual_seed_all"):
            return torch.manual_seed
        if name in ("get_rng_state", "set_rng_state"):
            return getattr(torch, name)
        if name == "get_device_name":
            return lambda *a, **k: "CPU"  # verl's flops counter looks the name up in its table
        return _noop


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"

    @property
    def device_module(self):
        return _CPUDeviceModule()

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True

    def current_device(self) -> str:
        return "cpu"  # verl passes it to .to(device=...): an index would mean an accelerator

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_resource_options(self, num_gpus: float):
        return {"num_cpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self):
        return None


def initialize_global_process_group(timeout_second=36000):
    torch.distributed.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_second),
                                         init_method=os.environ.get("DIST_INIT_METHOD", None))
    return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def initialize_global_process_group_ray(timeout_second=None, backend=None):
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend="gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
            timeout=timedelta(seconds=timeout_second) if timeout_second is not None else None,
            init_method=os.environ.get("DIST_INIT_METHOD", None))


def aggressive_empty_cache(force_sync: bool = True, max_retries: int = 3) -> None:
    """verl's release of the accelerator's cached memory (verl.utils.memory_utils): nothing to release on CPU
    (module docstring). Bound before verl's trainer and workers import it by name."""


set_platform(PlatformCPU())
verl_memory_utils.aggressive_empty_cache = aggressive_empty_cache
verl_distributed.initialize_global_process_group = initialize_global_process_group
verl_distributed.initialize_global_process_group_ray = initialize_global_process_group_ray
