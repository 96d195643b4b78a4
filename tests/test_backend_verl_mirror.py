"""verl's checkpoints mirrored into the store (moto S3) under our checkpoint layout, restored onto an
emptied shared path, and verl #7952 (a global_step_N folder without the latest file) repaired from
the mirror or refused. The folders here are laid out as verl 0.9.1's SFT trainer writes them
(tests/test_backend_verl_cpu.py runs the real trainer on a restored folder)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from omni_core.backends.jobs.mirror import committed_steps, mirror_new, prepare_resume
from omni_core.storage import Store
from omni_core.training.checkpoint import CheckpointError, checkpoint_steps, latest_checkpoint

FILES = ["model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt", "extra_state_world_size_1_rank_0.pt",
         "data_0.pt", "fsdp_config.json", "huggingface/config.json"]


def verl_step(run_dir: Path, step: int, *, commit: bool = True) -> None:
    folder = run_dir / f"global_step_{step}"
    for rel in FILES:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(f"{rel} of step {step}".encode() * 1000)
    if commit:
        (run_dir / "latest_checkpointed_iteration.txt").write_text(str(step))


@pytest.fixture
def s3_store(s3_bucket) -> Store:
    return Store(f"s3://{s3_bucket}/omni")


def test_complete_steps_are_mirrored_with_a_manifest_and_restored_onto_an_empty_path(tmp_path, s3_store):
    run_dir, root = tmp_path / "shared" / "runs" / "p" / "k" / "sft", "runs/p/k/sft"
    verl_step(run_dir, 1)
    verl_step(run_dir, 2)
    verl_step(run_dir, 3, commit=False)  # being written: above the latest step
    assert committed_steps(run_dir) == [1, 2]
    assert mirror_new(run_dir, s3_store, root, metadata={"submission_id": "omni-x"}) == [1, 2]
    assert mirror_new(run_dir, s3_store, root) == []  # nothing new
    manifest = latest_checkpoint(s3_store, root)
    assert manifest["global_step"] == 2 and manifest["source"] == "verl" and manifest["submission_id"] == "omni-x"
    assert sorted(f["path"] for f in manifest["files"]) == sorted(FILES)
    assert s3_store.sha256(f"{root}/checkpoints/global_step_2/data_0.pt") == \
        next(f["sha256"] for f in manifest["files"] if f["path"] == "data_0.pt")

    (run_dir / "latest_checkpointed_iteration.txt").write_text("3")
    assert mirror_new(run_dir, s3_store, root, keep=2) == [3]
    assert checkpoint_steps(s3_store, root) == {2: True, 3: True}  # step 1 pruned

    shutil.rmtree(tmp_path / "shared")  # a new cluster: the shared path lost everything
    assert prepare_resume(run_dir, s3_store, root) == 3
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (run_dir / "global_step_3" / "data_0.pt").read_bytes() == b"data_0.pt of step 3" * 1000
    assert prepare_resume(run_dir, s3_store, root) == 3  # verl can resume by itself now


def test_a_step_folder_without_the_latest_file_is_repaired_from_the_mirror_or_refused(tmp_path, s3_store):
    run_dir, root = tmp_path / "run", "runs/p/k/rl"
    verl_step(run_dir, 4, commit=False)  # verl #7952: async save, no latest file
    with pytest.raises(CheckpointError, match="#7952.*restart from step 0"):
        prepare_resume(run_dir, s3_store, root)
    assert prepare_resume(tmp_path / "fresh", s3_store, root) is None  # nothing anywhere: a fresh start

    other = tmp_path / "earlier"
    verl_step(other, 2)
    mirror_new(other, s3_store, root)
    assert prepare_resume(run_dir, s3_store, root) == 2  # repaired: the mirrored step, not step 0
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (run_dir / "global_step_2" / "data_0.pt").is_file()

    # a corrupt mirror is refused, not restored
    s3_store.write_bytes(f"{root}/checkpoints/global_step_2/data_0.pt", b"bit rot")
    with pytest.raises(CheckpointError, match="does not match its manifest sha256"):
        prepare_resume(tmp_path / "new-cluster", s3_store, root)


def test_a_mirrored_step_whose_latest_file_was_never_written_is_restored(tmp_path, s3_store):
    """The manifest is the commit point; the store's latest file follows it. A driver killed between the
    two must not make the next attempt restart from an older step (or from step 0)."""
    root = "runs/p/k/rl"
    for step in (1, 2):
        run_dir = tmp_path / f"step{step}"
        verl_step(run_dir, step)
        mirror_new(run_dir, s3_store, root)
    s3_store.write_text(f"{root}/latest_checkpointed_iteration.txt", "1\n")  # killed before moving it to 2
    assert prepare_resume(tmp_path / "new-cluster", s3_store, root) == 2
    s3_store.delete(f"{root}/latest_checkpointed_iteration.txt")
    assert prepare_resume(tmp_path / "another-cluster", s3_store, root) == 2
    assert latest_checkpoint(s3_store, root)["global_step"] == 2
