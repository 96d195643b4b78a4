"""Eval and register of the models beyond a causal LM's responses, each through a whole example pipeline
to a registered, promoted version: configs/flow_grpo.yaml (FlowGRPO on tiny://sd3: images scored by the
JPEG reward, the starting model as baseline, an image grid) and configs/dpo.yaml (DPO on Omni-Preference
pairs: TRL's eval_rewards/* against the reference, per modality). One run each, asserted many times;
plus the LoRA diffusion checkpoint and the baseline gate of register in a second, small diffusion run.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from browser import chromium, dump_dom, visible_text
from mlflow.tracking import MlflowClient
from mlflow_server import ui_server
from pipeline_runs import run_in_order

from omni_core.config import load_pipeline
from omni_core.evaluation.job import BASELINE_CACHE
from omni_core.pipeline.stages.eval import GRID_IMAGE, SAMPLES_TABLE
from omni_core.storage import Store

ROOT = Path(__file__).resolve().parents[1]
TRL = ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies", "eval_rewards/margins",
       "eval_logps/chosen", "eval_logps/rejected", "eval_loss")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(pipeline_model_env: Path) -> Path:
    return pipeline_model_env


def run_pipeline(config_file: str, workdir: Path, *overrides: str) -> dict[str, Any]:
    config = load_pipeline(ROOT / "configs" / config_file, [
        f"store={workdir / 'store'}", f"tracking_uri=sqlite:///{workdir / 'mlflow.db'}", "ray.num_cpus=2", *overrides])
    lines: list[str] = []
    run = run_in_order(config, progress=lines.append)
    return {"config": config, "run": run, "lines": lines, "workdir": workdir,
            "client": MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")}


@pytest.fixture(scope="module")
def flow(env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_pipeline("flow_grpo.yaml", tmp_path_factory.mktemp("flow"), "stages.flow_grpo.trainer.total_steps=2")


@pytest.fixture(scope="module")
def dpo(env: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_pipeline("dpo.yaml", tmp_path_factory.mktemp("dpo"), "stages.dpo.trainer.total_steps=2")


def registered_and_promoted(result: dict[str, Any], metric: str) -> Any:
    run, client = result["run"], result["client"]
    registered = run.outcomes["register"].outputs
    assert registered["promoted"] is True and registered["version"] == "1"
    name = registered["model_name"]
    version = client.get_model_version_by_alias(name, "champion")
    assert str(version.version) == "1" and "candidate" in version.aliases
    evaluated = run.outcomes["eval"].outputs
    assert version.tags["omni.metric"] == metric
    assert float(version.tags["omni.score"]) == pytest.approx(evaluated["metrics"][metric])
    assert version.tags["omni.checkpoint_sha256"] == run.outcomes[result["config"].ordered_stages()[1].name].outputs[
        "weights_sha256"]
    assert version.source == f"models:/{evaluated['model_id']}"
    return version


def test_diffusion_eval_scores_images_with_the_stage_reward_and_logs_a_grid(flow: dict[str, Any]) -> None:
    run, client = flow["run"], flow["client"]
    evaluated = run.outcomes["eval"].outputs
    metrics = evaluated["metrics"]
    assert evaluated["kind"] == "images"
    core = "val-core/flow_grpo/ocr/reward/mean@1"  # the rows' data_source
    for name in ("val/reward_mean", core):
        assert name in metrics and f"{name}_baseline" in metrics
        assert metrics[f"{name}_gain"] == pytest.approx(metrics[name] - metrics[f"{name}_baseline"])
        assert -1.0 < metrics[name] < 0.0  # jpeg_compressibility: minus the compressed size
    eval_run = client.get_run(run.outcomes["eval"].mlflow_run_id)
    assert eval_run.data.metrics["val-core/flow_grpo/ocr/reward/mean_at_1"] == pytest.approx(metrics[core])
    assert eval_run.data.params["reward"] == "jpeg_compressibility"
    assert eval_run.data.params["sampler.noise_level"] == "0.0" and eval_run.data.params["sampler.num_steps"] == "6"
    # the grid: an MLflow image artifact and a file of the stage's record (the Prefect artifact's source)
    artifacts = [a.path for a in client.list_artifacts(eval_run.info.run_id)]
    assert GRID_IMAGE in artifacts and SAMPLES_TABLE in artifacts
    from PIL import Image

    grid = Image.open(client.download_artifacts(eval_run.info.run_id, GRID_IMAGE, str(flow["workdir"])))
    report = run.outcomes["eval"].report["eval"]
    shown = report["image_grid"]["images"]
    assert shown == min(4, report["rows"]) and grid.size[0] == min(shown, 4) * 128
    stored = Store(run.config.store).read_bytes(report["image_grid"]["key"])
    assert Image.open(io.BytesIO(stored)).size == grid.size
    table = json.loads(Path(client.download_artifacts(eval_run.info.run_id, SAMPLES_TABLE,
                                                      str(flow["workdir"]))).read_text())
    assert {"score", "baseline_score", "prompt"} <= set(table["columns"])


def test_diffusion_eval_is_deterministic_and_its_baseline_cached(flow: dict[str, Any]) -> None:
    """ODE sampling from seeded noise: scoring again gives the same numbers; the starting model's
    scores come from the store's cache the second time (same weights, rows, settings, seed)."""
    from omni_core.pipeline.run import PipelineRun

    run = flow["run"]
    report = run.outcomes["eval"].report["eval"]
    assert report["baseline"]["cached"] is False
    store = Store(run.config.store)
    assert [k for k in store.list(BASELINE_CACHE) if k.endswith(".json")]
    again = PipelineRun.start(run.config, progress=lambda line: None, force=["eval"])
    try:
        for stage in run.config.ordered_stages()[:-1]:
            again.run_stage(stage.name)
    finally:
        again.finish(True)
    repeat = again.outcomes["eval"]
    assert repeat.report["eval"]["baseline"]["cached"] is True
    assert not repeat.cache_hit and repeat.outputs["metrics"] == run.outcomes["eval"].outputs["metrics"]


