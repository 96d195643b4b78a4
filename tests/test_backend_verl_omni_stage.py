"""`backend: {name: verl_omni, ...}` on an `rl` stage: validation naming the stage key, the mapping of
stage keys onto recipe options, the plan (`omni plan --json`), and the two example pipelines
(configs/verl_omni_*.yaml): both validate, their verl_omni stages render the pinned scripts' commands
after our substitutions, the native override of each plans, and the Qwen-Image OCR one runs natively
on CPU (1 FlowGRPO step of tiny://sd3). The job path on a real Ray head is in verl_jobs.py."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_backend_verl_omni_catalog import PATHS, _expected

from omni_core.backends.verl_omni.catalog import get_recipe, recipes
from omni_core.backends.verl_omni.export import RECIPE_LAYOUTS
from omni_core.backends.verl_omni.render import render_recipe
from omni_core.backends.verl_omni.stage import plan, recipe_command
from omni_core.config import load_pipeline, validate_pipeline
from omni_core.errors import ConfigError
from omni_core.training import rl_run_key

REPO = Path(__file__).resolve().parents[1]
MMK12 = REPO / "configs" / "verl_omni_mmk12_gspo.yaml"
OCR = REPO / "configs" / "verl_omni_qwen_image_ocr.yaml"


def pipeline(tmp_path: Path, **stage: object) -> dict:
    rl = {"name": "rl", "kind": "rl", "data": "mmk12:train", "algorithm": {"name": "gspo"},
          "backend": {"name": "verl_omni", "recipe": "qwen3-omni-thinker-gspo-mmk12", "shared_dir": str(tmp_path / "sh")}}
    rl.update(stage)
    return {"name": "vo", "store": str(tmp_path / "store"), "tracking_uri": "http://127.0.0.1:5999",
            "ray": {"address": "http://127.0.0.1:8265"},
            "datasets": {"mmk12": {"source": "fixtures://mmk12?rows=4&seed=0", "converter": "mmk12"},
                         "ocr": {"source": "fixtures://ocr?rows=4&seed=0", "converter": "ocr"},
                         "avqa": {"source": "fixtures://avqa?rows=4&seed=0", "converter": "avqa"}},
            "stages": [rl]}


def _error(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_pipeline(data)
    return str(info.value)


@pytest.mark.parametrize(("stage", "expected"), [
    ({"rollout": {"temperature": 0.5}}, "stages.rl.rollout.temperature: backend verl_omni has no counterpart"),
    ({"rollout": {"max_num_seqs": 4}}, "stages.rl.rollout.max_num_seqs: recipe 'qwen3-omni-thinker-gspo-mmk12'"),
    ({"execution": {"mode": "separate_async"}}, "stages.rl.execution.mode: separate_async needs standalone rollout"),
    ({"algorithm": {"name": "grpo"}}, "stages.rl.algorithm.name: recipe 'qwen3-omni-thinker-gspo-mmk12' trains GSPO"),
    ({"reward": {"name": "gsm8k"}}, "stages.rl.reward.name: gsm8k: recipe 'qwen3-omni-thinker-gspo-mmk12' scores"),
    ({"adapter": "qwen3_omni_thinker"}, "stages.rl.adapter: not used by backend verl_omni"),
    ({"checkpoint": {"save_freq": 0}}, "stages.rl.checkpoint.save_freq: 0 (only at the end)"),
    ({"kind": "sft", "algorithm": {"name": "sft"}}, "stages.rl.backend: VeRL-Omni recipes are RL"),
    # a dataset the recipe cannot take: refused at validation, before any job or export
    ({"data": "ocr:train"}, "stages.rl.data: recipe 'qwen3-omni-thinker-gspo-mmk12' reads mmk12 data"),
    ({"data": "avqa:train"}, "converter 'avqa'"),
    ({"backend": {"name": "verl_omni", "recipe": "qwen-image-edit-flowgrpo-pickscore-lora", "shared_dir": "/s"},
      "algorithm": {"name": "flow_grpo"}, "data": "ocr:train"}, "reads image_edit data"),
    ({"rollout": {"n": 4}, "backend": {"name": "verl_omni", "recipe": "qwen3-omni-thinker-gspo-mmk12",
                                      "shared_dir": "/s", "rollout_n": 8}}, "stages.rl.rollout.n: 4, but backend.rollout_n"),
    ({"backend": {"name": "verl_omni", "recipe": "no-such", "shared_dir": "/s"}}, "'no-such' is not a VeRL-Omni recipe"),
    ({"backend": {"name": "verl_omni", "shared_dir": "/s"}}, "names either a recipe"),
    ({"backend": {"name": "verl_omni", "recipe": "qwen3-omni-thinker-gspo-mmk12", "shared_dir": "/s", "rolout_n": 2}},
     "stages.rl.backend: rolout_n: unknown key"),
])
def test_what_the_recipe_cannot_honour_fails_validation_naming_the_key(tmp_path, stage, expected):
    assert expected in _error(pipeline(tmp_path, **stage))


def test_a_recipe_stage_needs_the_job_servers_address(tmp_path):
    data = pipeline(tmp_path)
    data["ray"] = {"address": "local"}
    assert "ray.address: local, but stage rl runs a VeRL-Omni recipe" in _error(data)


def test_stage_keys_map_onto_the_recipe_and_the_algorithms_defaults_do_not(tmp_path):
    data = pipeline(tmp_path, rollout={"n": 8}, lora={"rank": 16, "alpha": 32}, trainer={"total_steps": 5},
                    algorithm={"name": "gspo", "clip_ratio_high": 5.0e-4}, checkpoint={"save_freq": 2})
    stage = validate_pipeline(data).stage("rl")
    command = recipe_command(stage, PATHS)
    base = render_recipe("qwen3-omni-thinker-gspo-mmk12", {}, PATHS).overrides
    changed = [o for o in command.overrides if o not in base]
    assert changed == ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
                       "actor_rollout_ref.actor.clip_ratio_high=0.0005", "actor_rollout_ref.rollout.n=8",
                       "trainer.save_freq=2", "trainer.total_training_steps=5"]
    # trainer.lr / batch_size keep the recipe's values (gspo's defaults are ours, not the file's)
    assert "actor_rollout_ref.actor.optim.lr=3e-6" in command.overrides
    assert "data.train_batch_size=128" in command.overrides
    # the dump keeps only what the file set: a reload (inline configs, the Prefect UI) is the same stage
    dumped = validate_pipeline(data).model_dump(mode="json")
    assert dumped["stages"][0]["trainer"] == {"total_steps": 5} and "model" not in dumped["stages"][0]
    again = validate_pipeline(copy.deepcopy(dumped)).stage("rl")
    assert recipe_command(again, PATHS).overrides == command.overrides
    assert rl_run_key(again, 0, "v1") == rl_run_key(stage, 0, "v1")


def test_where_it_runs_is_not_in_the_run_key_but_what_it_trains_is(tmp_path):
    key = rl_run_key(validate_pipeline(pipeline(tmp_path)).stage("rl"), 0, "v1")
    data = pipeline(tmp_path)
    data["stages"][0]["backend"].update(shared_dir="/elsewhere", python="/opt/py/bin/python3", env={"X": "1"})
    assert rl_run_key(validate_pipeline(data).stage("rl"), 0, "v1") == key
    data["stages"][0]["backend"]["overrides"] = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.5"]
    assert rl_run_key(validate_pipeline(data).stage("rl"), 0, "v1") != key


@pytest.fixture
def no_driver_credentials(monkeypatch):
    """The driver's credentials unset: what the plan forwards is then exactly what the test sets (other
    modules on this xdist worker may have left MLflow / S3 / hub credentials in os.environ)."""
    from omni_core.backends.jobs.job import FORWARDED_ENV

    for name in FORWARDED_ENV:
        monkeypatch.delenv(name, raising=False)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=REPO)


def test_plan_prints_the_recipes_ray_job(tmp_path, no_driver_credentials):
    from omni_core.config import DatasetConfig
    from omni_core.data.ingest import ingest
    from omni_core.storage import Store

    data = pipeline(tmp_path, rollout={"n": 8}, backend={
        "name": "verl_omni", "recipe": "qwen3-omni-thinker-gspo-mmk12", "shared_dir": str(tmp_path / "sh"),
        "python": "/opt/venv/bin/python3", "overrides": ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6"]})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(tmp_path / "cache"))
        version = ingest(Store(data["store"]), "mmk12", DatasetConfig(**data["datasets"]["mmk12"]),
                         progress=lambda _: None).version
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    planned = cli("plan", str(path), "--json", env={"AWS_SECRET_ACCESS_KEY": "sekrit-value-2"})
    assert planned.returncode == 0, planned.stderr
    assert "sekrit" not in planned.stdout
    (rl,) = json.loads(planned.stdout)
    run_key = rl_run_key(validate_pipeline(data).stage("rl"), 0, version)
    shared = tmp_path / "sh"
    folder = f"{shared}/datasets/mmk12/{version}/verl_omni-inline"
    assert rl["backend"] == "verl_omni" and rl["recipe"] == "qwen3-omni-thinker-gspo-mmk12"
    # the run key and the rendered command's digest (another shared path or interpreter: another job)
    assert rl["submission_id"].startswith(f"omni-verl-vo-rl-{run_key}-") and len(rl["submission_id"].rsplit("-", 1)[1]) == 8
    assert rl["stages"]["dataset"] == {"from": f"mmk12@{version}", "to": folder, "layout": "inline",
                                       "files": [f"{folder}/test.parquet", f"{folder}/train.parquet"]}
    assert rl["stages"]["model"] == {"from": "Qwen/Qwen3-Omni-30B-A3B-Instruct", "to": "Qwen/Qwen3-Omni-30B-A3B-Instruct"}
    argv = shlex.split(rl["entrypoint"])
    assert argv[:3] == ["/opt/venv/bin/python3", "-m", "verl_omni.trainer.main_omni"] and argv[3:] == rl["overrides"]
    assert f"data.train_files={folder}/train.parquet" in argv and f"data.val_files={folder}/test.parquet" in argv
    assert 'trainer.logger=["console","file"]' in argv  # verl's file logger, relayed into MLflow by the driver
    assert f"trainer.default_local_dir={shared}/runs/vo/{run_key}/rl/checkpoints" in argv
    assert "actor_rollout_ref.rollout.n=8" in argv and argv[-1] == "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"
    assert rl["runtime_env"]["env_vars"] == {
        "VERL_USE_EXTERNAL_MODULES": "verl_omni",
        "VERL_FILE_LOGGER_PATH": f"{shared}/runs/vo/{run_key}/rl/metrics/{rl['submission_id']}.jsonl",
        "AWS_SECRET_ACCESS_KEY": "<from the driver's $AWS_SECRET_ACCESS_KEY>"}
    text = cli("run", str(path), "--dry-run")
    assert text.returncode == 0, text.stderr
    assert "rl (rl, backend verl_omni)" in text.stdout and "VeRL-Omni recipe qwen3-omni-thinker-gspo-mmk12" in text.stdout


# ---- the example pipelines ------------------------------------------------------------------------


def native_overrides(path: Path) -> list[str]:
    """The override the file's comment gives for running it natively on a CPU."""
    lines = [line.strip().removeprefix("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("omni run "))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\\"))
    text = " ".join(line.rstrip("\\").strip() for line in lines[start:end + 1])
    words = shlex.split(text.split("omni run ", 1)[1])
    assert words[0] == f"configs/{path.name}"
    return words[1:]


