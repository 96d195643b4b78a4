"""The rollout engine interface over vLLM-Omni's `AsyncOmni` (GPU images only; docs/reference/rollout.md, docs/reference/gpu-images.md).

`VllmOmniEngine` is a `RolloutEngine`: callers `submit` / `agenerate` / `generate` requests and
`update_weights` between batches, exactly as with the native torch engines. The batching itself is
vLLM-Omni's: every submitted request goes straight to `AsyncOmni.generate` (an asyncio loop on a
thread of its own keeps them all in flight), and vLLM-Omni's scheduler packs compatible ones
according to the engine arguments rendered from our `EngineConfig`:

| EngineConfig                | vLLM-Omni engine argument    | VeRL-Omni override                                                  |
|-----------------------------|------------------------------|---------------------------------------------------------------------|
| `max_num_seqs`              | `max_num_seqs`               | `++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=N`|
| `step_execution`            | `step_execution` (diffusion) | `actor_rollout_ref.rollout.step_execution=true/false`               |
| `request_batch_max_wait_ms` | `request_batch_max_wait_ms`  | `++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.request_batch_max_wait_ms=X` |

`request_batch_max_wait_ms` is vLLM-Omni's own knob with our meaning (an admission window of the
diffusion request-level scheduler, default 0 there too; OmniDiffusionConfig /
`--request-batch-max-wait-ms`); it has no effect in step mode, and our EngineConfig already refuses
both at once. Autoregressive (`output_mode="ar"`) stages are vLLM's own engine, which always batches
at token steps (continuous batching): `step_execution` is a diffusion-stage option there and is not
passed, and an admission window does not exist (a ConfigError rather than a silently ignored value).
VeRL-Omni picks its AR server path with `engine_kwargs.vllm_omni.output_mode=ar` and takes the AR
batch size from `actor_rollout_ref.rollout.max_num_seqs` (as its Qwen3-Omni recipes do).

How VeRL-Omni drives the same engine (verl_omni/workers/rollout/vllm_rollout/vllm_omni_async_server.py,
at the commit of `.github/vllm_omni_pin.txt`), and what is mirrored here:

- construction: `AsyncOmni(model=..., **engine_args)`; `engine_kwargs.vllm_omni` entries override the
  rollout config's; `step_execution=True` is added when configured; AR stages get
  `logprobs_mode="processed_logprobs"` (log-probs after temperature/top-p, what the trainer recomputes);
- AR requests: `{"prompt_token_ids": ids, "multi_modal_data": ...}` with vLLM `SamplingParams`
  (`logprobs=0`: the sampled token's log-prob); the result's log-probs are
  `completion.logprobs[i][token_ids[i]].logprob`;
- diffusion requests: `{"prompt": ...}` / `{"prompt_token_ids": ...}` dicts with
  `OmniDiffusionSamplingParams`; keys that are not fields of that dataclass (FlowGRPO's `noise_level`,
  `sde_type`, `logprobs`, ...) go in its `extra_args`, which the trajectory-recording pipelines read
  (VeRL-Omni's, chosen with `custom_pipeline_args={"pipeline_class": ...}`); the result's image is
  `images[0]`, the per-step log-probs `trajectory_log_probs`, the trajectory `trajectory_latents` /
  `trajectory_timesteps` (a leading batch dimension of 1 is removed). A stock pipeline records no
  log-probs: then `RolloutResult.logprobs` is None;
- multi-stage pipelines take one sampling-params entry per stage: ours goes to the diffusion stage (the
  last) or the AR stage (the first), the others keep `default_sampling_params_list`;
- weights: VeRL-Omni streams buckets over ZMQ into a `worker_extension_cls` mixin that calls
  `pipeline.load_weights` (diffusion workers) or `model.load_weights` + `process_weights_after_loading`
  (AR workers), and swaps a tensor LoRA with `remove_lora` / `add_lora`. Here, in one process: full
  state dicts go through `collective_rpc("omni_core_load_weights", ...)` into `OmniCoreWorkerExtension`
  (the same two load paths); a LoRA adapter (`omni_core.models.lora_state_dict`, PEFT key names) is
  written as a PEFT adapter folder and later requests carry a fresh `LoRARequest` for it (vLLM loads an
  adapter by path the first time a request names its id); the previous one is removed.

`update_weights` waits for the requests in flight to finish, loads, bumps `policy_version`, then
releases the requests submitted meanwhile; every result carries the version it was generated with.

vllm-omni is imported lazily: without it (CPU machines, CI) constructing the engine raises a
ConfigError saying to install the `gpu` extra; the rendering functions work everywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from omni_core.errors import ConfigError
from omni_core.rollout.engine import EngineConfig, RolloutEngine, RolloutRequest, RolloutResult

logger = logging.getLogger(__name__)

OutputMode = Literal["diffusion", "ar"]
OUTPUT_MODES = ("diffusion", "ar")
ROLLOUT = "actor_rollout_ref.rollout"
WORKER_EXTENSION = "omni_core.rollout.vllm_omni.OmniCoreWorkerExtension"
LOAD_WEIGHTS_RPC = "omni_core_load_weights"
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts

__all__ = [
    "OmniARSampling",
    "OmniCoreWorkerExtension",
    "OmniDiffusionSampling",
    "VllmOmniApi",
    "VllmOmniEngine",
    "ar_result",
    "ar_sampling_kwargs",
    "diffusion_result",
    "diffusion_sampling_kwargs",
    "split_diffusion_sampling",
    "verl_omni_overrides",
    "vllm_omni_engine_kwargs",
]


# ---- sampling -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OmniARSampling:
    """Token sampling of an AR request (`omni_core.training.components.Sampling` works too: the
    fields are read by name, missing ones take these defaults). `greedy` means temperature 0."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 32
    greedy: bool = False
    logprobs: bool = True
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class OmniDiffusionSampling:
    """A diffusion request (the field names of `FlowGRPOConfig` where they overlap). `extra`: more
    `OmniDiffusionSamplingParams` fields or pipeline `extra_args`, as (name, value) pairs."""

    num_steps: int = 10
    guidance_scale: float = 4.5
    true_cfg_scale: float | None = None  # Qwen-Image's True-CFG weight (SD3 uses guidance_scale)
    height: int | None = None
    width: int | None = None
    negative_prompt: str | None = None
    noise_level: float = 0.7
    sde_type: str = "sde"
    logprobs: bool = True
    output_type: str | None = None  # "latent": the final latents instead of pixels (VeRL-Omni's key)
    extra: tuple[tuple[str, Any], ...] = ()


