"""The eval's lean decode (`omni_core.rollout.lean_decode`) on tiny://lm: the same responses as the
engine path (greedy and sampled with seeds, prompts of different lengths, responses ending early),
greedy as HF `generate`, and the same logits as the model's own forward."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from omni_core.errors import ConfigError
from omni_core.evaluation.text import engine_responses, generate_responses, lean_responses
from omni_core.models import load_model
from omni_core.rollout import EngineConfig, RolloutRequest, lean_decode
from omni_core.rollout.autoregressive import ARengine, ARSampling
from omni_core.training.components import encode_prompts, left_pad


@pytest.fixture(scope="module", autouse=True)
def _env(tiny_model_env: Path) -> None:
    """Tiny models from the shared cache, one torch thread (conftest.tiny_model_env)."""


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny://lm")


QUESTION = "How many apples did Natalia sell altogether in April and May if she sold half as many"
ROWS = [{"prompt": [{"role": "user", "content": " ".join(QUESTION.split()[:n])}]} for n in (3, 11, 1, 16, 7)]
SETTINGS = {"n": 1, "batch_size": 3, "max_prompt_tokens": 64, "max_new_tokens": 10, "temperature": 1.0,
            "top_p": 1.0, "greedy": True}


def test_it_covers_text_only_qwen3(lm) -> None:
    model, tokenizer = lm
    assert lean_decode.supports(model, tokenizer)
    assert not lean_decode.supports(model, SimpleNamespace(tokenizer=tokenizer))  # a processor: the engine's
    assert not lean_decode.supports(torch.nn.Linear(2, 2), tokenizer)
    with pytest.raises(ConfigError, match="temperature"):  # the engine's checks
        lean_responses(model, tokenizer, ROWS, dict(SETTINGS, greedy=False, temperature=0.0), seed=0)


def test_greedy_is_the_engines_and_generates(lm) -> None:
    model, tokenizer = lm
    prompts = encode_prompts(tokenizer, ROWS, 64)
    assert len({len(p) for p in prompts}) == len(prompts)  # left padding in every batch
    lean = lean_responses(model, tokenizer, ROWS, SETTINGS, seed=0)
    assert lean == engine_responses(model, tokenizer, ROWS, SETTINGS, seed=0)
    assert lean == generate_responses(model, tokenizer, ROWS, SETTINGS, seed=0)
    ids, mask = left_pad(prompts[:3], tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    assert lean[:3] == tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_responses_are_the_engines(lm, top_p: float) -> None:
    model, tokenizer = lm
    settings = dict(SETTINGS, greedy=False, temperature=0.8, top_p=top_p, n=2)
    lean = lean_responses(model, tokenizer, ROWS, settings, seed=5)
    assert lean == engine_responses(model, tokenizer, ROWS, settings, seed=5)
    assert len(set(lean)) > len(ROWS)  # seeds differ per (row, response)
    assert lean != lean_responses(model, tokenizer, ROWS, settings, seed=6)


@pytest.mark.parametrize("sampling", [ARSampling(temperature=1.0, max_new_tokens=12),
                                      ARSampling(temperature=0.7, top_p=0.9, max_new_tokens=12)])
def test_responses_that_stop_early_are_the_engines(lm, sampling: ARSampling) -> None:
    """With the third token of five of eight responses as extra EOS tokens, responses end at different
    steps (kept up to their EOS) and the finished ones leave the batch once they are half of it."""
    model, tokenizer = lm
    prompts = encode_prompts(tokenizer, ROWS + ROWS[:3], 64)
    seeds = list(range(21, 29))
    free = lean_decode.decode(model, prompts, sampling, seeds, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    eos = [tokenizer.eos_token_id] + [free[i][2] for i in range(5)]
    lean = lean_decode.decode(model, prompts, sampling, seeds, eos, tokenizer.pad_token_id)
    with ARengine(model, tokenizer, EngineConfig(max_num_seqs=8), eos_token_ids=eos) as engine, engine._lock:
        results = engine.run_requests([RolloutRequest(p, sampling, seed=s) for p, s in zip(prompts, seeds, strict=True)])
    assert lean == [r.output for r in results]
    assert sum(len(o) <= 3 for o in lean) >= 5 and max(len(o) for o in lean) == 12
    assert all(o[-1] in eos for o in lean if len(o) < 12)


@pytest.mark.parametrize("rows", [ROWS, ROWS[:1] * 5], ids=["left-padded", "no-padding"])
def test_a_step_gives_the_models_logits(lm, rows: list) -> None:
    """Bit for bit, with padding (SDPA on grouped query heads with a mask) and without (no mask)."""
    model, tokenizer = lm
    ids, mask = left_pad(encode_prompts(tokenizer, rows, 64), tokenizer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    following = torch.tensor([[7], [9], [11], [13], [15]])
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        state = lean_decode._State(model, cache, mask.bool(), steps=4)
        lean = state.step(following[:, 0], 0)
        logits = model(input_ids=following, attention_mask=torch.cat([mask, torch.ones_like(following)], dim=1),
                     position_ids=mask.sum(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
    assert torch.equal(lean, logits)


def test_a_step_gives_the_models_logits_for_real_qwen3_shapes() -> None:
    """As Qwen3 checkpoints have them: head_dim not hidden / heads, untied LM head, 3 layers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    model = Qwen3ForCausalLM(config).eval()
    assert lean_decode.supports(model, SimpleNamespace(eos_token_id=1))
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    ids, mask = left_pad(prompts, 0)
    following = torch.tensor([[20], [21], [22]])
    with torch.inference_mode():
        cache = DynamicCache()
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache,
              use_cache=True)
        lean = lean_decode._State(model, cache, mask.bool(), steps=2).step(following[:, 0], 0)
        logits = model(input_ids=following, attention_mask=torch.cat([mask, torch.ones_like(following)], dim=1),
                       position_ids=mask.sum(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
    assert torch.equal(lean, logits)
