"""The Ray training-stage runner: the version schedule, checkpoints with the full state, and resume
determinism after a SIGKILL of the trainer actor, a rollout worker, or the driver.

Every run trains `tiny://lm` on the digits fixture with a reward that varies within a group
(tests/data/rewards.py:by_length), so the weights depend on what was generated: a resumed run that
generated anything differently would end with other weights.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from omni_core.config import DatasetConfig
from omni_core.config.loader import ConfigValidationError, validate_pipeline
from omni_core.config.models import ExecutionConfig, RLStage
from omni_core.data import ingest
from omni_core.errors import OmniError
from omni_core.storage import Store
from omni_core.training.checkpoint import (
    LEFTOVER_AFTER_S,
    CheckpointError,
    checkpoint_steps,
    latest_checkpoint,
    load_training_state,
    prune_checkpoints,
)
from omni_core.training.ray_stage import config_digest, read_split, rl_run_key
from omni_core.training.runner import StageRun, StageRunner, is_dropped, rollout_version

ROOT = Path(__file__).resolve().parents[1]
REWARD = f"{ROOT / 'tests' / 'data' / 'rewards.py'}:by_length"
DATASET = DatasetConfig(source="fixtures://digits?rows=24&seed=0", converter="digits")

pytestmark = pytest.mark.slow


def stage_spec(mode: str, **execution: Any) -> dict[str, Any]:
    return {"name": "rl", "kind": "rl", "data": "digits:train", "model": "tiny://lm", "reward": {"name": REWARD},
            "trainer": {"total_steps": 4, "batch_size": 2, "lr": 1e-2},
            "rollout": {"n": 3, "max_new_tokens": 6},
            # sync: the rollout worker scores its own batch (no reward actor: one process less to start)
            "execution": {"mode": mode, "retry_backoff_s": 0.2, "async_reward": mode != "sync", **execution},
            "checkpoint": {"save_freq": 2}}


ASYNC = {"max_staleness": 2}  # batch k uses version k - 2: resuming at step 2 needs version 1's weights


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, tiny_model_env: Path, shared_ray: None) -> Any:
    """The process's shared Ray (4 CPUs, started with the model cache set, so the actors see it) and
    the ingested digits dataset."""
    data = tmp_path_factory.mktemp("data-store")
    store = Store(str(data))
    version = ingest(store, "digits", DATASET, progress=lambda _: None)
    rows = read_split(store, version.shard_keys("train"))
    return {"data_store": data, "version": version.version, "rows": rows, "clean": {}, "tmp": tmp_path_factory}


def train(env: Any, spec: dict[str, Any], *, kill: str | None = None, store: Store | None = None,
          said: list[str] | None = None) -> tuple[dict[str, Any], StageRunner, Store]:
    """One stage run into a fresh store (or `store`); `kill`: the actor SIGKILLed once, right after step 3;
    `said`: gets the progress lines."""
    stage = RLStage.model_validate(spec)
    store = store or Store(str(env["tmp"].mktemp("run")))
    killed: list[int] = []
    runner: StageRunner
    actor_steps: list[int] = []  # the trainer actor's step once the driver has step N (calls queue behind it)

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if kill and step == 3 and not killed:
            killed.append(pid := runner.actor_pids()[kill])
            os.kill(pid, signal.SIGKILL)
        elif not kill:
            actor_steps.append(ray.get(runner.attempt.trainer.global_step.remote()))

    run = StageRun("runner-test", stage, 0, store, env["rows"], env["version"],
                   rl_run_key(stage, 0, env["version"]), config_digest(stage, 0, env["version"]),
                   progress=(said.append if said is not None else lambda _: None), on_step=on_step)
    runner = StageRunner(run)
    runner.actor_steps = actor_steps
    manifest = runner.run()
    assert bool(killed) == bool(kill)
    return manifest, runner, store


def policy_sha(manifest: dict[str, Any]) -> str:
    """The digest of the trained weights: a full fine-tune's policy is the exported weights file
    (state/policy.json points there), anything else is state/policy.safetensors."""
    files = {f["path"]: f["sha256"] for f in manifest["files"]}
    return files.get("state/policy.safetensors") or files[manifest["weights"]]


def clean_run(env: Any, mode: str) -> dict[str, Any]:
    if mode not in env["clean"]:
        spec = stage_spec(mode, **(ASYNC if mode == "separate_async" else {}))
        manifest, runner, store = train(env, spec)
        env["clean"][mode] = {"manifest": manifest, "metrics": runner.run_.metrics, "store": store,
                              "actor_steps": runner.actor_steps}
    return env["clean"][mode]


# ---- the schedule ---------------------------------------------------------------------------------


def test_rollout_version_schedule_depends_on_the_step_only():
    sync = ExecutionConfig(mode="sync")
    assert [rollout_version(k, sync) for k in range(5)] == [0, 1, 2, 3, 4]
    lag1 = ExecutionConfig(mode="separate_async", max_staleness=1)
    assert [rollout_version(k, lag1) for k in range(5)] == [0, 0, 1, 2, 3]
    wait = ExecutionConfig(mode="separate_async", max_staleness=1, parameter_sync_step=2)
    assert [rollout_version(k, wait) for k in range(7)] == [0, 0, 2, 2, 4, 4, 6]  # rounded up: never staler than 1
    assert not any(is_dropped(k, wait) for k in range(7))
    drop = ExecutionConfig(mode="separate_async", max_staleness=1, parameter_sync_step=2, staleness_policy="drop")
    assert [rollout_version(k, drop) for k in range(7)] == [0, 0, 0, 2, 2, 4, 4]  # rounded down
    assert [k for k in range(7) if is_dropped(k, drop)] == [2, 4, 6]  # staleness 2 > 1
    assert all(k - rollout_version(k, wait) <= 1 for k in range(50))


def test_a_wait_schedule_that_would_deadlock_is_refused():
    with pytest.raises(ValueError, match="parameter_sync_step 3 > max_staleness \\+ 1 \\(2\\)"):
        ExecutionConfig(mode="separate_async", max_staleness=1, parameter_sync_step=3)
    ExecutionConfig(mode="separate_async", max_staleness=1, parameter_sync_step=3, staleness_policy="drop")


def test_separate_async_is_for_grpo_and_gspo():
    data = {"name": "p", "datasets": {"prefs": {"source": "fixtures://omni_preference?rows=8", "converter":
                                                "omni_preference"}},
            "stages": [{"name": "rl", "kind": "rl", "data": "prefs", "algorithm": {"name": "dpo"},
                        "execution": {"mode": "separate_async"}}]}
    with pytest.raises(ConfigValidationError, match="separate_async runs rollout workers beside the trainer"):
        validate_pipeline(data)


def test_checkpoint_options_do_not_change_the_run_key():
    base = RLStage.model_validate(stage_spec("sync"))
    other = RLStage.model_validate({**stage_spec("sync"), "checkpoint": {"save_freq": 1, "max_to_keep": 5},
                                    "resources": {"rollout": {"CPU": 2}}})
    other.execution.max_failures = 9
    assert rl_run_key(base, 0, "v") == rl_run_key(other, 0, "v")
    changed = RLStage.model_validate(stage_spec("separate_async"))
    assert rl_run_key(base, 0, "v") != rl_run_key(changed, 0, "v")


# ---- checkpoints ----------------------------------------------------------------------------------


def test_half_written_checkpoints_are_never_used_and_are_pruned(tmp_path: Path):
    store = Store(str(tmp_path))
    root = "runs/p/key/rl"
    for step in (1, 2):
        store.write_json(f"{root}/checkpoints/global_step_{step}/_manifest.json", {"global_step": step, "uri": "x"})
    store.write_text(f"{root}/latest_checkpointed_iteration.txt", "2\n")
    store.write_bytes(f"{root}/checkpoints/global_step_3/state/policy.safetensors", b"half")  # no manifest
    assert latest_checkpoint(store, root)["global_step"] == 2
    assert checkpoint_steps(store, root) == {1: True, 2: True, 3: False}
    store.write_json(f"{root}/checkpoints/global_step_4/_manifest.json", {"global_step": 4, "uri": "y"})
    # step 3 may still be written (a concurrent run of the same key behind this one): kept for now
    assert prune_checkpoints(store, root, keep=2, newest=4) == [1]
    assert checkpoint_steps(store, root) == {2: True, 3: False, 4: True}
    # untouched for longer than LEFTOVER_AFTER_S: a leftover
    assert prune_checkpoints(store, root, keep=2, newest=4, now=time.time() + LEFTOVER_AFTER_S + 1) == [3]
    assert checkpoint_steps(store, root) == {2: True, 4: True}


def test_a_checkpoint_holds_the_full_training_state(env: Any):
    clean = clean_run(env, "separate_async")
    store, manifest = clean["store"], clean["manifest"]
    root = manifest["uri"].rsplit("/checkpoints/", 1)[0]
    root_key = root[len(store.root) + 1:]
    assert checkpoint_steps(store, root_key) == {2: True, 4: True}
    assert store.read_text(f"{root_key}/latest_checkpointed_iteration.txt").strip() == "4"
    paths = {f["path"] for f in manifest["files"]}
    assert {"model.safetensors", "state/policy.json", "state/optimizer.pt", "state/rng.safetensors",
            "state/state.json"} <= paths  # a full fine-tune: the policy is read from model.safetensors
    assert "state/policy.safetensors" not in paths
    for f in manifest["files"]:  # every file listed with the digest of its bytes
        assert store.sha256(f"{manifest['uri'][len(store.root) + 1:]}/{f['path']}") == f["sha256"]
    state = load_training_state(store, manifest)
    assert state.info["global_step"] == 4 and state.info["data_cursor"] == {"next_step": 4}
    assert state.info["config_digest"] == manifest["config_digest"]
    assert set(state.rng) == {"trainer", "rollout_0", "reward_0"}  # every actor's RNG
    assert state.optimizer["state"], "Adam moments are saved"
    # the mid-run checkpoint keeps the weights of version 1, which batch 3 is generated with
    mid = load_training_state(store, store.read_json(f"{root_key}/checkpoints/global_step_2/_manifest.json"))
    assert mid.info["global_step"] == 2 and sorted(mid.rollout_versions) == [1]
    metrics = clean["metrics"]
    assert [m["training/off_policy/staleness_mean"] for m in metrics] == [0.0, 1.0, 2.0, 2.0]
    for key in ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/update_actor",
                "timing_s/update_weights", "timing_s/step", "training/rollout_probs_diff_mean",
                "training/rollout_actor_probs_pearson_corr", "training/off_policy/dropped_samples"):
        assert all(key in m for m in metrics), key
    # the trainer recomputes the old log-probs only for a batch of an older policy version; batch 0's
    # (version 0, its own) come from the update forward
    assert [m["timing_s/old_log_prob"] > 0 for m in metrics] == [False, True, True, True]


def test_a_checkpoint_of_another_config_is_refused_unless_forced(env: Any):
    clean = clean_run(env, "sync")
    path = clean["manifest"]["uri"]
    spec = {**stage_spec("sync"), "trainer": {**stage_spec("sync")["trainer"], "lr": 5e-3},
            "checkpoint": {"resume_mode": "resume_path", "resume_from_path": path}}
    with pytest.raises(CheckpointError, match="written with config digest .*force_resume"):
        train(env, spec, store=clean["store"])
    spec["checkpoint"]["force_resume"] = True
    stage = RLStage.model_validate(spec)
    run = StageRun("runner-test", stage, 0, clean["store"], env["rows"], env["version"], "key",
                   config_digest(stage, 0, env["version"]))
    assert StageRunner(run)._resume_manifest(first=True)["uri"] == path  # what a forced run resumes from


# ---- resume determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "victim", "forced"),
                         [("sync", "trainer", True), ("separate_async", "rollout_0", False)])
def test_a_killed_actor_resumes_to_the_same_weights(env: Any, mode: str, victim: str, forced: bool):
    """`forced`: the run trains again from step 0 (`resume_mode: disable`, what `omni run --force` hands
    the stage) in the clean run's store, whose run-key folder holds that run's steps 2 and 4: the
    recovery after step 3 resumes from the step 2 it committed itself, not from the earlier run's newer
    step 4 (which it did: a forced run whose actor died came back as the earlier run)."""
    clean = clean_run(env, mode)
    spec = stage_spec(mode, **(ASYNC if mode == "separate_async" else {}))
    store, said = None, []
    if forced:
        spec["checkpoint"] = {**spec["checkpoint"], "resume_mode": "disable"}
        store = clean["store"]
    manifest, runner, _ = train(env, spec, kill=victim, store=store, said=said)
    assert runner.recoveries == 1
    resumed = [line for line in said if "resuming at step" in line]
    assert len(resumed) == 1 and "resuming at step 2/4" in resumed[0], said
    assert policy_sha(manifest) == policy_sha(clean["manifest"])
    assert manifest["weights"] == "model.safetensors"


def test_the_trainer_runs_the_next_step_while_the_driver_logs_the_last(env: Any):
    """Sync, rollout in the trainer: when the driver has step N (and has saved its checkpoint, every 2nd
    step here), step N+1 is already queued in the trainer actor; the separate_async trainer learns from
    rollout workers' batches and is not run ahead."""
    assert clean_run(env, "sync")["actor_steps"] == [2, 3, 4, 4]
    assert clean_run(env, "separate_async")["actor_steps"] == [1, 2, 3, 4]


