"""End to end with real verl on a real `ray start --head`, an S3 store (moto) and an MLflow server:
ingest the digits task -> `sft` with `backend: {name: verl, device: cpu}` on tiny://lm (verl's SFT
trainer as a Ray Job) -> `rl` (verl's main_ppo GRPO from the sft checkpoint, `model: {from: sft}`, the
digits reward, verl's CPU rollout `omni_cpu`) -> `eval` of the rl checkpoint (our engine, 8 sampled
responses a row with the sft checkpoint as the baseline: GRPO raised the reward; and `engine: trainer`:
verl's own validation as a val-only Ray Job) -> `register`. Asserts verl's own metrics in our child runs
(train/loss; critic/score/mean, actor/pg_loss, actor/ppo_kl and the rollout-vs-actor log-prob
difference: written by verl's file logger, relayed by the driver), the mirrored checkpoints with
manifests, verl's own Hugging Face weights committed as our checkpoints, a custom reward file
(`path.py:function`) staged on the shared path as verl's custom reward function, and the registered
version's lineage down to the raw files.

The faults run the `pipeline` flow itself (`omni run` in a subprocess, Prefect's embedded API) as a
laptop user runs it: MLflow on sqlite (the embedded default; verl's own interpreter has no SQL store,
hence the relay) and no `backend.python` (the job runs the .venv-verl the Hydra check found), once:
ingest -> rl (GRPO from the module run's sft checkpoint) -> gspo (main_ppo's GSPO loss). The GRPO
trainer is SIGKILLed once a step is mirrored and the shared path emptied: the flow's task retry resumes
from S3 to the weights the uninterrupted run (the module run's rl stage) had at that step. Then, once the
GSPO job mirrored its first checkpoint, the flow-run process is SIGTERMed (what Prefect's worker sends
on cancel): the flow stops the Ray Job. (One flow for both: each verl RL job's start-up, its actors
importing verl one after another, is most of its time.)"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient
from pipeline_runs import run_in_order
from typer.testing import CliRunner
from verl_env import verl_python
from verl_jobs import (  # noqa: F401 - the job-path tests, collected here: they share this module's Ray head
    ray_jobs,
    test_a_job_that_would_fail_again_is_told_apart_from_a_killed_one,
    test_a_verl_omni_recipe_stage_goes_through_the_job_path_up_to_the_jobs_start,
    test_a_verl_omni_recipes_own_validation_goes_through_the_job_path_up_to_the_jobs_start,
    test_an_interpreter_without_verl_on_the_nodes_is_refused_before_any_submission,
    test_job_submission_finds_a_finished_job_and_stops_one_on_ctrl_c,
)

from omni_core.backends.jobs.job import STEP_LINE
from omni_core.backends.jobs.metrics import MetricsMissing
from omni_core.backends.verl.stage import REWARD_FILES
from omni_core.config import validate_pipeline
from omni_core.storage import Store
from omni_core.training.checkpoint import LATEST, MANIFEST, checkpoint_prefix, checkpoint_steps, stage_prefix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the module run: 3 verl jobs on a loaded 2-core machine

DIGITS = {"digits": {"source": "fixtures://digits?rows=120&seed=7", "converter": "digits"}}
TOTAL_STEPS = 80  # sft: the model answers in digits and has begun to learn the rotation (eval ~0.22)
SFT_SAVE_FREQ = 40
RL_STEPS = 4
# the fault run's GRPO stage: killed after step 1, resumed to step 2, compared with the module run's step 2
# (verl's learning rate is constant and its sampler's order seeded, so total_steps changes no step before it)
FAULT_RL_STEPS = 2
HF_WEIGHTS = "actor/huggingface/model.safetensors"  # verl's Hugging Face save in a main_ppo checkpoint
# one forward for 16 sequences (verl's default micro batch is 1: on CPU 16 single-row forwards cost ~1.6x the
# step); measured: the same weights and eval rewards as micro batch 1 on this module's runs
MICRO_BATCHES = [f"{role}_micro_batch_size_per_gpu=16" for role in (
    "actor_rollout_ref.actor.ppo", "actor_rollout_ref.rollout.log_prob", "actor_rollout_ref.ref.log_prob")]


def sft_stage(shared_dir: Path, **extra) -> dict:
    """The verl sft stage of this module's runs (the cancel test changes its steps)."""
    return {"name": "sft", "kind": "sft", "after": ["ingest"], "model": "tiny://lm", "data": "digits:train",
            "algorithm": {"name": "sft", "response": "ground_truth"},
            "trainer": {"total_steps": TOTAL_STEPS, "batch_size": 16, "lr": 3e-3},
            "checkpoint": {"save_freq": SFT_SAVE_FREQ, "max_to_keep": None},
            "backend": {"name": "verl", "python": verl_python(), "shared_dir": str(shared_dir), "device": "cpu",
                        "overrides": ["data.max_length=128", "data.micro_batch_size_per_gpu=16"]}, **extra}