def ar_sampling_kwargs(sampling: Any, seed: int) -> dict[str, Any]:
    """vLLM `SamplingParams` keyword arguments of an AR request: the request's own `seed`, the
    sampled token's log-prob (`logprobs=0`) unless `sampling.logprobs` is False."""
    greedy = bool(getattr(sampling, "greedy", False))
    kwargs: dict[str, Any] = {
        "temperature": 0.0 if greedy else float(getattr(sampling, "temperature", 1.0)),
        "top_p": 1.0 if greedy else float(getattr(sampling, "top_p", 1.0)),
        "max_tokens": int(getattr(sampling, "max_new_tokens", 32)),
        "seed": int(seed),
        "logprobs": 0 if getattr(sampling, "logprobs", True) else None,
    }
    top_k = int(getattr(sampling, "top_k", 0) or 0)
    if top_k > 0 and not greedy:
        kwargs["top_k"] = top_k
    penalty = float(getattr(sampling, "repetition_penalty", 1.0))
    if penalty != 1.0:
        kwargs["repetition_penalty"] = penalty
    return kwargs


def diffusion_sampling_kwargs(sampling: Any, seed: int) -> dict[str, Any]:
    """The flat sampling keys of a diffusion request, before `split_diffusion_sampling` sorts them
    into `OmniDiffusionSamplingParams` fields and `extra_args`. One image per request, drawn from the
    request's own `seed`."""
    kwargs: dict[str, Any] = {
        "num_inference_steps": int(getattr(sampling, "num_steps", 10)),
        "guidance_scale": float(getattr(sampling, "guidance_scale", 4.5)),
        "seed": int(seed),
        "num_outputs_per_prompt": 1,
        "noise_level": float(getattr(sampling, "noise_level", 0.7)),
        "sde_type": getattr(sampling, "sde_type", "sde"),
        "logprobs": bool(getattr(sampling, "logprobs", True)),
    }
    for name in ("true_cfg_scale", "height", "width", "output_type"):
        value = getattr(sampling, name, None)
        if value is not None:
            kwargs[name] = value
    kwargs.update(dict(getattr(sampling, "extra", ()) or ()))
    return kwargs


