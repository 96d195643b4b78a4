"""Config loading, overrides, and the CLI's one-line errors (exit code 2, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omni_core.config import ConfigValidationError, apply_overrides, load_pipeline
from omni_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"
OMNI = [sys.executable, "-m", "flows.cli"]


def omni(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([*OMNI, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=120)


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def demo_data() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_demo_config_resolves_with_defaults_and_overrides() -> None:
    config = load_pipeline(DEMO, ["stages.rl.trainer.total_steps=3", "stages.rl.rollout.temperature=0.7",
                                  "seed=5", "store=s3://bucket/prefix"])
    rl = config.stage("rl")
    assert rl.trainer.total_steps == 3 and isinstance(rl.trainer.total_steps, int)
    assert rl.rollout.temperature == 0.7
    assert config.seed == 5 and config.store == "s3://bucket/prefix"
    assert [s.name for s in config.ordered_stages()] == ["ingest", "sft", "rl", "eval_sft", "eval", "register"]
    assert rl.algorithm.name == "grpo" and rl.trainer.max_grad_norm == 1.0  # defaults filled in


def test_override_by_stage_index_and_list_values() -> None:
    data = apply_overrides(demo_data(), ["stages.1.after=[]", "stages.ingest.datasets=[gsm8k]"])
    assert data["stages"][1]["after"] == [] and data["stages"][0]["datasets"] == ["gsm8k"]


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("stages.rl.trainer.total_steps=many", "stages.rl.trainer.total_steps: Input should be a valid integer"),
        ("stages.rl.trainer.total_step=3", "stages.rl.trainer.total_step: unknown key"),
        ("stages.rl.after=[nowhere]", "stages.rl.after: 'nowhere' is not a stage"),
        ("stages.rl.data=avqa", "stages.rl.data: 'avqa' is not under datasets"),
        ("stages.ingest.kind=train", "stages.ingest.kind: unknown stage kind 'train'"),
        ("stages.rl.algorithm.loss_agg_mode=mean", "stages.rl.algorithm.loss_agg_mode: Input should be"),
        ("stages.ingest.after=[rl]", "stages: after: dependencies form a cycle"),
    ],
)
def test_invalid_values_name_their_key_path(override: str, expected: str) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_pipeline(DEMO, [override])
    assert any(line.startswith(expected) for line in info.value.errors), info.value.errors


def test_every_error_is_reported() -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_pipeline(DEMO, ["stages.rl.trainer.total_steps=x", "stages.rl.bogus=1", "name=has space"])
    assert len(info.value.errors) == 3


@pytest.mark.parametrize("override", ["no_equals_sign", "stages.nope.trainer.lr=1", "name.sub=1"])
def test_malformed_overrides(override: str) -> None:
    with pytest.raises(ConfigError):
        load_pipeline(DEMO, [override])


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_cli_missing_file(tmp_path: Path) -> None:
    assert_one_line_error(omni("run", "missing.yaml", cwd=tmp_path), "missing.yaml", "no such pipeline file")


def test_cli_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage\x81")
    assert_one_line_error(omni("run", str(path), cwd=tmp_path), "binary.yaml", "cannot be read")


def test_cli_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "name: demo\nstages: [\n  - {name: a\n")
    assert_one_line_error(omni("run", str(path), cwd=tmp_path), "invalid YAML", "line")


def test_cli_unknown_key_and_wrong_type(tmp_path: Path) -> None:
    result = omni("run", str(DEMO), "stages.rl.trainer.epochs=2", cwd=tmp_path)
    assert_one_line_error(result, "stages.rl.trainer.epochs: unknown key")
    result = omni("run", str(DEMO), "stages.rl.trainer.lr=fast", cwd=tmp_path)
    assert_one_line_error(result, "stages.rl.trainer.lr: Input should be a valid number")


def test_cli_validate_lists_every_error(tmp_path: Path) -> None:
    result = omni("validate", str(DEMO), "stages.rl.trainer.lr=fast", "stages.rl.foo=1", cwd=tmp_path)
    assert result.returncode == 2
    assert "stages.rl.trainer.lr" in result.stderr and "stages.rl.foo: unknown key" in result.stderr
    ok = omni("validate", str(DEMO), "stages.rl.trainer.total_steps=7", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["stages"][2]["trainer"]["total_steps"] == 7


def test_a_misspelt_converter_or_reward_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """The names only a registry knows (omni_core.pipeline.names): validate, plan and run refuse each
    unknown one by its key, with the known names, before anything is created; a custom reward is
    refused only when its file is missing."""
    bad = ("datasets.gsm8k.converter=gsm8kk", "stages.rl.reward.name=digit", "stages.eval.reward.name=missing.py:score")
    wide = {"COLUMNS": "400"}  # one error a line
    for command in ("validate", "plan", "run"):
        result = omni(command, str(DEMO), *bad, cwd=tmp_path, env=wide)
        assert result.returncode == 2, result.stdout + result.stderr
        assert "3 error(s)" in result.stderr, result.stderr
        assert "datasets.gsm8k.converter: unknown converter 'gsm8kk'; known: avqa, digits, gsm8k" in result.stderr
        assert "stages.rl.reward.name: unknown reward 'digit'; known names: choice, default, digits" in result.stderr
        assert "stages.eval.reward.name: custom reward 'missing.py:score': file missing.py does not exist" in result.stderr
    assert not (tmp_path / ".omni").exists()  # no store, no MLflow database, no Prefect server
    (tmp_path / "mine.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                      "    return 0.0\n")
    ok = omni("validate", str(DEMO), "stages.rl.reward.name=mine.py:score", "stages.eval.reward.name=openai/gsm8k",
              cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr


def test_cli_debug_shows_traceback(tmp_path: Path) -> None:
    result = omni("--debug", "run", "missing.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_cli_unreachable_s3_endpoint(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"OMNI_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}
    result = omni("run", str(DEMO), "store=s3://bucket/omni", cwd=tmp_path, env=env)
    assert_one_line_error(result, f"127.0.0.1:{port}", "OMNI_S3_ENDPOINT_URL")


def test_cli_unwritable_store(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = omni("run", str(DEMO), f"store={blocker}/store", cwd=tmp_path)
    assert_one_line_error(result, str(blocker))


# ---- rl stage algorithms: options per algorithm, model options, combinations that cannot work -------

DPO = ROOT / "configs" / "dpo.yaml"
FLOW = ROOT / "configs" / "flow_grpo.yaml"


@pytest.mark.parametrize(
    ("path", "overrides", "expected"),
    [
        (DEMO, ["stages.rl.algorithm.beta=0.2"],
         "stages.rl.algorithm.beta: not an option of grpo (it is one of dpo, mpo); grpo takes: clip_ratio_low"),
        (DPO, ["stages.dpo.algorithm.clip_ratio_low=0.1"],
         "stages.dpo.algorithm.clip_ratio_low: not an option of dpo (it is one of grpo, gspo)"),
        (DPO, ["stages.dpo.algorithm.num_steps=4"], "stages.dpo.algorithm.num_steps: not an option of dpo"),
        (FLOW, ["stages.flow_grpo.algorithm.beta=0.2"], "stages.flow_grpo.algorithm.beta: not an option of flow_grpo"),
        (DPO, ["stages.dpo.algorithm.betta=0.2"], "stages.dpo.algorithm.betta: unknown key"),
        (DPO, ["stages.dpo.algorithm.name=ppo"],
         "stages.dpo.algorithm.name: unknown algorithm 'ppo'; known: dpo, flow_grpo, grpo, gspo, mpo, sft"),
        (DEMO, ["stages.sft.algorithm={name: grpo}"],
         "stages.sft.algorithm.name: a stage of kind sft trains with a supervised algorithm (sft), not grpo"),
        (DEMO, ["stages.rl.algorithm={name: sft}", "stages.rl.rollout={}", "stages.rl.reward={}",
                "stages.rl.trainer={total_steps: 2}"],
         "stages.rl.algorithm.name: sft is supervised fine-tuning: use kind: sft for this stage"),
        (DEMO, ["stages.sft.rollout.n=4"], "stages.sft.rollout.n: not used by sft"),
        (DEMO, ["stages.sft.algorithm.clip_ratio_low=0.1"],
         "stages.sft.algorithm.clip_ratio_low: not an option of sft (it is one of grpo, gspo); sft takes: response"),
        (DEMO, ["stages.rl.model={from: eval_sft}"],
         "stages.rl.model.from: 'eval_sft' is a stage of kind eval, not rl or sft"),
        (DEMO, ["stages.rl.model={from: nowhere}"], "stages.rl.model.from: 'nowhere' is not a stage"),
        (DEMO, ["stages.eval_sft.checkpoint_from=ingest"],
         "stages.eval_sft.checkpoint_from: 'ingest' is a stage of kind ingest, not rl or sft"),
        (DPO, ["stages.dpo.algorithm.lr=0.1"],
         "stages.dpo.algorithm: `lr` is not an algorithm option; set trainer.lr in the stage instead"),
        (FLOW, ["stages.flow_grpo.algorithm.group_size=8"], "stages.flow_grpo.algorithm: `group_size` is not an"),
        (DPO, ["stages.dpo.algorithm.loss_weights=[1.0, 2.0]"],
         "stages.dpo.algorithm: loss_weights: 1 loss types (sigmoid) but 2 loss_weights"),
        (DPO, ["stages.dpo.algorithm.beta=0"], "stages.dpo.algorithm.beta: Input should be greater than 0"),
        (DPO, ["stages.dpo.rollout.temperature=0.7"], "stages.dpo.rollout.temperature: not used by dpo"),
        (DPO, ["stages.dpo.reward.name=gsm8k"], "stages.dpo.reward.name: not used by dpo"),
        (FLOW, ["stages.flow_grpo.trainer.ppo_mini_batch_size=2"],
         "stages.flow_grpo.trainer.ppo_mini_batch_size: not used by flow_grpo"),
        (FLOW, ["stages.flow_grpo.model=tiny://lm"],
         "stages.flow_grpo.model: flow_grpo trains a text-to-image diffusion model (e.g. tiny://sd3), but tiny://lm"),
        (DEMO, ["stages.rl.model=tiny://sd3"], "stages.rl.model: grpo trains a language model"),
        (DPO, ["stages.dpo.model=tiny://sd3"], "stages.dpo.model: dpo trains a language model"),
        (FLOW, ["stages.flow_grpo.adapter=causal_lm"],
         "stages.flow_grpo.adapter: causal_lm is for a language model, but tiny://sd3 is"),
        (FLOW, ["stages.flow_grpo.model=./my-sd3", "stages.flow_grpo.adapter=qwen3_omni_thinker"],
         "stages.flow_grpo.adapter: flow_grpo trains a text-to-image diffusion model"),
        (DPO, ["stages.dpo.lora.rnak=8"], "stages.dpo.lora.rnak: unknown key"),
        (DPO, ["stages.dpo.lora.dropout=1.5"], "stages.dpo.lora.dropout: Input should be less than 1"),
        (DPO, ["stages.dpo.algorithm.name=gspo"], "stages.dpo.algorithm.beta: not an option of gspo (it is one of dpo, mpo)"),
        (DPO, ["stages.dpo.algorithm={name: grpo}"],
         "stages.dpo.data: grpo samples responses to prompts and rewards them, but 'omni_preference' holds "
         "preference pairs (converter omni_preference)"),
        (DEMO, ["stages.rl.algorithm={name: mpo}", "stages.rl.rollout={}", "stages.rl.reward={}",
                "stages.rl.trainer={total_steps: 2}"],
         "stages.rl.data: mpo trains on preference pairs (a dataset with converter omni_preference), "
         "but 'digits' uses converter digits"),
    ],
)
def test_rl_algorithm_errors_name_their_key_path(path: Path, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_pipeline(path, overrides)
    assert any(line.startswith(expected) for line in info.value.errors), info.value.errors


def test_example_pipelines_resolve_algorithm_defaults() -> None:
    dpo = load_pipeline(DPO, ["stages.dpo.trainer={total_steps: 2}", "stages.dpo.algorithm={name: mpo}"]).stage("dpo")
    assert (dpo.trainer.lr, dpo.trainer.batch_size, dpo.algorithm.weight_decay) == (1e-3, 8, 0.0)  # PreferenceConfig's
    dumped = dpo.model_dump(mode="json")
    assert set(dumped) >= {"model", "algorithm", "trainer"} and not {"rollout", "reward", "lora"} & set(dumped)
    assert set(dumped["trainer"]) == {"total_steps", "batch_size", "lr", "max_grad_norm"}
    assert set(dumped["algorithm"]) == {"name", "loss_type", "loss_weights", "beta", "label_smoothing",
                                        "average_log_prob", "weight_decay", "modality_weights"}
    assert type(dpo).model_validate(dumped) == dpo  # what the trainer actor receives

    flow = load_pipeline(FLOW, ["stages.flow_grpo.reward={}", "stages.flow_grpo.trainer={}",
                                "stages.flow_grpo.lora={rank: 4, target_modules: [attn.to_q]}"]).stage("flow_grpo")
    assert flow.reward.name == "jpeg_compressibility" and (flow.trainer.lr, flow.trainer.batch_size) == (3e-4, 2)
    assert flow.algorithm.weight_decay == 1e-4 and flow.lora.rank == 4 and flow.lora.target_modules == ["attn.to_q"]
    assert flow.model_dump(mode="json")["rollout"] == {"n": 4}

    demo = load_pipeline(DEMO).stage("rl")  # grpo keeps its sections whole and adds no model options
    dumped = demo.model_dump(mode="json")
    assert not {"adapter", "adapter_stage", "lora"} & set(dumped) and "temperature" in dumped["rollout"]
    assert set(dumped["algorithm"]) == {"name", "clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "adv_scale",
                                        "kl_beta"}


def test_cli_rl_algorithm_error_is_one_line(tmp_path: Path) -> None:
    result = omni("run", str(FLOW), "stages.flow_grpo.model=tiny://lm", cwd=tmp_path)
    assert_one_line_error(result, "stages.flow_grpo.model: flow_grpo trains a text-to-image diffusion model")
    ok = omni("validate", str(DPO), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["stages"][1]["algorithm"]["name"] == "dpo"


SWEEPS = {"sweep_demo.yaml": "demo.yaml"}  # an example sweep file -> the pipeline it sweeps


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_pipeline_validates(path: Path) -> None:
    if path.name in SWEEPS:  # a sweep file: planned against its pipeline (keys, metrics, rungs, variants)
        from omni_core.sweep.plan import plan_sweep
        from omni_core.sweep.spec import load_sweep

        assert plan_sweep(load_sweep(path), str(ROOT / "configs" / SWEEPS[path.name])).variants
        return
    config = load_pipeline(path)
    assert config.ordered_stages()  # references, dependency order and per-algorithm options all check out


def test_a_registered_policy_loss_is_an_algorithm_without_a_record() -> None:
    """Loss names are open: a function registered as a policy loss is usable as `algorithm.name`, with
    the policy-gradient options and trainer; an unregistered name fails naming the known ones."""
    import importlib

    from omni_core.training.algorithms import get_algorithm

    policy_loss = importlib.import_module("omni_core.algorithms.policy_loss")  # the module, not the function

    def clipped_more(*args, **kwargs):  # a new loss: one function, registered
        return policy_loss.grpo_policy_loss(*args, **kwargs)

    policy_loss.register_policy_loss("clipped_more")(clipped_more)
    try:
        rl = load_pipeline(DEMO, ["stages.rl.algorithm={name: clipped_more, clip_ratio_high: 0.3}"]).stage("rl")
        assert rl.algorithm.name == "clipped_more" and rl.algorithm.clip_ratio_high == 0.3
        assert rl.record is get_algorithm("grpo") and rl.record.separate_async
        assert rl.model_dump(mode="json")["algorithm"]["name"] == "clipped_more"
    finally:
        policy_loss._POLICY_LOSSES.pop("clipped_more")
    with pytest.raises(ConfigValidationError, match="unknown algorithm 'clipped_more'"):
        load_pipeline(DEMO, ["stages.rl.algorithm={name: clipped_more}"])


def test_model_from_an_upstream_stage_and_the_sft_stage() -> None:
    config = load_pipeline(DEMO)
    sft, rl = config.stage("sft"), config.stage("rl")
    assert sft.kind == "sft" and sft.algorithm.name == "sft" and sft.record.data == "supervised"
    assert set(sft.model_dump(mode="json")["trainer"]) == {"total_steps", "batch_size", "lr", "max_grad_norm",
                                                           "max_prompt_tokens"}
    assert not {"rollout", "reward"} & set(sft.model_dump(mode="json"))
    assert rl.model.from_ == "sft" and rl.model_dump(mode="json")["model"] == {"from": "sft"}
    assert type(rl).model_validate(rl.model_dump(mode="json")) == rl
    with pytest.raises(ValueError, match="from sft is not resolved yet"):
        _ = rl.model_uri
