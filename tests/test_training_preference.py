"""Preference training (DPO, MPO): modality-grouped sampler, pair encoding, reference log-probs,
metric names, determinism, the omni path, and the proof that DPO and MPO rank held-out pairs."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omni_core.config import DatasetConfig
from omni_core.data.ingest import ingest
from omni_core.errors import ConfigError, ModelError
from omni_core.models import load_model, response_logits, tiny_model_dir, token_logprobs
from omni_core.models.multimodal_inputs import prompt_messages
from omni_core.storage import Store
from omni_core.training.preference import (
    PreferenceConfig,
    PreferenceTrainer,
    encode_pairs,
    pair_logps,
    read_split,
    reference_logps,
)
from omni_core.training.sampler import ModalityGroupedSampler, row_modality, validation_batches

SEED = 0


@pytest.fixture(scope="module", autouse=True)
def _env(model_cache: Path) -> Iterator[None]:  # conftest's session-wide model_cache
    """Tiny models (and fixtures) in the shared cache; one torch thread (a 166k-parameter model only
    pays for thread synchronisation, badly so on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        tiny_model_dir("lm", cache_dir=model_cache)
        mp.setenv("OMNI_CACHE_DIR", str(model_cache))
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    """(train, held-out test) rows of Omni-Preference fixtures: 392 and 58 pairs over three modalities."""
    store = Store(str(tmp_path_factory.mktemp("store")))
    config = DatasetConfig(source=f"fixtures://omni_preference?rows=150&seed={SEED}", converter="omni_preference")
    version = ingest(store, "omni_preference", config, progress=lambda _: None)
    return read_split(store, version, "train"), read_split(store, version, "test")


def lm():
    return load_model("tiny://lm", seed=SEED)


# ---- sampler -------------------------------------------------------------------------------------


MODALITIES = ["image"] * 5 + ["video"] * 3 + ["audio"] * 4


def test_training_batches_are_single_modality_deterministic_and_cover_each_modality() -> None:
    sampler = ModalityGroupedSampler(MODALITIES, batch_size=2, seed=3)
    batches = [sampler.batch(step) for step in range(60)]
    for step, batch in enumerate(batches):
        assert len(batch) == 2 and {MODALITIES[i] for i in batch} == {sampler.modality(step)}
    assert set(Counter(sampler.modality(s) for s in range(60))) == {"image", "video", "audio"}
    again = ModalityGroupedSampler(MODALITIES, batch_size=2, seed=3)
    assert [again.batch(step) for step in reversed(range(60))][::-1] == batches  # batch k depends on k only
    other = ModalityGroupedSampler(MODALITIES, batch_size=2, seed=4)
    assert [other.batch(step) for step in range(60)] != batches
    # without replacement within a pass: each image row twice in the first five image batches
    image_rows = [i for s in range(60) if sampler.modality(s) == "image" for i in sampler.batch(s)][:10]
    assert sorted(image_rows) == sorted(list(range(5)) * 2)


def test_modality_weights() -> None:
    only_video = ModalityGroupedSampler(MODALITIES, batch_size=1, seed=0, weights={"video": 100, "image": 0, "audio": 0})
    assert {only_video.modality(s) for s in range(30)} == {"video"}
    skewed = ModalityGroupedSampler(MODALITIES, batch_size=1, seed=0, weights={"image": 8, "video": 1, "audio": 1})
    share = Counter(skewed.modality(s) for s in range(2000))["image"] / 2000
    assert 0.75 < share < 0.85
    with pytest.raises(ConfigError, match="modality_weights.audio must be >= 0"):
        ModalityGroupedSampler(MODALITIES, batch_size=1, seed=0, weights={"audio": -1})
    with pytest.raises(ConfigError, match="weight 0"):
        ModalityGroupedSampler(MODALITIES, batch_size=1, seed=0, weights={"image": 0, "video": 0, "audio": 0})


def test_validation_batches_visit_every_row_once_one_modality_each() -> None:
    batches = validation_batches(MODALITIES, batch_size=3)
    assert [i for b in batches for i in b] == [8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7]  # audio, image, video
    assert all(len({MODALITIES[i] for i in b}) == 1 for b in batches)


def test_row_modality() -> None:
    assert row_modality({"extra_info": {"modality": "video"}, "images": [{"bytes": b""}]}) == "video"
    assert row_modality({"images": None, "audios": [{"bytes": b"x"}]}) == "audio"
    assert row_modality({"data_source": "omni_preference/image"}) == "image"
    assert row_modality({"data_source": "openai/gsm8k", "extra_info": None}) == "text"
    assert row_modality({"data_source": "mmk12"}) == "text"


# ---- config, encoding, reference -----------------------------------------------------------------


def test_config_resolves_loss_types_and_rejects_bad_ones() -> None:
    assert (PreferenceConfig().loss_types, PreferenceConfig().weights) == (["sigmoid"], [1.0])
    mpo = PreferenceConfig(loss_mode="mpo")
    assert (mpo.loss_types, mpo.weights) == (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0])
    assert PreferenceConfig(loss_type="ipo").loss_types == ["ipo"]
    with pytest.raises(ValueError, match="unknown preference loss type 'hinge'"):
        PreferenceConfig(loss_type="hinge")
    with pytest.raises(ValueError, match="dpo takes one pairwise loss type"):
        PreferenceConfig(loss_type=["sigmoid", "sft"])
    with pytest.raises(ValueError, match=r"2 loss types \(sigmoid, sft\) but 1 loss_weights"):
        PreferenceConfig(loss_mode="mpo", loss_type=["sigmoid", "sft"], loss_weights=[1.0])


