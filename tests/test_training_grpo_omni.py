"""GRPO/GSPO on the Qwen3-Omni thinker (tiny://qwen3-omni) with image and audio rows: the rollout
batch carries each row's media, generation and every log-prob forward see it, mini-batches keep it."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from omni_core.config import RLStage
from omni_core.data.avqa import AVQAConverter
from omni_core.data.media import tone_wav
from omni_core.data.mmk12 import MMK12Converter
from omni_core.data.sources import resolve_source
from omni_core.errors import ModelError
from omni_core.models import load_model, tiny_model_dir
from omni_core.training.components import (
    RolloutBatch,
    Sampling,
    encode_prompt_inputs,
    generate_rollouts,
    rollout_logprobs,
)
from omni_core.training.grpo_loop import GRPOTrainer
from omni_core.training.multimodal import MEDIA_MARKER, collate_media, media_token_ids

BY_LENGTH = str(Path(__file__).parent / "data" / "rewards.py") + ":by_length"
LM = "thinker.model.language_model."


@pytest.fixture(scope="module", autouse=True)
def _env(tiny_model_env: Path) -> None:
    """Tiny models in the shared cache (qwen3-omni built first), one torch thread (conftest.tiny_model_env)."""
    tiny_model_dir("qwen3-omni", cache_dir=tiny_model_env)


@pytest.fixture(scope="module")
def thinker() -> tuple[torch.nn.Module, object]:
    """(thinker-only Qwen3-Omni, its processor); tests that train take a deep copy."""
    return load_model("tiny://qwen3-omni", adapter="qwen3_omni_thinker")


def _convert(name: str, converter) -> list[dict]:
    raw = resolve_source(f"fixtures://{name}?rows=4&seed=0")
    return [converter.convert(record, "train", i, raw) for i, (_, _, record) in enumerate(converter.records(raw, "train"))]


@pytest.fixture(scope="module")
def rows() -> dict[str, list[dict]]:
    """verl RL rows: AVQA (an image and an audio clip each) and MMK12 (an image each)."""
    return {"avqa": _convert("avqa", AVQAConverter()), "mmk12": _convert("mmk12", MMK12Converter())}


def _drop(row: dict, kind: str, column: str) -> dict:
    """The row without its `kind` media (marker and bytes)."""
    prompt = [{**m, "content": m["content"].replace(f"<{kind}>", "")} for m in row["prompt"]]
    return {**row, "prompt": prompt, column: []}


@pytest.fixture(scope="module")
def mixed(thinker, rows) -> tuple[list[dict], RolloutBatch]:
    """Four prompts of different lengths and media, 2 responses each (left padding), generated with
    the rollout-time log-probs kept: image+audio, image only, a longer audio only, text only."""
    model, processor = thinker
    avqa, mmk12 = rows["avqa"], rows["mmk12"]
    audio_only = {**_drop(avqa[1], "image", "images"), "audios": [{"bytes": tone_wav(440.0, seconds=0.6)}]}
    prompts = [avqa[0], mmk12[0], audio_only, _drop(mmk12[1], "image", "images")]
    ids, media = encode_prompt_inputs(processor, prompts, 512)
    batch = generate_rollouts(model, processor, ids, media=media, n=2, sampling=Sampling(max_new_tokens=8), seed=3,
                              keep_logprobs=True)
    return prompts, batch


def _stage(data: str, algorithm: str, kl_beta: float = 0.0) -> RLStage:
    return RLStage(name="rl", model="tiny://qwen3-omni", data=data, algorithm={"name": algorithm, "kl_beta": kl_beta},
                   reward={"name": BY_LENGTH}, rollout={"n": 3, "max_new_tokens": 6},
                   trainer={"total_steps": 1, "batch_size": 2, "lr": 1e-2, "max_prompt_tokens": 512,
                            "ppo_mini_batch_size": 1})


# ---- a whole step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
@pytest.mark.parametrize("data", ["avqa", "mmk12"])
def test_a_step_trains_the_thinker_language_model(thinker, rows, data: str, algorithm: str) -> None:
    model, processor = thinker
    kl_beta = 0.01 if algorithm == "grpo" else 0.0  # grpo: with a frozen reference (k3 KL) seeing the media too
    trainer = GRPOTrainer(_stage(data, algorithm, kl_beta), rows[data], seed=0, model=copy.deepcopy(model),
                          text_io=processor)
    batch = trainer.generate(rows[data][:2], 0)
    assert batch.media is not None and len(batch.media) == 6 and all("pixel_values" in m for m in batch.media)
    assert all(("input_features" in m) == (data == "avqa") for m in batch.media)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    metrics = trainer.step()  # 2 mini-batches of one prompt each: two optimizer steps on selected rows

    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    if kl_beta:  # the second mini-batch's policy moved away from the reference
        assert 0 < metrics["actor/kl_loss"] < 1
    params = dict(trainer.model.named_parameters())
    lm = [n for n in params if n.startswith(LM)]
    assert lm and any(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in lm)
    assert all(params[n].grad is None or torch.isfinite(params[n].grad).all() for n in params)
    assert sum(not torch.equal(before[n], params[n]) for n in lm) > len(lm) // 2
    towers = [n for n in params if n.startswith(("thinker.model.visual.", "thinker.model.audio_tower."))]
    assert towers and all(torch.equal(before[n], params[n]) for n in towers)  # frozen by the adapter


# ---- the log-probs see the rollout's prompt, media and positions -------------------------------


def test_old_logprobs_equal_the_rollouts_and_unpadded_recomputations(thinker, rows, mixed) -> None:
    model, processor = thinker
    _, batch = mixed
    prompt_lengths = (batch.attention_mask - batch.response_mask).sum(1)
    assert len(set(prompt_lengths.tolist())) == 4 and (batch.attention_mask[:, 0] == 0).any()  # left padding
    media = batch.media_inputs()
    assert media["image_grid_thw"].shape[0] == 4 and media["input_features"].shape[0] == 4  # 2 rows each, x2
    assert (media["feature_attention_mask"] == 0).any()  # audio clips of different lengths: padded frames

    trainer = GRPOTrainer(_stage("avqa", "grpo"), rows["avqa"], seed=0, model=model, text_io=processor)
    with torch.no_grad():
        old = trainer.logprobs(batch)  # what step() records as old_log_prob
    mask = batch.response_mask.bool()
    assert mask.sum() > 0 and (old[mask] < 0).all() and (old[~mask] == 0).all()
    # the log-probs generate sampled from (KV cache, its own 3-D positions) equal the recomputation
    torch.testing.assert_close(old, batch.rollout_logp, atol=1e-5, rtol=0)

    for i in range(len(batch.responses)):  # each row alone, without padding: the same log-probs
        keep = batch.attention_mask[i].bool()
        alone = RolloutBatch(batch.input_ids[i:i + 1, keep], batch.attention_mask[i:i + 1, keep],
                             batch.response_mask[i:i + 1, keep], batch.responses[i:i + 1], batch.group_ids[i:i + 1],
                             batch.media[i:i + 1])
        with torch.no_grad():
            torch.testing.assert_close(rollout_logprobs(model, alone)[0], old[i, keep], atol=1e-5, rtol=0)

    # the text-only positions (cumsum - 1) would be wrong for every token after an image
    with torch.no_grad():
        position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids,
                       **media).logits
    wrong = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    assert (wrong - old[:, 1:])[mask[:, 1:]].abs().max() > 1e-3


def _replace_media(processor, prompts: list[dict], batch: RolloutBatch, prompt: int, **columns) -> RolloutBatch:
    """`batch` with prompt `prompt`'s media re-encoded from its row with `columns` replaced."""
    ids, media = encode_prompt_inputs(processor, [{**prompts[prompt], **columns}], 512)
    assert ids == encode_prompt_inputs(processor, prompts[prompt:prompt + 1], 512)[0]  # same tokens
    rows = (batch.group_ids == prompt).tolist()
    return dataclasses.replace(batch, media=[media[0] if own else m for own, m in zip(rows, batch.media, strict=True)])