@pytest.mark.parametrize(("path", "stage", "recipe", "gpus"), [
    (MMK12, "gspo", "qwen3-omni-thinker-gspo-mmk12", "4x H800 80GB"),
    (OCR, "flow_grpo", "qwen-image-flowgrpo-ocr-lora", "4 GPUs"),
])
def test_example_pipelines_render_the_recipe_and_plan_natively(path, stage, recipe, gpus):
    config = load_pipeline(path)
    assert gpus in get_recipe(recipe).published and f"GPUs: {gpus.split(' (')[0].replace(' GPUs', '')}" in path.read_text()
    command = recipe_command(config.stage(stage), PATHS)
    overrides, env = _expected(recipe, {})
    assert command.argv == ["python3", "-m", get_recipe(recipe).module, *overrides]  # the script's, substituted
    assert command.env == env
    native = load_pipeline(path, native_overrides(path))
    assert native.stage(stage).backend == "native" and native.ray.address == "local"
    from omni_core.pipeline.plan import plan_pipeline

    entries = {e["name"]: e for e in plan_pipeline(native)}
    assert entries[stage]["backend"] == "native"


@pytest.mark.slow
def test_the_ocr_example_runs_natively_on_cpu(pipeline_model_env, tmp_path, mlflow_db):
    from pipeline_runs import run_in_order

    overrides = [o for o in native_overrides(OCR) if not o.startswith(("store=", "tracking_uri="))]
    config = load_pipeline(OCR, [*overrides, f"store={tmp_path / 'store'}",
                                 f"tracking_uri={mlflow_db(tmp_path / 'mlflow.db')}", "ray.num_cpus=2"])
    run = run_in_order(config)
    outcome = run.outcomes["flow_grpo"]
    assert outcome.status == "completed" and outcome.outputs["global_step"] == 1
    manifest = json.loads((Path(outcome.outputs["checkpoint_uri"]) / "_manifest.json").read_text())
    assert manifest["algorithm"] == "flow_grpo" and manifest["weights"]
    # and on to a registered version: the LoRA checkpoint's images scored by tesseract's OCR reward
    evaluated = run.outcomes["eval"].outputs
    assert evaluated["kind"] == "images" and "val/reward_mean" in evaluated["metrics"]
    registered = run.outcomes["register"].outputs
    assert registered["model_name"] == "qwen-image-ocr-lora" and registered["version"]