def test_encode_pairs_masks_exactly_the_response_and_eos(pairs) -> None:
    _, tokenizer = lm()
    rows = pairs[0][:3]
    batch = encode_pairs(tokenizer, rows)
    assert batch.inputs["input_ids"].shape[0] == 6 and batch.modalities == [row_modality(r) for r in rows]
    answers = [r["chosen"]["content"] for r in rows] + [r["rejected"]["content"] for r in rows]
    for i, answer in enumerate(answers):
        picked = batch.inputs["input_ids"][i][batch.response_mask[i].bool()]
        assert tokenizer.decode(picked) == answer + tokenizer.eos_token
        text = tokenizer.decode(batch.inputs["input_ids"][i][batch.inputs["attention_mask"][i].bool()])
        assert "<image>" not in text and text.endswith("<|im_start|>assistant\n" + answer + "<|im_end|>")


def test_a_rows_cached_token_ids_give_the_batch_one_tokenizer_call_gives(pairs) -> None:
    """The trainer keeps each row's token ids (encode_pairs' cache): its batches are the tensors that
    tokenizing the batch's texts in one call gives, and a cached row is not tokenized again."""
    _, tokenizer = lm()
    rows = pairs[0][:5]
    cache: dict = {}
    first = encode_pairs(tokenizer, rows[:3], cache, [0, 1, 2])
    assert sorted(cache) == [0, 1, 2]
    cache[1] = dataclasses.replace(cache[1], chosen=cache[1].chosen[1:], chosen_answer=cache[1].chosen_answer)
    again = encode_pairs(tokenizer, [rows[1]], cache, [1])  # the cached (here: altered) ids are used
    assert again.inputs["input_ids"][0][again.inputs["attention_mask"][0].bool()].tolist() == cache[1].chosen
    del cache[1]
    batch = encode_pairs(tokenizer, rows[2:5], cache, [2, 3, 4])
    for encoded, picked in ((first, rows[:3]), (batch, rows[2:5])):
        prompts = [tokenizer.apply_chat_template(prompt_messages(r, False), add_generation_prompt=True, tokenize=False)
                   for r in picked]
        answers = [r["chosen"]["content"] for r in picked] + [r["rejected"]["content"] for r in picked]
        one_call = tokenizer([p + a + tokenizer.eos_token for p, a in zip(prompts + prompts, answers, strict=True)],
                             padding=True, return_tensors="pt", add_special_tokens=False)
        assert torch.equal(encoded.inputs["input_ids"], one_call["input_ids"])
        assert torch.equal(encoded.inputs["attention_mask"], one_call["attention_mask"])


def test_response_logits_are_the_full_forwards_last_positions(pairs) -> None:
    """Log-probs from the logits of the response window only (`logits_to_keep`) equal those of the
    full forward, and the forward really kept fewer positions."""
    model, tokenizer = lm()
    batch = encode_pairs(tokenizer, pairs[0][:4])
    with torch.no_grad():
        full = token_logprobs(model(**batch.inputs).logits, batch.inputs["input_ids"]) * batch.response_mask
        window = response_logits(model, batch.response_mask, **batch.inputs)
        windowed = token_logprobs(window, batch.inputs["input_ids"]) * batch.response_mask
    assert window.shape[1] < batch.inputs["input_ids"].shape[1]
    torch.testing.assert_close(windowed, full, atol=1e-5, rtol=0)


