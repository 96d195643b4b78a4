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
from omni_core.evaluation.text import encode_batch, engine_responses, generate_responses, lean_responses
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


@pytest.mark.parametrize("max_prompt_tokens", [64, 12])
def test_the_lean_path_encodes_its_rows_as_the_engine(lm, max_prompt_tokens: int) -> None:
    _, tokenizer = lm
    assert encode_batch(tokenizer, ROWS, max_prompt_tokens) == encode_prompts(tokenizer, ROWS, max_prompt_tokens)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampled_responses_are_the_engines(lm, top_p: float) -> None:
    model, tokenizer = lm
    settings = dict(SETTINGS, greedy=False, temperature=0.8, top_p=top_p, n=2)
    lean = lean_responses(model, tokenizer, ROWS, settings, seed=5)
    assert lean == engine_responses(model, tokenizer, ROWS, settings, seed=5)
    assert len(set(lean)) > len(ROWS)  # seeds differ per (row, response)
    assert lean != lean_responses(model, tokenizer, ROWS, settings, seed=6)


@pytest.mark.parametrize("sampling", [ARSampling(temperature=1.0, max_new_tokens=12),
                                      ARSampling(temperature=0.7, top_p=0.9, max_new_tokens=12),
                                      ARSampling(greedy=True, max_new_tokens=12)], ids=["t1", "top-p", "greedy"])
def test_responses_that_stop_early_are_the_engines(lm, sampling: ARSampling) -> None:
    """With the third token of five of eight responses as extra EOS tokens, responses end at different
    steps (kept up to their EOS) and the finished ones leave the batch once they are half of it.
    `decode_with_logprobs` (a GRPO rollout worker's) gives the same tokens and the log-prob of each as
    the engine records it: the engine drops a finished row at once, this batch keeps it until half are
    done, so a later forward's floats may differ in the last bits; the tokens drawn do not."""
    model, tokenizer = lm
    prompts = encode_prompts(tokenizer, ROWS + ROWS[:3], 64)
    seeds = list(range(21, 29))
    free = lean_decode.decode(model, prompts, sampling, seeds, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    eos = [tokenizer.eos_token_id] + [free[i][2] for i in range(5)]
    lean = lean_decode.decode(model, prompts, sampling, seeds, eos, tokenizer.pad_token_id)
    with ARengine(model, tokenizer, EngineConfig(max_num_seqs=8), eos_token_ids=eos) as engine, engine._lock:
        results = engine.run_requests([RolloutRequest(p, sampling, seed=s) for p, s in zip(prompts, seeds, strict=True)])
    assert lean == [r.output for r in results]
    assert sum(len(o) <= 3 for o in lean) >= 5
    assert sampling.greedy or max(len(o) for o in lean) == 12  # greedy's repeat their early tokens: all end
    assert all(o[-1] in eos for o in lean if len(o) < 12)
    with_logprobs = lean_decode.decode_with_logprobs(model, prompts, sampling, seeds, eos, tokenizer.pad_token_id)
    assert [tokens for tokens, _ in with_logprobs] == lean
    for (tokens, logprobs), result in zip(with_logprobs, results, strict=True):
        assert len(logprobs) == len(tokens)
        torch.testing.assert_close(torch.tensor(logprobs), result.logprobs, atol=1e-5, rtol=0)


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
    model = small_qwen3()
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


# ---- speculative decoding (prompt lookup): the same responses as one token a step ----------------

SPECULATIVE = [ARSampling(greedy=True, max_new_tokens=24), ARSampling(temperature=1.0, max_new_tokens=24),
               ARSampling(temperature=0.7, top_p=0.9, max_new_tokens=24)]


@pytest.mark.parametrize("sampling", SPECULATIVE, ids=["greedy", "sampled", "top-p"])
def test_speculative_responses_are_one_token_a_steps(lm, sampling: ARSampling) -> None:
    """Prompts of different lengths; drafts accepted (rows gain more than one token a forward), also
    while sampling: the k-th response token is drawn with the k-th uniform either way."""
    model, tokenizer = lm
    prompts = encode_prompts(tokenizer, ROWS + ROWS[:3], 64)
    seeds, eos, pad = list(range(40, 48)), [tokenizer.eos_token_id], tokenizer.pad_token_id
    plain = lean_decode.decode(model, prompts, sampling, seeds, eos, pad, speculate=0)
    for speculate in (1, 3, 8):
        stats: dict[str, int] = {}
        assert lean_decode.decode(model, prompts, sampling, seeds, eos, pad, speculate=speculate, stats=stats) == plain
        assert stats["tokens"] == sum(len(o) - 1 for o in plain)  # every token after the prefill's (no EOS)
        if sampling.greedy and speculate == 8:  # a random-weight model repeats itself: drafts are kept
            assert stats["tokens"] > 4 * stats["row_steps"] and stats["forwards"] < 24 / 4


def test_speculative_responses_stopping_early_are_the_engines(lm) -> None:
    """Sampled, with extra EOS tokens taken from the responses at positions 2 and 5."""
    model, tokenizer = lm
    sampling = SPECULATIVE[1]
    prompts = encode_prompts(tokenizer, ROWS + ROWS[:3], 64)
    seeds, pad = list(range(21, 29)), tokenizer.pad_token_id
    free = lean_decode.decode(model, prompts, sampling, seeds, [tokenizer.eos_token_id], pad, speculate=0)
    eos = [tokenizer.eos_token_id] + [free[i][2] for i in range(2)] + [free[i][5] for i in range(2, 5)]
    lean = lean_decode.decode(model, prompts, sampling, seeds, eos, pad, speculate=8)
    with ARengine(model, tokenizer, EngineConfig(max_num_seqs=8), eos_token_ids=eos) as engine, engine._lock:
        results = engine.run_requests([RolloutRequest(p, sampling, seed=s) for p, s in zip(prompts, seeds, strict=True)])
    assert lean == [r.output for r in results]
    assert any(3 < len(o) <= 6 for o in lean) and all(o[-1] in eos for o in lean if len(o) < 24)


def small_qwen3():
    """A random Qwen3 as checkpoints have them (head_dim not hidden / heads, untied LM head, 3 layers):
    its greedy responses run into cycles longer than one token, unlike tiny://lm's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).eval()


def test_an_eos_inside_a_forwards_drafts_ends_the_response_there(monkeypatch) -> None:
    """Greedy, EOS 44: some response meets it inside a forward (kept drafts before it, drawn tokens after
    it), and every response is one token a step's (cut after its EOS)."""
    model = small_qwen3()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [20, 30, 40, 50, 60, 70, 80], [3, 3, 3, 4]]
    sampling = ARSampling(greedy=True, max_new_tokens=24)
    plain = lean_decode.decode(model, prompts, sampling, [0] * 5, [44], 0, speculate=0)
    drawn = []
    verify = lean_decode._State.verify
    monkeypatch.setattr(lean_decode._State, "verify", lambda self, *a: drawn.append(verify(self, *a)) or drawn[-1])
    assert lean_decode.decode(model, prompts, sampling, [0] * 5, [44], 0, speculate=8) == plain
    assert any(len(o) < 24 for o in plain) and all(o[-1] == 44 for o in plain if len(o) < 24)
    # greedy: the drawn tokens are the argmax; an EOS neither first nor last among a forward's draws
    assert any(bool((logits.argmax(-1)[:, 1:-1] == 44).any()) for logits in drawn)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 13])
