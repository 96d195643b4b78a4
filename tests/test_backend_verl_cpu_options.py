"""`backend: {name: verl, device: cpu}`: the GPU command plus the CPU keys (rendered, planned by the real
CLI), options the CPU rollout cannot honour refused at validate time naming them, digests of configs
without `device` unchanged; and verl's own Hydra composition run by `omni validate`, `omni plan` and
`omni run --dry-run` before anything is staged (a misspelled override refused with Hydra's message,
the check skipped, saying why, where no interpreter has verl)."""

from __future__ import annotations

import json

import pytest
import yaml
from test_backend_verl_stage import cli, error_of, pipeline
from typer.testing import CliRunner
from verl_env import verl_python

from omni_core.backends.verl import VerlBackend, VerlTraining, interpreter, precheck, render
from omni_core.backends.verl.cpu import RUNTIME_DIR
from omni_core.config import config_digest, validate_pipeline


def grpo(device: str, **backend) -> tuple:
    b = VerlBackend(shared_dir="/shared", device=device, **backend)
    t = VerlTraining(task="grpo", model="/m", train_files=["/d/train.parquet"], total_steps=2, batch_size=4, lr=1e-3)
    return render(t, b, "/shared/runs/p/k/rl"), b


def test_device_cpu_is_the_gpu_command_plus_the_cpu_keys_and_env():
    gpu, _ = grpo("gpu")
    cpu, _ = grpo("cpu")
    assert cpu.module == gpu.module == "verl.trainer.main_ppo"
    keys = {o.split("=", 1)[0]: o for o in cpu.overrides}
    assert keys["actor_rollout_ref.rollout.name"] == "actor_rollout_ref.rollout.name=omni_cpu"
    for override in gpu.overrides:  # every GPU override is there, unchanged, except the rollout engine
        if not override.startswith("actor_rollout_ref.rollout.name="):
            assert override in cpu.overrides
    assert {"actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.fsdp_config.use_torch_compile=false", "trainer.device=cpu",
            "++actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
            "actor_rollout_ref.rollout.agent.num_workers=1", "reward.num_workers=1"} <= set(cpu.overrides)
    assert cpu.env["VERL_USE_EXTERNAL_MODULES"] == "omni_verl_cpu,omni_verl_cpu_rollout"
    assert cpu.env["PYTHONPATH"] == str(RUNTIME_DIR) and (RUNTIME_DIR / "omni_verl_cpu_rollout.py").is_file()
    assert gpu.env == {}
    # the job's Ray workers run verl's interpreter (a laptop's `ray start` may come from another one)
    assert "ray_kwargs.ray_init.runtime_env.py_executable=python3" in grpo("cpu", python="python3")[0].overrides
    # backend.python left out: the interpreter the job runs (.venv-verl here), for its workers too
    assert f"ray_kwargs.ray_init.runtime_env.py_executable={verl_python()}" in cpu.overrides
    # a user's PYTHONPATH is kept after ours; backend.overrides still come last
    mixed, _ = grpo("cpu", env={"PYTHONPATH": "/mine"}, overrides=["data.seed=3"])
    assert mixed.env["PYTHONPATH"] == f"{RUNTIME_DIR}:/mine" and mixed.overrides[-1] == "data.seed=3"


def test_device_is_not_dumped_when_unset_so_digests_stay(tmp_path):
    data = pipeline(tmp_path)
    plain = validate_pipeline(data)
    assert "device" not in plain.model_dump(mode="json")["stages"][0]["backend"]
    data["stages"][0]["backend"]["device"] = "gpu"
    assert config_digest(validate_pipeline(data).stage("sft")) == config_digest(plain.stage("sft"))
    data["stages"][0]["backend"]["device"] = "cpu"
    assert config_digest(validate_pipeline(data).stage("sft")) != config_digest(plain.stage("sft"))


CPU_RL = {"backend": {"name": "verl", "shared_dir": "/s", "device": "cpu"}}


@pytest.mark.parametrize(("backend", "expected"), [
    ({"rollout_engine": "vllm"}, "stages.rl.backend.rollout_engine: vllm: device cpu generates with verl's `omni_cpu`"),
    ({"n_gpus_per_node": 2}, "stages.rl.backend.n_gpus_per_node: 2: device cpu trains on one rank"),
    ({"nnodes": 2}, "stages.rl.backend.nnodes: 2"),
    ({"overrides": ["actor_rollout_ref.rollout.gpu_memory_utilization=0.5"]},
     "'actor_rollout_ref.rollout.gpu_memory_utilization=0.5': not honoured with device cpu (a vLLM / SGLang memory"),
    ({"overrides": ["+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"]}, "an option of vLLM's / SGLang's"),
    ({"overrides": ["trainer.v1.trainer_mode=separate_async"]}, "only sync runs"),
    ({"overrides": ["actor_rollout_ref.model.lora.merge=false"]}, "unmerged LoRA adapters"),
    ({"overrides": ["actor_rollout_ref.rollout.data_parallel_size=2"]}, "one replica of one rank"),
    ({"overrides": ["actor_rollout_ref.rollout.multi_turn.enable=true"]}, "tool loops need an HTTP rollout server"),
])
def test_options_the_cpu_rollout_cannot_honour_are_refused_naming_them(tmp_path, backend, expected):
    rl = {"backend": {**CPU_RL["backend"], **backend}}
    assert expected in error_of(pipeline(tmp_path, rl=rl))