def test_sequence_logps_do_not_depend_on_padding_or_batch_mates(pairs) -> None:
    model, tokenizer = lm()
    rows = pairs[0][:4]
    with torch.no_grad():
        together = pair_logps(model, encode_pairs(tokenizer, rows))
        for i, row in enumerate(rows):
            alone = pair_logps(model, encode_pairs(tokenizer, [row]))
            torch.testing.assert_close(together.chosen[i], alone.chosen[0], atol=1e-4, rtol=0)
            torch.testing.assert_close(together.rejected[i], alone.rejected[0], atol=1e-4, rtol=0)


def test_reference_without_lora_needs_a_model(pairs) -> None:
    model, tokenizer = lm()
    with pytest.raises(ModelError, match="pass reference=frozen_copy"):
        reference_logps(model, None, encode_pairs(tokenizer, pairs[0][:1]))


# ---- training steps ------------------------------------------------------------------------------


DPO_KEYS = {"actor/dpo_loss", "actor/reward_accuracy", "actor/chosen_rewards", "actor/rejected_rewards",
            "actor/reward_margin", "actor/grad_norm", "actor/lr", "timing_s/ref"}


def test_metric_names_and_validation_per_modality(pairs) -> None:
    train, test = pairs
    model, tokenizer = lm()
    dpo = PreferenceTrainer(PreferenceConfig(batch_size=4), train, SEED, model=model, text_io=tokenizer)
    assert set(dpo.step()) == DPO_KEYS
    model, tokenizer = lm()
    mpo = PreferenceTrainer(PreferenceConfig(loss_mode="mpo", batch_size=4), train, SEED, model=model,
                            text_io=tokenizer)
    metrics = mpo.step()
    assert set(metrics) == DPO_KEYS - {"actor/dpo_loss"} | {
        "actor/mpo_loss", "actor/sigmoid_loss", "actor/bco_pair_loss", "actor/sft_loss"}
    assert metrics["actor/mpo_loss"] == pytest.approx(
        0.8 * metrics["actor/sigmoid_loss"] + 0.2 * metrics["actor/bco_pair_loss"] + metrics["actor/sft_loss"], rel=1e-5)
    val = mpo.validate(test)
    for scope in ("val", "val/image", "val/video", "val/audio"):
        assert {f"{scope}/{k}" for k in ("mpo_loss", "reward_accuracy", "reward_margin", "chosen_rewards",
                                         "rejected_rewards")} <= set(val)
    counts = Counter(row_modality(r) for r in test)  # overall = pair-weighted mean of the modalities
    overall = sum(val[f"val/{m}/reward_margin"] * n for m, n in counts.items()) / len(test)
    assert val["val/reward_margin"] == pytest.approx(overall, rel=1e-6)


def test_same_seed_gives_identical_weights_and_metrics(pairs) -> None:
    runs = []
    for seed in (SEED, SEED, SEED + 1):
        model, tokenizer = lm()
        trainer = PreferenceTrainer(PreferenceConfig(batch_size=4), pairs[0], seed, model=model, text_io=tokenizer)
        metrics = [{k: v for k, v in trainer.step().items() if not k.startswith("timing_s/")} for _ in range(3)]
        runs.append((metrics, {k: v.clone() for k, v in model.state_dict().items()}))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    assert any(not torch.equal(runs[0][1][k], runs[2][1][k]) for k in runs[0][1])


def test_reference_log_probs_are_computed_once_per_pair_and_resume_to_the_same_weights(pairs) -> None:
    """A run that sees every pair computes each pair's reference log-probs once, in fixed chunks: they
    match the per-step reference, no step after the chunks are done runs the reference, and a trainer
    restored after 3 steps (its cache empty) reaches the uninterrupted run's weights bit for bit."""
    train = pairs[0][:24]
    config = PreferenceConfig(batch_size=4, total_steps=8, val_batch_size=8)  # 8 x 4 >= 24 pairs: cached

    def trainer() -> PreferenceTrainer:
        model, tokenizer = lm()
        return PreferenceTrainer(config, train, SEED, model=model, text_io=tokenizer)

    uninterrupted = trainer()
    steps = [uninterrupted.step() for _ in range(8)]
    cache = uninterrupted._reference_cache
    assert cache is not None and sorted(cache.chosen) == list(range(24))
    # every pair was computed in the first pass: later steps only look theirs up
    assert steps[-1]["timing_s/ref"] < steps[0]["timing_s/ref"] / 10
    index = [3, 17, 5]
    per_step = reference_logps(uninterrupted.model, uninterrupted.reference, encode_pairs(uninterrupted.text_io,
                                                                                          [train[i] for i in index]))
    cached = cache.logps(index, lambda rows: pytest.fail(f"computed {rows} again"))
    torch.testing.assert_close(cached.chosen, per_step.chosen, atol=1e-4, rtol=0)
    torch.testing.assert_close(cached.rejected, per_step.rejected, atol=1e-4, rtol=0)

    first = trainer()
    for _ in range(3):
        first.step()
    state, weights = first.state_dict(), {k: v.clone() for k, v in first.model.state_dict().items()}
    resumed = trainer()
    resumed.model.load_state_dict(weights)
    resumed.load_state_dict(state)
    for _ in range(5):
        resumed.step()
    expected = uninterrupted.model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in resumed.model.state_dict().items())
    few = PreferenceTrainer(PreferenceConfig(batch_size=4, total_steps=5), train, SEED, model=lm()[0],
                            text_io=lm()[1])
    assert few._reference_cache is None  # 5 x 4 < 24 pairs: the reference runs on each step's pairs