def split_diffusion_sampling(kwargs: Mapping[str, Any], fields: set[str]) -> dict[str, Any]:
    """Keyword arguments of `OmniDiffusionSamplingParams`: its `fields` as they are, everything else
    in `extra_args` (VeRL-Omni's rule; the trajectory pipelines read noise_level, sde_type, logprobs there)."""
    params = {k: v for k, v in kwargs.items() if k in fields and k != "extra_args"}
    extra = {k: v for k, v in kwargs.items() if k not in fields}
    params["extra_args"] = {**dict(kwargs.get("extra_args") or {}), **extra}
    return params


# ---- engine arguments and VeRL-Omni overrides -----------------------------------------------------


def _check_mode(output_mode: str) -> None:
    if output_mode not in OUTPUT_MODES:
        raise ConfigError(f"vllm_omni output_mode={output_mode!r}: must be one of {', '.join(OUTPUT_MODES)}")


def _check_ar(config: EngineConfig) -> None:
    if config.request_batch_max_wait_ms > 0:
        raise ConfigError(
            f"rollout request_batch_max_wait_ms={config.request_batch_max_wait_ms} with vLLM-Omni's AR engine: "
            "the admission window exists only for diffusion stages (vLLM batches tokens continuously); "
            "set request_batch_max_wait_ms=0")


def vllm_omni_engine_kwargs(config: EngineConfig, output_mode: OutputMode = "diffusion") -> dict[str, Any]:
    """The `AsyncOmni` engine arguments our EngineConfig determines (see the module table)."""
    _check_mode(output_mode)
    if output_mode == "ar":
        _check_ar(config)
        return {"max_num_seqs": config.max_num_seqs}
    kwargs: dict[str, Any] = {"max_num_seqs": config.max_num_seqs, "step_execution": config.step_execution}
    if not config.step_execution:
        kwargs["request_batch_max_wait_ms"] = float(config.request_batch_max_wait_ms)
    return kwargs


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def verl_omni_overrides(config: EngineConfig, output_mode: OutputMode = "diffusion") -> list[str]:
    """VeRL-Omni (Hydra) command-line overrides for the same settings, e.g. for a diffusion recipe
    `actor_rollout_ref.rollout.step_execution=false`,
    `++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=32` and, with a window,
    `++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.request_batch_max_wait_ms=10`.
    AR (the omni trainer, whose rollout config has no step_execution key):
    `actor_rollout_ref.rollout.max_num_seqs=N` and `++...engine_kwargs.vllm_omni.output_mode=ar`."""
    _check_mode(output_mode)
    engine = f"++{ROLLOUT}.engine_kwargs.vllm_omni"
    if output_mode == "ar":
        _check_ar(config)
        return [f"{ROLLOUT}.max_num_seqs={config.max_num_seqs}", f"{engine}.output_mode=ar"]
    overrides = [f"{ROLLOUT}.step_execution={'true' if config.step_execution else 'false'}",
                 f"{engine}.max_num_seqs={config.max_num_seqs}"]
    if config.request_batch_max_wait_ms > 0:
        overrides.append(f"{engine}.request_batch_max_wait_ms={_number(config.request_batch_max_wait_ms)}")
    return overrides


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    for allowed in _VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ConfigError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {_VLLM_LORA_RANKS[-1]}")


