"""The model factory, the built-in tiny://lm model and the log-prob helper."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omni_core.errors import ModelError
from omni_core.models import load_model, sequence_logprobs, tiny_model_dir

BUILD_FILES = [
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "README.md",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("omni-cache")


@pytest.fixture(scope="session")
def lm_dir(cache_dir) -> Path:
    return tiny_model_dir("lm", cache_dir=cache_dir)


@pytest.fixture
def lm(lm_dir, cache_dir, monkeypatch):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(cache_dir))
    return load_model("tiny://lm")


def test_tiny_dir_layout_and_model_card(lm_dir, cache_dir):
    assert lm_dir.parent == cache_dir / "tiny"
    assert lm_dir.name.startswith("lm-") and len(lm_dir.name) == len("lm-") + 12
    for name in BUILD_FILES:
        assert (lm_dir / name).is_file(), name
    card = (lm_dir / "README.md").read_text()
    assert "Random weights, not a trained model" in card
    assert tiny_model_dir("lm", cache_dir=cache_dir) == lm_dir  # cached: same directory
    assert tiny_model_dir("lm", seed=1, cache_dir=cache_dir) != lm_dir  # the seed is in the recipe


def test_build_is_byte_identical_in_a_fresh_process(lm_dir, tmp_path):
    code = "import sys; from omni_core.models import tiny_model_dir; print(tiny_model_dir(cache_dir=sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    other = Path(out.stdout.strip().splitlines()[-1])
    assert other != lm_dir and other.name == lm_dir.name
    for name in BUILD_FILES:
        assert (other / name).read_bytes() == (lm_dir / name).read_bytes(), name


def test_concurrent_builds_share_one_directory(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        dirs = list(pool.map(lambda _: tiny_model_dir("lm", cache_dir=tmp_path), range(2)))
    assert dirs[0] == dirs[1]
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == [dirs[0].name]  # no temp dirs left


def test_load_tiny_lm(lm, lm_dir, cache_dir, monkeypatch):
    model, tok = lm
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32 and not model.training
    cfg = model.config
    sizes = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert sizes == (64, 2, 4, 2)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    assert 500 <= len(tok) <= 2048
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    monkeypatch.setenv("OMNI_CACHE_DIR", str(cache_dir))
    start = time.perf_counter()
    load_model("tiny://lm")
    assert time.perf_counter() - start < 2.0


def test_chat_template_and_compact_gsm8k_tokens(lm):
    _, tok = lm
    question = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether? Let's think step by step and output the final "
        'answer after "####".'
    )
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    assert text == f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.eos_token_id in ids
    assert len(ids) < len(text) / 3  # words and "####" are merged, not spelled byte by byte
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("#### 72")["input_ids"]) == ["####", "Ġ", "7", "2"]


def test_generate_runs(lm):
    model, tok = lm
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 4)


def test_load_local_directory_and_file_uri(lm_dir):
    for uri in (str(lm_dir), f"file://{lm_dir}"):
        model, tok = load_model(uri)
        assert type(model).__name__ == "Qwen3ForCausalLM" and tok.eos_token == "<|im_end|>"


def test_load_from_an_s3_prefix(lm_dir, s3_bucket):
    from omni_core.storage import Store

    store = Store(f"s3://{s3_bucket}/models/lm")
    for path in sorted(p for p in lm_dir.rglob("*") if p.is_file()):
        store.write_bytes(path.relative_to(lm_dir).as_posix(), path.read_bytes())
    model, tok = load_model(f"s3://{s3_bucket}/models/lm")
    local, _ = load_model(str(lm_dir))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), local.state_dict().values(), strict=True))
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.parametrize(
    ("uri", "needle"),
    [
        ("tiny://nope", "tiny://lm"),
        ("./no/such/model/dir", "config.json"),
        ("", "tiny://"),
        ("not a uri!", "hub id"),
    ],
)
def test_bad_uris_raise_model_error(uri, needle):
    with pytest.raises(ModelError) as info:
        load_model(uri)
    message = str(info.value)
    assert needle in message and repr(uri) in message


def test_directory_without_config_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        load_model(str(tmp_path))


class _TableLM(torch.nn.Module):
    """logits[b, t] = table[input_ids[b, t]]: the next-token distribution depends on the last token."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.tensor(table).log()

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return SimpleNamespace(logits=self.table[input_ids])


def test_sequence_logprobs_by_hand():
    # after token 0: uniform; after 1: (1, 2, 3)/6; after 2: (4, 1, 5)/10
    model = _TableLM([[1.0, 1.0, 1.0], [1.0, 2.0, 3.0], [4.0, 1.0, 5.0]])
    input_ids = torch.tensor([[0, 1, 2, 1], [2, 2, 0, 0]])
    attention = torch.ones_like(input_ids)
    response = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    out = sequence_logprobs(model, input_ids, attention, response)
    expected = torch.tensor(
        [
            [0.0, 0.0, math.log(3 / 6), math.log(1 / 10)],
            [0.0, math.log(5 / 10), math.log(4 / 10), 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)


def test_sequence_logprobs_left_padding_matches_unpadded(lm):
    model, tok = lm
    prompt, response = tok("How many eggs?")["input_ids"], tok(" 12 eggs")["input_ids"]
    ids = torch.tensor([prompt + response])
    mask = torch.ones_like(ids)
    resp = torch.tensor([[0] * len(prompt) + [1] * len(response)])
    pad = 3
    padded_ids = torch.cat([torch.full((1, pad), tok.pad_token_id), ids], dim=1)
    padded_mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), mask], dim=1)
    padded_resp = torch.cat([torch.zeros(1, pad, dtype=torch.long), resp], dim=1)
    with torch.no_grad():
        plain = sequence_logprobs(model, ids, mask, resp)
        padded = sequence_logprobs(model, padded_ids, padded_mask, padded_resp)
    torch.testing.assert_close(padded[:, pad:], plain, atol=1e-5, rtol=1e-5)
    assert (plain[resp == 1] < 0).all() and (plain[resp == 0] == 0).all()
