"""The autoregressive rollout engine on tiny://lm (and the tiny Qwen3-Omni thinker with media): a
sample's tokens and log-probs depend on its seed only, never on what it was batched with, and the
trainer's recomputed log-probs match the rollout's."""

from __future__ import annotations

import copy
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from omni_core.errors import ConfigError, ModelError
from omni_core.models import load_model, sequence_logprobs, tiny_model_dir
from omni_core.rollout import EngineConfig, RolloutRequest, RolloutResult
from omni_core.rollout.autoregressive import ARengine, ARPrompt, ARSampling

try:
    from omni_core.rollout.metrics import rollout_consistency
except ImportError:  # written in parallel: the same two numbers, computed here
    def rollout_consistency(rollout_logp, actor_logp, mask=None):
        keep = torch.ones_like(rollout_logp, dtype=torch.bool) if mask is None else mask.bool()
        p, q = actor_logp.double().exp()[keep], rollout_logp.double().exp()[keep]
        return {"training/rollout_probs_diff_mean": (p - q).abs().mean().item(),
                "training/rollout_actor_probs_pearson_corr": torch.corrcoef(torch.stack([p, q]))[0, 1].item()}


@pytest.fixture(scope="module", autouse=True)
def _env(tiny_model_env: Path) -> None:
    """Tiny models from the shared cache, one torch thread (conftest.tiny_model_env)."""


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny://lm")


QUESTION = "How many apples did Natalia sell altogether in April and May if she sold half"


@pytest.fixture(scope="module")
def prompts(lm) -> list[list[int]]:
    """Six chat prompts of different lengths (so batches are left-padded)."""
    _, tokenizer = lm
    words = QUESTION.split()
    out = []
    for n in (2, 9, 4, 14, 1, 6):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(words[:n])}],
                                            add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    assert len({len(p) for p in out}) == len(out)
    return out


SAMPLING = ARSampling(temperature=0.8, top_p=0.95, max_new_tokens=12)


def _requests(prompts, sampling=SAMPLING, seed0: int = 100) -> list[RolloutRequest]:
    return [RolloutRequest(p, sampling, seed=seed0 + i, request_id=f"r{i}") for i, p in enumerate(prompts)]


def _generate(lm, config: EngineConfig, requests, *, stagger_s: float = 0.0, **kwargs) -> tuple[list, ARengine]:
    model, tokenizer = lm
    with ARengine(model, tokenizer, config, **kwargs) as engine:
        futures = []
        for r in requests:
            futures.append(engine.submit(r))
            time.sleep(stagger_s)
        return [f.result(60) for f in futures], engine


@pytest.fixture(scope="module")
def stop_token(lm, prompts) -> int:
    """A token the random model samples often: as an extra EOS it ends responses at different lengths,
    so sequences leave batches early and step-level admits waiting ones mid-flight."""
    (probe,), _ = _generate(lm, EngineConfig(max_num_seqs=1), _requests(prompts[:1]))
    return probe.output[3]


