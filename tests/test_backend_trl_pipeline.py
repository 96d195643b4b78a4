"""End to end with real TRL on CPU under a real Ray (2 Ray Train workers, one DDP group over gloo), an S3
store (moto) and an MLflow server: the two examples (configs/trl_grpo.yaml: ingest -> sft -> grpo -> eval
-> register; configs/trl_mpo.yaml: Omni-Preference pairs -> mpo -> eval -> register), smaller, run once in
this process; then the faults, in a pipeline of the grpo stage from the module run's sft checkpoint
driven by a subprocess:

1. a Ray Train worker SIGKILLed once checkpoint 2 is committed: Ray Train restarts the group, which
   resumes from the store;
2. the driver (its local Ray with it) SIGKILLed once the restarted group committed a checkpoint, and Ray
   Train's run folder and the workers' local folders deleted (a new machine);
3. `omni run` (the `pipeline` flow): the grpo stage resumes from the store's checkpoint (S3) -

ending with the uninterrupted run's grpo weights, bit for bit. Sizes are tiny (a 2-layer toy model, 6-token
completions); what is asserted is what the platform does around TRL."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient
from pipeline_runs import REWARD, run_in_order
from typer.testing import CliRunner

from omni_core.backends.trl.metrics import OWN_SECONDS
from omni_core.config import validate_pipeline
from omni_core.storage import Store
from omni_core.training.checkpoint import MANIFEST, checkpoint_steps, stage_prefix

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[1]
SFT_STEPS, GRPO_STEPS, SAVE_FREQ = 6, 6, 2  # grpo: checkpoints 2 and 4 (the faults' kills), then the final 6
KILL_WORKER_AT, KILL_DRIVER_AT = 2, 4
TRL_METRICS = ("reward", "reward_std", "rewards/score/mean", "completions/mean_length", "entropy", "loss",
               "learning_rate", "clip_ratio/low_mean", "timing_s/step")
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "loss", "timing_s/step")


@pytest.fixture(scope="module")
def trl_env(moto_server, mlflow_server, model_cache, tmp_path_factory):
    """S3 (moto) settings and the model cache for the module, then this process's own local Ray (2 CPUs),
    started with them so its workers see them; the reward file both grpo runs score with."""
    import boto3
    import ray

    home = tmp_path_factory.mktemp("trl")
    reward = home / "reward.py"
    reward.write_text(REWARD)
    if ray.is_initialized():
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"OMNI_S3_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
                            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                            "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(home / "no-aws-config"),
                            "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
                            "OMNI_CACHE_DIR": str(model_cache)}.items():
            mp.setenv(name, value)
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            mp.delenv(var, raising=False)
        bucket = f"omni-trl-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(Bucket=bucket)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
        try:
            yield {"store": f"s3://{bucket}/store", "reward": reward, "home": home}
        finally:
            ray.shutdown()


def grpo_example(env: dict, tracking_uri: str, name: str = "trl-grpo") -> dict:
    """configs/trl_grpo.yaml, smaller: 64 digits rows, SFT_STEPS sft steps, GRPO_STEPS grpo steps of 4 prompts
    x 4 completions (checkpoints every SAVE_FREQ), the reward that depends on every character (so GRPO always
    moves)."""
    config = yaml.safe_load((ROOT / "configs" / "trl_grpo.yaml").read_text())
    config.update({"name": name, "store": env["store"], "tracking_uri": tracking_uri})
    config["datasets"]["digits"]["source"] = "fixtures://digits?rows=64&seed=0"
    stages = {s["name"]: s for s in config["stages"]}
    stages["sft"]["trainer"] = {"total_steps": SFT_STEPS, "batch_size": 8, "lr": 3e-3}
    stages["grpo"].update({"rollout": {"n": 4, "max_new_tokens": 6}, "reward": {"name": f"{env['reward']}:score"},
                           "trainer": {"total_steps": GRPO_STEPS, "batch_size": 4, "lr": 1e-2},
                           "checkpoint": {"save_freq": SAVE_FREQ, "max_to_keep": None}})
    stages["eval"].update({"max_rows": 8, "max_new_tokens": 6, "reward": {"name": f"{env['reward']}:score"},
                           "baseline": False})  # the starting model's score: one more model scored, asserts nothing here
    return config


@pytest.fixture(scope="module")
def grpo_run(trl_env, mlflow_server):
    config = validate_pipeline(grpo_example(trl_env, mlflow_server.url))
    lines: list[str] = []
    return {"run": run_in_order(config, progress=lines.append), "lines": lines, "config": config}


@pytest.fixture(scope="module")
def mpo_run(trl_env, mlflow_server):
    config = yaml.safe_load((ROOT / "configs" / "trl_mpo.yaml").read_text())
    config.update({"name": "trl-mpo", "store": trl_env["store"], "tracking_uri": mlflow_server.url})
    next(s for s in config["stages"] if s["name"] == "mpo")["trainer"]["total_steps"] = 4
    lines: list[str] = []
    return {"run": run_in_order(validate_pipeline(config), progress=lines.append), "lines": lines}


def histories(client: MlflowClient, run_id: str, names: tuple[str, ...]) -> dict[str, list[int]]:
    return {name: sorted(m.step for m in client.get_metric_history(run_id, name)) for name in names}


def test_the_grpo_example_trains_on_trl_and_is_evaluated_registered_and_traced(grpo_run, trl_env, mlflow_server):
    run, lines = grpo_run["run"], grpo_run["lines"]
    sft, grpo = run.outcomes["sft"], run.outcomes["grpo"]
    for outcome, steps in ((sft, SFT_STEPS), (grpo, GRPO_STEPS)):
        out = outcome.outputs
        assert (out["backend"], out["global_step"], out["reused"]) == ("trl", steps, False)
    assert grpo.outputs["weights_sha256"] != sft.outputs["weights_sha256"]  # GRPO moved the sft weights
    client = MlflowClient(mlflow_server.url)
    # TRL's own metric names, every step once (rank 0), in each stage's MLflow child run
    assert histories(client, grpo.mlflow_run_id, TRL_METRICS) == {m: list(range(1, GRPO_STEPS + 1))
                                                                  for m in TRL_METRICS}
    assert histories(client, sft.mlflow_run_id, ("loss", "mean_token_accuracy")) == {
        "loss": list(range(1, SFT_STEPS + 1)), "mean_token_accuracy": list(range(1, SFT_STEPS + 1))}
    tags = client.get_run(grpo.mlflow_run_id).data.tags
    assert {k: tags[k] for k in ("omni.backend", "omni.trl.version", "omni.transformers.version",
                                 "omni.accelerate.version", "omni.trl.world_size", "omni.trl.num_threads",
                                 "omni.trl.worker_group_starts", "omni.trl.trainer")} == {
        "omni.backend": "trl", "omni.trl.version": "1.16.0", "omni.transformers.version": "5.25.0",
        "omni.accelerate.version": "1.15.0", "omni.trl.world_size": "2", "omni.trl.num_threads": "1",
        "omni.trl.worker_group_starts": "1", "omni.trl.trainer": "GRPOTrainer"}
    assert tags["omni.trl.ray_train_run"].startswith(f"omni-trl-grpo-grpo-{grpo.outputs['run_key']}-")
    seconds = client.get_run(grpo.mlflow_run_id).data.metrics  # the backend's own, once each (driver and rank 0)
    assert {f"trl/{name}_s" for name in OWN_SECONDS} - {"trl/restore_s"} <= set(seconds)
    assert seconds["trl/start_s"] > 0 and seconds["trl/setup_s"] > seconds["trl/data_s"] > 0
    progress = [ln for ln in lines if ln.startswith("[grpo] step ")]
    assert progress and progress[-1].startswith(f"[grpo] step {GRPO_STEPS}/{GRPO_STEPS}  reward=")
    assert "  len=" in progress[-1] and progress[-1].endswith("s")

    # the store: TRL's checkpoint-N (every rank's RNG state) committed every 2 steps, the final model last
    store = Store(trl_env["store"])
    root = stage_prefix("trl-grpo", grpo.outputs["run_key"], "grpo")
    assert checkpoint_steps(store, root) == {s: True for s in range(SAVE_FREQ, GRPO_STEPS + 1, SAVE_FREQ)}
    second = store.read_json(f"{root}/checkpoints/global_step_2/{MANIFEST}")
    assert second["model_format"] == "trl-checkpoint" and second["world_size"] == 2
    assert {"trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
            "model.safetensors"} <= {f["path"] for f in second["files"]}
    final = store.read_json(f"{root}/checkpoints/global_step_{GRPO_STEPS}/{MANIFEST}")
    assert final["model_format"] == "huggingface" and final["weights"] == "model.safetensors"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f["path"] for f in final["files"]}
    assert final["uri"] == grpo.outputs["checkpoint_uri"] and "optimizer.pt" not in {f["path"] for f in final["files"]}

    # eval, register, lineage and verify take the TRL checkpoint as they take a native one
    evaluated = run.outcomes["eval"].outputs
    assert evaluated["weights_sha256"] == grpo.outputs["weights_sha256"]
    assert "val/reward_mean" in evaluated["metrics"]
    assert run.outcomes["register"].outputs["version"]
    from flows.cli import app

    chain = CliRunner().invoke(app, ["lineage", "models:/digits-trl-grpo@candidate", "--json", "--tracking-uri",
                                     mlflow_server.url, "--store", trl_env["store"]])
    assert chain.exit_code == 0, (chain.output, chain.exception)
    lineage = json.loads(chain.stdout)
    assert (lineage["checkpoint"]["uri"], lineage["checkpoint"]["sha256"]) == (grpo.outputs["checkpoint_uri"],
                                                                               grpo.outputs["weights_sha256"])
    assert lineage["checkpoint"]["store_check"]["status"] == "ok"
    assert [(t["run_id"], t["algorithm"], t["backend"]) for t in lineage["training"]][:2] == [
        (grpo.mlflow_run_id, "grpo", "trl"), (sft.mlflow_run_id, "sft", "trl")]
    assert [d["raw_source_uri"] for d in lineage["datasets"]] == ["fixtures://digits?rows=64&seed=0"]
    verified = CliRunner().invoke(app, ["verify", final["uri"], "--store", trl_env["store"]])
    assert verified.exit_code == 0 and "MISMATCH" not in verified.output, verified.output


def test_the_mpo_example_trains_trls_dpo_with_mpos_losses_and_is_evaluated_and_registered(mpo_run, mlflow_server):
    run = mpo_run["run"]
    mpo = run.outcomes["mpo"]
    assert (mpo.outputs["backend"], mpo.outputs["global_step"]) == ("trl", 4)
    client = MlflowClient(mlflow_server.url)
    assert histories(client, mpo.mlflow_run_id, DPO_METRICS) == {m: [1, 2, 3, 4] for m in DPO_METRICS}
    assert client.get_run(mpo.mlflow_run_id).data.tags["omni.trl.trainer"] == "DPOTrainer"
    metrics = run.outcomes["eval"].outputs["metrics"]
    assert {"eval_rewards/accuracies", "eval_rewards/margins"} <= set(metrics)
    assert run.outcomes["register"].outputs["version"]
    assert any(ln.startswith("[mpo] step 4/4  loss=") for ln in mpo_run["lines"])


# ---- the faults: a killed driver, then `omni run` (subprocesses) -----------------------------------------


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _ray_train_workers(pid: int) -> list[psutil.Process]:
    found = []
    for proc in _descendants(pid):
        with contextlib.suppress(psutil.Error):
            if "RayTrainWorker" in " ".join(proc.cmdline()):
                found.append(proc)
    return found


def _saved_locally(tmp: Path) -> int:
    """The newest `checkpoint-N` folder a worker saved under its TMPDIR (`tmp`), which it does before
    committing that step to the store: a local glob, so the loop below lists the store (S3: ~20 ms of
    CPU between boto3 and moto a call) only once a commit is coming, not 20 times a second throughout."""
    steps = [int(p.name.split("-", 1)[1]) for p in tmp.glob("omni-trl-*/output/checkpoint-*")
             if p.name.split("-", 1)[1].isdigit()]
    return max(steps, default=0)


def _newest(store: Store, pipeline: str) -> int:
    """The newest committed grpo checkpoint of `pipeline` (0: none)."""
    suffix = f"/{MANIFEST}"
    steps = [int(k.rsplit("/global_step_", 1)[1][:-len(suffix)]) for k in store.list(f"runs/{pipeline}")
             if "/grpo/checkpoints/global_step_" in k and k.endswith(suffix)]
    return max(steps, default=0)


# The first driver: the pipeline's stages in order in a plain process (what the flow's tasks call, without
# starting Prefect's server for a run that is killed anyway); `omni run` is the second.
DRIVER = """
from omni_core.config import load_pipeline
from omni_core.pipeline.run import PipelineRun