def test_sync_and_separate_async_train_different_weights(env: Any):
    assert policy_sha(clean_run(env, "sync")["manifest"]) != policy_sha(clean_run(env, "separate_async")["manifest"])
    # sync, one optimizer step per batch: the old log-probs always come from the update forward
    assert all(m["timing_s/old_log_prob"] == 0.0 for m in clean_run(env, "sync")["metrics"])


def test_sync_rolls_out_inside_the_trainer_with_the_rollout_workers_numbers(env: Any):
    """Sync mode with one rollout worker: the trainer actor holds the rollout worker (one actor, no weight
    push between processes); given a rollout resource the worker is an actor of its own. Same weights."""
    from omni_core.training.runner import rollout_in_trainer

    colocated = clean_run(env, "sync")
    spec = {**stage_spec("sync"), "resources": {"rollout": {"CPU": 1}}}
    assert rollout_in_trainer(RLStage.model_validate(stage_spec("sync")))
    assert not rollout_in_trainer(RLStage.model_validate(spec))
    pids: list[dict[str, int]] = []
    runner: StageRunner | None = None

    def on_step(step: int, metrics: dict[str, float]) -> None:
        if step == 1:
            pids.append(runner.actor_pids())

    stage = RLStage.model_validate(spec)
    run = StageRun("runner-test", stage, 0, Store(str(env["tmp"].mktemp("run"))), env["rows"], env["version"],
                   rl_run_key(stage, 0, env["version"]), config_digest(stage, 0, env["version"]),
                   progress=lambda _: None, on_step=on_step)
    runner = StageRunner(run)
    manifest = runner.run()
    assert set(pids[0]) == {"trainer", "rollout_0"}
    sync = StageRunner(StageRun("runner-test", RLStage.model_validate(stage_spec("sync")), 0, run.store, [], "v",
                                "key", "digest"))
    assert sync._roles(sync._workers()) == ["trainer"]  # the actors an attempt of the colocated run starts
    assert policy_sha(manifest) == policy_sha(colocated["manifest"])
    assert [m["critic/score/mean"] for m in run.metrics] == [m["critic/score/mean"] for m in colocated["metrics"]]
    for key in ("timing_s/gen", "timing_s/reward", "timing_s/update_weights", "training/policy_version"):
        assert all(key in m for m in colocated["metrics"]), key
    assert [m["training/policy_version"] for m in colocated["metrics"]] == [0.0, 1.0, 2.0, 3.0]


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`. Ray puts each worker (an actor) in a process group of its
    own, so killing the driver's group leaves its actors running until they notice their raylet is
    gone: long enough to train the last step and commit the final checkpoint (seen once in a suite
    run: the rerun found the run complete instead of resuming at step 2)."""
    import psutil

    os.killpg(sid, signal.SIGKILL)  # the driver, its raylet and GCS first: no new workers start
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                proc.kill()
        except (psutil.Error, OSError):
            pass


def test_a_killed_driver_is_resumed_by_the_next_run(env: Any, tmp_path: Path):
    """The driver (`python -m omni_core.training run`, with its local Ray) is SIGKILLed after step 3;
    running the same command again resumes from global_step_2 and ends with the uninterrupted weights."""
    clean = clean_run(env, "sync")
    store = tmp_path / "store"
    subprocess.run(["cp", "-r", str(env["data_store"]), str(store)], check=True)
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({
        "name": "runner-test", "store": str(store), "ray": {"address": "local", "num_cpus": 2}, "seed": 0,
        "datasets": {"digits": DATASET.model_dump()}, "stages": [stage_spec("sync")]}))
    command = [sys.executable, "-m", "omni_core.training", "run", str(pipeline), "--stage", "rl"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, cwd=ROOT)
    seen = []
    for line in child.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if "step 3/4" in line:
            kill_session(child.pid)  # the driver and the Ray it started, its actors included
            break
    child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL, "".join(seen)
    runs = Store(str(store))
    key_root = next(k for k in runs.list("runs") if k.endswith("latest_checkpointed_iteration.txt"))
    assert runs.read_text(key_root).strip() == "2"
    time.sleep(1)
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming at step 2/4" in again.stdout
    result = __import__("json").loads(again.stdout.strip().splitlines()[-1])
    assert result["global_step"] == 4 and not result["reused"]
    final = runs.read_json(result["checkpoint_uri"][len(runs.root) + 1:] + "/_manifest.json")
    assert policy_sha(final) == policy_sha(clean["manifest"])


def test_a_stage_asking_more_than_the_local_ray_has_is_refused(env: Any, tmp_path: Path) -> None:
    # the env's Ray has 4 CPUs: trainer 1 + 2 rollout workers x 2 CPUs = 5 would wait forever
    stage = RLStage.model_validate({**stage_spec("separate_async", rollout_workers=2),
                                    "resources": {"rollout": {"CPU": 2}}})
    said: list[str] = []
    run = StageRun("runner-test", stage, 0, Store(str(tmp_path)), env["rows"], env["version"], "key", "digest",
                   progress=said.append, local_ray=True)
    with pytest.raises(OmniError, match=r"CPU 5 \(the cluster has 4\).*raise ray.num_cpus"):
        StageRunner(run).run()
    assert not said  # refused before any actor started or any restart was tried