def rl_stage(shared_dir: Path, reward: Path, *, name: str = "rl", algorithm: dict | None = None,
             steps: int = RL_STEPS, model: dict | str | None = None, n: int = 8, batch_size: int = 16,
             python: str | None = None, **extra) -> dict:
    """A verl main_ppo stage on CPU: GRPO by default, from the sft stage's checkpoint, the digits reward
    from a file of the user's (`reward_file`: partial credit, so a group's responses score differently
    and the policy gradient is not zero); `python` left out: the interpreter the Hydra check found."""
    return {"name": name, "kind": "rl", "after": ["sft"] if model is None else ["ingest"],
            "model": model or {"from": "sft"}, "data": "digits:train", "algorithm": algorithm or {"name": "grpo"},
            "rollout": {"n": n, "temperature": 1.0, "max_new_tokens": 8}, "reward": {"name": f"{reward}:rotation_score"},
            "trainer": {"total_steps": steps, "batch_size": batch_size, "lr": 5e-4, "max_prompt_tokens": 64},
            "checkpoint": {"save_freq": 1, "max_to_keep": None},
            "backend": {"name": "verl", **({"python": python} if python else {}), "shared_dir": str(shared_dir),
                        "device": "cpu", "overrides": ["trainer.val_before_train=false", *MICRO_BATCHES]}, **extra}


def reward_file(folder: Path) -> Path:
    """A user's reward file: our digits scorer (standard library only, as verl loads it) under a name of
    the user's, `rotation_score`."""
    path = folder / "rotation_reward.py"
    if not path.exists():
        path.write_text(Path(REWARD_FILES["digits"]).read_text() + "\n\nrotation_score = compute_score\n")
    return path


GSPO = {"name": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}


@pytest.fixture(scope="module")
def verl_s3(moto_server, tmp_path_factory):
    """S3 (moto) settings for the whole module (the uninterrupted run is module-scoped) and a bucket."""
    import uuid

    import boto3

    home = tmp_path_factory.mktemp("verl-s3")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"OMNI_S3_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(home / "no-aws-config"),
                            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
                            "OMNI_CACHE_DIR": str(home / "cache")}.items():
            mp.setenv(name, value)
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            mp.delenv(var, raising=False)
        bucket = f"omni-verl-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield bucket