@pytest.mark.parametrize("name", sorted(recipes()))
def test_the_stage_omni_recipes_show_prints_validates_and_renders(name, tmp_path):
    """Every recipe's stage snippet is a valid stage that renders the recipe's example command; a recipe
    whose data omni does not export needs data.train_files in backend.overrides."""
    from typer.testing import CliRunner

    from flows.cli import app

    shown = CliRunner().invoke(app, ["recipes", "show", name, "--shared-dir", str(tmp_path / "nfs")])
    assert shown.exit_code == 0, shown.output
    stage = yaml.safe_load(shown.output.split("# pipeline stage to start from:\n", 1)[1])["stages"][0]
    recipe = get_recipe(name)
    data = {"name": "shown", "ray": {"address": "http://127.0.0.1:8265"}, "stages": [stage],
            "datasets": {recipe.dataset: {"source": "fixtures://x", "converter": recipe.dataset}}}
    if name not in RECIPE_LAYOUTS:
        assert "is not exported by omni yet" in _error(copy.deepcopy(data))
        stage["backend"]["overrides"] = ["data.train_files=/data/train.parquet", "data.val_files=/data/test.parquet"]
    config = validate_pipeline(data)
    command = recipe_command(config.stages[0], PATHS)
    expected = render_recipe(name, recipe.example, PATHS)
    assert command.argv[:len(expected.argv)] == expected.argv and command.env == expected.env
    entry = plan(config.stages[0], pipeline="shown", seed=0, dataset=recipe.dataset, converter=recipe.dataset,
                 version=None, splits=None, run_key=None, tracking_uri=None, ray_address="http://127.0.0.1:8265")
    if name not in RECIPE_LAYOUTS:
        assert entry["stages"]["dataset"]["files"] == ["/data/train.parquet", "/data/test.parquet"]
        assert "data.train_files=/data/train.parquet" in entry["overrides"]
    else:  # the export's files are what the recipe reads
        layout = RECIPE_LAYOUTS[name][0]
        assert f"`converter: {recipe.dataset}` as verl_omni-{layout}" in shown.output
        folder = f"{tmp_path}/nfs/datasets/{recipe.dataset}/<version>/verl_omni-{layout}"
        assert entry["stages"]["dataset"]["to"] == folder and entry["stages"]["dataset"]["layout"] == layout
        train = [f for f in entry["stages"]["dataset"]["files"] if f.endswith("train.parquet")]
        assert train and all(f.startswith(folder) for f in entry["stages"]["dataset"]["files"])
        assert any(o.startswith("data.train_files=") and train[0] in o for o in entry["overrides"])
        if layout == "bagel_ocr":  # BAGEL's prompt_token_ids come from the stage model's tokenizer
            assert entry["stages"]["dataset"]["tokenizer"] == entry["stages"]["model"]["to"]
            assert f"actor_rollout_ref.model.tokenizer_path={entry['stages']['model']['to']}" in entry["overrides"]