def test_diffusion_checkpoint_registered_promoted_and_traced(flow: dict[str, Any]) -> None:
    """The registered diffusion version leads back to its checkpoint folder (lineage checks the
    manifest's transformer weights digest), and `omni verify` checks that folder's files."""
    from omni_core.lineage import Tracker
    from omni_core.lineage.chain import lineage
    from omni_core.lineage.verify import verify_target

    version = registered_and_promoted(flow, "val/reward_mean")
    store = flow["run"].config.store
    chain = lineage(Tracker(f"sqlite:///{flow['workdir'] / 'mlflow.db'}"), f"models:/{version.name}/1", store)
    checkpoint = chain["checkpoint"]
    assert checkpoint["sha256"] == version.tags["omni.checkpoint_sha256"]
    assert checkpoint["weights_file"].startswith("transformer/") and checkpoint["store_check"]["status"] == "ok"
    assert chain["eval"] and chain["training"], chain["warnings"]
    summary, checks = verify_target(checkpoint["uri"], store)
    assert summary.ok and len(summary.checkpoints) == 1 and summary.total >= 5


def test_preference_eval_uses_trl_names_against_the_reference(dpo: dict[str, Any]) -> None:
    run, client = dpo["run"], dpo["client"]
    evaluated = run.outcomes["eval"].outputs
    metrics = evaluated["metrics"]
    assert evaluated["kind"] == "pairs"
    assert set(TRL) <= set(metrics)
    assert metrics["eval_rewards/margins"] == pytest.approx(metrics["eval_rewards/chosen"]
                                                            - metrics["eval_rewards/rejected"], abs=1e-6)
    assert 0.0 <= metrics["eval_rewards/accuracies"] <= 1.0
    modalities = {name.rsplit("/", 1)[1] for name in metrics if name.startswith("eval_rewards/accuracies/")}
    assert modalities and modalities <= {"image", "video", "audio", "text"}
    eval_run = client.get_run(run.outcomes["eval"].mlflow_run_id)
    assert eval_run.data.metrics["eval_rewards/accuracies"] == pytest.approx(metrics["eval_rewards/accuracies"])
    table = json.loads(Path(client.download_artifacts(eval_run.info.run_id, SAMPLES_TABLE,
                                                      str(dpo["workdir"]))).read_text())
    assert {"chosen", "rejected", "chosen_reward", "rejected_reward"} <= set(table["columns"])
    # the trained model moved away from its reference: its implicit rewards are not all zero
    assert any(abs(r[table["columns"].index("chosen_reward")]) > 0 for r in table["data"])


