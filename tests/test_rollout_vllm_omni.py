"""The vLLM-Omni engine (omni_core.rollout.vllm_omni): the engine arguments and VeRL-Omni overrides
rendered from an EngineConfig, the clear error without the package, and the engine itself driven
against a stand-in for AsyncOmni (its generate / collective_rpc contract as VeRL-Omni uses it): what
goes in (prompts, sampling params per stage, LoRA requests), what comes out (RolloutResult), and
weight updates between requests. The tests that need the real package skip without it."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.errors import ConfigError
from omni_core.rollout import EngineConfig, RolloutRequest
from omni_core.rollout.vllm_omni import (
    LOAD_WEIGHTS_RPC,
    WORKER_EXTENSION,
    OmniARSampling,
    OmniCoreWorkerExtension,
    OmniDiffusionSampling,
    VllmOmniApi,
    VllmOmniEngine,
    ar_sampling_kwargs,
    diffusion_sampling_kwargs,
    split_diffusion_sampling,
    verl_omni_overrides,
    vllm_max_lora_rank,
    vllm_omni_engine_kwargs,
)
from omni_core.training.components import Sampling

GPU_ONLY = "vllm-omni is a GPU-only dependency (the `gpu` extra, installed in the CUDA image), not in CPU CI"
HAS_VLLM_OMNI = importlib.util.find_spec("vllm_omni") is not None


# ---- rendering --------------------------------------------------------------------------------------


def test_engine_kwargs_and_verl_omni_overrides_follow_the_engine_config() -> None:
    request_level = EngineConfig(max_num_seqs=32, request_batch_max_wait_ms=10)
    assert vllm_omni_engine_kwargs(request_level) == {"max_num_seqs": 32, "step_execution": False,
                                                      "request_batch_max_wait_ms": 10.0}
    assert verl_omni_overrides(request_level) == [
        "actor_rollout_ref.rollout.step_execution=false",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=32",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.request_batch_max_wait_ms=10",
    ]
    # docs/reference/rollout.md's spelling for the defaults; no window, no window override
    assert verl_omni_overrides(EngineConfig(max_num_seqs=32)) == [
        "actor_rollout_ref.rollout.step_execution=false",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=32",
    ]
    assert verl_omni_overrides(EngineConfig(max_num_seqs=8, request_batch_max_wait_ms=2.5))[-1].endswith(
        "request_batch_max_wait_ms=2.5")
    step_level = EngineConfig(max_num_seqs=8, step_execution=True)
    assert vllm_omni_engine_kwargs(step_level) == {"max_num_seqs": 8, "step_execution": True}
    assert verl_omni_overrides(step_level) == [
        "actor_rollout_ref.rollout.step_execution=true",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=8",
    ]
    # AR: vLLM batches tokens continuously; the omni trainer's rollout config has no step_execution
    assert vllm_omni_engine_kwargs(EngineConfig(max_num_seqs=128), "ar") == {"max_num_seqs": 128}
    assert verl_omni_overrides(EngineConfig(max_num_seqs=128, step_execution=True), "ar") == [
        "actor_rollout_ref.rollout.max_num_seqs=128",
        "++actor_rollout_ref.rollout.engine_kwargs.vllm_omni.output_mode=ar",
    ]


def test_ar_has_no_admission_window_and_modes_are_checked() -> None:
    with pytest.raises(ConfigError, match="request_batch_max_wait_ms=5 with vLLM-Omni's AR engine"):
        vllm_omni_engine_kwargs(EngineConfig(request_batch_max_wait_ms=5), "ar")
    with pytest.raises(ConfigError, match="request_batch_max_wait_ms"):
        verl_omni_overrides(EngineConfig(request_batch_max_wait_ms=5), "ar")
    with pytest.raises(ConfigError, match="output_mode='video'"):
        verl_omni_overrides(EngineConfig(), "video")  # type: ignore[arg-type]
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 32, 33, 300)] == [1, 8, 8, 32, 64, 320]


def test_sampling_maps_to_vllm_and_diffusion_params() -> None:
    assert ar_sampling_kwargs(Sampling(temperature=0.7, top_p=0.9, max_new_tokens=12), seed=5) == {
        "temperature": 0.7, "top_p": 0.9, "max_tokens": 12, "seed": 5, "logprobs": 0}
    greedy = ar_sampling_kwargs(OmniARSampling(greedy=True, top_k=20, logprobs=False, repetition_penalty=1.1), 1)
    assert greedy == {"temperature": 0.0, "top_p": 1.0, "max_tokens": 32, "seed": 1, "logprobs": None,
                      "repetition_penalty": 1.1}
    flat = diffusion_sampling_kwargs(OmniDiffusionSampling(num_steps=10, guidance_scale=4.5, height=512, width=512,
                                                           extra=(("sde_window_size", 2),)), seed=9)
    assert flat == {"num_inference_steps": 10, "guidance_scale": 4.5, "seed": 9, "num_outputs_per_prompt": 1,
                    "noise_level": 0.7, "sde_type": "sde", "logprobs": True, "height": 512, "width": 512,
                    "sde_window_size": 2}
    params = split_diffusion_sampling(flat, {"num_inference_steps", "guidance_scale", "seed", "height", "width",
                                             "num_outputs_per_prompt", "extra_args"})
    assert params["extra_args"] == {"noise_level": 0.7, "sde_type": "sde", "logprobs": True, "sde_window_size": 2}
    assert params["num_inference_steps"] == 10 and "noise_level" not in params


@pytest.mark.skipif(HAS_VLLM_OMNI, reason="checks the error raised where vllm-omni is not installed")
def test_without_the_package_constructing_the_engine_says_to_install_the_gpu_extra() -> None:
    threads = threading.active_count()
    with pytest.raises(ConfigError, match=r"vllm-omni package, which is not installed.*gpu extra"):
        VllmOmniEngine("Qwen/Qwen-Image", EngineConfig(max_num_seqs=8))
    assert threading.active_count() == threads  # nothing was started


# ---- the engine against a stand-in for AsyncOmni ------------------------------------------------------


@dataclass
class FakeDiffusionParams:
    """The fields of OmniDiffusionSamplingParams the mapping uses (a dataclass, like the real one)."""

    num_inference_steps: int = 50
    guidance_scale: float = 0.0
    true_cfg_scale: float | None = None
    height: int | None = None
    width: int | None = None
    seed: int | None = None
    num_outputs_per_prompt: int = 1
    lora_request: Any = None
    extra_args: dict[str, Any] = field(default_factory=dict)


class FakeARParams:
    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs


@dataclass(frozen=True)
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str


class FakeAsyncOmni:
    """AsyncOmni's surface as VeRL-Omni drives it: generate (async generator of outputs), collective_rpc,
    default_sampling_params_list, shutdown. Outputs are functions of the request's seed."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs
        self.default_sampling_params_list = kwargs.pop("_stage_defaults", ["diffusion-defaults"])
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[dict[str, Any]] = []
        self.rpcs: list[tuple[str, tuple]] = []
        self.in_flight = self.max_in_flight = 0
        self.shut_down = False

    async def generate(self, *, prompt, request_id, sampling_params_list, lora_request=None):
        self.calls.append({"prompt": prompt, "request_id": request_id, "params": sampling_params_list,
                           "lora_request": lora_request})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.002)
            params = sampling_params_list[-1] if isinstance(sampling_params_list[-1], FakeDiffusionParams) \
                else sampling_params_list[0]
            yield SimpleNamespace(finished=False, images=[])  # an intermediate output: only the last counts
            yield self.output(params)
        finally:
            self.in_flight -= 1

    def output(self, params: Any) -> Any:
        if isinstance(params, FakeARParams):
            seed = params.kwargs["seed"]
            ids = [seed, seed + 1, 2]
            steps = [{t: SimpleNamespace(logprob=-0.5 * (i + 1)), 99: SimpleNamespace(logprob=-9.0)}
                     for i, t in enumerate(ids)]
            completion = SimpleNamespace(token_ids=ids, logprobs=steps, text=f"text {seed}", finish_reason="stop")
            return SimpleNamespace(request_output=SimpleNamespace(prompt_token_ids=[1, 2], outputs=[completion]))
        seed, steps = params.seed, params.num_inference_steps
        image = Image.fromarray(np.full((8, 6, 3), seed % 256, dtype=np.uint8))
        return SimpleNamespace(
            images=[image], request_output=None, finish_reason="stop",
            trajectory_log_probs=torch.arange(steps, dtype=torch.float64)[None] + seed,
            trajectory_latents=torch.zeros(1, steps + 1, 4, 2, 2),
            trajectory_timesteps=torch.linspace(1, 0, steps)[None],
            multimodal_output={"metadata": {"rl": {"prompt_len": torch.tensor([[7]])}}},
        )

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.rpcs.append((method, args))
        return [len(args[0])] if method == LOAD_WEIGHTS_RPC else [None]

    def shutdown(self) -> None:
        self.shut_down = True


