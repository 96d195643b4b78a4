"""The demo pipeline end to end through the CLI: Prefect flow, ingest, SFT then GRPO on Ray, eval of
both checkpoints, register, MLflow.

Runs `omni run configs/demo.yaml` in a temporary directory with its own store, MLflow database and
Prefect home, then checks what a user would look at: Parquet, manifest, MLflow runs, checkpoints, and
that the policy learnt (the seed is fixed: the same run gives the same scores). Also what `omni run`
prints: the run, not its tools' start-up noise (no Ray SIGTERM or token-authentication warning, no
transformers "Loading weights" bar, no `None` anywhere, no Prefect UI URL when Prefect knows none), in
both runs' output (tests/test_run_output.py tests `quiet_startup` itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from omni_core.data.gsm8k import SCHEMA
from omni_core.storage.digest import file_list_sha256

ROOT = Path(__file__).resolve().parents[1]
# what `omni run` must not print, and what the test environment may carry that would hide (or change)
# the defaults under test
NOISE = ("SIGTERM handler is not set", "Token authentication", "RAY_AUTH_MODE", "Loading weights", "None")
UNSET = ("PREFECT_API_URL", "PREFECT_UI_URL", "RAY_ADDRESS", "RAY_AUTH_MODE", "HF_HUB_DISABLE_PROGRESS_BARS")
METRICS = ["critic/score/mean", "actor/pg_loss", "timing_s/step", "actor/grad_norm", "response_length/mean"]

pytestmark = pytest.mark.slow


def run_demo(workdir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if k not in UNSET}, "PREFECT_HOME": str(workdir / "prefect"),
           "OMNI_CACHE_DIR": str(workdir / "cache"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "demo.yaml"),
         f"store={workdir / 'store'}", f"tracking_uri=sqlite:///{workdir / 'mlflow.db'}", *overrides],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, prefect_db: Callable[[Path], Path]) -> dict:
    workdir = tmp_path_factory.mktemp("demo")
    prefect_db(workdir / "prefect" / "prefect.db")  # Prefect's temporary server: no migrations to run
    first = run_demo(workdir)
    second = run_demo(workdir)
    return {"workdir": workdir, "store": workdir / "store", "first": first.stdout, "second": second.stdout,
            "output": [first.stdout + first.stderr, second.stdout + second.stderr],
            "client": MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")}


def test_summary_names_dataset_checkpoint_and_mlflow(demo: dict) -> None:
    out = demo["first"]
    for fragment in ("pipeline digits-grpo-demo finished", "dataset      digits version", "dataset      gsm8k version",
                     "dataset      mmk12 version", "checkpoint   ", "mlflow       parent run",
                     "mlflow ui --backend-store-uri", "prefect server start",
                     "registered   digits-grpo-demo version 1 [candidate, champion] val/reward_mean ",
                     "lineage      omni lineage models:/digits-grpo-demo/1"):
        assert fragment in out, out[-2000:]
    assert "[sft] step 60/60" in out and "[rl] step 40/40" in out  # per-step progress from the Ray actors


def test_omni_run_prints_no_start_up_noise_and_no_none(demo: dict) -> None:
    for out in demo["output"]:
        flow_runs = [line for line in out.splitlines() if "prefect flow run " in line]  # the lineage's runs
        assert flow_runs and not any("/flow-runs/" in line for line in flow_runs)  # no UI URL known: none printed
        for noise in NOISE:
            assert noise not in out, f"{noise!r} in the output of omni run:\n{out[-4000:]}"
    client: MlflowClient = demo["client"]
    runs = client.search_runs([client.get_experiment_by_name("digits-grpo-demo").experiment_id])
    assert runs and all("prefect.flow_run_url" not in r.data.tags for r in runs)
    assert all(r.data.tags.get("prefect.flow_run_id") for r in runs if "mlflow.parentRunId" not in r.data.tags)


def _eval_score(store: Path, stage: str) -> float:
    records = sorted((store / "runs/digits-grpo-demo/stages" / stage).glob("*.json"))
    return json.loads(records[-1].read_text())["outputs"]["metrics"]["val/reward_mean"]


def test_the_demo_learns(demo: dict) -> None:
    """Seed 0: the RL checkpoint scores clearly above the SFT warm start on 128 held-out numbers
    (greedy, the digits reward); both scores are printed, and the training reward rises."""
    sft, rl = _eval_score(demo["store"], "eval_sft"), _eval_score(demo["store"], "eval")
    assert sft < 0.4 and rl > sft + 0.2, (sft, rl)
    rows = {line.split("│")[1].strip(): line for line in demo["first"].splitlines() if line.startswith("│ ")}
    assert f"val/reward_mean {sft:.4g}" in rows["eval_sft"] and f"val/reward_mean {rl:.4g}" in rows["eval"]
    record = json.loads(sorted((demo["store"] / "runs/digits-grpo-demo/stages/rl").glob("*.json"))[0].read_text())
    curve = record["report"]["reward_curve"]
    scores = [v for _, v in curve["points"]]
    assert curve["metric"] == "critic/score/mean" and len(scores) == 40
    assert sum(scores[-10:]) / 10 > sum(scores[:10]) / 10 + 0.15, scores
    assert (demo["store"] / curve["key"]).read_bytes().startswith(b"\x89PNG")


def test_summary_shows_the_registered_version_and_its_lineage(demo: dict) -> None:
    """The register stage's model version, its lineage through the rl and sft runs down to the dataset,
    and how to re-check it; the second (cached) run shows the same version again."""
    store = demo["store"]
    version = (store / "datasets/digits/LATEST").read_text().strip()
    client: MlflowClient = demo["client"]
    registered = client.get_model_version("digits-grpo-demo", "1")
    manifest = json.loads((store / "datasets/digits" / version / "_manifest.json").read_text())
    for out in (demo["first"], demo["second"]):
        assert "  model digits-grpo-demo version 1 [candidate, champion]" in out, out[-3000:]
        assert f"checkpoint {registered.tags['omni.checkpoint_uri']} (global_step 40)" in out
        assert f"weights sha256 {registered.tags['omni.checkpoint_sha256']}" in out
        assert "(digits-grpo-demo/rl) grpo: " in out  # eval -> rl -> sft -> dataset
        assert "(digits-grpo-demo/sft) sft: trained the starting model (model: {from: sft})" in out
        assert f"dataset digits@{version} (training, eval)" in out
        listed = file_list_sha256((f["path"], f["sha256"]) for f in manifest["raw_files"])
        assert f"raw files {len(manifest['raw_files'])}, list sha256 {listed}" in out
        assert "raw file " not in out  # one line per raw source, not one per file
        assert f"re-check: omni verify {store / 'datasets/digits' / version}" in out
    assert len(client.search_model_versions("name='digits-grpo-demo'")) == 1  # the cached run registers nothing new


def test_dataset_version_parquet_and_manifest(demo: dict) -> None:
    store = demo["store"]
    version = (store / "datasets/gsm8k/LATEST").read_text().strip()
    folder = store / "datasets/gsm8k" / version
    manifest = json.loads((folder / "_manifest.json").read_text())
    assert manifest["version"] == version and manifest["source_uri"] == "fixtures://gsm8k?rows=64&seed=0"
    assert manifest["counts"] == {"read": 80, "rows": 80, "quarantined": 0, "skipped": 0}
    assert [f["path"] for f in manifest["raw_files"]] == ["main/test-00000-of-00001.parquet",
                                                          "main/train-00000-of-00001.parquet"]
    shard = manifest["splits"]["train"]["shards"][0]
    path = store / shard["key"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
    table = pq.read_table(path)
    assert table.schema.equals(SCHEMA) and table.num_rows == 64 == manifest["splits"]["train"]["rows"]
    first = table.slice(0, 1).to_pylist()[0]
    assert first["data_source"] == "openai/gsm8k" and first["prompt"][0]["content"].endswith('after "####".')
    assert first["reward_model"]["ground_truth"].lstrip("-").isdigit()


def test_mmk12_version_has_images(demo: dict) -> None:
    from io import BytesIO

    from PIL import Image

    from omni_core.data.mmk12 import SCHEMA as MMK12_SCHEMA

    store = demo["store"]
    version = (store / "datasets/mmk12/LATEST").read_text().strip()
    manifest = json.loads((store / "datasets/mmk12" / version / "_manifest.json").read_text())
    assert manifest["splits"]["train"]["rows"] == 32 and manifest["counts"]["quarantined"] == 0
    table = pq.read_table(store / manifest["splits"]["train"]["shards"][0]["key"])
    assert table.schema.equals(MMK12_SCHEMA)
    row = table.slice(0, 1).to_pylist()[0]
    assert row["prompt"][0]["content"].startswith("<image>\n")
    with Image.open(BytesIO(row["images"][0]["bytes"])) as image:
        assert image.width > 0 and image.height > 0


def test_mlflow_parent_and_child_runs_with_dataset_input(demo: dict) -> None:
    client: MlflowClient = demo["client"]
    experiment = client.get_experiment_by_name("digits-grpo-demo")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2  # one per `omni run`
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    for tag in ("omni.config_digest", "omni.git_commit", "prefect.flow_run_id", "omni.pipeline"):
        assert parent.data.tags.get(tag), tag
    children = {r.data.tags["mlflow.runName"]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"ingest", "sft", "rl", "eval_sft", "eval", "register"}
    ingested = {i.dataset.name for i in children["ingest"].inputs.dataset_inputs}
    assert ingested == {"digits", "gsm8k", "mmk12"}
    assert all(c.info.status == "FINISHED" for c in children.values())

    version = (demo["store"] / "datasets/digits/LATEST").read_text().strip()
    rl = children["rl"]
    inputs = rl.inputs.dataset_inputs
    assert len(inputs) == 1
    dataset = inputs[0].dataset
    assert dataset.name == "digits" and dataset.digest == version
    source = json.loads(dataset.source)
    assert source["uri"].endswith(f"datasets/digits/{version}")
    assert source["raw_source_uri"] == "fixtures://digits?rows=1000"
    assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == "training"

    for name in METRICS:
        history = client.get_metric_history(rl.info.run_id, name)
        assert [m.step for m in history] == list(range(1, 41)), name
    assert rl.data.params["algorithm"] == "grpo" and rl.data.params["model"].startswith("from sft (sha256 ")
    sft = children["sft"]
    assert sft.data.params["algorithm"] == "sft" and sft.data.params["model"] == "tiny://lm"
    assert rl.data.tags["omni.model_from.checkpoint_sha256"] == sft.data.tags["omni.checkpoint_sha256"]
    assert [m.step for m in client.get_metric_history(sft.info.run_id, "train/loss")] == list(range(1, 61))


def test_checkpoint_is_committed_and_loadable(demo: dict) -> None:
    client: MlflowClient = demo["client"]
    experiment = client.get_experiment_by_name("digits-grpo-demo")
    rl = client.search_runs([experiment.experiment_id], "tags.`mlflow.runName` = 'rl'",
                            order_by=["attributes.start_time ASC"])[0]
    folder = Path(rl.data.tags["omni.checkpoint_uri"])
    assert folder.name == "global_step_40"
    assert (folder.parents[1] / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
    manifest = json.loads((folder / "_manifest.json").read_text())
    weights = folder / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert digest == rl.data.tags["omni.checkpoint_sha256"]
    assert {f["path"]: f["sha256"] for f in manifest["files"]}["model.safetensors"] == digest
    tensors = load_file(weights)
    assert tensors and all(t.isfinite().all() for t in tensors.values())

    from omni_core.models import load_model

    model, tokenizer = load_model(str(folder))
    assert model.config.model_type == "qwen3" and tokenizer.eos_token_id is not None


def test_second_run_succeeds_and_reuses_finished_work(demo: dict) -> None:
    out = demo["second"]
    rows = {line.split("│")[1].strip(): line for line in out.splitlines() if line.startswith("│ ")}
    for stage in ("ingest", "sft", "rl", "eval_sft", "eval", "register"):
        assert "reused" in rows[stage], out[-2000:]
    client: MlflowClient = demo["client"]
    experiment = client.get_experiment_by_name("digits-grpo-demo")
    rls = client.search_runs([experiment.experiment_id], "tags.`mlflow.runName` = 'rl'",
                             order_by=["attributes.start_time ASC"])
    assert len(rls) == 2
    assert rls[1].data.tags["omni.cache_hit"] == "true"
    assert rls[0].data.tags["omni.checkpoint_sha256"] == rls[1].data.tags["omni.checkpoint_sha256"]