@pytest.fixture(scope="module")
def uninterrupted(ray_jobs, mlflow_server, verl_s3, tmp_path_factory):  # noqa: F811
    """ingest -> sft (verl) -> rl (verl GRPO) -> eval -> register, run once."""
    store_uri = f"s3://{verl_s3}/store"
    shared = tmp_path_factory.mktemp("verl-e2e") / "shared"
    reward = reward_file(shared.parent)
    config = validate_pipeline({
        "name": "verl-e2e", "store": store_uri, "tracking_uri": mlflow_server.url,
        "ray": {"address": ray_jobs.get_address()}, "datasets": DIGITS,
        "stages": [
            {"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
            sft_stage(shared),
            rl_stage(shared, reward, python=verl_python()),
            # sampled (8 responses a row, the same random numbers for both): did GRPO help the sft checkpoint
            {"name": "eval", "kind": "eval", "after": ["rl"], "checkpoint_from": "rl", "data": "digits:test",
             "max_new_tokens": 8, "greedy": False, "n": 8, "samples": 2, "baseline": True},
            {"name": "eval_verl", "kind": "eval", "after": ["rl"], "checkpoint_from": "rl", "data": "digits:test",
             "engine": "trainer", "max_new_tokens": 8, "max_rows": 4, "samples": 2},
            {"name": "register", "kind": "register", "after": ["eval"], "model_name": "verl-e2e-rl"},
        ]})
    lines: list[str] = []
    run = run_in_order(config, progress=lines.append)
    return {"run": run, "lines": lines, "store_uri": store_uri, "shared": shared, "reward": reward}


def test_ingest_sft_on_verl_eval_register(uninterrupted, mlflow_server, ray_jobs, tmp_path):  # noqa: F811
    run, lines, store_uri = uninterrupted["run"], uninterrupted["lines"], uninterrupted["store_uri"]
    sft = run.outcomes["sft"]
    out = sft.outputs
    assert out["backend"] == "verl" and out["global_step"] == TOTAL_STEPS and not out["reused"]
    steps = list(range(1, TOTAL_STEPS + 1))
    assert [f"stage sft: step {n} of {TOTAL_STEPS}" for n in steps] == [
        ln for ln in lines if ln.startswith("stage sft: step ")], \
        "\n".join(line for line in lines if line.startswith("stage sft"))

    client = MlflowClient(mlflow_server.url)
    losses = client.get_metric_history(sft.mlflow_run_id, "train/loss")
    assert sorted(m.step for m in losses) == steps  # verl's own mlflow logger, in our child run
    tags = client.get_run(sft.mlflow_run_id).data.tags
    assert tags["omni.verl.version"] == "0.9.1"
    assert tags["omni.verl.submission_id"].startswith(f"omni-verl-verl-e2e-sft-{out['run_key']}-")  # + command digest
    assert "-m verl.trainer.sft_trainer" in tags["omni.verl.command"]
    artifacts = [a.path for a in client.list_artifacts(sft.mlflow_run_id, "verl")]
    assert "verl/command.json" in artifacts and any(p.endswith(".log") for p in artifacts)
    # verl logged through its file logger beside the checkpoints (relayed into our run by the driver; the
    # job itself knows no MLflow run), and Hydra's run folder is there too
    job_id = tags["omni.verl.submission_id"]
    job_env = ray_jobs.get_job_info(job_id).runtime_env["env_vars"]
    run_dir = uninterrupted["shared"] / "runs" / "verl-e2e" / out["run_key"] / "sft"
    assert job_env["VERL_FILE_LOGGER_PATH"] == f"{run_dir}/metrics/{job_id}.jsonl"
    assert not {"MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI"} & set(job_env)
    assert len((run_dir / "metrics" / f"{job_id}.jsonl").read_text().splitlines()) >= TOTAL_STEPS
    assert list(run_dir.glob("hydra/*/.hydra/config.yaml"))

    store = Store(store_uri)
    root = stage_prefix("verl-e2e", out["run_key"], "sft")
    assert checkpoint_steps(store, root) == {SFT_SAVE_FREQ: True, TOTAL_STEPS: True}  # all mirrored, with manifests
    final = store.read_json(f"{root}/checkpoints/global_step_{TOTAL_STEPS}/{MANIFEST}")
    assert final["source"] == "verl" and final["weights"] == "model.safetensors"
    paths = {f["path"] for f in final["files"]}
    assert {"model.safetensors", "config.json", "model_world_size_1_rank_0.pt"} <= paths
    # backend.hf_model: save (default): verl wrote the weights with its checkpoint, committed as they are,
    # and no merger job ran
    by_path = {f["path"]: f["sha256"] for f in final["files"]}
    assert by_path["model.safetensors"] == by_path["huggingface/model.safetensors"]
    assert not [j for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith(tags["omni.verl.submission_id"] + "-merge")]
    assert out["weights_sha256"] == next(f["sha256"] for f in final["files"] if f["path"] == "model.safetensors")
    assert out["checkpoint_uri"] == final["uri"]

    # ---- rl: verl's main_ppo GRPO from the sft checkpoint, on the CPU rollout
    rl = run.outcomes["rl"]
    rl_out = rl.outputs
    assert rl_out["backend"] == "verl" and rl_out["global_step"] == RL_STEPS and not rl_out["reused"]
    rl_tags = client.get_run(rl.mlflow_run_id).data.tags
    assert "-m verl.trainer.main_ppo" in rl_tags["omni.verl.command"]
    assert "actor_rollout_ref.rollout.name=omni_cpu" in rl_tags["omni.verl.command"]
    # the user's reward file, staged on the shared path by its content (an edit reaches only the next job)
    from omni_core.storage import file_sha256

    staged = uninterrupted["shared"] / "rewards" / file_sha256(uninterrupted["reward"])[:16] / "rotation_reward.py"
    assert staged.read_bytes() == uninterrupted["reward"].read_bytes()
    assert f"reward.custom_reward_function.path={staged}" in rl_tags["omni.verl.command"]
    assert "reward.custom_reward_function.name=rotation_score" in rl_tags["omni.verl.command"]
    assert rl_out["weights_sha256"] != out["weights_sha256"]  # trained from the sft checkpoint
    metrics = {name: client.get_metric_history(rl.mlflow_run_id, name) for name in (
        "critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean")}
    for name, history in metrics.items():
        assert sorted(m.step for m in history) == list(range(1, RL_STEPS + 1)), name
    # the rollout's log-probs are the actor's (the same weights, pushed before each step's generation)
    diff_max = max(m.value for m in metrics["training/rollout_probs_diff_max"])
    assert diff_max < 1e-3, diff_max
    print(f"verl GRPO on the CPU rollout: rollout-vs-actor |p diff| max {diff_max:.2e}, critic/score/mean "
          f"{[round(m.value, 3) for m in sorted(metrics['critic/score/mean'], key=lambda m: m.step)]}")
    # the CPU rollout generated each prompt's 8 samples together: 16 prompts x 8 samples in 16 groups of 8
    rl_job = rl_tags["omni.verl.submission_id"]
    rl_log = Path(client.download_artifacts(rl.mlflow_run_id, f"verl/{rl_job}.log", str(tmp_path))).read_text()
    assert "omni_cpu rollout: weights version 1: 128 requests in 16 groups (largest 8)" in rl_log, rl_log[-3000:]
    rl_root = stage_prefix("verl-e2e", rl_out["run_key"], "rl")
    assert checkpoint_steps(store, rl_root) == {step: True for step in range(1, RL_STEPS + 1)}

    evaluated = run.outcomes["eval"].outputs
    assert evaluated["weights_sha256"] == rl_out["weights_sha256"] and "val/reward_mean" in evaluated["metrics"]

    # ---- eval_verl (engine: trainer): verl's own validation of the rl checkpoint, a val-only Ray Job that
    # logs into the eval stage's run; its reward mean is ours
    by_verl = run.outcomes["eval_verl"]
    verl_metrics = by_verl.outputs["metrics"]
    assert by_verl.outputs["kind"] == "trainer" and by_verl.outputs["weights_sha256"] == rl_out["weights_sha256"]
    # digits_score returns `acc` too, so acc is verl's core var and the reward's score is in val-aux
    assert {"val-core/digits_rotate/acc/mean_at_1", "val-aux/digits_rotate/reward/mean_at_1"} <= set(verl_metrics), verl_metrics
    assert verl_metrics["val/reward_mean"] == verl_metrics["val-aux/digits_rotate/reward/mean_at_1"]
    val_tags = client.get_run(by_verl.mlflow_run_id).data.tags
    val_command = val_tags["omni.verl.command"]
    assert "-m verl.trainer.main_ppo" in val_command and "trainer.val_only=true" in val_command
    assert "data.val_max_samples=4" in val_command and "actor_rollout_ref.rollout.name=omni_cpu" in val_command
    assert "trainer.val_before_train=false" not in val_command  # the stage's own override, replaced
    assert val_tags["omni.eval.job_id"] == val_tags["omni.verl.submission_id"]
    logged = client.get_run(by_verl.mlflow_run_id).data.metrics
    assert logged["val-core/digits_rotate/acc/mean_at_1"] == verl_metrics["val-core/digits_rotate/acc/mean_at_1"]
    assert not client.get_metric_history(by_verl.mlflow_run_id, "actor/pg_loss")  # validated, did not train
    gain = evaluated["metrics"]["val/reward_mean_gain"]
    print(f"verl's validation of the rl checkpoint (4 test rows, greedy): val/reward_mean "
          f"{verl_metrics['val/reward_mean']:.3f}; our eval (8 sampled responses a row): rl "
          f"{evaluated['metrics']['val/reward_mean']:.4f}, its sft checkpoint "
          f"{evaluated['metrics']['val/reward_mean_baseline']:.4f}, gain {gain:+.4f}")
    # learning: verl's GRPO raised the eval reward over its sft checkpoint (seeded: the same every run;
    # 0.2156 -> 0.2365 when written). 4 steps of 16 prompts x 8 samples at lr 5e-4: from an sft checkpoint
    # that had not begun the rotation (0.079, a random answer's partial credit is 0.1) 4 steps of 8 x 4 at
    # lr 2e-3 followed noise (group-normalised advantages of near-random scores) and lost reward
    assert gain > 0, evaluated["metrics"]

    from flows.cli import app

    chain = CliRunner().invoke(app, ["lineage", "models:/verl-e2e-rl@candidate", "--json", "--tracking-uri",
                                     mlflow_server.url, "--store", store_uri])
    assert chain.exit_code == 0, (chain.output, chain.exception)
    lineage = json.loads(chain.stdout)
    assert lineage["checkpoint"]["uri"] == rl_out["checkpoint_uri"]
    assert lineage["checkpoint"]["sha256"] == rl_out["weights_sha256"]
    assert lineage["checkpoint"]["store_check"]["status"] == "ok"
    assert [(t["run_id"], t["algorithm"]) for t in lineage["training"]][:2] == [
        (rl.mlflow_run_id, "grpo"), (sft.mlflow_run_id, "sft")]
    [dataset] = {d["version"]: d for d in lineage["datasets"]}.values()
    manifest = store.read_json(f"datasets/digits/{dataset['version']}/_manifest.json")
    assert dataset["raw_source_uri"] == DIGITS["digits"]["source"]
    assert dataset["raw_files"] == [{"path": f["path"], "sha256": f["sha256"]} for f in manifest["raw_files"]]
    assert dataset["raw_files"]


# ---- the pipeline flow in a subprocess (`omni run`, Prefect's embedded API) ----------------------------


def _omni_run(workdir: Path, config: dict) -> tuple[subprocess.Popen, Path]:
    """`omni run` of `config` in its own session (its Prefect server child is cleaned up with it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "pipeline.yaml").write_text(yaml.safe_dump(config))
    out = workdir / "omni-run.log"
    env = {**os.environ, "PREFECT_HOME": str(workdir / "prefect"), "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    with open(out, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "pipeline.yaml"], cwd=workdir, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, out


def _end(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of its session (Prefect's server)


def _rl_trainers(shared_dir: Path) -> list[psutil.Process]:
    """verl main_ppo's driver of runs under `shared_dir` and its trainer loop (the TaskRunner actor, told
    apart from other runs' on this machine by the metrics file its job's env names)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        with contextlib.suppress(psutil.Error):
            if ("verl.trainer.main_ppo" in cmd and str(shared_dir) in cmd) or (
                    "TaskRunner" in cmd and str(shared_dir) in proc.environ().get("VERL_FILE_LOGGER_PATH", "")):
                found.append(proc)
    return found