def fake_api(output_mode: str = "diffusion") -> VllmOmniApi:
    sampling = FakeARParams if output_mode == "ar" else FakeDiffusionParams
    return VllmOmniApi(FakeAsyncOmni, sampling, FakeLoRARequest)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_diffusion_requests_all_reach_vllm_omni_with_our_batching_and_map_to_results() -> None:
    config = EngineConfig(max_num_seqs=4, request_batch_max_wait_ms=10)
    with VllmOmniEngine("Qwen/Qwen-Image", config, api=fake_api(),
                        engine_kwargs={"tensor_parallel_size": 2,
                                       "_stage_defaults": ["thinker-defaults", "diffusion-defaults"]}) as engine:
        client = engine.client
        assert client.kwargs == {"model": "Qwen/Qwen-Image", "worker_extension_cls": WORKER_EXTENSION,
                                 "max_num_seqs": 4, "step_execution": False, "request_batch_max_wait_ms": 10.0,
                                 "tensor_parallel_size": 2}
        client.gate.clear()
        sampling = OmniDiffusionSampling(num_steps=3, negative_prompt=" ", height=8, width=6)
        requests = [RolloutRequest("a cat" if i % 2 else [5, 6, 7], sampling, seed=i) for i in range(4)]
        futures = [engine.submit(r) for r in requests]
        wait_until(lambda: client.in_flight == 4)  # all in flight at once: vLLM-Omni does the batching
        client.gate.set()
        results = [f.result(10) for f in futures]
        assert engine.stats["max_in_flight"] == 4
    assert client.shut_down

    call = next(c for c in client.calls if c["request_id"] == requests[1].request_id)
    assert call["prompt"] == {"prompt": "a cat", "negative_prompt": " "}
    assert next(c for c in client.calls if c["request_id"] == requests[0].request_id)["prompt"] == {
        "prompt_token_ids": [5, 6, 7], "negative_prompt": " "}
    first, params = call["params"][0], call["params"][-1]
    assert first == "thinker-defaults" and len(call["params"]) == 2  # ours on the diffusion (last) stage
    assert (params.num_inference_steps, params.seed, params.height, params.width) == (3, 1, 8, 6)
    assert params.extra_args == {"noise_level": 0.7, "sde_type": "sde", "logprobs": True}
    for request, result in zip(requests, results, strict=True):
        assert (result.request_id, result.seed, result.policy_version) == (request.request_id, request.seed, 0)
        assert result.output.dtype == torch.float32 and result.output.shape == (3, 8, 6)
        assert result.output[0, 0, 0].item() == pytest.approx(request.seed / 127.5 - 1)  # [-1, 1], as natively
        assert result.logprobs.dtype == torch.float32 and result.logprobs.tolist() == [request.seed + j for j in
                                                                                        range(3)]
        assert result.extra["latents"].shape == (4, 4, 2, 2) and result.extra["timesteps"].shape == (3,)
        assert result.extra["prompt_len"].tolist() == [7] and result.extra["finish_reason"] == "stop"