def _same(a: list[RolloutResult], b: list[RolloutResult]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.request_id == y.request_id and x.output == y.output
        assert x.logprobs.dtype == torch.float32 and x.logprobs.shape == (len(x.output),)
        torch.testing.assert_close(x.logprobs, y.logprobs, rtol=0, atol=1e-5)


def test_samples_do_not_depend_on_the_batch(lm, prompts, stop_token) -> None:
    stop = {"eos_token_ids": [lm[1].eos_token_id, stop_token]}
    alone, _ = _generate(lm, EngineConfig(max_num_seqs=1), _requests(prompts), **stop)
    batched, engine = _generate(lm, EngineConfig(max_num_seqs=8), _requests(prompts), **stop)
    assert engine.stats["max_batch"] > 1
    _same(alone, batched)
    # step-level, 3 at a time: finished ones leave and waiting ones join mid-flight (lengths differ)
    stepped, engine = _generate(lm, EngineConfig(max_num_seqs=3, step_execution=True), _requests(prompts), **stop)
    assert engine.stats["max_batch"] == 3
    _same(alone, stepped)
    # and with staggered submissions: requests join whatever is running when they arrive
    staggered, _ = _generate(lm, EngineConfig(max_num_seqs=4, step_execution=True), _requests(prompts),
                             stagger_s=0.01, **stop)
    _same(alone, staggered)

    lengths = [len(r.output) for r in alone]
    assert len(set(lengths)) > 1 and max(lengths) == SAMPLING.max_new_tokens  # both ways of finishing
    for r in alone:
        assert r.extra["finish_reason"] == ("eos" if r.output[-1] == stop_token else "length")
        assert stop_token not in r.output[:-1]
    assert alone[0].extra["prompt_ids"] == prompts[0] and alone[0].text == lm[1].decode(alone[0].output,
                                                                                        skip_special_tokens=True)


def test_the_seed_alone_decides(lm, prompts) -> None:
    same = [RolloutRequest(prompts[1], SAMPLING, seed=s, request_id=str(i)) for i, s in enumerate([7, 7, 8])]
    a, b, c = _generate(lm, EngineConfig(max_num_seqs=4), same)[0]
    assert a.output == b.output and a.output != c.output
    # greedy ignores the seed and agrees with transformers' own generate (the KV-cache loop is right)
    greedy = ARSampling(greedy=True, max_new_tokens=8)
    results, _ = _generate(lm, EngineConfig(max_num_seqs=4, step_execution=True),
                           _requests(prompts[:3], greedy, seed0=1) + _requests(prompts[2:3], greedy, seed0=50))
    assert results[2].output == results[3].output
    model, tokenizer = lm
    with torch.no_grad():
        for r, p in zip(results, prompts[:3], strict=False):
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            assert r.output == out[0, len(p):].tolist()


def _trainer_batch(results: list[RolloutResult], pad: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, response_mask, rollout_logp) as the trainer's RolloutBatch lays them
    out: prompts left-padded, responses right-padded."""
    width_p = max(len(r.extra["prompt_ids"]) for r in results)
    width_r = max(len(r.output) for r in results)
    ids, attention, response, logp = [], [], [], torch.zeros(len(results), width_p + width_r)
    for i, r in enumerate(results):
        p, o = r.extra["prompt_ids"], r.output
        lead, tail = width_p - len(p), width_r - len(o)
        ids.append([pad] * lead + p + o + [pad] * tail)
        attention.append([0] * lead + [1] * (len(p) + len(o)) + [0] * tail)
        response.append([0] * width_p + [1] * len(o) + [0] * tail)
        logp[i, width_p:width_p + len(o)] = r.logprobs
    return torch.tensor(ids), torch.tensor(attention), torch.tensor(response), logp


def _check_consistency(model, results, pad: int, temperature: float, **media) -> None:
    ids, attention, response, rollout_logp = _trainer_batch(results, pad)
    with torch.no_grad():
        actor_logp = sequence_logprobs(model, ids, attention, response, temperature=temperature, **media)
    metrics = rollout_consistency(rollout_logp, actor_logp, response)
    assert metrics["training/rollout_actor_probs_pearson_corr"] >= 0.9999
    assert metrics["training/rollout_probs_diff_mean"] < 1e-4
    torch.testing.assert_close(actor_logp, rollout_logp, rtol=0, atol=1e-4)


def test_the_trainer_recomputes_the_rollout_logprobs(lm, prompts) -> None:
    model, tokenizer = lm
    hot = ARSampling(temperature=0.7, top_p=0.9, max_new_tokens=10)
    results, _ = _generate(lm, EngineConfig(max_num_seqs=3, step_execution=True), _requests(prompts, hot),
                           stagger_s=0.005)
    _check_consistency(model, results, tokenizer.pad_token_id, 0.7)
    assert all(math.isfinite(x) and x <= 0 for r in results for x in r.logprobs.tolist())


def test_weight_pushes(lm, prompts) -> None:
    model, tokenizer = lm
    own = copy.deepcopy(model)
    request = _requests(prompts[:1])
    with ARengine(own, tokenizer, EngineConfig()) as engine:
        before = engine.generate(request)[0]
        name = "model.layers.0.self_attn.q_proj.weight"  # a subset, as a LoRA push is
        engine.update_weights({name: own.state_dict()[name] * 3}, version=2)
        after = engine.generate(request)[0]
        assert after.policy_version == 2 and after.logprobs.tolist() != before.logprobs.tolist()
        with pytest.raises(ModelError, match="does not have"):
            engine.update_weights({"lora_A.nope": torch.zeros(1)}, version=3)
        with pytest.raises(ModelError, match="empty prompt"):
            engine.generate([RolloutRequest([], SAMPLING, seed=0)])
        assert engine.policy_version == 2
    with pytest.raises(ConfigError, match="temperature"):
        ARSampling(temperature=0.0)
    with pytest.raises(ConfigError, match="top_p"):
        ARSampling(top_p=1.5)


def test_concurrent_callers_in_step_mode(lm, prompts) -> None:
    """Callers on several threads; each gets its own result, the same as alone."""
    alone, _ = _generate(lm, EngineConfig(max_num_seqs=1), _requests(prompts[:4]))
    model, tokenizer = lm
    out: dict[str, RolloutResult] = {}
    with ARengine(model, tokenizer, EngineConfig(max_num_seqs=4, step_execution=True)) as engine:
        def call(r: RolloutRequest) -> None:
            out[r.request_id] = engine.submit(r).result(60)
        threads = [threading.Thread(target=call, args=(r,)) for r in _requests(prompts[:4])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _same(alone, [out[r.request_id] for r in alone])


# ---- Qwen3-Omni thinker with image and audio prompts -----------------------------------------------


def test_media_prompts_on_the_omni_thinker(model_cache: Path) -> None:
    from omni_core.data.avqa import AVQAConverter
    from omni_core.data.sources import resolve_source
    from omni_core.models.multimodal_inputs import collate_media, media_token_ids
    from omni_core.training.components import encode_prompt_inputs

    tiny_model_dir("qwen3-omni", cache_dir=model_cache)
    model, processor = load_model("tiny://qwen3-omni", adapter="qwen3_omni_thinker")
    raw = resolve_source("fixtures://avqa?rows=2&seed=0")
    converter = AVQAConverter()
    rows = [converter.convert(r, "train", i, raw) for i, (_, _, r) in enumerate(converter.records(raw, "train"))]
    text_only = {**rows[1], "prompt": [{**m, "content": m["content"].replace("<image>", "").replace("<audio>", "")}
                                       for m in rows[1]["prompt"]], "images": [], "audios": []}
    ids, media = encode_prompt_inputs(processor, [rows[0], text_only], 512)  # image + audio, text only
    assert "pixel_values" in media[0] and "input_features" in media[0] and media[1] == {}
    sampling = ARSampling(max_new_tokens=5)
    requests = [RolloutRequest(ARPrompt(i, m), sampling, seed=3 + k, request_id=str(k))
                for k, (i, m) in enumerate(zip(ids, media, strict=True))]
    alone, _ = _generate((model, processor), EngineConfig(max_num_seqs=1), requests)
    together, engine = _generate((model, processor), EngineConfig(max_num_seqs=2, step_execution=True), requests)
    assert engine.stats["max_batch"] == 2
    _same(alone, together)
    banned = set(media_token_ids(processor.tokenizer))
    assert not banned & {t for r in alone for t in r.output}  # media tokens are never sampled
    assert all(alone[0].extra["media"][k] is v for k, v in media[0].items()) and "media" not in alone[1].extra
    _check_consistency(model, alone, processor.tokenizer.pad_token_id, 1.0, **collate_media(media))


def test_forwards_counts_model_calls(lm, prompts) -> None:
    """One prefill plus one decode forward per further token, for the whole batch at once."""
    sampling = ARSampling(temperature=0.8, max_new_tokens=5)
    results, engine = _generate(lm, EngineConfig(max_num_seqs=8), _requests(prompts, sampling),
                                eos_token_ids=[-1])  # no EOS: every response runs to max_new_tokens
    assert all(len(r.output) == 5 for r in results)
    # (the scheduler may start a batch before every request is queued: still 5 forwards a batch)
    assert engine.stats["batches"] < len(prompts) and engine.stats["forwards"] == 5 * engine.stats["batches"]
    _, serial = _generate(lm, EngineConfig(max_num_seqs=1), _requests(prompts, sampling), eos_token_ids=[-1])
    assert serial.stats["forwards"] == 5 * len(prompts)
