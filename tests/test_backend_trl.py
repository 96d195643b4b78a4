"""Backend trl without a Ray (tests/test_backend_trl_pipeline.py runs it): what `omni validate`, `omni plan`
and `omni run` refuse (each key TRL cannot honour, an override TRL's config class does not have), the
stage keys -> TRL config fields, the dataset rows -> TRL's columns, our rewards as TRL's reward
functions, a custom reward file's bytes in the run key, and GRPO with `vllm_mode: colocate` built up to
GRPOTrainer's start (which needs vLLM, i.e. a GPU image)."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from typer.testing import CliRunner

from omni_core.backends import precheck_pipeline
from omni_core.backends.trl.fields import config_fields
from omni_core.backends.trl.render import render
from omni_core.config import ConfigValidationError, validate_pipeline

ROOT = Path(__file__).resolve().parents[1]
GRPO_EXAMPLE = ROOT / "configs" / "trl_grpo.yaml"
MPO_EXAMPLE = ROOT / "configs" / "trl_mpo.yaml"


def pipeline(**rl: object) -> dict:
    """ingest -> a GRPO stage on TRL (2 workers), `rl`'s keys replacing the stage's."""
    stage = {"name": "rl", "kind": "rl", "after": ["ingest"], "model": "tiny://lm", "data": "digits:train",
             "rollout": {"n": 4, "max_new_tokens": 8}, "reward": {"name": "digits"},
             "trainer": {"total_steps": 4, "batch_size": 4}, "backend": {"name": "trl", "num_workers": 2}}
    stage.update(rl)
    return {"name": "trl-unit", "datasets": {"digits": {"source": "fixtures://digits?rows=16", "converter": "digits"},
                                             "avqa": {"source": "fixtures://avqa?rows=4", "converter": "avqa"},
                                             "pairs": {"source": "fixtures://omni_preference?rows=8",
                                                       "converter": "omni_preference"}},
            "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]}, stage]}


def refusal(**rl: object) -> str:
    with pytest.raises(ConfigValidationError) as info:
        validate_pipeline(pipeline(**rl))
    return "\n".join(info.value.errors)


def test_validate_refuses_every_key_trl_cannot_honour():
    backend = {"name": "trl", "num_workers": 2}
    cases = {
        "stages.rl.algorithm.name: backend trl runs sft, grpo, gspo, dpo, mpo": {
            "algorithm": {"name": "flow_grpo"}, "model": "tiny://sd3", "rollout": {"n": 4}, "reward": {"name": "ocr"},
            "trainer": {"total_steps": 2}},
        "stages.rl.trainer.ppo_epochs: backend trl cannot honour it": {"trainer": {"ppo_epochs": 2}},
        "stages.rl.trainer.max_prompt_tokens: backend trl cannot honour it": {"trainer": {"max_prompt_tokens": 64}},
        "stages.rl.trainer.ppo_mini_batch_size: backend trl cannot honour it": {"trainer": {"ppo_mini_batch_size": 2}},
        "stages.rl.rollout.max_num_seqs: backend trl cannot honour it": {"rollout": {"max_num_seqs": 8}},
        "stages.rl.execution.mode: backend trl cannot honour it": {"execution": {"mode": "separate_async"}},
        "stages.rl.execution.rollout_workers: backend trl cannot honour it": {"execution": {"rollout_workers": 2}},
        "stages.rl.resources: backend trl cannot honour it (each Ray Train worker's resources are "
        "backend.resources_per_worker)": {"resources": {"trainer": {"CPU": 2}}},
        "stages.rl.num_cpus: backend trl cannot honour it": {"num_cpus": 2},
        "stages.rl.adapter: backend trl cannot honour it": {"adapter": "causal_lm"},
        "stages.rl.model: tiny://qwen3-omni is a Qwen3-Omni": {"model": "tiny://qwen3-omni"},
        "stages.rl.backend.num_workers: 2 workers cannot split a step's 9 completions": {
            "rollout": {"n": 3}, "trainer": {"batch_size": 3}},
        "stages.rl.backend.overrides.learning_rate: set by the stage's trainer.lr; set it there": {
            "backend": {**backend, "overrides": {"learning_rate": 0.1}}},
        "stages.rl.backend.overrides.output_dir: set by omni for every run": {
            "backend": {**backend, "overrides": {"output_dir": "/tmp/x"}}},
        "stages.rl.checkpoint.save_freq: 3 is not a multiple of the 2 steps that train on one generation": {
            "checkpoint": {"save_freq": 3}, "backend": {**backend, "overrides": {"steps_per_generation": 2}}},
        "stages.rl.data: its rows have audios columns, which TRL's GRPOTrainer cannot take": {"data": "avqa:train"},
        "stages.rl.backend: vllm_mode: colocate runs a vLLM engine on each worker's GPU; set use_gpu: true": {
            "backend": {**backend, "vllm_mode": "colocate"}},
        "stages.rl.backend: num_workers: Input should be greater than or equal to 1": {
            "backend": {"name": "trl", "num_workers": 0}},
        "stages.rl.backend: num_gpus: unknown key": {"backend": {**backend, "num_gpus": 1}},
    }
    for expected, rl in cases.items():
        assert expected in refusal(**rl), (expected, refusal(**rl))
    # set to what TRL does anyway, a key is no refusal; a bare `backend: trl` is its defaults
    config = validate_pipeline(pipeline(trainer={"ppo_epochs": 1}, execution={"mode": "sync"}, backend="trl"))
    assert config.stage("rl").backend.num_workers == 1
    # MPO on preference pairs with audio and video rows trains the text of a text model; an eval of its pairs too
    mpo = pipeline(algorithm={"name": "mpo"}, data="pairs:train", rollout={}, reward={})
    del mpo["stages"][1]["rollout"], mpo["stages"][1]["reward"]
    mpo["stages"].append({"name": "eval", "kind": "eval", "after": ["rl"], "data": "pairs:test"})
    assert validate_pipeline(mpo).stage("rl").algorithm.loss_types == ["sigmoid", "bco_pair", "sft"]


def test_validate_plan_and_run_check_the_overrides_against_trls_config_class(tmp_path: Path):
    from flows.cli import app

    data = pipeline(backend={"name": "trl", "num_workers": 2, "overrides": {"top_k": 5, "num_generation": 2}})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    runner = CliRunner()
    for args in (["validate", str(path)], ["plan", str(path)], ["run", str(path), "--dry-run"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert ("stages.rl.backend.overrides.num_generation: not a field of GRPOConfig of trl 1.16.0 (did you mean "
                "num_generations") in " ".join(result.output.split()), result.output
    result = runner.invoke(app, ["validate", str(path), "stages.rl.backend.overrides.num_generation=null",
                                 "stages.rl.backend.overrides={top_k: 5}"])
    assert result.exit_code == 0, result.output
    assert "trl config check, stage rl: ok: backend.overrides are fields of GRPOConfig of trl 1.16.0" in result.output
    # the precheck is the Backend protocol's, one per backend the pipeline uses: a native pipeline checks nothing
    native = pipeline(backend="native")
    assert precheck_pipeline(validate_pipeline(native)) == []


def test_the_fields_read_from_trls_source_are_its_dataclass_fields():
    import trl

    for name in ("GRPOConfig", "DPOConfig", "SFTConfig"):
        cls = getattr(trl, name)
        assert config_fields(name) == {f.name for f in dataclasses.fields(cls) if f.init}, name


def test_stage_keys_map_onto_trls_config_fields():
    grpo = validate_pipeline(pipeline(
        algorithm={"name": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "kl_beta": 0.02,
                   "loss_agg_mode": "seq-mean-token-mean", "adv_scale": "batch"},
        rollout={"n": 4, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12},
        trainer={"total_steps": 5, "batch_size": 6, "lr": 2e-3, "max_grad_norm": 0.5},
        checkpoint={"save_freq": 2}, lora={"rank": 4, "alpha": 8},
        backend={"name": "trl", "num_workers": 2, "overrides": {"top_k": 5}})).stage("rl")
    rendered = render(grpo, seed=7)
    assert rendered.trainer == "GRPOTrainer" and rendered.config_class == "GRPOConfig"
    expected = {"max_steps": 5, "per_device_train_batch_size": 12, "learning_rate": 2e-3, "max_grad_norm": 0.5,
                "num_generations": 4, "temperature": 0.7, "top_p": 0.9, "max_completion_length": 12,
                "epsilon": 3e-4, "epsilon_high": 4e-4, "beta": 0.02, "loss_type": "grpo", "scale_rewards": "batch",
                "importance_sampling_level": "sequence", "seed": 7, "data_seed": 7, "lr_scheduler_type": "constant",
                "steps_per_generation": 1, "num_iterations": 1, "bf16": False, "gradient_checkpointing": False,
                "top_k": 5}
    assert {k: rendered.fields[k] for k in expected} == expected
    assert rendered.lora == {"r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "target_modules": None, "bias": "none",
                             "task_type": "CAUSAL_LM"}
    assert set(rendered.fields) <= config_fields("GRPOConfig")  # every rendered name is TRL's
    mpo_data = yaml.safe_load(MPO_EXAMPLE.read_text())
    mpo = validate_pipeline(mpo_data).stage("mpo")
    rendered = render(mpo, seed=0)
    assert rendered.trainer == "DPOTrainer" and set(rendered.fields) <= config_fields("DPOConfig")
    assert (rendered.fields["loss_type"], rendered.fields["loss_weights"]) == (["sigmoid", "bco_pair", "sft"],
                                                                               [0.8, 0.2, 1.0])
    assert rendered.fields["per_device_train_batch_size"] == 4 and rendered.fields["beta"] == 0.1
    sft = validate_pipeline(yaml.safe_load(GRPO_EXAMPLE.read_text())).stage("sft")
    rendered = render(sft, seed=0)
    assert rendered.trainer == "SFTTrainer" and set(rendered.fields) <= config_fields("SFTConfig")
    assert rendered.fields["per_device_train_batch_size"] == 16 and rendered.fields["learning_rate"] == 3e-3
    # the run key: the world size, threads and overrides change the weights; the Ray resources do not
    from omni_core.training.ray_stage import rl_run_key

    def key(**backend: object) -> str:
        stage = validate_pipeline(pipeline(backend={"name": "trl", "num_workers": 2, **backend})).stage("rl")
        return rl_run_key(stage, 0, "v1")

    assert key() == key(resources_per_worker={"CPU": 2})
    assert len({key(), key(num_workers=4), key(num_threads=2), key(overrides={"top_k": 5})}) == 4


def test_plan_shows_trls_trainer_and_config(tmp_path: Path):
    from flows.cli import app

    result = CliRunner().invoke(app, ["plan", str(GRPO_EXAMPLE), "--json"])
    assert result.exit_code == 0, result.output
    entries = json.loads(result.output[result.output.index("["):])
    grpo = next(e for e in entries if e["name"] == "grpo")
    assert grpo["backend"] == "trl" and grpo["trl"]["trainer"] == "GRPOTrainer" and grpo["trl"]["version"] == "1.16.0"
    assert grpo["trl"]["config"]["num_generations"] == 8 and grpo["trl"]["workers"] == 2
    assert grpo["does"].startswith("trains grpo with TRL's GRPOTrainer on Ray Train (2 CPU workers, one data-parallel")
    text = CliRunner().invoke(app, ["plan", str(GRPO_EXAMPLE)]).output
    assert '  GRPOConfig: {"beta": 0.0' in text and '  workers: 2 x {"CPU": 1.0}, 1 torch thread(s) each' in text


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def verl_rows(**media: list) -> object:
    """Two verl RL rows (prompt with an `<image>` marker, reward columns, a preference pair) as a datasets.Dataset."""
    import datasets

    from omni_core.data.schema import MEDIA_LIST, MESSAGE, REWARD_MODEL, rl_schema

    schema = rl_schema(("reward_model", REWARD_MODEL), ("extra_info", pa.struct([("index", pa.int64())])),
                       ("chosen", MESSAGE), ("rejected", MESSAGE), *[(k, MEDIA_LIST) for k in media])
    rows = [{"data_source": "digits_rotate", "prompt": [{"role": "user", "content": f"<image>Rotate 123{i}"}],
             "reward_model": {"style": "rule", "ground_truth": f"23{i}1"}, "extra_info": {"index": i},
             "chosen": {"role": "assistant", "content": "good"}, "rejected": {"role": "assistant", "content": "bad"},
             **{k: v[i] for k, v in media.items()}} for i in range(2)]
    return datasets.Dataset(pa.Table.from_pylist(rows, schema=schema))


def test_dataset_rows_map_onto_trls_columns():
    from omni_core.backends.trl.data import to_trl
    from omni_core.errors import DataError

    images = [[{"bytes": _png()}], [{"bytes": _png()}]]
    rows = verl_rows(images=images)
    text = to_trl(rows, "grpo", vision=False)
    assert text.column_names == ["data_source", "prompt", "reward_model", "extra_info"]  # reward kwargs kept
    assert text[0]["prompt"] == [{"role": "user", "content": "Rotate 1230"}]  # the marker dropped, no images
    vision = to_trl(rows, "gspo", vision=True)
    assert vision[1]["prompt"] == [{"role": "user", "content": [{"type": "image", "text": None},
                                                                {"type": "text", "text": "Rotate 1231"}]}]
    assert [type(i).__name__ for i in vision[0]["images"]] == ["PngImageFile"] and vision[0]["images"][0].size == (4, 3)
    pairs = to_trl(rows, "mpo", vision=False)
    assert pairs.column_names == ["prompt", "chosen", "rejected"]
    assert (pairs[0]["chosen"], pairs[0]["rejected"]) == ([{"role": "assistant", "content": "good"}],
                                                          [{"role": "assistant", "content": "bad"}])
    sft = to_trl(rows, "sft", vision=False, response="ground_truth")
    assert sft.column_names == ["prompt", "completion"] and sft[1]["completion"] == [
        {"role": "assistant", "content": "2311"}]
    with_audio = verl_rows(audios=[[{"bytes": b"RIFF"}], []])
    assert to_trl(with_audio, "dpo", vision=False).column_names == ["prompt", "chosen", "rejected"]  # text only
    with pytest.raises(DataError, match="rows with audios: TRL's trainers take images only"):
        to_trl(with_audio, "dpo", vision=True)


def test_our_rewards_as_trls_reward_functions_and_a_custom_files_bytes_in_the_run_key(tmp_path: Path):
    from omni_core.backends.trl.rewards import shipped_reward, trl_reward, unpack_reward
    from omni_core.pipeline.stages.rl import reward_file
    from omni_core.training.ray_stage import rl_run_key

    digits = trl_reward("digits")
    completions = [[{"role": "assistant", "content": "2341"}], [{"role": "assistant", "content": "9999"}]]
    scores = digits(prompts=[[], []], completions=completions, completion_ids=[[], []],
                    data_source=["digits_rotate"] * 2, reward_model=[{"ground_truth": "2341"}] * 2,
                    extra_info=[{}, {}], trainer_state=None)
    assert scores[0] == 1.0 and scores[1] < 1.0 and digits.__name__ == "digits"  # rewards/digits/mean
    custom = tmp_path / "reward.py"
    custom.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str))\n")
    spec = f"{custom}:score"
    shipped = shipped_reward(spec)
    assert shipped["bytes"] == custom.read_bytes() and shipped["function"] == "score"
    on_worker = unpack_reward(shipped, spec, tmp_path / "worker")  # a worker loads the bytes it was sent
    assert on_worker == f"{tmp_path / 'worker' / 'reward.py'}:score"
    assert trl_reward(on_worker)(prompts=["p"], completions=["abc"]) == [3.0]
    stage = validate_pipeline(pipeline(reward={"name": spec})).stage("rl")
    before = rl_run_key(stage, 0, "v1")
    assert reward_file(stage) == custom
    custom.write_text(custom.read_text().replace("len(solution_str)", "len(solution_str) + 1"))
    assert rl_run_key(stage, 0, "v1") != before  # the same path with other code trains other weights


def test_grpo_with_vllm_colocate_is_built_up_to_the_trainers_start(tmp_path: Path, monkeypatch):
    """A CPU machine has no vLLM: our GRPOConfig (use_vllm, colocate, on the GPU) goes into GRPOTrainer,
    which refuses only for want of vLLM, after our worker mapped the data and built the config."""
    from omni_core.backends.trl.worker import Worker, WorkerJob
    from omni_core.config.models import DatasetConfig
    from omni_core.data import load_version
    from omni_core.data.ingest import ingest
    from omni_core.storage import Store

    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
    store = Store(str(tmp_path / "store"))
    ingest(store, "digits", DatasetConfig(source="fixtures://digits?rows=8", converter="digits"), progress=print)
    stage = validate_pipeline(pipeline(backend={"name": "trl", "num_workers": 2, "use_gpu": True,
                                                "vllm_mode": "colocate",
                                                "overrides": {"vllm_gpu_memory_utilization": 0.3}})).stage("rl")
    rendered = render(stage, 0)
    assert {k: rendered.fields[k] for k in ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "bf16")} == {
        "use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "bf16": None}
    assert stage.backend.worker_resources() == {"CPU": 1.0, "GPU": 1.0}
    dv = load_version(store, "digits")
    job = WorkerJob(pipeline="p", stage="rl", algorithm="grpo", trainer="GRPOTrainer",
                    fields={**rendered.fields, "per_device_train_batch_size": 4}, lora=None,
                    model_uri="tiny://lm", seed=0, store_root=store.root, shard_keys=dv.shard_keys("train"),
                    stage_root="runs/p/k/rl", checkpoint=stage.checkpoint.model_dump(mode="json"),
                    config_digest="d", metadata={}, ray_run="r", use_gpu=False, num_threads=1, reward="digits")
    with pytest.raises(ImportError, match="vLLM is not available and `use_vllm` is set to True"):
        Worker(job, 0, 1, tmp_path / "worker").build_trainer(resumed=0)


def test_the_ray_train_run_starts_no_dataset_manager_for_workers_that_read_the_store():
    """Ray Train starts Ray Data's DatasetManager actor (a process) for every run; ours pass no Ray
    Dataset, so our TorchTrainer leaves that callback out and keeps Ray Train's others."""
    from ray.train.torch import TorchTrainer

    from omni_core.backends.trl.runner import _trainer
    from omni_core.backends.trl.worker import WorkerJob

    stage = validate_pipeline(pipeline(backend={"name": "trl", "num_workers": 2})).stage("rl")
    job = WorkerJob(pipeline="p", stage="rl", algorithm="grpo", trainer="GRPOTrainer", fields={}, lora=None,
                    model_uri="tiny://lm", seed=0, store_root="s", shard_keys=[], stage_root="r", checkpoint={},
                    config_digest="d", metadata={}, ray_run="r", use_gpu=False, num_threads=1)
    ours = {type(c).__name__ for c in _trainer(stage, job, local=True)._create_default_callbacks()}
    theirs = {type(c).__name__ for c in TorchTrainer(lambda: None)._create_default_callbacks()}
    assert "DatasetsCallback" in theirs and ours == theirs - {"DatasetsCallback"}


