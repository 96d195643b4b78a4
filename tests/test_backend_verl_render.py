"""The verl backend's rendering: our options -> verl's Hydra overrides, checked by verl 0.9.1 itself
(Hydra composition on verl/trainer/config, then verl's own validation) in the verl environment."""

from __future__ import annotations

import pytest
from verl_env import verl_python

from omni_core.backends.verl.check import compose_all
from omni_core.backends.verl.options import VerlBackend, VerlTraining
from omni_core.backends.verl.render import hydra_value, render
from omni_core.errors import ConfigError

GSM8K = ["/shared/datasets/gsm8k/v1/train-00000.parquet", "/shared/datasets/gsm8k/v1/train-00001.parquet"]


def backend(tmp_path, **kw) -> VerlBackend:
    return VerlBackend(shared_dir=str(tmp_path / "shared"), **kw)


def training(task: str, model: str = "/models/qwen", **kw) -> VerlTraining:
    return VerlTraining(task=task, model=model, train_files=GSM8K, total_steps=5, batch_size=8, lr=1e-5, **kw)


# ---- rendering, without verl ---------------------------------------------------------------------


def test_hydra_values_read_back_as_written():
    assert hydra_value(None) == "null"
    assert hydra_value(True) == "true"
    assert hydra_value(3e-4) == "0.0003"
    assert hydra_value(["console", "mlflow"]) == "[console,mlflow]"
    assert hydra_value("/a/b-c.parquet") == "/a/b-c.parquet"
    # strings Hydra would read as another type, or that hold grammar characters, are quoted
    assert hydra_value("123") == "'123'"
    assert hydra_value("null") == "'null'"
    assert hydra_value("/data/my file,v2.parquet") == "'/data/my file,v2.parquet'"
    assert hydra_value("it's") == "'it\\'s'"


def test_sft_command_is_torchrun_with_absolute_run_dir_and_user_overrides_last(tmp_path):
    b = backend(tmp_path, python="/opt/verl/bin/python", n_gpus_per_node=4,
                overrides=["trainer.save_freq=7", "+model.override_config.attn_implementation=sdpa"],
                env={"VERL_LOGGING_LEVEL": "INFO"})
    run_dir = b.run_dir("pipe", "abc123", "sft")
    command = render(training("sft", save_freq=2, max_to_keep=3, lora_rank=16, lora_alpha=32,
                              lora_targets=["q_proj", "v_proj"]), b, run_dir)
    assert command.argv[:8] == ["/opt/verl/bin/python", "-m", "torch.distributed.run", "--standalone",
                                "--nnodes=1", "--nproc_per_node=4", "-m", "verl.trainer.sft_trainer"]
    assert f"trainer.default_local_dir={tmp_path}/shared/runs/pipe/abc123/sft" in command.overrides
    assert "trainer.logger=[console,file]" in command.overrides
    assert f"hydra.run.dir='{run_dir}/hydra/${{now:%Y-%m-%d_%H-%M-%S}}'" in command.overrides
    assert "trainer.max_ckpt_to_keep=3" in command.overrides
    assert "model.target_modules=[q_proj,v_proj]" in command.overrides
    assert command.overrides[-2:] == ["trainer.save_freq=7", "+model.override_config.attn_implementation=sdpa"]
    assert command.overrides.index("trainer.save_freq=2") < command.overrides.index("trainer.save_freq=7")
    assert command.env == {"VERL_LOGGING_LEVEL": "INFO"}
    assert "'trainer.logger=[console,file]'" in command.entrypoint  # shell-quoted for the Ray Job
    # the entry point prints verl's version first (the run's tag, without a second job), then trains
    probe, train = command.entrypoint.split(" && ")
    assert probe.startswith("/opt/verl/bin/python -c ") and "omni-verl-version=" in probe
    assert train.startswith("/opt/verl/bin/python -m torch.distributed.run ")
    # hf_model: save (default) has verl write the Hugging Face weights with every checkpoint; merge does not
    assert "checkpoint.save_contents=[model,optimizer,extra,hf_model]" in command.overrides
    merge = render(training("sft"), backend(tmp_path, hf_model="merge"), run_dir)
    assert "checkpoint.save_contents=[model,optimizer,extra]" in merge.overrides
    grpo = render(training("grpo"), b, run_dir)
    assert "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]" in grpo.overrides


def test_options_verl_cannot_honour_are_config_errors_naming_the_key(tmp_path):
    b = backend(tmp_path)
    run_dir = b.run_dir("p", "k", "s")
    cases = {
        "rollout_n": training("sft", rollout_n=8),
        "lora.dropout": training("sft", lora_rank=8, lora_dropout=0.05),
        "algorithm.adv_scale=batch": training("grpo", adv_scale="batch"),
        "algorithm.loss_agg_mode": training("gspo", loss_agg_mode="seq-mean-token-sum"),
        "lora.alpha": training("grpo", lora_rank=8, lora_alpha=16.5),
        "resume_from_path": training("sft", resume_mode="resume_path"),
        "ppo_mini_batch_size": training("grpo", ppo_mini_batch_size=3),
    }
    for key, t in cases.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("=", "=")):
            render(t, b, run_dir)
    with pytest.raises(ConfigError, match="backend.nnodes=2"):
        render(training("sft"), backend(tmp_path, nnodes=2), run_dir)
    with pytest.raises(ConfigError, match="relative"):
        render(training("sft"), b, "runs/p/k/s")


