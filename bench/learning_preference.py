"""Learning curves of DPO and MPO on Omni-Preference fixtures: train loss per step and reward accuracy
on the held-out (test split) pairs, starting from the random-weight `tiny://lm`.

    python bench/learning_preference.py [--quick] [--json]

Text-only (the `<image>`-style markers are dropped from the prompts; the media do not reach the
model), full fine-tuning with a frozen copy as the reference, modality-grouped batches with equal
modality weights. Held-out accuracy at step 0 is 0: policy and reference agree, so every pair ties.
`--quick`: 150 fixture rows per modality (58 held-out pairs), 20 steps; otherwise 400 rows, 60 steps.
PNG curves go to bench/out/learning_preference_{dpo,mpo}.png.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omni_core.config import DatasetConfig
from omni_core.data.ingest import ingest
from omni_core.models import load_model
from omni_core.storage import Store
from omni_core.training.preference import PreferenceConfig, PreferenceTrainer, read_split

OUT = Path(__file__).resolve().parent / "out"
SEED = 0


def fixture_rows(rows: int, seed: int = SEED) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, test) rows of an ingested `fixtures://omni_preference?rows=...` dataset."""
    with tempfile.TemporaryDirectory(prefix="omni-bench-pref-") as tmp:
        store = Store(tmp)
        config = DatasetConfig(source=f"fixtures://omni_preference?rows={rows}&seed={seed}", converter="omni_preference")
        version = ingest(store, "omni_preference", config, progress=lambda _: None)
        return read_split(store, version, "train"), read_split(store, version, "test")


def curve(loss_mode: str, train: list[dict], test: list[dict], steps: int, eval_every: int) -> dict[str, Any]:
    model, tokenizer = load_model("tiny://lm", seed=SEED)
    config = PreferenceConfig(loss_mode=loss_mode, lr=1e-3, batch_size=8, total_steps=steps)
    trainer = PreferenceTrainer(model, tokenizer, train, config, seed=SEED)
    losses, accuracy = [], [[0, trainer.validate(test)["val/reward_accuracy"]]]
    start = time.perf_counter()
    for step in range(1, steps + 1):
        losses.append([step, trainer.step()[f"actor/{loss_mode}_loss"]])
        if step % eval_every == 0 or step == steps:
            accuracy.append([step, trainer.validate(test)["val/reward_accuracy"]])
    seconds = time.perf_counter() - start
    final = {k: round(v, 4) for k, v in trainer.validate(test).items()}
    return {"train_loss": losses, "val_reward_accuracy": accuracy, "final": final | {"train_eval_s": round(seconds, 2)}}


def run(quick: bool) -> dict[str, Any]:
    """Curves (`[step, value]` pairs) and final held-out metrics for dpo and mpo."""
    rows, steps, eval_every = (150, 20, 2) if quick else (400, 60, 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 166k-parameter model: more threads only add synchronisation
    try:
        train, test = fixture_rows(rows)
        out: dict[str, Any] = {"setup": {"model": "tiny://lm", "fixture_rows_per_modality": rows, "train_pairs": len(train),
                                         "held_out_pairs": len(test), "steps": steps, "batch_size": 8, "lr": 1e-3}}
        for loss_mode in ("dpo", "mpo"):
            out[loss_mode] = curve(loss_mode, train, test, steps, eval_every)
    finally:
        torch.set_num_threads(threads)
    return out


def save_plots(result: dict[str, Any], out_dir: Path = OUT) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / ".gitignore").exists():
        (out_dir / ".gitignore").write_text("*\n")
    paths = []
    for loss_mode in ("dpo", "mpo"):
        data = result[loss_mode]
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
        left.plot(*zip(*data["train_loss"], strict=True), marker=".")
        left.set(title=f"{loss_mode}: train loss", xlabel="step", ylabel=f"actor/{loss_mode}_loss")
        right.plot(*zip(*data["val_reward_accuracy"], strict=True), marker="o")
        right.set(title=f"{loss_mode}: held-out reward accuracy", xlabel="step", ylabel="val/reward_accuracy",
                  ylim=(-0.05, 1.05))
        right.axhline(0.9, color="grey", linestyle="--", linewidth=1)
        fig.tight_layout()
        path = out_dir / f"learning_preference_{loss_mode}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="150 rows per modality, 20 steps (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the results last")
    args = parser.parse_args()
    result = run(args.quick)
    setup = result["setup"]
    print(f"tiny://lm, {setup['train_pairs']} train / {setup['held_out_pairs']} held-out pairs, {setup['steps']} steps:")
    for loss_mode in ("dpo", "mpo"):
        final = result[loss_mode]["final"]
        print(f"  {loss_mode}: held-out reward accuracy {final['val/reward_accuracy']:.3f}, "
              f"margin {final['val/reward_margin']:.3f} ({final['train_eval_s']:.1f} s)")
    for path in save_plots(result):
        print(f"  curve: {path}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