# ---- outputs -> RolloutResult --------------------------------------------------------------------


def _unbatch(value: Any) -> Any:
    """One request's entry of a trajectory field: a leading batch dimension of 1 is removed."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if isinstance(value, Tensor):
        return value[0] if value.dim() >= 2 and value.shape[0] == 1 else value
    if isinstance(value, (list, tuple)):
        return value[0] if len(value) == 1 else value
    return value


def _request_output(output: Any) -> Any:
    return getattr(output, "request_output", None) or output


def _finish_reason(output: Any) -> str | None:
    inner = _request_output(output)
    outputs = getattr(inner, "outputs", None)
    if outputs:
        return getattr(outputs[0], "finish_reason", None)
    return getattr(inner, "finish_reason", None)


def ar_result(request: RolloutRequest, output: Any, policy_version: int) -> RolloutResult:
    """A RolloutResult of a finished AR request, laid out as `omni_core.rollout.autoregressive.ARengine`'s:
    `output` the response token ids (a list), `logprobs` their log-probs (1-D float32; None when not
    requested), `text` the decoded response, `extra` the finish reason and the prompt ids."""
    inner = _request_output(output)
    outputs = getattr(inner, "outputs", None)
    if not outputs:
        raise RuntimeError(f"vLLM-Omni returned no completion for request {request.request_id}")
    completion = outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    logprobs = None
    if getattr(completion, "logprobs", None) is not None:
        logprobs = torch.tensor([step[token_ids[i]].logprob for i, step in enumerate(completion.logprobs)],
                                dtype=torch.float32)
    extra: dict[str, Any] = {"finish_reason": getattr(completion, "finish_reason", None)}
    prompt_ids = getattr(inner, "prompt_token_ids", None)
    if prompt_ids is not None:
        extra["prompt_ids"] = list(prompt_ids)
    return RolloutResult(request.request_id, request.seed, policy_version, token_ids, logprobs, extra,
                         text=getattr(completion, "text", None))


def _pixels(image: Any) -> Tensor:
    """A PIL image, an HWC array or a CHW tensor as float32 [C, H, W] in [-1, 1] (the native engines'
    and SD3Model's range); uint8 input is read as 0..255, float input as [0, 1]."""
    if isinstance(image, Tensor):
        pixels = image.detach().cpu()
    else:
        array = np.array(image)  # a writable copy (PIL's buffer is read-only)
        if array.ndim == 2:
            array = array[..., None]
        pixels = torch.from_numpy(array).permute(2, 0, 1).contiguous()
    if pixels.dtype != torch.uint8:
        pixels = (pixels.float().clamp(0, 1) * 255).round().to(torch.uint8)  # VeRL-Omni's quantisation
    return pixels.float() / 127.5 - 1.0


def diffusion_result(request: RolloutRequest, output: Any, policy_version: int) -> RolloutResult:
    """A RolloutResult of a finished diffusion request, laid out as
    `omni_core.rollout.diffusion.DiffusionEngine`'s: `output` the image as float32 [C, H, W] in [-1, 1]
    (the float latents with `output_type="latent"`), `logprobs` the per-step log-probs (1-D float32,
    None from a pipeline that records none), `extra` the trajectory (`latents` [S + 1, ...],
    `timesteps`) and any rollout metadata the pipeline returned."""
    images = getattr(output, "images", None)
    if not images:
        raise RuntimeError(f"vLLM-Omni returned no image for request {request.request_id} "
                           f"(finish_reason={_finish_reason(output)!r})")
    image = images[0]
    if isinstance(image, Mapping):
        image = next(image[k] for k in ("image", "video", "output") if image.get(k) is not None)
    if isinstance(image, (list, tuple)):  # (video, audio) pipelines: the visual stream
        image = image[0]
    if getattr(request.sampling, "output_type", None) == "latent":
        pixels = (image if isinstance(image, Tensor) else torch.from_numpy(np.array(image))).float()
    else:
        pixels = _pixels(image)
    logprobs = getattr(output, "trajectory_log_probs", None)
    if logprobs is not None:
        logprobs = torch.as_tensor(_unbatch(logprobs)).float().reshape(-1)
    extra: dict[str, Any] = {"finish_reason": _finish_reason(output)}
    for name, key in (("trajectory_latents", "latents"), ("trajectory_timesteps", "timesteps")):
        value = getattr(output, name, None)
        if value is not None:
            extra[key] = _unbatch(value)
    metadata = (getattr(output, "multimodal_output", None) or {}).get("metadata")
    if isinstance(metadata, Mapping):
        for group in ("prompt_embeddings", "rl"):
            for key, value in (metadata.get(group) or {}).items():
                extra.setdefault(key, _unbatch(value))
    return RolloutResult(request.request_id, request.seed, policy_version, pixels, logprobs, extra)


# ---- weights ---------------------------------------------------------------------------------------


def is_lora_state_dict(weights: Mapping[str, Any]) -> bool:
    """True for a PEFT adapter state dict (every key a lora_A / lora_B matrix)."""
    return bool(weights) and all(".lora_A." in k or ".lora_B." in k for k in weights)


def write_peft_adapter(weights: Mapping[str, Tensor], path: Path, *, rank: int, alpha: float,
                       base_model: str) -> Path:
    """`weights` (`omni_core.models.lora_state_dict`: PEFT's saved key names) as a PEFT adapter folder
    (adapter_model.safetensors + adapter_config.json), the format vLLM's LoRA loader reads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in weights})
    save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()},
              str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": modules, "bias": "none",
              "lora_dropout": 0.0, "base_model_name_or_path": base_model, "modules_to_save": None,
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "task_type": None}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


class OmniCoreWorkerExtension:
    """Mixed into vLLM-Omni's workers (engine argument `worker_extension_cls`, as VeRL-Omni's
    vLLMOmniColocateWorkerExtension): loads a full state dict sent by `VllmOmniEngine.load_weights`."""

    def omni_core_load_weights(self, weights: list[tuple[str, Tensor]]) -> int:
        runner = getattr(self, "model_runner", None)
        pipeline = getattr(runner, "pipeline", None)
        if pipeline is not None and hasattr(pipeline, "load_weights"):  # a diffusion worker
            pipeline.load_weights(iter(weights))
            return len(weights)
        model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
        if model is None or not hasattr(model, "load_weights"):
            raise RuntimeError("this vLLM-Omni worker has neither a diffusion pipeline nor a model with load_weights")
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model.load_weights(weights=iter(weights))
        process_weights_after_loading(model, runner.model_config, self.device)  # type: ignore[attr-defined]
        return len(weights)


# ---- the engine ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmOmniApi:
    """The vLLM-Omni classes the engine uses (imported lazily by `VllmOmniApi.load`)."""

    engine_cls: Any  # AsyncOmni
    sampling_cls: Any  # vllm SamplingParams (AR) | OmniDiffusionSamplingParams (diffusion)
    lora_request_cls: Any  # vllm LoRARequest (AR) | vllm_omni LoRARequest (diffusion)

    @classmethod
    def load(cls, output_mode: OutputMode) -> VllmOmniApi:
        if importlib.util.find_spec("vllm_omni") is None:
            raise ConfigError(
                "rollout engine vllm_omni needs the vllm-omni package, which is not installed here: install the "
                "gpu extra (pip install -e '.[gpu]', on a CUDA machine; the CUDA image has it) or use the native "
                "torch engines (omni_core.rollout.diffusion / omni_core.rollout.autoregressive)")
        try:
            from vllm_omni.entrypoints import AsyncOmni

            if output_mode == "ar":
                from vllm import SamplingParams
                from vllm.lora.request import LoRARequest
            else:
                from vllm_omni.inputs.data import OmniDiffusionSamplingParams as SamplingParams
                from vllm_omni.lora.request import LoRARequest
        except ImportError as exc:
            raise ConfigError(f"vllm-omni is installed but does not import ({exc}); reinstall the gpu extra "
                              "(its vllm / vllm-omni pins must match, see pyproject.toml)") from exc
        return cls(AsyncOmni, SamplingParams, LoRARequest)

    def sampling_fields(self) -> set[str]:
        if dataclasses.is_dataclass(self.sampling_cls):
            return {f.name for f in dataclasses.fields(self.sampling_cls)}
        return {name for name in dir(self.sampling_cls) if not name.startswith("_")}


class VllmOmniEngine(RolloutEngine):
    """The RolloutEngine interface over vLLM-Omni's AsyncOmni (see the module docstring).

    `model`: a hub id or local folder; `output_mode`: "diffusion" (images, per-step log-probs) or
    "ar" (tokens, per-token log-probs); `engine_kwargs`: more AsyncOmni arguments (tensor parallelism,
    `custom_pipeline_args`, `stage_configs_path`, ...; not the three EngineConfig ones); `lora`: the
    LoRA spec of the trained adapter (`{rank, alpha}`) when `update_weights` will push adapters;
    `weight_prefix` is put before every full-weight name (e.g. "transformer." when a diffusion
    pipeline names its DiT that way). `api` replaces the lazily imported vLLM-Omni classes (tests).
    """

    supports_step_execution = True  # vLLM-Omni schedules both modes itself

    def __init__(self, model: str, config: EngineConfig | None = None, *, output_mode: OutputMode = "diffusion",
                 engine_kwargs: Mapping[str, Any] | None = None, lora: Any = None, weight_prefix: str = "",
                 api: VllmOmniApi | None = None):
        config = config or EngineConfig()
        rendered = vllm_omni_engine_kwargs(config, output_mode)
        clashes = sorted(set(engine_kwargs or {}) & {"max_num_seqs", "step_execution", "request_batch_max_wait_ms"})
        if clashes:
            raise ConfigError(f"vllm_omni engine_kwargs {clashes}: set these through the rollout's EngineConfig "
                              "(max_num_seqs, step_execution, request_batch_max_wait_ms)")
        self.api = api or VllmOmniApi.load(output_mode)
        self.model_name, self.output_mode, self.weight_prefix = model, output_mode, weight_prefix
        self.lora = None
        if lora is not None:
            from omni_core.models.lora import LoraSpec

            self.lora = LoraSpec.parse(lora)
        self.engine_args: dict[str, Any] = {"model": model, "worker_extension_cls": WORKER_EXTENSION, **rendered}
        if output_mode == "ar":
            self.engine_args["logprobs_mode"] = "processed_logprobs"
            if self.lora is not None:
                self.engine_args.update(enable_lora=True, max_loras=1,
                                        max_lora_rank=vllm_max_lora_rank(self.lora.rank))
        self.engine_args.update(engine_kwargs or {})

        super().__init__(config)  # the base scheduler thread stays idle: requests bypass it
        self.stats["max_in_flight"] = 0
        self._gate = threading.Condition()
        self._inflight = 0
        self._updating = False
        self._held: list[tuple[RolloutRequest, Future]] = []
        self._tasks: set[Future] = set()
        self._lora_request: Any = None
        self._lora_version = 0
        self._lora_dir: Path | None = None
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="VllmOmniEngine-loop", daemon=True)
        self._loop_thread.start()
        try:
            self.client = self._call(self._make_client())
        except BaseException:
            self.close()
            raise

    async def _make_client(self) -> Any:
        return self.api.engine_cls(**self.engine_args)  # on the loop thread: AsyncOmni's tasks live there

    def _call(self, coroutine: Any) -> Any:
        """Run `coroutine` on the engine's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    # ---- callers ------------------------------------------------------------------------------

    def submit(self, request: RolloutRequest) -> Future:
        """Send `request` to vLLM-Omni now (or right after a weight update in progress); thread-safe."""
        outer: Future = Future()
        with self._gate:
            if self._closed:
                raise RuntimeError("rollout engine is closed")
            if self._updating:
                self._held.append((request, outer))
            else:
                self._dispatch(request, outer)
        return outer

    def update_weights(self, weights: dict[str, Any], version: int) -> None:
        """Wait for the requests in flight, load `weights`, set `policy_version`; requests submitted
        meanwhile start after it, with the new weights."""
        with self._gate:
            while self._updating:
                self._gate.wait()
            self._updating = True
            while self._inflight:
                self._gate.wait()
        try:
            self.load_weights(weights)
            self.policy_version = version
        finally:
            with self._gate:
                self._updating = False
                held, self._held = self._held, []
                for request, outer in held:
                    self._dispatch(request, outer)
                self._gate.notify_all()

    def load_weights(self, weights: dict[str, Any]) -> None:
        """A LoRA adapter state dict becomes the adapter of later requests; a full state dict is loaded
        into every worker."""
        if is_lora_state_dict(weights):
            self._load_lora(weights)
            return
        named = [(self.weight_prefix + name, torch.as_tensor(t).detach().to("cpu")) for name, t in weights.items()]
        self._call(self.client.collective_rpc(LOAD_WEIGHTS_RPC, args=(named,)))

    def close(self) -> None:
        if getattr(self, "_loop", None) is None or self._loop.is_closed():
            super().close()
            return
        with self._gate:
            super().close()
            held, self._held = self._held, []
            tasks = list(self._tasks)
        for _, outer in held:
            if outer.set_running_or_notify_cancel():
                outer.set_exception(RuntimeError("rollout engine closed before the request ran"))
        for task in tasks:
            task.cancel()
        client = getattr(self, "client", None)
        if client is not None and hasattr(client, "shutdown"):
            try:
                self._call(self._shutdown(client))
            except Exception:  # the engine is going away either way
                logger.warning("vLLM-Omni shutdown failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join()
        self._loop.close()
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    @staticmethod
    async def _shutdown(client: Any) -> None:
        client.shutdown()

    # ---- internals ----------------------------------------------------------------------------

    def _dispatch(self, request: RolloutRequest, outer: Future) -> None:
        """Start `request` on the loop (the caller holds `_gate`)."""
        if not outer.set_running_or_notify_cancel():
            return
        self._inflight += 1
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self._inflight)
        inner = asyncio.run_coroutine_threadsafe(
            self._generate(request, self.policy_version, self._lora_request), self._loop)
        self._tasks.add(inner)
        inner.add_done_callback(lambda done: self._finished(done, outer))

    def _finished(self, inner: Future, outer: Future) -> None:
        with self._gate:
            self._inflight -= 1
            self._tasks.discard(inner)
            self._gate.notify_all()
        if inner.cancelled():
            outer.set_exception(RuntimeError("rollout engine closed before the request finished"))
        elif inner.exception() is not None:
            outer.set_exception(inner.exception())
        else:
            outer.set_result(inner.result())

    async def _generate(self, request: RolloutRequest, version: int, lora_request: Any) -> RolloutResult:
        prompt = self._prompt(request)
        params = self._sampling_params(request, lora_request)
        kwargs: dict[str, Any] = {"prompt": prompt, "request_id": request.request_id,
                                  "sampling_params_list": self._stage_params(params)}
        if self.output_mode == "ar" and lora_request is not None:
            kwargs["lora_request"] = lora_request
        final = None
        async for output in self.client.generate(**kwargs):
            final = output
        if final is None:
            raise RuntimeError(f"vLLM-Omni yielded no output for request {request.request_id}")
        self.stats["finished"] = self.stats.get("finished", 0) + 1  # vLLM-Omni does not report its forwards
        convert = ar_result if self.output_mode == "ar" else diffusion_result
        return convert(request, final, version)

    def _prompt(self, request: RolloutRequest) -> dict[str, Any]:
        """Token ids, a text, or a ready vLLM-Omni prompt dict (multi_modal_data, extra ids, ...)."""
        prompt = request.prompt
        if hasattr(prompt, "token_ids") and hasattr(prompt, "media"):  # omni_core.rollout.autoregressive.ARPrompt
            if prompt.media:
                raise TypeError(f"request {request.request_id}: vLLM-Omni takes raw media, not processor tensors "
                                f"({', '.join(prompt.media)}); give the prompt as a dict with prompt_token_ids "
                                "and multi_modal_data ({'image': [PIL images], 'audio': [...]})")
            prompt = prompt.token_ids
        if isinstance(prompt, Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            out: dict[str, Any] = {"prompt": prompt}
        elif isinstance(prompt, Mapping):
            out = dict(prompt)
        elif isinstance(prompt, Sequence):
            out = {"prompt_token_ids": [int(t) for t in prompt]}
        else:
            raise TypeError(f"request {request.request_id}: prompt must be a str, token ids or a dict, "
                            f"not {type(prompt).__name__}")
        negative = getattr(request.sampling, "negative_prompt", None)
        if self.output_mode == "diffusion" and negative is not None:
            out.setdefault("negative_prompt", negative)
        return out

    def _sampling_params(self, request: RolloutRequest, lora_request: Any) -> Any:
        if self.output_mode == "ar":
            return self.api.sampling_cls(**ar_sampling_kwargs(request.sampling, request.seed))
        params = split_diffusion_sampling(diffusion_sampling_kwargs(request.sampling, request.seed),
                                          self.api.sampling_fields())
        if lora_request is not None:
            params["lora_request"] = lora_request
        return self.api.sampling_cls(**params)

    def _stage_params(self, params: Any) -> list[Any]:
        """One entry per pipeline stage: ours on the diffusion (last) or AR (first) stage."""
        defaults = list(getattr(self.client, "default_sampling_params_list", None) or [])
        if len(defaults) <= 1:
            return [params]
        return [params, *defaults[1:]] if self.output_mode == "ar" else [*defaults[:-1], params]

    def _load_lora(self, weights: Mapping[str, Tensor]) -> None:
        if self.lora is None:
            raise ConfigError("update_weights got LoRA adapter weights but the vllm_omni engine was built without "
                              "lora={rank, alpha}: pass the trained adapter's LoRA spec to VllmOmniEngine")
        if self._lora_dir is None:
            self._lora_dir = Path(tempfile.mkdtemp(prefix="omni-vllm-lora-"))
        self._lora_version += 1
        path = write_peft_adapter(weights, self._lora_dir / f"v{self._lora_version}", rank=self.lora.rank,
                                  alpha=self.lora.alpha, base_model=self.model_name)
        previous = self._lora_request
        self._lora_request = self.api.lora_request_cls(
            lora_name=f"omni_core_policy_v{self._lora_version}", lora_int_id=self._lora_version, lora_path=str(path))
        if previous is not None:
            try:  # free the old adapter's slot; vLLM would also evict it when the slots run out
                self._call(self.client.collective_rpc("remove_lora", args=(previous.lora_int_id,)))
            except Exception:
                logger.warning("could not remove LoRA adapter %s from vLLM-Omni", previous.lora_name, exc_info=True)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