def test_preference_checkpoint_registered_promoted_on_accuracy(dpo: dict[str, Any]) -> None:
    registered_and_promoted(dpo, "eval_rewards/accuracies")


def test_lora_diffusion_checkpoint_and_the_baseline_gate(env: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A LoRA FlowGRPO checkpoint holds only the transformer's adapter: eval loads the base with it.
    register's min_gain_over_baseline keeps a version out of champion that does not beat its starting
    model by the gain, even with no champion yet."""
    result = run_pipeline("flow_grpo.yaml", tmp_path_factory.mktemp("flow-lora"),
                          "stages.flow_grpo.trainer.total_steps=1", "stages.flow_grpo.trainer.lr=0.05",
                          "stages.flow_grpo.lora={rank: 4, alpha: 8}",
                          "stages.register.min_gain_over_baseline=1000000.0")
    run, client = result["run"], result["client"]
    trained = run.outcomes["flow_grpo"].outputs
    folder = Path(trained["checkpoint_uri"].removeprefix("file://"))
    assert (folder / "transformer" / "adapter_config.json").is_file()
    assert not (folder / "transformer" / "diffusion_pytorch_model.safetensors").exists()
    metrics = run.outcomes["eval"].outputs["metrics"]
    eval_run = client.get_run(run.outcomes["eval"].mlflow_run_id)
    table = json.loads(Path(client.download_artifacts(eval_run.info.run_id, SAMPLES_TABLE,
                                                      str(result["workdir"]))).read_text())
    scores = [(row[table["columns"].index("score")], row[table["columns"].index("baseline_score")])
              for row in table["data"]]
    assert any(a != b for a, b in scores), "the trained adapter should change some image"
    registered = run.outcomes["register"].outputs
    assert registered["promoted"] is False and registered["champion_version"] == ""
    version = client.get_model_version(registered["model_name"], registered["version"])
    assert version.tags["omni.promotion"] == "kept" and "min_gain_over_baseline" in version.tags["omni.promotion_reason"]
    assert float(version.tags["omni.baseline_gain"]) == pytest.approx(metrics["val/reward_mean_gain"])
    with pytest.raises(Exception, match="champion"):
        client.get_model_version_by_alias(registered["model_name"], "champion")


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (make setup installs it)")
def test_mlflow_ui_shows_the_runs_metrics_and_grid_in_the_model_training_view(flow: dict[str, Any]) -> None:
    """Headless Chromium on MLflow's UI (a JS app: the DOM after its requests) at the links we print:
    the experiment link opens the runs table (not the GenAI overview, which the bare link opens): the
    pipeline's run, its stage runs nested under it, all counted; the eval
    run's link shows its metrics, its artifact view renders the image grid."""
    from omni_core.lineage.tracking import (
        EXPERIMENT_KIND,
        EXPERIMENT_KIND_TAG,
        mlflow_experiment_url,
        mlflow_run_url,
    )

    run, client = flow["run"], flow["client"]
    experiment = client.get_experiment_by_name(run.config.name)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    eval_run_id = run.outcomes["eval"].mlflow_run_id
    with ui_server(f"sqlite:///{flow['workdir'] / 'mlflow.db'}", flow["workdir"]) as url:
        runs_page = visible_text(dump_dom(mlflow_experiment_url(url, experiment.experiment_id)))
        assert "Detect Issues" not in runs_page, runs_page[:2000]
        parent = client.get_run(run.parent_run_id).info.run_name  # the stage runs are nested under it
        total = len(client.search_runs([experiment.experiment_id]))
        assert f" {parent} " in runs_page and f" {total} matching runs " in runs_page, runs_page[:3000]
        bare = visible_text(dump_dom(f"{url}/#/experiments/{experiment.experiment_id}"))
        assert "Detect Issues" in bare  # what the link without the view opens (MLflow 3.17)
        eval_page = visible_text(dump_dom(mlflow_run_url(url, experiment.experiment_id, eval_run_id)))
        assert "val/reward_mean" in eval_page and "val/reward_mean_baseline" in eval_page, eval_page[:3000]
        grid_url = mlflow_run_url(url, experiment.experiment_id, eval_run_id).replace(
            "?", f"/artifacts/{GRID_IMAGE}?")
        assert re.search(rf'<img alt="{GRID_IMAGE}" src="blob:', dump_dom(grid_url))