def test_a_worker_group_that_cannot_be_placed_is_refused_before_it_starts_naming_the_resources():
    from omni_core.backends.trl.runner import placement_problem

    stage = validate_pipeline(pipeline(backend={"name": "trl", "num_workers": 2,
                                                "resources_per_worker": {"CPU": 2}})).stage("rl")
    two_cpus = [{"Alive": True, "Resources": {"CPU": 2.0, "memory": 1e9}}]
    assert placement_problem(stage, two_cpus, "local") == (
        "stages.rl.backend: 2 Ray Train worker(s) of {'CPU': 2.0} do not fit on the Ray cluster (local: CPU 2); only "
        "1 would: lower backend.num_workers or backend.resources_per_worker, or give Ray more (ray.num_cpus, more nodes)")
    # two nodes of 2 CPUs fit them (one each); 4 CPUs spread as 3 + 1 do not, nor a dead node's
    assert placement_problem(stage, two_cpus * 2, "h:6379") is None
    assert "only 1 would" in placement_problem(stage, [{"Alive": True, "Resources": {"CPU": 3.0}},
                                                       {"Alive": True, "Resources": {"CPU": 1.0}}], "h:6379")
    assert "only 1 would" in placement_problem(stage, [*two_cpus, {"Alive": False, "Resources": {"CPU": 2.0}}], "x")
    gpu = validate_pipeline(pipeline(backend={"name": "trl", "num_workers": 2, "use_gpu": True})).stage("rl")
    assert "{'CPU': 1.0, 'GPU': 1.0} do not fit" in placement_problem(gpu, two_cpus * 2, "h:6379")