def _changed_rows(model, before: RolloutBatch, after: RolloutBatch) -> torch.Tensor:
    with torch.no_grad():
        return (rollout_logprobs(model, after) - rollout_logprobs(model, before)).abs().amax(dim=1)


def test_replacing_a_rows_image_changes_only_that_rows_logprobs(thinker, rows, mixed) -> None:
    model, processor = thinker
    prompts, batch = mixed
    other = rows["avqa"][3]["images"]  # another AVQA picture of the same size: the same image tokens
    assert other != prompts[0]["images"]
    changed = _changed_rows(model, batch, _replace_media(processor, prompts, batch, 0, images=other))
    own = batch.group_ids == 0
    assert (changed[own] > 1e-4).all() and (changed[~own] == 0).all(), changed


def test_replacing_a_rows_audio_changes_only_that_rows_logprobs(thinker, rows, mixed) -> None:
    model, processor = thinker
    prompts, batch = mixed
    # A random audio tower's output is dominated by its sinusoidal position embedding (the convs start
    # at std 0.02): a different clip moves the log-probs by ~1e-6, float noise. Louder convs make what
    # the tower hears visible.
    model = copy.deepcopy(model)
    tower = model.thinker.model.audio_tower
    with torch.no_grad():
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3, tower.conv_out):
            conv.weight.mul_(16)
    other = rows["avqa"][3]["audios"]  # another tone of the same length: the same audio tokens
    assert other != prompts[0]["audios"]
    longer = [{"bytes": tone_wav(1000.0, seconds=0.6)}]  # as long as the audio-only row's own clip
    for prompt, audios in ((0, other), (2, longer)):  # image + audio, audio only
        changed = _changed_rows(model, batch, _replace_media(processor, prompts, batch, prompt, audios=audios))
        own = batch.group_ids == prompt
        assert (changed[own] > 1e-4).all() and (changed[~own] == 0).all(), (prompt, changed)