def _kill_after_mirrored(store: Store, pipeline: str, shared_dir: Path, step: int, seen: dict,
                         stop: threading.Event) -> None:
    """Once verl's latest file names `step`: SIGSTOP the trainer (so it cannot finish meanwhile); once the
    store shows the step mirrored: SIGKILL it and empty the shared path (a new cluster), so the retry
    has to restore the checkpoint from S3."""
    frozen: list[psutil.Process] = []
    while not stop.is_set():
        if not frozen:
            for latest_file in shared_dir.glob(f"runs/{pipeline}/*/rl/{LATEST}"):
                text = latest_file.read_text().strip()
                if text.isdigit() and int(text) >= step:
                    frozen = _rl_trainers(shared_dir)
                    for proc in frozen:
                        proc.send_signal(signal.SIGSTOP)
        else:
            latest = [k for k in store.list(f"runs/{pipeline}") if k.endswith(f"/rl/{LATEST}")]
            if latest and int(store.read_text(latest[0]).strip()) >= step:
                seen["mirrored"] = int(store.read_text(latest[0]).strip())
                seen["root"] = latest[0].rsplit("/", 1)[0]
                seen["frozen"] = [" ".join(p.cmdline())[:80] for p in frozen]
                for proc in frozen:
                    proc.send_signal(signal.SIGKILL)
                psutil.wait_procs(frozen, timeout=30)
                shutil.rmtree(shared_dir, ignore_errors=True)
                seen["killed"] = True
                return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def faults(uninterrupted, ray_jobs, verl_s3, tmp_path_factory, prefect_db, mlflow_db):  # noqa: F811
    """`omni run` of ingest -> rl -> gspo on MLflow's sqlite, without backend.python: rl's trainer killed
    once (the retry resumes), then the flow-run process SIGTERMed once gspo's first checkpoint is mirrored
    (the cancel)."""
    store_uri = f"s3://{verl_s3}/store"
    workdir = tmp_path_factory.mktemp("verl-fault")
    shared = workdir / "shared"
    tracking = mlflow_db(workdir / "run" / "mlflow.db")  # the embedded default's tracking: sqlite
    sft_checkpoint = uninterrupted["run"].outcomes["sft"].outputs["checkpoint_uri"]
    reward = uninterrupted["reward"]
    config = {"name": "verl-fault", "store": store_uri, "tracking_uri": tracking,
              "ray": {"address": ray_jobs.get_address()}, "datasets": DIGITS,
              "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
                         rl_stage(shared, reward, model=sft_checkpoint, steps=FAULT_RL_STEPS,
                                  execution={"max_failures": 1, "retry_backoff_s": 1.0}),
                         # many steps: it is cancelled at its first mirrored checkpoint (smaller steps than
                         # rl's: nothing is compared with its weights)
                         {**rl_stage(shared, reward, name="gspo", algorithm=GSPO, steps=50, model=sft_checkpoint,
                                     n=4, batch_size=8), "after": ["rl"]}]}
    store = Store(store_uri)
    seen: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_after_mirrored, daemon=True,
                              args=(store, "verl-fault", shared, 1, seen, stop))
    killer.start()
    prefect_db(workdir / "run" / "prefect" / "prefect.db")  # Prefect's temporary server: no migrations to run
    proc, out = _omni_run(workdir / "run", config)
    try:
        deadline = time.monotonic() + 1200
        gspo_latest = None
        while gspo_latest is None or int(store.read_text(gspo_latest).strip() or 0) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-4000:]
            # verl writes its latest file on the shared path before the driver mirrors the step: the store (S3)
            # is listed only from then on, not every half second of the whole run
            if any(p.read_text().strip() not in ("", "0") for p in shared.glob(f"runs/verl-fault/*/gspo/{LATEST}")):
                gspo_latest = next((k for k in store.list("runs/verl-fault") if k.endswith(f"/gspo/{LATEST}")), None)
            time.sleep(0.5)
        [job] = [j for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith("omni-verl-verl-fault-gspo-")]
        running = ray_jobs.get_job_status(job.submission_id).value
        trainers = _rl_trainers(shared)
        proc.send_signal(signal.SIGTERM)  # what Prefect's worker sends the flow-run process on cancel
        code = proc.wait(timeout=120)
    finally:
        stop.set()
        _end(proc, timeout=0)
    return {"seen": seen, "code": code, "log": out.read_text(), "store": store, "shared": shared,
            "gspo_job": job.submission_id, "gspo_root": gspo_latest.rsplit("/", 1)[0], "running": running,
            "trainers": trainers, "tracking": tracking}