def test_ar_requests_map_token_ids_log_probs_and_text() -> None:
    with VllmOmniEngine("Qwen/Qwen3-Omni-30B-A3B-Instruct", EngineConfig(max_num_seqs=16), output_mode="ar",
                        api=fake_api("ar")) as engine:
        assert engine.client.kwargs == {"model": "Qwen/Qwen3-Omni-30B-A3B-Instruct",
                                        "worker_extension_cls": WORKER_EXTENSION, "max_num_seqs": 16,
                                        "logprobs_mode": "processed_logprobs"}
        request = RolloutRequest([11, 12, 13], Sampling(temperature=0.8, max_new_tokens=3), seed=40)
        result = asyncio.run(engine.agenerate(request))
        call = engine.client.calls[0]
    assert call["prompt"] == {"prompt_token_ids": [11, 12, 13]} and call["lora_request"] is None
    assert call["params"][0].kwargs == {"temperature": 0.8, "top_p": 1.0, "max_tokens": 3, "seed": 40, "logprobs": 0}
    assert result.output == [40, 41, 2]  # as ARengine's results
    assert result.logprobs.tolist() == [-0.5, -1.0, -1.5]  # the sampled tokens', not the other candidates'
    assert result.text == "text 40" and result.extra == {"finish_reason": "stop", "prompt_ids": [1, 2]}