def test_select_gives_the_full_batch_logprobs_of_its_rows(thinker, mixed) -> None:
    model, _ = thinker
    _, batch = mixed
    index = torch.tensor([6, 2, 5, 0])  # text only, image only, audio only, image + audio; reordered
    sub = batch.select(index)
    assert sub.group_ids.tolist() == [3, 1, 2, 0] and sub.responses == [batch.responses[i] for i in index.tolist()]
    media = sub.media_inputs()
    assert media["image_grid_thw"].shape[0] == 2 and media["input_features"].shape[0] == 2
    torch.testing.assert_close(sub.rollout_logp, batch.rollout_logp[index])
    with torch.no_grad():
        full = rollout_logprobs(model, batch)
        torch.testing.assert_close(rollout_logprobs(model, sub), full[index], atol=1e-5, rtol=0)


def test_prompts_keep_their_media_or_fail(thinker, rows) -> None:
    _, processor = thinker
    row = rows["mmk12"][0]
    ids, media = encode_prompt_inputs(processor, [row], 512)
    tokenizer = processor.tokenizer
    assert ids[0].count(tokenizer.image_token_id) == media[0]["image_grid_thw"].prod() // 4
    assert not MEDIA_MARKER.search(tokenizer.decode(ids[0]))
    with pytest.raises(ModelError, match="max_prompt_tokens=64"):  # the image is near the start
        encode_prompt_inputs(processor, [row], 64)
    with pytest.raises(ModelError, match="do not match"):
        encode_prompt_inputs(processor, [{**row, "images": []}], 512)


def test_rollouts_never_sample_media_tokens(thinker, rows) -> None:
    """A response holding an image/audio placeholder would ask the model for media it was not given
    (the recomputation fails on the count): with media, generate never samples those tokens."""
    model, processor = thinker
    model = copy.deepcopy(model)
    media_ids = media_token_ids(processor.tokenizer)
    prompts = rows["avqa"][:2]
    ids, media = encode_prompt_inputs(processor, prompts, 512)
    with torch.no_grad():  # point the media tokens' output rows along the prompt's mean hidden state
        hidden = model(input_ids=torch.tensor(ids[:1]), output_hidden_states=True,
                       **collate_media(media[:1])).hidden_states[-1][0].mean(0)
        head = model.thinker.lm_head.weight
        head[media_ids] = hidden / hidden.norm() * head.norm(dim=1).max() * 20
        input_ids = torch.tensor(ids[:1])
        greedy = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=4,
                                do_sample=False, **collate_media(media[:1]))
    assert torch.isin(greedy[0, input_ids.shape[1]:], torch.tensor(media_ids)).all()  # what it would sample

    batch = generate_rollouts(model, processor, ids, media=media, n=2, sampling=Sampling(max_new_tokens=8), seed=0,
                              keep_logprobs=True)
    assert not torch.isin(batch.input_ids[batch.response_mask.bool()], torch.tensor(media_ids)).any()
    with torch.no_grad():
        torch.testing.assert_close(rollout_logprobs(model, batch), batch.rollout_logp, atol=1e-5, rtol=0)