def test_a_killed_rl_trainer_is_retried_by_the_flow_and_resumes_from_s3_to_the_same_weights(
        faults, uninterrupted, ray_jobs, tmp_path):  # noqa: F811
    """The module run's GRPO stage again for its first 2 steps, inside the `pipeline` flow (`omni run`),
    from the same sft checkpoint (its URI): once it saved step 1 its driver and trainer loop are paused,
    and SIGKILLed once that step is mirrored to S3, and the shared path is deleted; the flow's task retry
    (`execution.max_failures: 1`) resubmits `-attempt-2`, which restores the mirrored checkpoint from S3
    and resumes with verl's resume_mode=auto. Its step-2 weights are byte-identical to the uninterrupted
    run's step 2: verl's GRPO on one CPU rank is deterministic with the CPU rollout (per-request sampling
    seeds, the batch sorted into submission order; runtime/omni_verl_cpu_rollout.py), and the restored optimizer
    state, data cursor and weights version carry the run on exactly."""
    seen, log, store, shared = faults["seen"], faults["log"], faults["store"], faults["shared"]
    assert seen.get("killed"), f"the trainer was never killed:\n{log[-3000:]}"
    assert any("main_ppo" in c for c in seen["frozen"]) and any("TaskRunner" in c for c in seen["frozen"]), seen
    mirrored, root = seen["mirrored"], seen["root"]
    assert "stage rl: verl resumes from global_step_" in log, log[-4000:]
    resumed = int(log.split("stage rl: verl resumes from global_step_")[1].split()[0])
    assert resumed >= mirrored  # restored from the mirror (the shared path was empty)

    run_key = root.split("/")[2]
    [attempt2] = [j.submission_id for j in ray_jobs.list_jobs()
                  if (j.submission_id or "").startswith(f"omni-verl-verl-fault-rl-{run_key}-")
                  and j.submission_id.endswith("-attempt-2")]
    # backend.python left out: the job ran the interpreter the Hydra check found (this checkout's .venv-verl)
    assert ray_jobs.get_job_info(attempt2).entrypoint.startswith(f"{verl_python()} -c ")
    client = MlflowClient(faults["tracking"])  # sqlite, as on a laptop
    [retried] = client.search_runs([client.get_experiment_by_name("verl-fault").experiment_id],
                                   f"tags.`omni.verl.submission_id` = '{attempt2}'")
    local = client.download_artifacts(retried.info.run_id, f"verl/{attempt2}.log", str(tmp_path))
    steps = [int(s) for s in STEP_LINE.findall(Path(local).read_text())]
    assert steps and min(steps) == resumed + 1 and max(steps) == FAULT_RL_STEPS  # resumed, not restarted
    # verl's metrics reached the stage's sqlite run (relayed by the driver from verl's file logger)
    for name in ("critic/score/mean", "actor/pg_loss"):
        assert {m.step for m in client.get_metric_history(retried.info.run_id, name)} >= {FAULT_RL_STEPS}, name

    # the restored optimizer state and data cursor are the mirrored bytes (restore checks every sha256)
    restored = store.read_json(f"{root}/checkpoints/global_step_{resumed}/{MANIFEST}")
    by_path = {f["path"]: f["sha256"] for f in restored["files"]}
    from omni_core.storage import file_digest

    run_dir = shared / "runs" / "verl-fault" / run_key / "rl"
    for name in ("actor/optim_world_size_1_rank_0.pt", "data.pt"):
        assert file_digest(run_dir / f"global_step_{resumed}" / name)[1] == by_path[name]
    # ... and the final weights are the uninterrupted run's at that step, byte for byte (verl's own Hugging
    # Face save, in every checkpoint; the final one's is also committed as the stage's weights)
    def digests(root_key: str, step: int) -> dict[str, str]:
        manifest = store.read_json(f"{checkpoint_prefix(root_key, step)}/{MANIFEST}")
        return {f["path"]: f["sha256"] for f in manifest["files"]}

    clean_root = stage_prefix("verl-e2e", uninterrupted["run"].outcomes["rl"].outputs["run_key"], "rl")
    final = digests(root, FAULT_RL_STEPS)
    assert final["model.safetensors"] == final[HF_WEIGHTS] == digests(clean_root, FAULT_RL_STEPS)[HF_WEIGHTS]
    assert final[HF_WEIGHTS] != by_path[HF_WEIGHTS]  # the step after the resumed one trained