config = load_pipeline("pipeline.yaml", [])
run = PipelineRun.start(config, progress=lambda line: print(line, flush=True))
for stage in config.ordered_stages():
    run.run_stage(stage.name)
run.finish(True)
"""


def _start(workdir: Path, env: dict[str, str], command: list[str]) -> tuple[subprocess.Popen, Path]:
    log = workdir / f"driver-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


def _kill_session(proc: subprocess.Popen) -> None:
    left = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in left:  # what left the session (Ray's processes)
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(left, timeout=30)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def faults(grpo_run, trl_env, mlflow_server, prefect_server, tmp_path_factory):
    """ingest -> grpo (from the module run's sft checkpoint): a worker killed at checkpoint 2, the driver
    once the restarted group committed one, Ray Train's and the workers' folders deleted, then `omni run`."""
    workdir = tmp_path_factory.mktemp("trl-fault")
    config = grpo_example(trl_env, mlflow_server.url, name="trl-fault")
    sft = grpo_run["run"].outcomes["sft"].outputs
    config["stages"] = [s for s in config["stages"] if s["name"] in ("ingest", "grpo")]
    config["stages"][1].update({"model": sft["checkpoint_uri"], "after": ["ingest"]})
    (workdir / "pipeline.yaml").write_text(yaml.safe_dump(config))
    cache = workdir / "cache"  # the drivers' own (the model is the sft checkpoint on S3)
    tmp = Path(tempfile.mkdtemp(prefix="trlf-", dir="/tmp"))  # short: Ray's socket paths live under it
    # `omni run` against the session's Prefect server (conftest: one server, not a temporary one per command)
    env = {**os.environ, "PREFECT_API_URL": prefect_server["PREFECT_API_URL"],
           "PREFECT_HOME": prefect_server["PREFECT_HOME"], "PYTHONUNBUFFERED": "1", "OMNI_CACHE_DIR": str(cache),
           "TMPDIR": str(tmp)}
    store = Store(trl_env["store"])
    seen: dict = {}
    first, first_log = _start(workdir, env, [sys.executable, "-c", DRIVER])
    try:
        deadline = time.monotonic() + 900
        while first.poll() is None and time.monotonic() < deadline:
            awaited = KILL_WORKER_AT if "worker" not in seen else max(seen["at_worker_kill"], KILL_DRIVER_AT - 1) + 1
            if _saved_locally(tmp) < awaited:
                time.sleep(0.05)
                continue
            newest = _newest(store, "trl-fault")
            if "worker" not in seen and newest >= KILL_WORKER_AT:
                workers = _ray_train_workers(first.pid)
                for worker in workers:  # frozen, so that none goes on meanwhile
                    worker.suspend()
                workers[-1].kill()  # Ray Train restarts the group
                workers[0].resume()
                seen.update(worker=len(workers), at_worker_kill=_newest(store, "trl-fault"))
            elif "worker" in seen and newest > max(seen["at_worker_kill"], KILL_DRIVER_AT - 1):
                _kill_session(first)  # a checkpoint the restarted group committed is there
                seen["driver"] = newest
                break
            time.sleep(0.05)
    finally:
        if first.poll() is None:
            _kill_session(first)
    if "driver" not in seen:
        pytest.fail(f"the first driver ended ({first.returncode}) before its faults ({seen}):\n"
                    + first_log.read_text()[-6000:])
    leftover = [p.pid for p in psutil.process_iter() if _environ(p).get("OMNI_CACHE_DIR") == str(cache)]
    seen["committed"] = sorted(s for s, ok in checkpoint_steps(store, _stage_root(store, "trl-fault")).items() if ok)
    shutil.rmtree(cache / "ray-train", ignore_errors=True)  # Ray Train's run folder
    shutil.rmtree(tmp)  # the workers' local TRL output (checkpoint-N folders)
    tmp.mkdir()
    second, second_log = _start(workdir, env, [sys.executable, "-m", "flows.cli", "run", "pipeline.yaml"])
    code = second.wait(timeout=900)
    _kill_session(second)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"seen": seen, "leftover": leftover, "first_log": first_log.read_text(), "code": code,
            "second_log": second_log.read_text(), "store": store}


def _environ(proc: psutil.Process) -> dict[str, str]:
    with contextlib.suppress(psutil.Error):
        return proc.environ()
    return {}


def _stage_root(store: Store, pipeline: str) -> str:
    [key] = {k.split("/checkpoints/")[0] for k in store.list(f"runs/{pipeline}") if "/grpo/checkpoints/" in k}
    return key


def test_a_killed_worker_and_a_killed_driver_resume_from_the_store_to_the_uninterrupted_weights(
        faults, grpo_run, mlflow_server):
    seen = faults["seen"]
    assert seen["worker"] == 2 and seen.get("driver"), (seen, faults["first_log"][-3000:])
    assert not faults["leftover"], "the killed driver left processes behind"
    assert faults["code"] == 0, faults["second_log"][-4000:]
    # the first driver's stage run: Ray Train restarted the worker group, which resumed from checkpoint 2
    client = MlflowClient(mlflow_server.url)
    runs = client.search_runs([client.get_experiment_by_name("trl-fault").experiment_id],
                              "tags.`omni.stage` = 'grpo'", order_by=["attributes.start_time ASC"])
    first, last = runs[0].data.tags, runs[-1].data.tags
    assert first["omni.trl.worker_group_starts"] == "2" and first["omni.resumed_from_step"] == str(
        seen["at_worker_kill"])
    # the second `omni run`: the stage resumed from the newest checkpoint the store had (S3), not step 0
    resumed = int(last["omni.resumed_from_step"])
    assert resumed == max(seen["committed"]) and resumed >= KILL_DRIVER_AT, (resumed, seen)
    assert last["omni.resumed_from"].startswith("s3://")
    store, root = faults["store"], _stage_root(faults["store"], "trl-fault")
    final = store.read_json(f"{root}/checkpoints/global_step_{GRPO_STEPS}/{MANIFEST}")
    uninterrupted = grpo_run["run"].outcomes["grpo"].outputs["weights_sha256"]
    assert next(f["sha256"] for f in final["files"] if f["path"] == "model.safetensors") == uninterrupted
    # every step logged once in each run, none twice across the restart of the worker group
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "reward"))
    assert steps == sorted(set(steps)) and steps[0] == 1
