"""`backend: {name: verl, device: cpu}`: the same verl command a GPU cluster runs, plus what verl 0.9.1
needs to run it on one CPU rank. Rendered here (our interpreter); the code that runs inside verl's
interpreter is in `runtime/` next to this file, never imported by ours:

- `runtime/omni_verl_cpu.py`: a `cpu` platform for verl (gloo, torch.cpu as the device module);
- `runtime/omni_verl_cpu_rollout.py`: main_ppo's rollout `omni_cpu` (transformers on CPU, a prompt's n
  samples generated together with per-sample seeds, the batch order made deterministic).

The job's env puts `runtime/` on PYTHONPATH and names both modules in `VERL_USE_EXTERNAL_MODULES` (verl
imports them in every process of the job), so the Ray nodes must see this folder at the same path (a
laptop's `ray start --head`, or the project installed at the same place on each node).

Overrides added after ours and before `backend.overrides`: fsdp2 (fsdp1 needs an accelerator), sdpa
attention, no torch.compile (its entropy kernel needs a C++ toolchain), `trainer.device=cpu`; for
main_ppo also the `omni_cpu` rollout with tensor parallel 1, one TransferQueue storage unit, one agent
loop and one reward worker (each asks Ray for a CPU; verl's defaults, 8 each, stall a small node),
the actor and reference in fp32 (verl's FSDP default is bf16 compute),
merged LoRA weights and `backend.python` as the Ray workers' interpreter. The Ray node needs at least 8 logical CPUs (`ray start --head --num-cpus 8`).
"""

from __future__ import annotations

from pathlib import Path

from omni_core.errors import ConfigError

RUNTIME_DIR = Path(__file__).resolve().with_name("runtime")
PLATFORM_MODULE = "omni_verl_cpu"
ROLLOUT_MODULE = "omni_verl_cpu_rollout"
ROLLOUT_NAME = "omni_cpu"
ROLLOUT = "actor_rollout_ref.rollout"

SFT_OVERRIDES = {"engine.strategy": "fsdp2", "++model.override_config.attn_implementation": "sdpa",
                 "trainer.device": "cpu", "data.num_workers": 0}
PPO_OVERRIDES = {
    f"{ROLLOUT}.name": ROLLOUT_NAME,
    f"{ROLLOUT}.tensor_model_parallel_size": 1,
    f"{ROLLOUT}.agent.num_workers": 1,
    "reward.num_workers": 1,
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
    "++actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
    "data.dataloader_num_workers": 0,
    "trainer.device": "cpu",
    # verl's FSDP engine computes in bf16 by default (a GPU speed trade): on CPU the actor and reference
    # compute in fp32, as the rollout does, so the rollout's log-probs are the actor's (bf16 was 2e-2 apart)
    **{f"++actor_rollout_ref.{role}.fsdp_config.mixed_precision.{part}_dtype": "fp32"
       for role in ("actor", "ref") for part in ("param", "reduce", "buffer")},
}
LORA_MERGE = "actor_rollout_ref.model.lora.merge"
PY_EXECUTABLE = "ray_kwargs.ray_init.runtime_env.py_executable"

# keys of backend.overrides the CPU rollout cannot honour -> why (a key, or a prefix ending in ".")
REFUSED = {
    f"{ROLLOUT}.name": "device cpu runs verl's rollout `omni_cpu`",
    f"{ROLLOUT}.mode": "the CPU rollout serves verl's async mode only",
    f"{ROLLOUT}.engine_kwargs.": "an option of vLLM's / SGLang's engine",
    f"{ROLLOUT}.gpu_memory_utilization": "a vLLM / SGLang memory option",
    f"{ROLLOUT}.enforce_eager": "a vLLM CUDA-graph option",
    f"{ROLLOUT}.cudagraph_capture_sizes": "a vLLM CUDA-graph option",
    f"{ROLLOUT}.enable_chunked_prefill": "a vLLM scheduler option",
    f"{ROLLOUT}.enable_prefix_caching": "a vLLM cache option",
    f"{ROLLOUT}.max_num_batched_tokens": "a vLLM scheduler option",
    f"{ROLLOUT}.quantization": "a vLLM quantization option",
    f"{ROLLOUT}.disaggregation.": "prefill/decode disaggregation is vLLM's / SGLang's",
    f"{ROLLOUT}.multi_turn.": "tool loops need an HTTP rollout server (the CPU rollout is called through Ray)",
    f"{ROLLOUT}.data_parallel_size": "the CPU rollout runs one replica of one rank",
    f"{ROLLOUT}.pipeline_model_parallel_size": "the CPU rollout runs one replica of one rank",
    f"{ROLLOUT}.expert_parallel_size": "the CPU rollout runs one replica of one rank",
    f"{ROLLOUT}.tensor_model_parallel_size": "the CPU rollout runs one replica of one rank",
    f"{ROLLOUT}.agent.num_workers": "more agent-loop workers reorder requests and need a CPU each",
    "trainer.v1.trainer_mode": "colocate_async / separate_async abort and resume generation mid-step, which "
                               "the CPU rollout does not; only sync runs",
    "trainer.nnodes": "the CPU platform trains on one rank (one replica); use backend.nnodes: 1",
    "trainer.n_gpus_per_node": "the CPU platform trains on one rank (one replica); use backend.n_gpus_per_node: 1",
    "trainer.device": "device cpu sets it",
    "actor_rollout_ref.actor.strategy": "the CPU platform trains with fsdp2",
    LORA_MERGE: "the CPU rollout takes merged weights only (unmerged LoRA adapters are vLLM's / SGLang's)",
}
SFT_REFUSED = {"engine.strategy": "the CPU platform trains with fsdp2", "trainer.device": "device cpu sets it",
               "trainer.nnodes": REFUSED["trainer.nnodes"], "trainer.n_gpus_per_node": REFUSED["trainer.n_gpus_per_node"]}