def test_native_engines_requests_carry_over() -> None:
    """Requests written for the native engines (ARPrompt-like prompts; DiffusionSampling's field names,
    read by name) go to vLLM-Omni unchanged; processed media tensors cannot."""
    with VllmOmniEngine("m", output_mode="ar", api=fake_api("ar")) as engine:
        prompt = SimpleNamespace(token_ids=[4, 5], media={})
        engine.generate([RolloutRequest(prompt, Sampling(greedy=True), seed=2)])
        assert engine.client.calls[-1]["prompt"] == {"prompt_token_ids": [4, 5]}
        assert engine.client.calls[-1]["params"][0].kwargs["temperature"] == 0.0
        with pytest.raises(TypeError, match="raw media"):
            engine.generate([RolloutRequest(SimpleNamespace(token_ids=[4], media={"pixel_values": torch.zeros(1)}),
                                            Sampling(), seed=0)])
    native = SimpleNamespace(num_steps=4, guidance_scale=4.5, noise_level=0.0, sde_type="cps", negative_prompt="",
                             height=None, width=None)
    with VllmOmniEngine("m", api=fake_api()) as engine:
        engine.generate([RolloutRequest("a fox", native, seed=1)])
        call = engine.client.calls[-1]
    assert call["prompt"] == {"prompt": "a fox", "negative_prompt": ""}
    params = call["params"][-1]
    assert (params.num_inference_steps, params.guidance_scale, params.height) == (4, 4.5, None)
    assert params.extra_args == {"noise_level": 0.0, "sde_type": "cps", "logprobs": True}


def test_update_weights_waits_for_requests_in_flight_and_results_carry_their_version() -> None:
    with VllmOmniEngine("sd3", EngineConfig(max_num_seqs=2), api=fake_api(), weight_prefix="transformer.") as engine:
        client, sampling = engine.client, OmniDiffusionSampling(num_steps=2)
        client.gate.clear()
        early = [engine.submit(RolloutRequest("p", sampling, seed=s)) for s in (1, 2)]
        wait_until(lambda: client.in_flight == 2)
        weights = {"blocks.0.weight": torch.ones(2, 2), "blocks.0.bias": torch.zeros(2)}
        update = threading.Thread(target=engine.update_weights, args=(weights, 1))
        update.start()
        wait_until(lambda: engine._updating)
        late = engine.submit(RolloutRequest("p", sampling, seed=3))  # held until the update is done
        time.sleep(0.05)
        assert update.is_alive() and client.rpcs == [] and len(client.calls) == 2
        client.gate.set()
        update.join(10)
        assert [f.result(10).policy_version for f in early] == [0, 0]
        assert late.result(10).policy_version == 1 and engine.policy_version == 1
        (method, args), = client.rpcs
        assert method == LOAD_WEIGHTS_RPC
        assert [name for name, _ in args[0]] == ["transformer.blocks.0.weight", "transformer.blocks.0.bias"]
        assert torch.equal(args[0][0][1], torch.ones(2, 2))


class TinyAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.v_proj, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.q_proj(x) * self.v_proj(x))


def test_lora_updates_become_peft_adapters_that_later_requests_name() -> None:
    from peft import PeftModel

    from omni_core.models.lora import LoraSpec, apply_lora, lora_state_dict

    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    trained = apply_lora(TinyAttention(), spec, [])
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    adapter = lora_state_dict(trained)
    with VllmOmniEngine("sd3", EngineConfig(), api=fake_api(), lora={"rank": 4, "alpha": 8}) as engine:
        engine.update_weights(adapter, 1)
        engine.generate([RolloutRequest("p", OmniDiffusionSampling(num_steps=2), seed=0)])
        first = engine.client.calls[-1]["params"][-1].lora_request
        assert (first.lora_name, first.lora_int_id) == ("omni_core_policy_v1", 1)
        # the folder is a PEFT adapter: loaded onto the base model it computes what the trained model does
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        loaded = PeftModel.from_pretrained(TinyAttention(), first.lora_path)
        torch.testing.assert_close(loaded(x), trained(x))
        engine.update_weights(adapter, 2)
        engine.generate([RolloutRequest("p", OmniDiffusionSampling(num_steps=2), seed=0)])
        second = engine.client.calls[-1]["params"][-1].lora_request
        assert second.lora_int_id == 2 and engine.client.rpcs == [("remove_lora", (1,))]
        assert not Path(first.lora_path).exists() and Path(second.lora_path).exists()
    assert not Path(second.lora_path).exists()  # close removes the adapters
    with VllmOmniEngine("sd3", api=fake_api()) as engine, pytest.raises(ConfigError, match="without lora"):
        engine.update_weights(adapter, 1)