def test_cancelling_the_flow_run_stops_the_ray_job(faults, ray_jobs):  # noqa: F811
    """Prefect's process worker cancels a flow run by SIGTERM to the flow-run process (its runner's
    graceful kill); Prefect's flow engine turns it into TerminationSignal in the flow's thread, while
    the stage follows its job in a task thread. The flow stops the Ray Job and waits for STOPPED before
    the process goes; verl's driver and trainer loop are gone with it. The job was the GSPO stage's
    (main_ppo's GSPO loss: its clip ratios, seq-mean-token-mean), to its first mirrored checkpoint."""
    log = faults["log"]
    assert faults["running"] == "RUNNING" and faults["trainers"], log[-3000:]
    assert faults["code"] != 0, log[-3000:]
    assert ray_jobs.get_job_status(faults["gspo_job"]).value == "STOPPED", log[-3000:]  # before the process went
    gone, alive = psutil.wait_procs(faults["trainers"], timeout=30)
    assert not alive and not _rl_trainers(faults["shared"])

    client = MlflowClient(faults["tracking"])
    [gspo] = client.search_runs([client.get_experiment_by_name("verl-fault").experiment_id],
                                f"tags.`omni.verl.submission_id` = '{faults['gspo_job']}'")
    gspo_command = gspo.data.tags["omni.verl.command"]
    for override in ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=0.0003",
                     "actor_rollout_ref.actor.clip_ratio_high=0.0004",
                     "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"):
        assert override in gspo_command, override
    mirrored = checkpoint_steps(faults["store"], faults["gspo_root"])
    assert mirrored.get(1) is True, mirrored  # its first checkpoint, mirrored with its manifest
    assert client.get_metric_history(gspo.info.run_id, "actor/pg_loss")