def test_a_recipe_whose_data_omni_does_not_export_reads_the_files_the_overrides_name(tmp_path, monkeypatch):
    """Every catalog recipe's data is exported today; one that is not (a recipe added to the catalog
    before its export) is refused unless backend.overrides names its files, which the plan then uses."""
    name = "wan2.2-dancegrpo-t2v-hpsv3"
    monkeypatch.delitem(RECIPE_LAYOUTS, name)
    recipe = get_recipe(name)
    stage = {"name": "rl", "kind": "rl", "data": "hpsv3:train", "algorithm": {"name": "flow_grpo"},
             "backend": {"name": "verl_omni", "recipe": name, "shared_dir": str(tmp_path / "sh"),
                         "env": recipe.example["env"]}}
    data = {"name": "vo", "ray": {"address": "http://127.0.0.1:8265"}, "stages": [stage],
            "datasets": {"hpsv3": {"source": "fixtures://hpsv3?rows=4", "converter": "hpsv3"}}}
    assert "is not exported by omni yet" in _error(copy.deepcopy(data))
    stage["backend"]["overrides"] = ["data.train_files=/data/train.parquet", "data.val_files=/data/test.parquet"]
    entry = plan(validate_pipeline(data).stages[0], pipeline="vo", seed=0, dataset="hpsv3", converter="hpsv3",
                 version=None, splits=None, run_key=None, tracking_uri=None, ray_address="http://127.0.0.1:8265")
    assert entry["stages"]["dataset"]["files"] == ["/data/train.parquet", "/data/test.parquet"]
    assert "data.train_files=/data/train.parquet" in entry["overrides"]


