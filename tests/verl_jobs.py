"""Jobs on a real `ray start --head` (127.0.0.1, its own temp dir): the `ray_jobs` fixture, and the
job-path tests that tests/test_backend_verl_pipeline.py collects on its own head (one cluster per
module; its pipeline runs the verl jobs themselves: the job's python is the verl environment, the log
tailed into progress and a file, checkpoints mirrored while the job runs, verl logging into our
MLflow run). Here: the runtime env, a resubmission finds the finished job, one after a stopped job is
`-attempt-2`, a Ctrl-C while following stops the job; and a VeRL-Omni recipe stage's job path up to
the job's start (its entry point needs GPUs)."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from job_head import start_job_head
from mlflow import MlflowClient
from verl_env import verl_python

from omni_core.backends.jobs.job import (
    JobFailed,
    command_digest,
    describe_env,
    follow,
    permanent_failure,
    probe_interpreter,
    runtime_env,
    stop,
    submission_id,
    submit,
)
from omni_core.backends.jobs.mirror import mirror_new
from omni_core.backends.verl import VerlCommand
from omni_core.backends.verl.runner import entrypoint_resources
from omni_core.storage import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_jobs():
    """A JobSubmissionClient on a Ray head of our own (tests/job_head.py), with the 8 logical CPUs verl's
    main_ppo on CPU places its workers, TransferQueue and agent loop on."""
    head, client = start_job_head(num_cpus=8)
    yield client
    head.stop()


def test_job_submission_finds_a_finished_job_and_stops_one_on_ctrl_c(ray_jobs, tmp_path):
    """submit/follow/stop on trivial commands (the verl jobs themselves run in the pipeline module)."""
    command = VerlCommand("sft", "true", "none", ["true"], [], {"VERL_ENV": "1"}, str(tmp_path / "run"))
    env = runtime_env(command, environ={"AWS_SECRET_ACCESS_KEY": "not-in-any-file", "UNRELATED": "x",
                                        "MLFLOW_TRACKING_PASSWORD": "not-for-the-job"})
    assert env["env_vars"] == {"VERL_ENV": "1", "AWS_SECRET_ACCESS_KEY": "not-in-any-file"}  # no MLflow: relayed
    assert "not-in-any-file" not in str(describe_env(env))
    sft, ppo = (replace(command, module=f"verl.trainer.{m}") for m in ("sft_trainer", "main_ppo"))
    assert (entrypoint_resources(sft, 8), entrypoint_resources(ppo, 8)) == ({"entrypoint_num_gpus": 8}, {})

    cpu = {"entrypoint_num_cpus": 1}  # no GPUs here; any entrypoint resource keeps Ray's NOSET variable off
    job = submit(ray_jobs, command, pipeline="gsm8k-sft", stage="sft", run_key="k1", env=env, resources=cpu,
                 metrics_dir=tmp_path / "run" / "metrics")
    digest = command_digest(command)
    assert job.submitted and job.submission_id == submission_id("gsm8k-sft", "sft", "k1", digest) \
        == f"omni-verl-gsm8k-sft-sft-k1-{digest[:8]}"
    lines: list[str] = []
    status = follow(ray_jobs, job.submission_id, total_steps=0, progress=lines.append, poll_s=0.5,
                    log_path=tmp_path / "job.log", timeout_s=120)
    assert status == "SUCCEEDED", (tmp_path / "job.log").read_text()[-3000:]
    info = ray_jobs.get_job_info(job.submission_id)
    assert info.metadata["omni.command_sha256"] == digest
    assert info.runtime_env["env_vars"]["VERL_FILE_LOGGER_PATH"] == f"{tmp_path}/run/metrics/{job.submission_id}.jsonl"
    again = submit(ray_jobs, command, pipeline="gsm8k-sft", stage="sft", run_key="k1", env=env, resources=cpu)
    assert (again.submission_id, again.submitted, again.status) == (job.submission_id, False, "SUCCEEDED")
    # the same run key with another command (another shared path: another store's run) is a job of its own
    elsewhere = replace(command, default_local_dir=str(tmp_path / "other"), argv=["true", "--other-shared-path"])
    other = submit(ray_jobs, elsewhere, pipeline="gsm8k-sft", stage="sft", run_key="k1", env=env, resources=cpu)
    assert other.submitted and other.submission_id != job.submission_id

    # a stopped (or failed) job is not found again: the next submission is attempt 2
    run_dir = tmp_path / "run"
    sleeper = VerlCommand("sft", "sleep", "none", ["sleep", "120"], [], {}, str(run_dir))
    first = submit(ray_jobs, sleeper, pipeline="p", stage="s", run_key="k2", env={})
    deadline = time.monotonic() + 60
    while ray_jobs.get_job_status(first.submission_id).value == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.5)
    stop(ray_jobs, first.submission_id)
    while ray_jobs.get_job_status(first.submission_id).value not in ("STOPPED", "FAILED"):
        time.sleep(0.5)
    second = submit(ray_jobs, sleeper, pipeline="p", stage="s", run_key="k2", env={})
    assert second.submitted and second.submission_id == f"{first.submission_id}-attempt-2"
    # Ctrl-C while following in the main thread: the job is stopped (and STOPPED) before it re-raises
    def interrupt_once_running() -> None:
        if ray_jobs.get_job_status(second.submission_id).value == "RUNNING":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        follow(ray_jobs, second.submission_id, total_steps=0, progress=lambda _: None, poll_s=0.2,
               on_poll=interrupt_once_running, timeout_s=120)
    assert ray_jobs.get_job_status(second.submission_id).value == "STOPPED"


def test_a_job_that_would_fail_again_is_told_apart_from_a_killed_one(ray_jobs, tmp_path):
    """What a failed job's own log says decides whether the stage is retried: an entry point that ended
    with a missing package or file, or a shell that could not start the interpreter, would fail the same
    way again (JobFailed, not retried); a trainer killed mid-run (a lost node) is worth a retry, even when
    a Ray actor printed a FileNotFoundError on its way down."""
    python = verl_python()

    def failed_log(argv: list[str], name: str, shell: str | None = None) -> str:
        command = VerlCommand("sft", "x", "none", argv, [], {}, str(tmp_path / name))
        job = submit(ray_jobs, command if shell is None else replace(command, argv=[shell]), pipeline="fail",
                     stage=name, run_key="k", env={}, resources={"entrypoint_num_cpus": 0})
        assert follow(ray_jobs, job.submission_id, total_steps=0, progress=lambda _: None, poll_s=0.3,
                      timeout_s=120) == "FAILED"
        return ray_jobs.get_job_logs(job.submission_id)

    missing = permanent_failure(failed_log([python, "-c", "import omni_not_a_package"], "missing"))
    assert missing == ("a package is missing in the job's interpreter: ModuleNotFoundError: No module named "
                       "'omni_not_a_package'"), missing
    killed = failed_log([python, "-c", "print('(TaskRunner pid=1) FileNotFoundError: [Errno 2] gone', flush=True); "
                                       "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], "killed")
    assert permanent_failure(killed) is None, killed
    no_interpreter = permanent_failure(failed_log([str(tmp_path / "no-such-python"), "-c", "1"], "nopython"))
    assert no_interpreter is not None and "no-such-python" in no_interpreter, no_interpreter
    with pytest.raises(JobFailed, match="not retried"):
        from omni_core.backends.jobs.runner import failed_for_good

        failed_for_good("stage x: verl job j", "FAILED", failed_log([python, "-c", "open('/no/such/file')"], "nofile"))


def test_an_interpreter_without_verl_on_the_nodes_is_refused_before_any_submission(ray_jobs, tmp_path, omni_cache,
                                                                                 mlflow_db):
    """The probe job asks the cluster's own nodes whether the job's interpreter has verl (kept on the
    cluster: a second probe finds it); a stage whose interpreter has none is refused with one message
    naming backend.python and what to set it to, and no training job is submitted."""
    import sys

    from omni_core.config import validate_pipeline
    from omni_core.errors import ConfigError
    from omni_core.pipeline.run import PipelineRun

    assert probe_interpreter(ray_jobs, verl_python())[0] == "0.9.1"
    version, log = probe_interpreter(ray_jobs, sys.executable)  # this project's .venv: no verl in it
    assert version is None and "PackageNotFoundError" in log
    probes = [j.submission_id for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith("omni-verl-probe-")]
    assert len(probes) == 2  # one per interpreter, each found again rather than submitted twice
    assert probe_interpreter(ray_jobs, verl_python())[0] == "0.9.1"
    assert len([j for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith("omni-verl-probe-")]) == 2

    config = validate_pipeline({
        "name": "no-verl", "store": str(tmp_path / "store"), "tracking_uri": mlflow_db(tmp_path / "mlflow.db"),
        "ray": {"address": ray_jobs.get_address()},
        "datasets": {"digits": {"source": "fixtures://digits?rows=8&seed=0", "converter": "digits"}},
        "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
                   {"name": "sft", "kind": "sft", "after": ["ingest"], "model": "tiny://lm", "data": "digits:train",
                    "algorithm": {"name": "sft", "response": "ground_truth"}, "trainer": {"total_steps": 1},
                    "backend": {"name": "verl", "device": "cpu", "shared_dir": str(tmp_path / "shared"),
                                "python": sys.executable}}]})
    run = PipelineRun.start(config)
    try:
        run.run_stage("ingest")
        with pytest.raises(ConfigError) as refused:
            run.run_stage("sft")
    finally:
        run.finish(False)
    message = str(refused.value)
    assert message.startswith(f"stages.sft.backend.python: the job's interpreter {sys.executable} (backend.python) "
                              f"has no verl on the Ray nodes of {ray_jobs.get_address()}, so no job was submitted")
    assert "set backend.python to an interpreter that has verl on the Ray nodes" in message
    assert not [j for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith("omni-verl-no-verl-")]


def _wrapper_python(tmp_path: Path) -> Path:
    """A job python that prints the env and argv it got, then runs an interpreter without verl_omni."""
    real = verl_python()  # an interpreter that exists, has no verl_omni
    wrapper = tmp_path / "python3"
    wrapper.write_text("#!/bin/sh\n"
                       'echo "omni-test-env=$VERL_USE_EXTERNAL_MODULES,$VERL_FILE_LOGGER_PATH"\n'
                       f"{real} -c 'import json, sys; print(\"omni-test-argv=\" + json.dumps(sys.argv[1:]))' \"$@\"\n"
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _verl_omni_pipeline(tmp_path: Path, address: str, tracking: str, wrapper: Path, shared: Path,
                        more_stages: tuple[dict, ...] = (), **gspo: object) -> object:
    """ingest MMK12 -> a `gspo` stage on VeRL-Omni's MMK12 recipe whose job python is `wrapper`."""
    from omni_core.config import validate_pipeline

    return validate_pipeline({
        "name": "vo", "store": str(tmp_path / "store"), "tracking_uri": tracking, "ray": {"address": address},
        "datasets": {"mmk12": {"source": "fixtures://mmk12?rows=4&seed=0", "converter": "mmk12"}},
        "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["mmk12"]},
                   {"name": "gspo", "kind": "rl", "after": ["ingest"], "model": "tiny://lm", "data": "mmk12:train",
                    "algorithm": {"name": "gspo"}, "trainer": {"total_steps": 2}, **gspo,
                    "backend": {"name": "verl_omni", "recipe": "qwen3-omni-thinker-gspo-mmk12",
                                "shared_dir": str(shared), "python": str(wrapper),
                                "entrypoint_resources": {"entrypoint_num_cpus": 1}}},
                   *more_stages]})