def test_drafts_running_past_max_new_tokens_are_cut(lm, max_new_tokens: int) -> None:
    """More drafts than tokens left: the responses stop at max_new_tokens, as one token a step."""
    model, tokenizer = lm
    prompts = encode_prompts(tokenizer, ROWS, 64)
    sampling = ARSampling(greedy=True, max_new_tokens=max_new_tokens)
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    plain = lean_decode.decode(model, prompts, sampling, [0] * 5, eos, pad, speculate=0)
    assert lean_decode.decode(model, prompts, sampling, [0] * 5, eos, pad, speculate=8) == plain
    assert all(len(o) == max_new_tokens for o in plain)


@pytest.mark.parametrize("rows", [ROWS, ROWS[:1] * 5], ids=["left-padded", "no-padding"])
def test_a_verify_at_each_rows_position_gives_the_steps_logits(lm, rows: list) -> None:
    """Three tokens per row at its own response position (rotary angles, K/V columns and mask per row)
    after a verify that wrote drafts past it: the logits of feeding the tokens one step at a time, a
    float rounding apart at most (SDPA's kernel over several queries; without padding a step passes no
    mask and a verify must), so the same argmax."""
    model, tokenizer = lm
    ids, mask = left_pad(encode_prompts(tokenizer, rows, 64), tokenizer.pad_token_id)
    following = torch.tensor([[7, 9, 11, 13, 15, 17], [9, 9, 9, 9, 9, 9], [11, 5, 11, 5, 11, 5],
                              [13, 14, 15, 16, 17, 18], [15, 15, 16, 16, 17, 17]])
    first = torch.tensor([3, 1, 2, 3, 0])
    with torch.inference_mode():
        states = []
        for _ in range(2):
            cache = DynamicCache()
            model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache,
                  use_cache=True)
            states.append(lean_decode._State(model, cache, mask.bool(), steps=8))
        stepped = torch.stack([states[0].step(following[:, k], k) for k in range(6)], dim=1)
        states[1].verify(following[:, :4], torch.zeros(5, dtype=torch.long))
        index = first[:, None] + torch.arange(3)
        verified = states[1].verify(following.gather(1, index), first)
    expected = stepped.gather(1, index[..., None].expand(-1, -1, stepped.shape[-1]))
    torch.testing.assert_close(verified, expected, rtol=0, atol=1e-6)
    assert torch.equal(verified.argmax(-1), expected.argmax(-1))