def test_what_the_cpu_rollout_honours_passes(tmp_path):
    rl = {"backend": {**CPU_RL["backend"], "overrides": [
        "trainer.v1.trainer_mode=sync", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.model.lora.merge=true", "actor_rollout_ref.rollout.val_kwargs.temperature=0"]}}
    validate_pipeline(pipeline(tmp_path, rl=rl))


def test_plan_shows_the_command_with_the_cpu_rollout(tmp_path):
    data = pipeline(tmp_path, rl=CPU_RL)
    # and an eval by verl's own validation (engine: trainer): its val-only command is composed too
    data["stages"].append({"name": "eval", "kind": "eval", "after": ["rl"], "data": "gsm8k:test", "engine": "trainer",
                           "max_rows": 4})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    planned = cli("plan", str(path))
    assert planned.returncode == 0, planned.stderr
    text = " ".join(planned.stdout.split())
    assert "-m verl.trainer.main_ppo " in text and "actor_rollout_ref.rollout.name=omni_cpu" in text
    assert "omni_verl_cpu,omni_verl_cpu_rollout" in text and str(RUNTIME_DIR) in text
    assert "verl hydra check, stage rl: ok: composed by verl 0.9.1" in " ".join(planned.stderr.split())
    assert "verl hydra check, stage eval: ok: composed by verl 0.9.1" in " ".join(planned.stderr.split())
    assert "trainer.val_only=true" in text


TYPO = "actor_rollout_ref.actor.ppo_epoch=2"


def test_a_misspelled_override_is_refused_by_validate_plan_and_dry_run(tmp_path, monkeypatch):
    """verl's verdicts are kept in omni's cache: validate composes the two stages' commands in verl's
    interpreter, plan and the dry run read the verdicts (the same file, the same verl install)."""
    cache = tmp_path / "cache"
    data = pipeline(tmp_path, rl={"backend": {**CPU_RL["backend"], "overrides": [TYPO]}})
    validate_pipeline(data)  # our own validation cannot know verl's keys
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    for args in (["validate", str(path)], ["plan", str(path)], ["run", str(path), "--dry-run"]):
        out = cli(*args, env={"OMNI_CACHE_DIR": str(cache)})
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        err = " ".join(out.stderr.split())
        assert "stages.rl.backend.overrides: verl verl.trainer.main_ppo refuses the rendered command" in err, err
        assert "ppo_epoch" in err and "Key 'ppo_epoch' is not in struct" in err, err
        assert not (tmp_path / "shared").exists()
    verdicts = {f: json.loads(f.read_text()) for f in (cache / "verl-compose").glob("*.json")}
    assert sorted(v["ok"] for v in verdicts.values()) == [False, True]  # sft composes, rl is refused
    # the cache is what plan read: a verdict written there is the one reported (no interpreter started)
    [refused] = [f for f, v in verdicts.items() if not v["ok"]]
    refused.write_text(json.dumps({"ok": True, "error": ""}))
    monkeypatch.setenv("OMNI_CACHE_DIR", str(cache))
    results = {r.stage: r.status for r in precheck.check_pipeline(validate_pipeline(data))}
    assert results == {"sft": "ok", "rl": "ok"}
    # the key names the install (verl's version, its config files' newest mtime): a reinstall is asked again
    found = interpreter.resolve(verl_python())
    assert found.check == found.job == verl_python()
    _, version, newest = found.install.split()
    assert version == "0.9.1" and int(newest) > 0


def test_without_verl_the_check_is_skipped_saying_why(tmp_path, monkeypatch):
    from flows.cli import app

    monkeypatch.setattr(interpreter, "REPO_VERL_PYTHON", tmp_path / "no-venv-verl" / "python")
    data = pipeline(tmp_path, rl={"backend": {**CPU_RL["backend"], "python": str(tmp_path / "no-python"),
                                              "overrides": [TYPO]}})
    data["stages"][0]["backend"]["python"] = "python3"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (f"verl hydra check, stage rl: skipped: neither the job's interpreter ({tmp_path / 'no-python'}, "
            "backend.python) nor") in text
    assert "verl hydra check, stage sft: skipped: neither the job's interpreter (python3, backend.python)" in text
    assert "has verl installed here" in text
    # backend.python itself is used when it has verl
    assert interpreter.resolve(verl_python()).check_origin.startswith("verl 0.9.1 of backend.python")


def test_only_at_the_end_still_saves_the_last_step_of_main_ppo():
    """checkpoint.save_freq 0 means the final step only: main_ppo saves nothing with -1 (its check is
    `save_freq > 0`), so grpo/gspo render the step count; sft_trainer's -1 saves the last step."""
    ppo, _ = grpo("gpu")
    assert "trainer.save_freq=2" in ppo.overrides
    sft = render(VerlTraining(task="sft", model="/m", train_files=["/d.parquet"], total_steps=5, batch_size=4, lr=1e-3),
                 VerlBackend(shared_dir="/s"), "/s/runs/p/k/sft")
    assert "trainer.save_freq=-1" in sft.overrides