def test_backend_options_are_checked(tmp_path):
    assert VerlBackend(shared_dir="rel/shared").shared_dir.startswith("/")
    with pytest.raises(ValueError, match="not a Hydra override"):
        VerlBackend(shared_dir=str(tmp_path), overrides=["trainer.total_epochs"])
    with pytest.raises(ValueError, match="extra"):
        VerlBackend(shared_dir=str(tmp_path), gpus=8)
    with pytest.raises(ValueError, match="hf_model"):
        VerlBackend(shared_dir=str(tmp_path), hf_model="gather")


# ---- verl itself composes and validates what we render ---------------------------------------------


@pytest.fixture(scope="module")
def composed(tmp_path_factory, model_cache):
    """Every command below checked by verl 0.9.1 in one interpreter start."""
    from omni_core.models.tiny import tiny_model_dir

    tmp = tmp_path_factory.mktemp("verl-render")
    model = str(tiny_model_dir("lm", cache_dir=model_cache))  # sft's validation loads its config and tokenizer
    b = backend(tmp)
    commands = {
        "sft": render(training("sft", model=model, val_files=GSM8K[:1], save_freq=1, max_to_keep=2, lora_rank=8,
                               lora_alpha=16, lora_targets="all-linear", resume_mode="auto"),
                      b, b.run_dir("gsm8k-sft", "k1", "sft")),
        "grpo": render(training("grpo", model=model, rollout_n=8, temperature=0.9, max_new_tokens=256, kl_beta=0.01,
                                ppo_mini_batch_size=4, save_freq=2, max_to_keep=1, resume_mode="disable"),
                       b, b.run_dir("gsm8k-rl", "k2", "rl")),
        "gspo": render(training("gspo", model=model, rollout_n=4, adv_scale="none"), b, b.run_dir("gsm8k-rl", "k3", "rl")),
        "sft_merge": render(training("sft", model=model), backend(tmp, hf_model="merge"), b.run_dir("p", "k", "m")),
        "user_override": render(training("grpo", model=model), backend(tmp, overrides=["trainer.save_freq=9"]),
                                b.run_dir("p", "k", "s")),
        "misspelled": render(training("grpo", model=model), backend(tmp, overrides=["trainer.totl_training_steps=3"]),
                             b.run_dir("p", "k", "s")),
    }
    return dict(zip(commands, compose_all(list(commands.values()), verl_python()), strict=True)), tmp


def test_sft_on_gsm8k_answers_composes_and_validates(composed):
    results, tmp = composed
    sft = results["sft"]
    assert not isinstance(sft, ConfigError), sft
    assert sft["verl_version"] == "0.9.1"
    config = sft["config"]
    assert config["trainer"]["default_local_dir"] == f"{tmp}/shared/runs/gsm8k-sft/k1/sft"
    assert config["trainer"]["logger"] == ["console", "file"]
    assert config["trainer"]["total_training_steps"] == 5 and config["trainer"]["save_freq"] == 1
    assert config["trainer"]["max_ckpt_to_keep"] == 2 and config["trainer"]["resume_mode"] == "auto"
    assert config["data"]["train_files"] == GSM8K and config["data"]["messages_key"] == "messages"
    assert config["model"]["lora_rank"] == 8 and config["model"]["lora_alpha"] == 16
    assert config["optim"]["lr"] == 1e-5
    assert config["checkpoint"]["save_contents"] == ["model", "optimizer", "extra", "hf_model"]
    assert results["sft_merge"]["config"]["checkpoint"]["save_contents"] == ["model", "optimizer", "extra"]


def test_grpo_and_gspo_on_gsm8k_compose_and_pass_validate_config(composed):
    results, tmp = composed
    for name in ("grpo", "gspo"):
        assert not isinstance(results[name], ConfigError), results[name]
    grpo, gspo = results["grpo"]["config"], results["gspo"]["config"]
    actor = grpo["actor_rollout_ref"]["actor"]
    assert grpo["algorithm"]["adv_estimator"] == "grpo" and grpo["algorithm"]["norm_adv_by_std_in_grpo"] is True
    assert actor["policy_loss"]["loss_mode"] == "vanilla"
    assert actor["use_kl_loss"] is True and actor["kl_loss_coef"] == 0.01 and actor["kl_loss_type"] == "low_var_kl"
    assert grpo["actor_rollout_ref"]["rollout"]["n"] == 8 and grpo["actor_rollout_ref"]["rollout"]["temperature"] == 0.9
    assert grpo["actor_rollout_ref"]["rollout"]["response_length"] == 256  # follows data.max_response_length
    assert grpo["trainer"]["max_actor_ckpt_to_keep"] == 1 and grpo["trainer"]["resume_mode"] == "disable"
    assert grpo["trainer"]["use_v1"] is True
    assert actor["checkpoint"]["save_contents"] == ["model", "optimizer", "extra", "hf_model"]
    g_actor = gspo["actor_rollout_ref"]["actor"]
    assert g_actor["policy_loss"]["loss_mode"] == "gspo"
    assert (g_actor["clip_ratio_low"], g_actor["clip_ratio_high"]) == (3e-4, 4e-4)
    assert g_actor["loss_agg_mode"] == "seq-mean-token-mean" and g_actor["use_kl_loss"] is False
    assert gspo["algorithm"]["norm_adv_by_std_in_grpo"] is False
    assert gspo["trainer"]["default_local_dir"] == f"{tmp}/shared/runs/gsm8k-rl/k3/rl"


def test_user_overrides_win_and_a_misspelled_one_fails_with_hydras_message(composed):
    results, _ = composed
    assert results["user_override"]["config"]["trainer"]["save_freq"] == 9
    error = results["misspelled"]
    assert isinstance(error, ConfigError)
    assert "Could not override 'trainer.totl_training_steps'" in str(error)
    assert "compose" in str(error)
