"""DPO and MPO on Omni-Preference fixtures: train loss per step and reward accuracy on the held-out
(test split) pairs, overall and per modality, starting from the random-weight `tiny://lm`.

Run through `python bench/learning.py --algo dpo,mpo [--quick] [--json]`; this module holds the
training loop so that other code can reuse it (`run_preference`).

Text-only (the `<image>`-style markers are dropped from the prompts; the media do not reach the
model), full fine-tuning with a frozen copy as the reference, modality-grouped batches with equal
modality weights, batch 8, lr 1e-3, beta 0.1. Held-out accuracy at step 0 is 0: policy and reference
are the same weights, so every implicit reward is 0 and every pair ties (a tie does not count as
right). The fixture is easy for a text-only model: the chosen and rejected answers follow different
fixed templates per modality ("The ball in the picture is red." vs "It is blue, I think."), so the
surface form alone separates them.
`quick`: 150 fixture rows per modality, 20 steps, held-out accuracy every 2 steps; otherwise 400
rows, 60 steps, held-out accuracy after every step.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

MODEL = "tiny://lm"


@dataclass(frozen=True)
class PreferenceSetup:
    rows: int = 400  # fixture rows per modality (train and test together)
    steps: int = 60
    eval_every: int = 1
    batch_size: int = 8
    lr: float = 1e-3
    fixture_seed: int = 0  # the data stays the same across --seed; the seed sets init and batch order

    @classmethod
    def quick(cls) -> PreferenceSetup:
        return cls(rows=150, steps=20, eval_every=2)


@cache
def fixture_rows(rows: int, seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, test) rows of an ingested `fixtures://omni_preference?rows=...` dataset (cached: dpo and
    mpo of one process share one ingest)."""
    from omni_core.config import DatasetConfig
    from omni_core.data.ingest import ingest
    from omni_core.storage import Store
    from omni_core.training.preference import read_split

    with tempfile.TemporaryDirectory(prefix="omni-bench-pref-") as tmp:
        store = Store(tmp)
        config = DatasetConfig(source=f"fixtures://omni_preference?rows={rows}&seed={seed}", converter="omni_preference")
        version = ingest(store, "omni_preference", config, progress=lambda _: None)
        return read_split(store, version, "train"), read_split(store, version, "test")


def run_preference(loss_mode: str, setup: PreferenceSetup, seed: int = 0) -> dict[str, Any]:
    """Train `loss_mode` ("dpo" or "mpo") for `setup.steps` steps. Returns `train_loss` (`[step, loss]`),
    `validation` (`[step, {val/... metrics}]`, step 0 included), the pair counts and the seconds."""
    from omni_core.models import load_model
    from omni_core.training.preference import PreferenceConfig, PreferenceTrainer
    from omni_core.training.sampler import row_modality

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 166k-parameter model: more threads only add synchronisation
    try:
        train, test = fixture_rows(setup.rows, setup.fixture_seed)
        model, tokenizer = load_model(MODEL, seed=seed)
        config = PreferenceConfig(loss_mode=loss_mode, lr=setup.lr, batch_size=setup.batch_size,
                                  total_steps=setup.steps)
        trainer = PreferenceTrainer(config, train, seed, model=model, text_io=tokenizer)
        start, cpu_start = time.perf_counter(), time.process_time()
        losses, validation = [], [[0, trainer.validate(test)]]
        for step in range(1, setup.steps + 1):
            losses.append([step, trainer.step()[f"actor/{loss_mode}_loss"]])
            if step % setup.eval_every == 0 or step == setup.steps:
                validation.append([step, trainer.validate(test)])
        wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        torch.set_num_threads(threads)
    return {"loss_mode": loss_mode, "model": MODEL, "train_loss": losses, "validation": validation,
            "train_pairs": len(train), "held_out_pairs": len(test),
            "held_out_pairs_per_modality": dict(sorted(Counter(row_modality(r) for r in test).items())),
            "wall_s": wall_s, "cpu_s": cpu_s}


def modalities(metrics: dict[str, float]) -> list[str]:
    """The modalities that `val/{modality}/reward_accuracy` metrics exist for."""
    return sorted(k.split("/")[1] for k in metrics if k.count("/") == 2 and k.endswith("/reward_accuracy"))