def test_an_imported_script_outside_the_catalog_is_a_stage(tmp_path, no_driver_credentials):
    from omni_core.backends.verl_omni.importer import import_script

    backend = import_script("#!/bin/bash\nexport VERL_USE_EXTERNAL_MODULES=verl_omni\nexport MY_FLAG=1\n"
                            "python3 -m verl_omni.trainer.main_omni data.train_files=$HOME/d/train.parquet "
                            "actor_rollout_ref.model.path=Qwen/X algorithm.adv_estimator=grpo \"$@\"\n")
    assert "recipe" not in backend
    data = pipeline(tmp_path, data="gsm8k:train", backend={**backend, "shared_dir": str(tmp_path / "sh")})
    data["datasets"] = {"gsm8k": {"source": "fixtures://gsm8k?rows=4", "converter": "gsm8k"}}
    stage = validate_pipeline(data).stage("rl")
    entry = plan(stage, pipeline="vo", seed=0, dataset="gsm8k", converter="gsm8k", version="v1", splits=["train"],
                 run_key="k", tracking_uri=None, ray_address="http://127.0.0.1:8265")
    folder = f"{tmp_path}/sh/datasets/gsm8k/v1/verl_omni-inline"
    assert entry["entrypoint"].startswith(f"python3 -m verl_omni.trainer.main_omni data.train_files={folder}/train.parquet "
                                          "actor_rollout_ref.model.path=Qwen/X algorithm.adv_estimator=grpo")
    assert entry["stages"]["model"]["from"] == "Qwen/X"
    assert entry["runtime_env"]["env_vars"] == {
        "VERL_USE_EXTERNAL_MODULES": "verl_omni", "MY_FLAG": "1",
        "VERL_FILE_LOGGER_PATH": f"{tmp_path}/sh/runs/vo/k/rl/metrics/{entry['submission_id']}.jsonl"}
    data["datasets"]["gsm8k"]["converter"] = "avqa"
    assert "an imported entry point reads the store's verl Parquet" in _error(data)