def test_a_verl_omni_recipes_own_validation_goes_through_the_job_path_up_to_the_jobs_start(
        ray_jobs, tmp_path, omni_cache, mlflow_db):
    """An eval stage with `engine: trainer` after a verl_omni stage: the recipe's final checkpoint (in the
    store, as its training mirrored it; the shared path empty, as on a new cluster) is put back on the
    shared path and the recipe's val-only command submitted with the eval run in its env. The job's
    python fails importing verl_omni (no GPUs here), which the eval stage reports, without a retry."""
    from omni_core.pipeline.run import PipelineRun
    from omni_core.training import rl_run_key
    from omni_core.training.checkpoint import LATEST, MANIFEST, stage_prefix

    wrapper, shared = _wrapper_python(tmp_path), tmp_path / "shared"
    tracking = mlflow_db(tmp_path / "mlflow.db")
    config = _verl_omni_pipeline(tmp_path, ray_jobs.get_address(), tracking, wrapper, shared, more_stages=(
        {"name": "eval", "kind": "eval", "after": ["gspo"], "data": "mmk12:test", "engine": "trainer", "max_rows": 2},))
    store = Store(config.store)
    lines: list[str] = []
    run = PipelineRun.start(config, progress=lines.append)
    try:
        version = run.run_stage("ingest").outputs["datasets"]["mmk12"]["version"]
        run_key = rl_run_key(config.stage("gspo"), 0, version)
        trained = tmp_path / "trained"  # the recipe's final checkpoint, mirrored as its training would
        (trained / "global_step_2" / "actor" / "lora_adapter").mkdir(parents=True)
        (trained / "global_step_2" / "actor" / "lora_adapter" / "adapter_model.safetensors").write_bytes(b"adapter")
        (trained / LATEST).write_text("2")
        root = stage_prefix("vo", run_key, "gspo")
        mirror_new(trained, store, root)
        key = f"{root}/checkpoints/global_step_2/{MANIFEST}"
        store.write_json(key, {**store.read_json(key), "weights": "actor/lora_adapter/adapter_model.safetensors"})
        assert run.run_stage("gspo").outputs["reused"]  # committed: no training job
        with pytest.raises(JobFailed) as failed:
            run.run_stage("eval")
    finally:
        run.finish(False)
    message = str(failed.value)
    assert "stage eval: VeRL-Omni validation job omni-verl-vo-eval-" in message and "is not retried" in message
    assert "a package is missing in the job's interpreter" in message and "No module named 'verl_omni'" in message
    [job_id] = [j.submission_id for j in ray_jobs.list_jobs() if (j.submission_id or "").startswith("omni-verl-vo-eval-")]
    checkpoints = shared / "runs" / "vo" / run_key / "gspo" / "checkpoints"
    restored = checkpoints / "global_step_2" / "actor" / "lora_adapter" / "adapter_model.safetensors"
    assert restored.read_bytes() == b"adapter"  # put back from the store's mirror
    log = ray_jobs.get_job_logs(job_id)
    # verl's file logger writes beside the trained stage's run folder: the driver relays it into the eval run
    assert f"omni-test-env=verl_omni,{shared}/runs/vo/{run_key}/gspo/metrics/{job_id}.jsonl" in log
    argv = json.loads(next(line for line in log.splitlines() if line.startswith("omni-test-argv="))
                      .removeprefix("omni-test-argv="))
    assert argv[:2] == ["-m", "verl_omni.trainer.main_omni"]
    assert argv[-6:] == ["trainer.val_before_train=true", "trainer.val_only=true", "trainer.resume_mode=resume_path",
                         f"trainer.resume_from_path={checkpoints}/global_step_2", "trainer.log_val_generations=16",
                         "data.val_max_samples=2"]
    assert "trainer.val_before_train=false" not in argv  # the recipe's own, replaced
    assert "actor_rollout_ref.rollout.val_kwargs.top_p=0.7" in argv  # the recipe's validation sampling
    assert any(a.startswith("data.val_files=") and a.endswith("/test.parquet") for a in argv)
    assert any(f"as Ray Job {job_id} (submitted)" in line for line in lines)