def test_ar_lora_is_enabled_in_the_engine_and_sent_with_each_request() -> None:
    with VllmOmniEngine("m", output_mode="ar", api=fake_api("ar"), lora={"rank": 32, "alpha": 64}) as engine:
        assert engine.client.kwargs["enable_lora"] and engine.client.kwargs["max_lora_rank"] == 32
        engine.update_weights({"base_model.model.q_proj.lora_A.weight": torch.zeros(32, 8),
                               "base_model.model.q_proj.lora_B.weight": torch.zeros(8, 32)}, 3)
        engine.generate([RolloutRequest([1], OmniARSampling(max_new_tokens=2), seed=1)])
        assert engine.client.calls[-1]["lora_request"].lora_int_id == 1


def test_errors_reach_the_caller_and_close_fails_what_is_pending() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        VllmOmniEngine("m", api=fake_api(), engine_kwargs={"max_num_seqs": 4})
    engine = VllmOmniEngine("m", api=fake_api())
    with pytest.raises(TypeError, match="prompt must be"):
        engine.generate([RolloutRequest(3.5, OmniDiffusionSampling(), seed=0)])
    engine.client.gate.clear()
    pending = engine.submit(RolloutRequest("p", OmniDiffusionSampling(num_steps=1), seed=0))
    wait_until(lambda: engine.client.in_flight == 1)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        pending.result(10)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(RolloutRequest("p", OmniDiffusionSampling(), seed=0))


def test_worker_extension_loads_full_weights_into_a_diffusion_pipeline() -> None:
    loaded: list[tuple[str, torch.Tensor]] = []
    worker = OmniCoreWorkerExtension()
    worker.model_runner = SimpleNamespace(pipeline=SimpleNamespace(load_weights=lambda w: loaded.extend(w)))
    weights = [("transformer.a", torch.ones(1)), ("transformer.b", torch.zeros(2))]
    assert worker.omni_core_load_weights(weights) == 2 and [n for n, _ in loaded] == ["transformer.a", "transformer.b"]
    worker.model_runner = SimpleNamespace(pipeline=None, model=None)
    with pytest.raises(RuntimeError, match="neither a diffusion pipeline nor a model"):
        worker.omni_core_load_weights(weights)


# ---- with the real package (GPU images) ----------------------------------------------------------------


def test_the_real_classes_take_our_parameters() -> None:
    pytest.importorskip("vllm_omni", reason=GPU_ONLY)
    diffusion = VllmOmniApi.load("diffusion")
    params = diffusion.sampling_cls(**split_diffusion_sampling(
        diffusion_sampling_kwargs(OmniDiffusionSampling(num_steps=4, height=64, width=64), seed=3),
        diffusion.sampling_fields()))
    assert (params.num_inference_steps, params.seed, params.height) == (4, 3, 64)
    assert params.extra_args["noise_level"] == 0.7
    ar = VllmOmniApi.load("ar")
    sampling = ar.sampling_cls(**ar_sampling_kwargs(Sampling(temperature=0.9, max_new_tokens=5), seed=2))
    assert (sampling.max_tokens, sampling.seed, sampling.logprobs) == (5, 2, 0)
    lora = ar.lora_request_cls(lora_name="x", lora_int_id=1, lora_path="/tmp/x")
    assert lora.lora_int_id == 1


def test_real_engine_generates_with_log_probs() -> None:
    """End to end on a GPU with a small causal LM named by OMNI_VLLM_OMNI_AR_MODEL (a hub id or folder)."""
    pytest.importorskip("vllm_omni", reason=GPU_ONLY)
    import os

    model = os.environ.get("OMNI_VLLM_OMNI_AR_MODEL")
    if not model or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device and OMNI_VLLM_OMNI_AR_MODEL (a small causal LM) to run vLLM-Omni")
    with VllmOmniEngine(model, EngineConfig(max_num_seqs=4), output_mode="ar",
                        engine_kwargs={"gpu_memory_utilization": 0.3, "enforce_eager": True}) as engine:
        results = engine.generate([RolloutRequest([1, 2, 3], OmniARSampling(max_new_tokens=4), seed=s)
                                   for s in range(4)])
    for result in results:
        assert 1 <= len(result.output) <= 4 and result.logprobs.shape == (len(result.output),)
        assert (result.logprobs <= 0).all()
