"""`backend:` on sft / rl stages: native by default (digests unchanged), verl options checked at
validate time naming the stage key, the stage -> verl mapping composed by verl itself, and the plan
(`omni plan` / `omni run --dry-run`) printed by the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from verl_env import verl_python

from omni_core.backends.verl.check import compose_all
from omni_core.backends.verl.stage import command
from omni_core.config import config_digest, validate_pipeline
from omni_core.config.loader import ConfigValidationError
from omni_core.training.ray_stage import rl_run_key

REPO = Path(__file__).resolve().parents[1]


def pipeline(tmp_path: Path, sft: dict | None = None, rl: dict | None = None, **top) -> dict:
    shared = str(tmp_path / "shared")
    return {
        "name": "verlp", "store": str(tmp_path / "store"), "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
        "ray": {"address": "http://127.0.0.1:8265"},
        "datasets": {"gsm8k": {"source": "fixtures://gsm8k?rows=16&seed=0", "converter": "gsm8k"}},
        "stages": [
            {"name": "sft", "kind": "sft", "data": "gsm8k:train", "trainer": {"total_steps": 2, "batch_size": 4},
             "backend": {"name": "verl", "shared_dir": shared, "python": verl_python()},
             **(sft or {})},
            {"name": "rl", "kind": "rl", "after": ["sft"], "model": {"from": "sft"}, "data": "gsm8k:train",
             "algorithm": {"name": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
                           "loss_agg_mode": "seq-mean-token-mean"},
             "rollout": {"n": 8, "temperature": 0.9, "max_new_tokens": 64},
             "backend": {"name": "verl", "shared_dir": shared, "n_gpus_per_node": 8,
                         "overrides": ["actor_rollout_ref.rollout.gpu_memory_utilization=0.5"]},
             **(rl or {})},
        ], **top}


def error_of(data: dict) -> str:
    with pytest.raises(ConfigValidationError) as info:
        validate_pipeline(data)
    return "\n".join(info.value.errors)


# ---- backend: native stays what it was --------------------------------------------------------------


def test_native_is_the_default_and_leaves_digests_and_run_keys_unchanged():
    from omni_core.config import load_pipeline

    plain = load_pipeline(REPO / "configs" / "demo.yaml")
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    for stage in data["stages"]:
        if stage["kind"] in ("rl", "sft"):
            stage["backend"] = "native"
    explicit = validate_pipeline(data)
    trained = [s for s in plain.stages if s.kind in ("rl", "sft")]
    assert trained and all(s.backend == "native" for s in trained)
    assert all("backend" not in s.model_dump(mode="json") for s in trained)
    assert config_digest(explicit) == config_digest(plain)
    assert [rl_run_key(s, 0, "v1") for s in explicit.stages if s.kind in ("rl", "sft")] == \
        [rl_run_key(s, 0, "v1") for s in trained]


def test_where_verl_runs_is_not_in_the_run_key_but_what_it_trains_is(tmp_path):
    a = validate_pipeline(pipeline(tmp_path)).stage("rl")
    moved = pipeline(tmp_path)
    moved["stages"][1]["backend"].update(shared_dir=str(tmp_path / "other"), python="/opt/verl/bin/python",
                                         env={"NCCL_DEBUG": "INFO"})
    b = validate_pipeline(moved).stage("rl")
    changed = pipeline(tmp_path)
    changed["stages"][1]["backend"]["overrides"] = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"]
    c = validate_pipeline(changed).stage("rl")
    native = pipeline(tmp_path)
    del native["stages"][1]["backend"]
    d = validate_pipeline(native).stage("rl")
    assert rl_run_key(a, 0, "v1") == rl_run_key(b, 0, "v1")
    assert len({rl_run_key(s, 0, "v1") for s in (a, c, d)}) == 3
    # backend.python left out is not dumped (an interpreter is decided when the job is rendered)
    assert "python" not in a.backend.model_dump(mode="json") and b.backend.model_dump(mode="json")["python"]


def test_a_custom_reward_file_is_verls_custom_reward_function_and_its_bytes_key_the_training(tmp_path):
    """`reward: {name: path.py:function}` maps onto verl's custom reward function, read at a copy staged
    on the shared path by its content; its bytes, like those of a reward file named in backend.overrides,
    are part of the run key (an edited reward trains again, the same bytes at another path do not)."""
    from omni_core.backends.verl.stage import command
    from omni_core.storage import file_sha256

    reward = tmp_path / "my_reward.py"
    reward.write_text("def rotation(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    data = pipeline(tmp_path, rl={"reward": {"name": f"{reward}:rotation"}})
    stage = validate_pipeline(data).stage("rl")
    cmd = command(stage, pipeline="p", run_key="k", model="/m", train_files=["/d.parquet"], seed=0)
    staged = tmp_path / "shared" / "rewards" / file_sha256(reward)[:16] / "my_reward.py"
    assert f"reward.custom_reward_function.path={staged}" in cmd.overrides
    assert "reward.custom_reward_function.name=rotation" in cmd.overrides
    before = rl_run_key(stage, 0, "v1")
    reward.write_text(reward.read_text().replace("1.0", "0.0"))  # edited in place: every response scores 0
    assert rl_run_key(stage, 0, "v1") != before

    # a reward file named in backend.overrides (verl's own keys) is keyed by its bytes too
    other = tmp_path / "verl_reward.py"
    other.write_text("def compute_score(*a, **k):\n    return 1.0\n")
    overrides = [f"reward.custom_reward_function.path={other}", "reward.custom_reward_function.name=compute_score"]
    by_override = validate_pipeline(pipeline(tmp_path, rl={"backend": {
        **data["stages"][1]["backend"], "overrides": overrides}})).stage("rl")
    assert by_override.backend.input_files() == [str(other)]
    first = rl_run_key(by_override, 0, "v1")
    other.write_text("def compute_score(*a, **k):\n    return 0.0\n")
    assert rl_run_key(by_override, 0, "v1") != first

    # refused at validation: a relative path (each worker has its own directory), a missing file
    for path, expected in (("rel/reward.py", "give the reward file's absolute path"),
                           (str(tmp_path / "gone.py"), "does not exist")):
        error = error_of(pipeline(tmp_path, rl={"backend": {**data["stages"][1]["backend"],
                                                           "overrides": [f"+reward.custom_reward_function.path={path}"]}}))
        assert "stages.rl.backend.overrides:" in error and expected in error, error
    error = error_of(pipeline(tmp_path, rl={"reward": {"name": f"{tmp_path / 'missing.py'}:rotation"}}))
    assert "stages.rl.reward.name" in error and "missing.py" in error, error


# ---- what verl cannot honour is a config error naming the key ------------------------------------------


@pytest.mark.parametrize(("stage", "change", "expected"), [
    ("rl", {"execution": {"mode": "separate_async"}}, "stages.rl.execution.mode: backend verl schedules"),
    ("rl", {"rollout": {"max_num_seqs": 64}}, "stages.rl.rollout.max_num_seqs: an engine option"),
    ("rl", {"reward": {"name": "mmk12"}}, "stages.rl.reward.name: mmk12: verl scores each row"),
    ("rl", {"resources": {"rollout": {"GPU": 1}}}, "stages.rl.resources: not used by backend verl"),
    ("rl", {"algorithm": {"name": "grpo", "adv_scale": "batch"}}, "stages.rl.algorithm.adv_scale=batch"),
    ("rl", {"trainer": {"batch_size": 6, "ppo_mini_batch_size": 4}}, "stages.rl.trainer.ppo_mini_batch_size=4"),
    ("sft", {"lora": {"rank": 8, "dropout": 0.1}}, "stages.sft.lora.dropout=0.1"),
    ("sft", {"trainer": {"max_prompt_tokens": 64}}, "stages.sft.trainer.max_prompt_tokens: verl's sft_trainer"),
    ("sft", {"algorithm": {"name": "sft", "response": "chosen"}}, "stages.sft.algorithm.response: chosen"),
    ("sft", {"adapter": "causal_lm"}, "stages.sft.adapter: not used by backend verl"),
    ("sft", {"checkpoint": {"force_resume": True}}, "stages.sft.checkpoint.force_resume"),
    ("sft", {"backend": "verl"}, "backend: verl needs its options"),
    ("sft", {"backend": {"name": "verl", "shared_dir": "/s", "nnodes": 2}}, "stages.sft.backend.nnodes=2"),
])
def test_options_verl_cannot_honour_fail_validation_naming_the_key(tmp_path, stage, change, expected):
    data = pipeline(tmp_path)
    target = data["stages"][0 if stage == "sft" else 1]
    for key, value in change.items():
        target[key] = {**target[key], **value} if key == "backend" and isinstance(value, dict) else value
    assert expected in error_of(data)


def test_an_algorithm_without_a_verl_trainer_is_refused(tmp_path):
    from omni_core.backends.verl.stage import verl_problem
    from omni_core.training.algorithms import parse_options

    stage = validate_pipeline(pipeline(tmp_path)).stage("rl")
    dpo = stage.model_copy(update={"algorithm": parse_options({"name": "dpo"}, "grpo")})
    assert verl_problem(dpo).startswith("stages.rl.algorithm.name: dpo has no verl trainer here")
    assert verl_problem(stage) is None


def test_a_verl_stage_needs_the_job_servers_address(tmp_path):
    assert "ray.address: local, but stage sft runs on verl" in error_of(pipeline(tmp_path, ray={"address": "local"}))


# ---- the mapping, checked by verl 0.9.1 itself ----------------------------------------------------------


def test_stage_options_render_and_compose_in_verl(tmp_path, model_cache):
    from omni_core.models.tiny import tiny_model_dir

    config = validate_pipeline(pipeline(tmp_path, sft={"lora": {"rank": 4, "alpha": 8},
                                                       "checkpoint": {"save_freq": 1, "max_to_keep": 3}}))
    model = str(tiny_model_dir("lm", cache_dir=model_cache))
    files = [str(tmp_path / "shared" / "datasets" / "gsm8k" / "v1" / "train-00000.parquet")]
    sft = command(config.stage("sft"), pipeline="verlp", run_key="k1", model=model, train_files=files, seed=3)
    rl = command(config.stage("rl"), pipeline="verlp", run_key="k2", model=model, train_files=files, seed=3)
    results = compose_all([sft, rl], verl_python())
    for result in results:
        assert not isinstance(result, Exception), result
    s, r = results[0]["config"], results[1]["config"]
    assert s["trainer"]["total_training_steps"] == 2 and s["data"]["train_batch_size"] == 4
    assert s["optim"]["lr"] == 3e-3 and s["trainer"]["seed"] == 3  # the sft algorithm's default lr
    assert s["model"]["lora_rank"] == 4 and s["model"]["lora_alpha"] == 8
    assert s["trainer"]["save_freq"] == 1 and s["trainer"]["max_ckpt_to_keep"] == 3
    assert s["trainer"]["default_local_dir"] == f"{tmp_path}/shared/runs/verlp/k1/sft"
    actor = r["actor_rollout_ref"]["actor"]
    assert actor["policy_loss"]["loss_mode"] == "gspo" and actor["clip_ratio_low"] == 3e-4
    assert actor["loss_agg_mode"] == "seq-mean-token-mean"
    assert r["actor_rollout_ref"]["rollout"]["n"] == 8 and r["actor_rollout_ref"]["rollout"]["temperature"] == 0.9
    assert r["actor_rollout_ref"]["rollout"]["gpu_memory_utilization"] == 0.5  # backend.overrides, last
    assert r["data"]["max_response_length"] == 64 and r["trainer"]["n_gpus_per_node"] == 8


# ---- the plan, through the real CLI ----------------------------------------------------------------


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=REPO)


def test_plan_and_dry_run_print_the_ray_jobs_without_running_anything(tmp_path):
    from omni_core.config import DatasetConfig
    from omni_core.data.ingest import ingest
    from omni_core.storage import Store

    data = pipeline(tmp_path)
    store = Store(data["store"])
    version = ingest(store, "gsm8k", DatasetConfig(**data["datasets"]["gsm8k"]), progress=lambda _: None).version
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    secret = {"AWS_SECRET_ACCESS_KEY": "sekrit-value-1", "AWS_ACCESS_KEY_ID": "AKIA-TEST"}
    planned = cli("plan", str(path), "--json", env=secret)
    assert planned.returncode == 0, planned.stderr
    assert "sekrit" not in planned.stdout and "AKIA-TEST" not in planned.stdout
    entries = {e["name"]: e for e in json.loads(planned.stdout)}
    assert list(entries) == ["sft", "rl"]
    sft, rl = entries["sft"], entries["rl"]
    run_key = rl_run_key(validate_pipeline(data).stage("sft"), 0, version)
    assert sft["run_key"] == run_key and sft["submission_id"].startswith(f"omni-verl-verlp-sft-{run_key}-")
    shared = tmp_path / "shared"
    export = f"{shared}/datasets/gsm8k/{version}/sft"
    assert sft["stages"]["dataset"]["to"] == export
    assert sft["stages"]["dataset"]["files"] == [f"{export}/train-00000.parquet"]
    assert sft["stages"]["model"]["to"].startswith(f"{shared}/models/tiny/lm-")
    probe, train = sft["entrypoint"].split(" && ")  # verl's version into the job's log, then the trainer
    assert probe.startswith(f"{verl_python()} -c ") and train.startswith(f"{verl_python()} -m torch.distributed.run --standalone")
    assert f"trainer.default_local_dir={shared}/runs/verlp/{run_key}/sft" in sft["overrides"]
    assert "trainer.total_training_steps=2" in sft["overrides"]
    env = sft["runtime_env"]["env_vars"]
    assert env["AWS_SECRET_ACCESS_KEY"] == "<from the driver's $AWS_SECRET_ACCESS_KEY>"
    # the job logs through verl's file logger beside its checkpoints; the driver relays it into MLflow
    assert env["VERL_FILE_LOGGER_PATH"] == f"{shared}/runs/verlp/{run_key}/sft/metrics/{sft['submission_id']}.jsonl"
    assert "MLFLOW_TRACKING_URI" not in env
    # the grpo stage: its model is the sft stage's checkpoint, known only once that stage ran
    # backend.python left out: the job runs the interpreter the Hydra check composed its command with,
    # this checkout's .venv-verl (one decision for both)
    assert rl["entrypoint"].split(" && ")[1].startswith(f"{verl_python()} -m verl.trainer.main_ppo ")
    assert rl["overrides"][-1] == "actor_rollout_ref.rollout.gpu_memory_utilization=0.5"
    assert rl["stages"]["model"]["from"] == "<checkpoint of sft>" and rl["run_key"] is None
    assert f"{shared}/datasets/gsm8k/{version}/rl/train-00000.parquet" in rl["stages"]["dataset"]["files"]

    dry = cli("run", str(path), "--dry-run", env=secret)
    assert dry.returncode == 0, dry.stderr
    text = " ".join(dry.stdout.split())  # rich may wrap
    assert "sft (sft, backend verl): runs verl's sft trainer as Ray Job" in text
    assert "entrypoint: " + " ".join(sft["entrypoint"].split()) in text
    assert "sekrit" not in dry.stdout and "<from the driver's $AWS_SECRET_ACCESS_KEY>" in text
    assert not shared.exists()  # nothing staged, nothing submitted
    assert not list(Path(data["store"]).glob("pipelines/**/*"))


def test_a_verl_stage_is_retried_by_the_orchestrator_max_failures_times(tmp_path):
    """A verl stage's failed try (a killed trainer) is the orchestrator's to retry: the Prefect task of
    the stage gets `execution.max_failures` retries, `retry_backoff_s` doubling; a native stage keeps
    its kind's retries (it restarts its own actors max_failures times inside one try)."""
    from tasks.stages import stage_task

    data = pipeline(tmp_path, sft={"execution": {"max_failures": 2, "retry_backoff_s": 1.5}})
    config = validate_pipeline(data)
    sft = stage_task(config.stage("sft"))
    assert (sft.retries, sft.retry_delay_seconds) == (2, [1.5, 3.0])
    rl = stage_task(config.stage("rl"))  # the defaults: max_failures 3, retry_backoff_s 2
    assert (rl.retries, rl.retry_delay_seconds) == (3, [2.0, 4.0, 8.0])
    native = dict(data["stages"][0])
    native.pop("backend")
    native_config = validate_pipeline({**data, "stages": [native]})
    task = stage_task(native_config.stage("sft"))
    assert (task.retries, task.retry_delay_seconds) == (1, [5.0])


TORCHRUN_TAIL = """Traceback (most recent call last):
  File "/v/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:{space}
============================================================
verl.trainer.sft_trainer FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : {code} (pid: 25187)
{signal}  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_under_torchrun_the_ranks_own_exception_decides_a_retry():
    """verl's sft_trainer runs under torchrun, whose job ends with ChildFailedError whatever the rank did:
    the rank's own exception above it decides (a file it could not open: not retried), and a rank killed
    by a signal (a lost node, the OOM killer) is retried."""
    from omni_core.backends.jobs.job import permanent_failure

    rank_error = "FileNotFoundError: [Errno 2] No such file or directory: '/shared/runs/p/k/sft/metrics/j.jsonl'\n"
    failed = permanent_failure(rank_error + TORCHRUN_TAIL.format(code=1, signal="", space=" "))
    assert failed is not None and failed.startswith("a file the job reads does not exist: FileNotFoundError")
    killed = TORCHRUN_TAIL.format(code=-9, space=" ", signal="  error_file: <N/A>\n  Signal 9 (SIGKILL) received by PID 25187\n")
    assert permanent_failure(rank_error + killed) is None
    assert permanent_failure("Traceback (most recent call last):\nRuntimeError: NCCL timeout\n") is None
