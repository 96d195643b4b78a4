"""The `rl` stage beyond GRPO: DPO on Omni-Preference pairs and FlowGRPO on tiny://sd3, each through
the real stage path (pipeline API: ingest, Ray actor, MLflow, checkpoint), and run again to show the
run key is reused. Built from configs/dpo.yaml and configs/flow_grpo.yaml with 2 steps each."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from pipeline_runs import run_in_order
from safetensors.numpy import load_file

from omni_core.config import load_pipeline
from omni_core.training import rl_run_key

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(pipeline_model_env: Path) -> Path:
    return pipeline_model_env


def run_pipeline(config_file: str, workdir: Path, *overrides: str) -> dict:
    config = load_pipeline(ROOT / "configs" / config_file, [
        f"store={workdir / 'store'}", f"tracking_uri=sqlite:///{workdir / 'mlflow.db'}", "ray.num_cpus=2", *overrides])
    lines: list[str] = []
    run = run_in_order(config, progress=lines.append)
    return {"config": config, "run": run, "lines": lines}


def run_twice(config_file: str, stage: str, workdir: Path) -> dict:
    steps = f"stages.{stage}.trainer.total_steps=2"
    first = run_pipeline(config_file, workdir, steps)
    second = run_pipeline(config_file, workdir, steps)
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(first["config"].name)
    runs = client.search_runs([experiment.experiment_id], f"tags.`mlflow.runName` = '{stage}'",
                              order_by=["attributes.start_time ASC"])
    return {"first": first["run"].outcomes[stage], "second": second["run"].outcomes[stage],
            "config": first["config"], "lines": second["lines"], "client": client, "runs": runs}


@pytest.fixture(scope="module")
def dpo(env: Path, tmp_path_factory: pytest.TempPathFactory, mlflow_db: Callable[[Path], str]) -> dict:
    workdir = tmp_path_factory.mktemp("dpo")
    mlflow_db(workdir / "mlflow.db")
    return run_twice("dpo.yaml", "dpo", workdir)


@pytest.fixture(scope="module")
def flow(env: Path, tmp_path_factory: pytest.TempPathFactory, mlflow_db: Callable[[Path], str]) -> dict:
    workdir = tmp_path_factory.mktemp("flow")
    mlflow_db(workdir / "mlflow.db")
    return run_twice("flow_grpo.yaml", "flow_grpo", workdir)


def committed_checkpoint(result: dict, weights: str, algorithm: str) -> Path:
    """The checkpoint folder of the first run, checked: manifest, weights digest, pointer, MLflow tags."""
    outputs = result["first"].outputs
    assert result["first"].status == "completed" and outputs["global_step"] == 2
    folder = Path(outputs["checkpoint_uri"])
    assert folder.name == "global_step_2"
    assert (folder.parents[1] / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert manifest["algorithm"] == algorithm and manifest["run_key"] == outputs["run_key"]
    assert manifest["weights"] == weights
    digest = hashlib.sha256((folder / weights).read_bytes()).hexdigest()
    assert {f["path"]: f["sha256"] for f in manifest["files"]}[weights] == digest == outputs["weights_sha256"]
    tags = result["runs"][0].data.tags
    assert tags["omni.checkpoint_sha256"] == digest and tags["omni.run_key"] == outputs["run_key"]
    # the checkpoint as an MLflow logged model: pointing at the store, linked to the training run at its step
    model = result["client"].get_logged_model(outputs["model_id"])
    assert model.source_run_id == result["runs"][0].info.run_id and model.status == "READY"
    assert model.tags["omni.checkpoint_uri"] == outputs["checkpoint_uri"] and model.tags["omni.checkpoint_sha256"] == digest
    assert model.params["algorithm"] == algorithm
    outputs_of_run = result["client"].get_run(model.source_run_id).outputs.model_outputs
    assert [(o.model_id, o.step) for o in outputs_of_run] == [(model.model_id, outputs["global_step"])]
    assert result["second"].outputs["model_id"] == model.model_id  # the cached re-run names the same model
    return folder


def assert_logged(result: dict, names: list[str], absent: list[str]) -> None:
    client: MlflowClient = result["client"]
    trained = result["runs"][0]
    trained_stage = next(s for s in result["config"].stages if s.kind == "rl")
    assert trained.data.params["algorithm"] == trained_stage.algorithm.name
    for name in names:
        history = client.get_metric_history(trained.info.run_id, name)
        assert [m.step for m in history] == [1, 2], name
        assert all(np.isfinite(m.value) for m in history), name
    for name in absent:
        assert not client.get_metric_history(trained.info.run_id, name), name


def assert_reused(result: dict) -> None:
    first, second = result["first"], result["second"]
    assert second.status == "reused" and second.outputs["reused"] is True
    assert second.outputs["run_key"] == first.outputs["run_key"]
    assert second.outputs["weights_sha256"] == first.outputs["weights_sha256"]
    assert any("already committed; nothing to do" in line for line in result["lines"])
    client: MlflowClient = result["client"]
    rerun = result["runs"][1]
    assert rerun.data.tags["omni.cache_hit"] == "true"
    assert not client.get_metric_history(rerun.info.run_id, "timing_s/step")  # nothing was trained


def tiny_weights(cache: Path, name: str, rel: str) -> dict[str, np.ndarray]:
    """Weights of the untrained `tiny://{name}` (seed 0) the stage started from."""
    from omni_core.models.tiny import tiny_model_dir

    return load_file(tiny_model_dir(name, seed=0, cache_dir=cache) / rel)


def test_dpo_commits_a_checkpoint_of_trained_weights(dpo: dict, env: Path) -> None:
    folder = committed_checkpoint(dpo, "model.safetensors", "dpo")
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    trained, start = load_file(folder / "model.safetensors"), tiny_weights(env, "lm", "model.safetensors")
    assert trained.keys() == start.keys()
    assert any(not np.array_equal(trained[k], start[k]) for k in start)  # DPO moved the weights


def test_dpo_logs_its_own_metric_names(dpo: dict) -> None:
    assert_logged(dpo, ["actor/dpo_loss", "actor/reward_accuracy", "actor/reward_margin", "actor/chosen_rewards",
                        "actor/grad_norm", "timing_s/step"], absent=["actor/pg_loss", "critic/score/mean"])


def test_dpo_rerun_reuses_the_run_key(dpo: dict) -> None:
    assert_reused(dpo)


def test_flow_grpo_commits_an_sd3_component_folder(flow: dict, env: Path) -> None:
    weights = "transformer/diffusion_pytorch_model.safetensors"
    folder = committed_checkpoint(flow, weights, "flow_grpo")
    pipeline = json.loads((folder / "omni_pipeline.json").read_text())
    assert pipeline["architecture"] == "SD3Transformer2DModel" and pipeline["kind"] == "sd3"
    for part in ("scheduler/scheduler_config.json", "text_encoder/model.safetensors", "tokenizer/tokenizer.json"):
        assert (folder / part).is_file(), part
    trained, start = load_file(folder / weights), tiny_weights(env, "sd3", weights)
    assert trained.keys() == start.keys()
    assert any(not np.array_equal(trained[k], start[k]) for k in start)  # the transformer trained
    encoder = load_file(folder / "text_encoder/model.safetensors")
    frozen = tiny_weights(env, "sd3", "text_encoder/model.safetensors")
    assert all(np.array_equal(encoder[k], frozen[k]) for k in frozen)  # the text encoder did not

    from omni_core.models import SD3Model, load_model

    model, _ = load_model(str(folder))  # the checkpoint is a model folder like any other
    assert isinstance(model, SD3Model) and model.sample_size == pipeline["sample_size"]


def test_flow_grpo_logs_its_metrics(flow: dict) -> None:
    assert_logged(flow, ["critic/score/mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm",
                         "timing_s/gen", "timing_s/step"], absent=["actor/dpo_loss", "response_length/mean"])
    score = flow["client"].get_metric_history(flow["runs"][0].info.run_id, "critic/score/mean")
    assert all(-0.1 < m.value < 0 for m in score)  # -(JPEG KB)/500 of 32x32 images


def test_flow_grpo_rerun_reuses_the_run_key(flow: dict) -> None:
    assert_reused(flow)


@pytest.mark.parametrize(
    ("config_file", "stage", "override"),
    [
        ("dpo.yaml", "dpo", "stages.dpo.algorithm.beta=0.2"),
        ("dpo.yaml", "dpo", "stages.dpo.algorithm.name=mpo"),
        ("dpo.yaml", "dpo", "stages.dpo.lora={rank: 4}"),
        ("dpo.yaml", "dpo", "stages.dpo.adapter=causal_lm"),
        ("dpo.yaml", "dpo", "stages.dpo.adapter_stage=all"),
        ("flow_grpo.yaml", "flow_grpo", "stages.flow_grpo.algorithm.num_steps=5"),
        ("flow_grpo.yaml", "flow_grpo", "stages.flow_grpo.rollout.n=2"),
        ("flow_grpo.yaml", "flow_grpo", "stages.flow_grpo.reward.name=ocr"),
    ],
)
def test_run_key_covers_what_determines_the_weights(config_file: str, stage: str, override: str) -> None:
    base = load_pipeline(ROOT / "configs" / config_file).stage(stage)
    changed = load_pipeline(ROOT / "configs" / config_file, [override]).stage(stage)
    assert rl_run_key(base, 0, "v1") != rl_run_key(changed, 0, "v1")


def test_stage_options_are_the_trainer_configs() -> None:
    """The `algorithm:` options are defined once, in the algorithm's record; the trainers' configs
    extend them with the stage's trainer keys, whose algorithm defaults they share."""
    from omni_core.config.models import LoraConfig
    from omni_core.models.lora import LoraSpec
    from omni_core.training.algorithms import get_algorithm
    from omni_core.training.flow_grpo import FlowGRPOConfig
    from omni_core.training.preference import PreferenceConfig

    for algorithm, trainer_config in (("dpo", PreferenceConfig), ("flow_grpo", FlowGRPOConfig)):
        record = get_algorithm(algorithm)
        assert issubclass(trainer_config, record.options)
        for path, value in record.defaults.items():
            key = {"trainer.batch_size": "prompts_per_step" if algorithm == "flow_grpo" else "batch_size",
                   "reward.name": "reward"}.get(path, path.split(".")[1])
            assert trainer_config.model_fields[key].default == value, (algorithm, path)
    assert {k: f.default for k, f in LoraConfig.model_fields.items()} == {
        k: f.default for k, f in LoraSpec.model_fields.items()}