# ---- one Ray cluster, several stores: each store's run has its job, or finds the very same one ----------


@pytest.fixture(scope="module")
def stores_on_one_cluster(ray_jobs, tmp_path_factory, mlflow_db):  # noqa: F811
    """The same small pipeline (ingest -> verl sft, 3 steps) on the embedded default's store and tracking
    (a local folder, MLflow on sqlite), run in turn against three stores on this module's Ray head: `dev`
    and `prod` with shared paths of their own, then `beside`, another store on dev's shared path."""
    root = tmp_path_factory.mktemp("stores")

    def config(store: str, shared: str, steps: int = 3, overrides: tuple[str, ...] = ()):
        return validate_pipeline({
            "name": "laptop", "store": str(root / store / "store"), "tracking_uri": mlflow_db(root / store / "mlflow.db"),
            "ray": {"address": ray_jobs.get_address()}, "datasets": DIGITS,
            "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
                       {"name": "sft", "kind": "sft", "after": ["ingest"], "model": "tiny://lm", "data": "digits:train",
                        "algorithm": {"name": "sft", "response": "ground_truth"},
                        "trainer": {"total_steps": steps, "batch_size": 8, "lr": 1e-3},
                        "backend": {"name": "verl", "shared_dir": str(root / shared), "device": "cpu",
                                    "overrides": ["data.max_length=128", "data.micro_batch_size_per_gpu=8",
                                                  *overrides]}}]})

    runs = {}
    for name, store, shared in (("dev", "dev", "shared-dev"), ("prod", "prod", "shared-prod"),
                                ("beside", "beside", "shared-dev")):
        lines: list[str] = []
        runs[name] = (run_in_order(config(store, shared), progress=lines.append), lines)
    # and a job that trains but logs nothing: verl's loggers overridden to the console only
    with pytest.raises(MetricsMissing) as quiet:
        run_in_order(config("quiet", "shared-quiet", steps=1, overrides=("trainer.logger=[console]",)))
    return {**runs, "quiet": quiet.value}


