"""A checkpoint's training state: the trainable weights are stored once. After a full fine-tune they
are the exported model's weights, and `state/policy.json` points there; otherwise (a LoRA adapter's
names, weights that differ from the export) `state/policy.safetensors` holds them. Either way
`load_training_state` gives back the same tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_core.models import load_model
from omni_core.storage import Store
from omni_core.training.checkpoint import (
    LATEST,
    TrainingState,
    latest_checkpoint,
    load_training_state,
    save_checkpoint,
)


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny://lm", seed=0)


def _save(tmp_path: Path, lm, policy: dict[str, torch.Tensor], step: int = 1) -> tuple[Store, dict]:
    model, tokenizer = lm
    store = Store(str(tmp_path))
    state = TrainingState(policy=policy, optimizer={"state": {}, "param_groups": []},
                          rng={"trainer": torch.get_rng_state()}, info={"global_step": step})
    return store, save_checkpoint(store, "runs/p/k/rl", step, model, tokenizer, {}, state=state)


def _paths(manifest: dict) -> set[str]:
    return {f["path"] for f in manifest["files"]}


def test_a_full_fine_tunes_policy_is_read_from_the_exported_weights(tmp_path: Path, lm) -> None:
    policy = {name: p.detach().clone() for name, p in lm[0].named_parameters()}
    store, manifest = _save(tmp_path, lm, policy)
    assert "state/policy.json" in _paths(manifest) and "state/policy.safetensors" not in _paths(manifest)
    weights_bytes = next(f["bytes"] for f in manifest["files"] if f["path"] == manifest["weights"])
    assert sum(f["bytes"] for f in manifest["files"]) < 1.2 * weights_bytes  # the model once, not twice
    loaded = load_training_state(store, manifest).policy
    assert loaded.keys() == policy.keys()
    assert all(torch.equal(loaded[name], policy[name]) for name in policy)


@pytest.mark.parametrize("change", ["a value differs", "a name the export lacks"])
def test_other_policies_are_written_whole(tmp_path: Path, lm, change: str) -> None:
    policy = {name: p.detach().clone() for name, p in lm[0].named_parameters()}
    first = next(iter(policy))
    if change == "a value differs":
        policy[first] = policy[first] + 1e-3
    else:  # e.g. a LoRA adapter's parameter names
        policy["base_model.model.lora_A.default.weight"] = torch.ones(2, 2)
    store, manifest = _save(tmp_path, lm, policy)
    assert "state/policy.safetensors" in _paths(manifest) and "state/policy.json" not in _paths(manifest)
    loaded = load_training_state(store, manifest).policy
    assert loaded.keys() == policy.keys()
    assert all(torch.equal(loaded[name], policy[name]) for name in policy)


def test_a_corrupt_weights_file_fails_the_policy_load(tmp_path: Path, lm) -> None:
    from omni_core.training.checkpoint import CheckpointError

    policy = {name: p.detach().clone() for name, p in lm[0].named_parameters()}
    store, manifest = _save(tmp_path, lm, policy)
    path = tmp_path / "runs/p/k/rl/checkpoints/global_step_1" / manifest["weights"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its manifest sha256"):
        load_training_state(store, manifest)


def test_a_checkpoint_whose_writer_died_before_moving_the_latest_pointer_is_still_the_latest(tmp_path: Path, lm) -> None:
    """The manifest is the commit; the latest pointer is written after it. A driver killed between the
    two (seen on the scaled-out stack: the worker's host killed right after step 1's manifest) left the
    pointer behind or absent, and the re-run started over from step 0 instead of resuming."""
    policy = {name: p.detach().clone() for name, p in lm[0].named_parameters()}
    store, _ = _save(tmp_path, lm, policy, step=1)
    _, second = _save(tmp_path, lm, policy, step=2)
    root = "runs/p/k/rl"
    store.write_text(f"{root}/{LATEST}", "1\n")  # step 2's writer died before it moved the pointer
    assert latest_checkpoint(store, root) == second
    store.delete(f"{root}/{LATEST}")  # ... or before the first pointer was written at all
    assert latest_checkpoint(store, root) == second
    store.write_bytes(f"{root}/checkpoints/global_step_3/model.safetensors", b"half")  # no manifest: not committed
    assert latest_checkpoint(store, root)["global_step"] == 2
    assert latest_checkpoint(store, "runs/p/k/other") is None