def test_a_verl_omni_recipe_stage_goes_through_the_job_path_up_to_the_jobs_start(ray_jobs, tmp_path, omni_cache,
                                                                               mlflow_db):
    """backend verl_omni on the real Ray head, through the pipeline's rl stage: the stage exports MMK12 in
    the recipe's layout, stages the model, submits the rendered command with its runtime env. The job's
    python is a wrapper around an interpreter without verl_omni (no GPUs here): it prints the argv and env
    it got, then fails importing verl_omni, which the stage reports as such (not retried: it would fail again)."""
    from omni_core.backends.verl_omni.stage import paths_for, recipe_command
    from omni_core.pipeline.run import PipelineRun

    wrapper, shared = _wrapper_python(tmp_path), tmp_path / "shared"
    tracking = mlflow_db(tmp_path / "mlflow.db")
    config = _verl_omni_pipeline(tmp_path, ray_jobs.get_address(), tracking, wrapper, shared,
                                 rollout={"n": 2}, checkpoint={"save_freq": 1})
    lines: list[str] = []
    run = PipelineRun.start(config, progress=lines.append)
    try:
        version = run.run_stage("ingest").outputs["datasets"]["mmk12"]["version"]
        with pytest.raises(JobFailed) as failed:
            run.run_stage("gspo")
    finally:
        run.finish(False)
    stage = config.stage("gspo")
    from omni_core.training import rl_run_key

    run_key = rl_run_key(stage, 0, version)
    # staged on the shared path: the export in the recipe's layout, the model
    folder = shared / "datasets" / "mmk12" / version / "verl_omni-inline"
    assert (folder / "_manifest.json").is_file() and (folder / "train.parquet").is_file()
    staged = sorted((shared / "models" / "tiny").iterdir())
    assert len(staged) == 1 and (staged[0] / "config.json").is_file()
    # the job Ray ran: the rendered command, its argv and env as the entry point saw them
    command = recipe_command(stage, paths_for(stage, pipeline="vo", run_key=run_key, model=str(staged[0]),
                                              train_files=[str(folder / "train.parquet")],
                                              val_files=[str(folder / "test.parquet")]))
    job_id = submission_id("vo", "gspo", run_key, command_digest(command))
    message = str(failed.value)
    assert f"VeRL-Omni job {job_id} failed and is not retried" in message
    assert "ModuleNotFoundError: No module named 'verl_omni'" in message  # the job's own error
    assert any(f"as Ray Job {job_id} (submitted)" in line for line in lines)
    info = ray_jobs.get_job_info(job_id)
    assert info.entrypoint == command.entrypoint
    assert info.runtime_env["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == "verl_omni"
    log = ray_jobs.get_job_logs(job_id)
    assert f"omni-test-env=verl_omni,{shared}/runs/vo/{run_key}/gspo/metrics/{job_id}.jsonl" in log
    argv = json.loads(next(line for line in log.splitlines() if line.startswith("omni-test-argv="))
                      .removeprefix("omni-test-argv="))
    assert [str(wrapper), *argv] == command.argv
    assert 'trainer.logger=["console","file"]' in argv and "actor_rollout_ref.rollout.n=2" in argv
    assert f"trainer.default_local_dir={shared}/runs/vo/{run_key}/gspo/checkpoints" in argv
    assert "trainer.total_training_steps=2" in argv and "trainer.save_freq=1" in argv
    # the stage's MLflow run: the job, the recipe and the command, the job's log as an artifact
    client = MlflowClient(tracking)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("vo").experiment_id],
                                  "tags.`mlflow.runName` = 'gspo'")
    tags = mlrun.data.tags
    assert (tags["omni.backend"], tags["omni.verl_omni.recipe"], tags["omni.verl.submission_id"]) == \
        ("verl_omni", "qwen3-omni-thinker-gspo-mmk12", job_id)
    assert {a.path for a in client.list_artifacts(mlrun.info.run_id, "verl")} == \
        {"verl/command.json", f"verl/{job_id}.log"}