def override_key(override: str) -> str:
    """`key` of a Hydra override `key=value` / `+key=value` / `++key=value` / `~key`."""
    return override.split("=", 1)[0].lstrip("+~")


def cpu_problem(task: str, backend, fields_set: set[str] | frozenset[str]) -> str | None:
    """The first option of a `device: cpu` backend that a CPU run cannot honour, as `backend.KEY: why`."""
    if "rollout_engine" in fields_set:
        return (f"rollout_engine: {backend.rollout_engine}: device cpu generates with verl's `{ROLLOUT_NAME}` "
                "rollout (transformers on CPU); remove rollout_engine, or use device: gpu")
    for key in ("nnodes", "n_gpus_per_node"):
        if getattr(backend, key) != 1:
            return (f"{key}: {getattr(backend, key)}: device cpu trains on one rank with one rollout replica "
                    f"(more would sample through verl's random load balancer); set {key}: 1")
    refused = REFUSED if task != "sft" else SFT_REFUSED
    for item in backend.overrides:
        key = override_key(item)
        value = item.split("=", 1)[1].strip().lower() if "=" in item else ""
        allowed = (key == LORA_MERGE and value == "true") or (key == "trainer.v1.trainer_mode" and value == "sync") \
            or (key.endswith(("_parallel_size", "agent.num_workers")) and value == "1")
        for refused_key, why in refused.items():
            if not allowed and (key == refused_key or (refused_key.endswith(".") and key.startswith(refused_key))):
                return f"overrides: {item!r}: not honoured with device cpu ({why}); remove it, or use device: gpu"
    return None


def cpu_overrides(task: str, ours: dict[str, object], python: str) -> dict[str, object]:
    """Our overrides for a CPU run: `ours` with the CPU keys set (replacing the rollout engine's name).
    main_ppo's Ray workers get verl's interpreter (verl's `ray_init.runtime_env.py_executable`): a
    laptop's `ray start --head` may come from an environment without verl (ours)."""
    extra = SFT_OVERRIDES if task == "sft" else {**PPO_OVERRIDES, PY_EXECUTABLE: python}
    out = {**ours, **extra}
    if task != "sft" and ours.get("actor_rollout_ref.model.lora_rank"):
        out[LORA_MERGE] = True
    return out


def cpu_env(task: str, env: dict[str, str]) -> dict[str, str]:
    """The job's env for a CPU run: the runtime modules on PYTHONPATH (before a user's), then `env`."""
    modules = [PLATFORM_MODULE] if task == "sft" else [PLATFORM_MODULE, ROLLOUT_MODULE]
    user_path = env.get("PYTHONPATH")
    out = {"VERL_USE_EXTERNAL_MODULES": ",".join(modules), "VERL_ENGINE_DEVICE": "cuda", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "HYDRA_FULL_ERROR": "1", **env,
           "PYTHONPATH": str(RUNTIME_DIR) + (f":{user_path}" if user_path else "")}
    if "VERL_USE_EXTERNAL_MODULES" in env:
        raise ConfigError("backend.env.VERL_USE_EXTERNAL_MODULES: device cpu sets it to "
                          f"{','.join(modules)}; add your modules to PYTHONPATH and import them from a reward "
                          "function instead, or use device: gpu")
    return out