def test_each_store_trains_its_own_job_and_its_metrics_land_in_its_sqlite_run(stores_on_one_cluster, ray_jobs):  # noqa: F811
    """The run key leaves out the store and the shared path; the submission id also holds the rendered
    command's digest, so prod (another shared path) submits its own job instead of following dev's
    finished one. A store on dev's shared path renders dev's very command: it follows dev's finished job
    (the same training), mirrors its checkpoints into its own store and relays its metrics into its own
    run. Every run's `train/loss` is in its sqlite MLflow run."""
    outcomes = {name: stores_on_one_cluster[name][0].outcomes["sft"] for name in ("dev", "prod", "beside")}
    keys = {o.outputs["run_key"] for o in outcomes.values()}
    assert len(keys) == 1  # one training, by the run key
    jobs = {}
    for name, outcome in outcomes.items():
        run, lines = stores_on_one_cluster[name]
        client = MlflowClient(run.config.tracking_uri)
        jobs[name] = client.get_run(outcome.mlflow_run_id).data.tags["omni.verl.submission_id"]
        assert sorted(m.step for m in client.get_metric_history(outcome.mlflow_run_id, "train/loss")) == [1, 2, 3], name
        store = Store(run.config.store)
        assert checkpoint_steps(store, stage_prefix("laptop", outcome.outputs["run_key"], "sft")) == {3: True}, name
        assert outcome.outputs["global_step"] == 3 and not outcome.outputs["reused"]
    assert jobs["dev"] != jobs["prod"]  # its own job
    assert jobs["beside"] == jobs["dev"]  # the same command: the same job, found finished
    assert any(f"Ray Job {jobs['dev']} (SUCCEEDED)" in line for line in stores_on_one_cluster["beside"][1])
    [key] = keys
    submitted = [j.submission_id for j in ray_jobs.list_jobs()
                 if (j.submission_id or "").startswith(f"omni-verl-laptop-sft-{key}-")]
    assert sorted(submitted) == sorted({jobs["dev"], jobs["prod"]})
    weights = {name: o.outputs["weights_sha256"] for name, o in outcomes.items()}
    assert weights["dev"] == weights["prod"] == weights["beside"]  # seeded: one training, one result


def test_a_job_that_logged_no_metric_fails_its_stage(stores_on_one_cluster):
    """verl's own loggers overridden to the console: the job trains and succeeds, but the stage's run got
    none of sft's `train/loss`, which is an error naming the metric and the file, not a silent pass."""
    message = str(stores_on_one_cluster["quiet"])
    assert "stage sft: verl job omni-verl-laptop-sft-" in message and "succeeded, but its MLflow run received none of " \
        "train/loss" in message, message
    assert "keep 'file' in trainer.logger" in message