def test_the_final_checkpoint_commits_the_recipes_lora_adapter(tmp_path):
    """A recipe's last global_step_N, mirrored, is committed naming what it holds: the PEFT adapter before
    a Hugging Face folder; the manifest is written again and the weights' sha256 is the file's."""
    import hashlib

    from omni_core.backends.jobs import mirror
    from omni_core.backends.verl_omni.runner import _commit_final, final_weights
    from omni_core.backends.verl_omni.stage import recipe_command
    from omni_core.storage import Store

    ckpt = tmp_path / "run" / "checkpoints"
    actor = ckpt / "global_step_3" / "actor"
    for rel, data in (("lora_adapter/adapter_model.safetensors", b"lora"), ("lora_adapter/adapter_config.json", b"{}"),
                      ("huggingface/config.json", b"{}"), ("model_world_size_1_rank_0.pt", b"shard")):
        (actor / rel).parent.mkdir(parents=True, exist_ok=True)
        (actor / rel).write_bytes(data)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    store = Store(str(tmp_path / "store"))
    assert mirror.mirror_new(ckpt, store, "runs/p/k/rl") == [3]
    command = recipe_command(validate_pipeline(pipeline(tmp_path)).stage("rl"), PATHS)
    manifest = _commit_final(store, "runs/p/k/rl", 3, ckpt, None, command, "job-1", {}, 0.1, print)
    assert (manifest["weights"], manifest["model_format"]) == ("actor/lora_adapter/adapter_model.safetensors", "peft_lora")
    assert manifest["recipe"] == "qwen3-omni-thinker-gspo-mmk12" and manifest["submission_id"] == "job-1"
    assert store.read_json("runs/p/k/rl/checkpoints/global_step_3/_manifest.json") == manifest
    entry = next(f for f in manifest["files"] if f["path"] == manifest["weights"])
    assert entry["sha256"] == hashlib.sha256(b"lora").hexdigest()
    assert final_weights([{"path": "actor/huggingface/model.safetensors"}]) == \
        ("actor/huggingface/model.safetensors", "huggingface")
    assert final_weights([{"path": "actor/model_world_size_1_rank_0.pt"}]) is None


def test_keys_the_native_algorithm_does_not_read_still_map_onto_a_recipe(tmp_path):
    """flow_grpo natively reads neither rollout.max_num_seqs nor separate_async; the SD3.5 recipe does."""
    data = pipeline(tmp_path, data="ocr:train", algorithm={"name": "flow_grpo"}, rollout={"max_num_seqs": 16},
                    execution={"mode": "separate_async", "max_staleness": 2, "staleness_policy": "drop"},
                    backend={"name": "verl_omni", "recipe": "sd35-medium-flowgrpo-ocr-lora-v1-separate-async",
                             "shared_dir": "/s"})
    overrides = recipe_command(validate_pipeline(data).stage("rl"), PATHS).overrides
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=16" in overrides
    assert "trainer.v1.sampler.max_off_policy_threshold=2" in overrides
    native = copy.deepcopy(data)
    native["stages"][0]["backend"] = "native"
    assert "stages.rl.rollout.max_num_seqs: not used by flow_grpo" in _error(native)
