"""An eval stage with `engine: vllm_omni`: the responses from vLLM-Omni's AsyncOmni (GPU images only), here
up to the engine's start: the requests it would get (prompt ids, seeds, sampling) against a stand-in
for AsyncOmni (as tests/test_rollout_vllm_omni.py drives the engine), the weights never loaded into
torch, and on this CPU machine the eval job stops at the engine's start naming the missing package."""

from __future__ import annotations

import pytest
from test_backend_verl_stage import error_of
from test_rollout_vllm_omni import fake_api

from omni_core.errors import ConfigError
from omni_core.evaluation.job import TEXT, EvalJob, ModelSpec, run_eval_job
from omni_core.evaluation.text import vllm_omni_responses
from omni_core.storage import Store
from omni_core.training.components import encode_prompt_inputs, rollout_seed

ROWS = [{"prompt": [{"role": "user", "content": text}], "data_source": "digits_rotate",
         "reward_model": {"style": "rule", "ground_truth": "21"}} for text in ("12", "345", "6")]


def job(tmp_path, **settings) -> EvalJob:
    base = {"engine": "vllm_omni", "n": 2, "batch_size": 2, "greedy": False, "temperature": 0.7, "top_p": 0.9,
            "max_new_tokens": 5, "max_prompt_tokens": 64}
    return EvalJob(kind=TEXT, candidate=ModelSpec("tiny://lm", seed=0), rows=ROWS, seed=3,
                   store=Store(str(tmp_path / "store")), settings={**base, **settings}, reward="digits")


def test_the_requests_are_the_native_engines_and_the_responses_come_back_in_row_order(tmp_path):
    the_job = job(tmp_path)
    text_io = the_job.candidate.load_text_io()
    engines = []
    api = fake_api("ar")
    real_engine_cls = api.engine_cls

    class Recording(real_engine_cls):  # keeps the stand-in for the assertions below
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            engines.append(self)

    texts = vllm_omni_responses(the_job, text_io, api=type(api)(Recording, api.sampling_cls, api.lora_request_cls))
    seeds = [rollout_seed(3, 0, row, j) for row in range(3) for j in range(2)]
    assert texts == [f"text {seed}" for seed in seeds]  # the stand-in's answer is a function of the seed
    [client] = engines
    assert client.kwargs["max_num_seqs"] == 4  # batch_size x n
    assert "/tiny/lm-" in client.kwargs["model"] and client.shut_down  # the tiny build's local folder
    prompts, _ = encode_prompt_inputs(text_io, ROWS, 64)
    by_seed = {call["params"][0].kwargs["seed"]: call for call in client.calls}
    for index, seed in enumerate(seeds):
        call = by_seed[seed]
        assert call["prompt"] == {"prompt_token_ids": prompts[index // 2]}
        assert call["params"][0].kwargs == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 5, "seed": seed,
                                            "logprobs": 0}


def test_on_a_machine_without_vllm_omni_the_eval_stops_at_the_engines_start(tmp_path):
    with pytest.raises(ConfigError, match="rollout engine vllm_omni needs the vllm-omni package"):
        run_eval_job(job(tmp_path))


def _pipeline(tmp_path, stage: dict, **eval_keys) -> dict:
    return {"name": "p", "store": str(tmp_path / "s"), "datasets": {
        "ocr": {"source": "fixtures://ocr?rows=8", "converter": "ocr"},
        "digits": {"source": "fixtures://digits?rows=8", "converter": "digits"}},
        "stages": [stage, {"name": "eval", "kind": "eval", "after": [stage["name"]], "engine": "vllm_omni",
                           **eval_keys}]}


def test_what_the_vllm_omni_eval_cannot_score_is_refused(tmp_path):
    flow = {"name": "flow", "kind": "rl", "model": "tiny://sd3", "data": "ocr:train",
            "algorithm": {"name": "flow_grpo"}, "reward": {"name": "jpeg_compressibility"}}
    assert "stages.eval.engine: vllm_omni scores a language model's responses here; 'flow' trains a " \
           "text-to-image diffusion model: use engine: native" in error_of(_pipeline(tmp_path, flow, data="ocr:test"))
    grpo = {"name": "rl", "kind": "rl", "model": "tiny://lm", "data": "digits:train", "reward": {"name": "digits"}}
    assert "stages.eval.baseline: scored by engine native only" in error_of(
        _pipeline(tmp_path, grpo, data="digits:test", baseline=True))