@pytest.mark.parametrize("loss_mode", ["dpo", "mpo"])
def test_preference_training_ranks_held_out_pairs(pairs, loss_mode: str) -> None:
    """The proof: from a random tiny LM, 20 steps of 8 pairs reach reward accuracy >= 0.9 on the
    held-out pairs (the test split), overall and per modality; at step 0 every pair ties (accuracy 0)."""
    train, test = pairs
    model, tokenizer = lm()
    config = PreferenceConfig(loss_mode=loss_mode, lr=1e-3, batch_size=8, total_steps=20)
    trainer = PreferenceTrainer(config, train, SEED, model=model, text_io=tokenizer)
    before = trainer.validate(test)
    assert before["val/reward_accuracy"] == 0.0 and before["val/reward_margin"] == 0.0
    history = [trainer.step() for _ in range(config.total_steps)]
    after = trainer.validate(test)
    assert after["val/reward_accuracy"] >= 0.9, after
    for modality in ("image", "video", "audio"):
        assert after[f"val/{modality}/reward_accuracy"] >= 0.9, after
    assert after["val/reward_margin"] > 0.5 and after["val/chosen_rewards"] > after["val/rejected_rewards"]
    pairwise = [m["actor/dpo_loss" if loss_mode == "dpo" else "actor/sigmoid_loss"] for m in history]
    total = [m[f"actor/{loss_mode}_loss"] for m in history]
    assert sum(pairwise[-5:]) < 0.5 * sum(pairwise[:5]) and sum(total[-5:]) < sum(total[:5])


# ---- the omni path: image and audio through the processor, LoRA reference ------------------------


def test_one_step_on_qwen3_omni_with_image_and_audio_rows(pairs, model_cache: Path) -> None:
    tiny_model_dir("qwen3-omni", cache_dir=model_cache)
    model, processor = load_model("tiny://qwen3-omni", seed=SEED, adapter="qwen3_omni_thinker",
                                  lora={"rank": 4, "alpha": 8})
    train, test = pairs
    image = [r for r in train if row_modality(r) == "image"][:2]
    audio = [r for r in train if row_modality(r) == "audio"][:2]
    batch = encode_pairs(processor, image)
    tokenizer = processor.tokenizer
    assert (batch.inputs["input_ids"] == tokenizer.image_token_id).sum() > 0 and "pixel_values" in batch.inputs
    assert "input_features" in encode_pairs(processor, audio).inputs
    with torch.no_grad():  # the image reaches the model
        blank = dict(batch.inputs, pixel_values=torch.zeros_like(batch.inputs["pixel_values"]))
        assert not torch.allclose(model(**blank).logits, model(**batch.inputs).logits)
    ref_before = reference_logps(model, None, batch)
    torch.testing.assert_close(pair_logps(model, batch).chosen.detach(), ref_before.chosen)  # LoRA B = 0

    config = PreferenceConfig(batch_size=2, lr=1e-2, modality_weights={"video": 0.0})
    trainer = PreferenceTrainer(config, image + audio, SEED, model=model, text_io=processor)
    metrics = trainer.step()
    assert set(metrics) == DPO_KEYS and metrics["actor/grad_norm"] > 0
    torch.testing.assert_close(reference_logps(model, None, batch).chosen, ref_before.chosen)  # base unchanged
    with torch.no_grad():
        assert not torch.allclose(pair_logps(model, batch).chosen, ref_before.chosen)  # policy moved
    val = trainer.validate(image + audio)
    assert {"val/image/reward_accuracy", "val/audio/reward_accuracy"} <= set(val)
    video = [r for r in train if row_modality(r) == "video"][:1]
    with pytest.raises(ModelError, match="video inputs are not supported"):
        encode_pairs(processor, video)
