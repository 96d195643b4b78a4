"""The `eval` and `register` stage kinds in a real pipeline: ingest the digits fixture, 2 GRPO steps on
tiny://lm (Ray actors), score the checkpoint on the test split, register it in the MLflow registry.

One store and one sqlite MLflow database for three runs: seed 0, seed 1 (a different checkpoint that
scores differently: the reward depends on the response's characters), then seed 0 again with a margin
no score can beat (rl and eval are cache hits; register decides again: a third version, kept out of
`champion`), then that third run again (every stage a cache hit: no fourth version). Also the pipeline errors of an eval without an rl stage upstream and a register without
an eval stage upstream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from pipeline_runs import digits_pipeline, run_in_order

from omni_core.config import validate_pipeline
from omni_core.data import load_version
from omni_core.errors import ConfigError
from omni_core.models import load_model
from omni_core.pipeline.run import PipelineRun
from omni_core.pipeline.stages.eval import SAMPLE_COLUMNS, SAMPLES_TABLE
from omni_core.storage import Store
from omni_core.training.components import Sampling, encode_prompts, evaluate, generate_rollouts
from omni_core.training.ray_stage import read_split

pytestmark = pytest.mark.slow

MODEL_NAME = "digits-tiny"
METRICS = ("val/reward_mean", "val-core/digits_rotate/reward/mean@1")  # verl's names (the stage's outputs)
LOGGED = {"val/reward_mean": "val/reward_mean",  # as verl's MLflow logger spells them (MLflow refuses `@`)
          "val-core/digits_rotate/reward/mean@1": "val-core/digits_rotate/reward/mean_at_1"}


@pytest.fixture(scope="module")
def env(pipeline_model_env: Path) -> Path:
    return pipeline_model_env


def pipeline(workdir: Path, seed: int, margin: float = 0.0, samples: int = 3) -> dict[str, Any]:
    return digits_pipeline(workdir, name="eval-register-test", store=str(workdir / "store"),
                           tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}", seed=seed, model_name=MODEL_NAME,
                           samples=samples, register={"margin": margin})


def run(data: dict[str, Any]) -> PipelineRun:
    return run_in_order(validate_pipeline(data))


@pytest.fixture(scope="module")
def runs(env: Path, tmp_path_factory: pytest.TempPathFactory, mlflow_db: Callable[[Path], str]) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("eval-register")
    mlflow_db(workdir / "mlflow.db")
    first = run(pipeline(workdir, seed=0))
    second = run(pipeline(workdir, seed=1))
    third = run(pipeline(workdir, seed=0, margin=1e6))  # nothing beats the champion by 1e6
    again = run(pipeline(workdir, seed=0, margin=1e6))  # the same again: every stage a cache hit
    return {"workdir": workdir, "runs": [first, second, third], "again": again,
            "client": MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")}


def outputs(run: PipelineRun, stage: str) -> dict[str, Any]:
    return run.outcomes[stage].outputs


def test_eval_logs_verl_metrics_linked_to_the_model_and_dataset(runs: dict[str, Any]) -> None:
    client: MlflowClient = runs["client"]
    for run in runs["runs"][:2]:
        trained, evaluated = outputs(run, "rl"), outputs(run, "eval")
        assert evaluated["model_id"] == trained["model_id"] and evaluated["model_id"]
        assert evaluated["weights_sha256"] == trained["weights_sha256"]
        assert evaluated["checkpoint_uri"] == trained["checkpoint_uri"]
        eval_run = client.get_run(run.outcomes["eval"].mlflow_run_id)
        assert set(evaluated["metrics"]) == set(METRICS)
        assert set(eval_run.data.metrics) == set(LOGGED.values())
        for name in METRICS:
            assert eval_run.data.metrics[LOGGED[name]] == pytest.approx(evaluated["metrics"][name])
        # the metrics are the logged model's, measured on the test split's dataset version
        model = client.get_logged_model(evaluated["model_id"])
        linked = {m.key: m for m in model.metrics if m.run_id == eval_run.info.run_id}
        assert set(linked) == set(LOGGED.values())
        assert {(m.dataset_name, m.dataset_digest) for m in linked.values()} == {("digits", evaluated["dataset_version"])}
        assert all(m.step == trained["global_step"] for m in linked.values())
        inputs = [(d.dataset.name, d.dataset.digest, {t.key: t.value for t in d.tags}.get("mlflow.data.context"))
                  for d in eval_run.inputs.dataset_inputs]
        assert inputs == [("digits", evaluated["dataset_version"], "eval")]
        assert eval_run.data.tags["omni.training_run_id"] == run.outcomes["rl"].mlflow_run_id


def test_eval_matches_the_evaluate_component_on_the_checkpoint(runs: dict[str, Any]) -> None:
    """The stage's numbers are `components.evaluate`'s on the committed checkpoint and the test rows."""
    run = runs["runs"][0]
    evaluated = outputs(run, "eval")
    store = Store(run.config.store)
    rows = read_split(store, load_version(store, "digits", evaluated["dataset_version"]).shard_keys("test"))
    model, tokenizer = load_model(evaluated["checkpoint_uri"], seed=0)
    expected = evaluate(model, tokenizer, rows, reward=f"{runs['workdir'] / 'reward.py'}:score",
                        sampling=Sampling(max_new_tokens=6, greedy=True), n=1, max_prompt_tokens=256, seed=0)
    assert evaluated["metrics"] == pytest.approx(expected)


def test_eval_ran_as_a_ray_task_not_in_the_flow_process(runs: dict[str, Any]) -> None:
    """The work ran in a Ray worker of the pipeline's Ray (a task of the driver's job on its node), with
    the stage's resources; the engine, not a `generate` loop, made the responses (equal to
    `evaluate`'s greedy ones, test above)."""
    import os

    import ray

    client: MlflowClient = runs["client"]
    run = runs["runs"][0]
    report = run.outcomes["eval"].report["eval"]
    tags = client.get_run(run.outcomes["eval"].mlflow_run_id).data.tags
    assert int(tags["omni.eval.pid"]) == report["where"]["pid"] != os.getpid()
    assert tags["omni.eval.task_id"] and tags["omni.eval.node_id"] == report["where"]["node_id"]
    assert ray.is_initialized() and tags["omni.eval.node_id"] == ray.get_runtime_context().get_node_id()
    assert tags["omni.eval.job_id"] == ray.get_runtime_context().get_job_id()
    assert report["kind"] == "text" and report["timings"]["load_s"] > 0 and report["timings"]["score_s"] > 0


def test_eval_samples_table(runs: dict[str, Any]) -> None:
    client: MlflowClient = runs["client"]
    run = runs["runs"][0]
    eval_run_id = run.outcomes["eval"].mlflow_run_id
    assert SAMPLES_TABLE in [a.path for a in client.list_artifacts(eval_run_id)]
    table = json.loads(Path(client.download_artifacts(eval_run_id, SAMPLES_TABLE, str(runs["workdir"]))).read_text())
    assert tuple(table["columns"]) == SAMPLE_COLUMNS
    assert len(table["data"]) == 3  # samples: 3 rows, n 1
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    for row in rows:
        assert row["data_source"] == "digits_rotate" and "Rotate" in row["prompt"]
        assert row["ground_truth"].isdigit() and len(row["ground_truth"]) == 4
        assert row["score"] == pytest.approx((sum(map(ord, row["response"])) % 97) / 96.0)


def test_register_versions_aliases_and_decisions(runs: dict[str, Any]) -> None:
    client: MlflowClient = runs["client"]
    first, second, third = (outputs(r, "register") for r in runs["runs"])
    listed = sorted(str(v.version) for v in client.search_model_versions(f"name='{MODEL_NAME}'"))
    assert listed == ["1", "2", "3"]
    versions = {v: client.get_model_version(MODEL_NAME, v) for v in listed}  # search leaves out aliases
    assert [first["version"], second["version"], third["version"]] == ["1", "2", "3"]
    scores = [outputs(r, "eval")["metrics"]["val/reward_mean"] for r in runs["runs"]]
    assert scores[0] != scores[1], "the two seeds should give checkpoints that score differently"
    assert scores[2] == scores[0]  # seed 0 again: the same checkpoint, eval taken from the cache
    assert runs["runs"][2].outcomes["eval"].cache_hit and runs["runs"][2].outcomes["rl"].cache_hit

    # run 1: no champion yet; run 2: champion only if it scores higher; run 3: margin 1e6, kept
    second_wins = scores[1] > scores[0]
    champion = "2" if second_wins else "1"
    assert str(client.get_model_version_by_alias(MODEL_NAME, "candidate").version) == "3"
    assert str(client.get_model_version_by_alias(MODEL_NAME, "champion").version) == champion
    aliases = {v: set(versions[v].aliases) for v in versions}
    assert [v for v, a in aliases.items() if "champion" in a] == [champion]
    assert [v for v, a in aliases.items() if "candidate" in a] == ["3"]

    tags = {v: versions[v].tags for v in versions}
    assert (tags["1"]["omni.promotion"], tags["1"]["omni.champion_score"]) == ("promoted", "")
    assert tags["2"]["omni.promotion"] == ("promoted" if second_wins else "kept")
    assert float(tags["2"]["omni.champion_score"]) == pytest.approx(scores[0])
    assert tags["3"]["omni.promotion"] == "kept"
    assert float(tags["3"]["omni.champion_score"]) == pytest.approx(max(scores[0], scores[1]) if second_wins
                                                                     else scores[0])
    for v, score in zip(("1", "2", "3"), scores, strict=True):
        assert float(tags[v]["omni.score"]) == pytest.approx(score)
    assert (first["promoted"], second["promoted"], third["promoted"]) == (True, second_wins, False)
    assert third["champion_version"] == champion

    # each version is the checkpoint's logged model, linked back to its runs, key and dataset
    for v, run in zip(("1", "2", "3"), runs["runs"], strict=True):
        trained, evaluated = outputs(run, "rl"), outputs(run, "eval")
        version = versions[v]
        assert version.source == f"models:/{trained['model_id']}"
        listed = json.loads(client.get_logged_model(trained["model_id"]).tags["mlflow.modelVersions"])
        assert (MODEL_NAME, v) in {(e["name"], str(e["version"])) for e in listed}  # as mlflow.register_model
        assert tags[v]["omni.run_key"] == trained["run_key"]
        assert tags[v]["omni.checkpoint_uri"] == trained["checkpoint_uri"]
        assert tags[v]["omni.checkpoint_sha256"] == trained["weights_sha256"]
        assert tags[v]["omni.dataset_version"] == evaluated["dataset_version"]
        assert tags[v]["omni.eval_run_id"] == evaluated["eval_run_id"] == version.run_id
        training = client.get_run(tags[v]["omni.training_run_id"])
        assert training.data.tags["omni.checkpoint_sha256"] == trained["weights_sha256"]
        assert training.data.tags["omni.cache_hit"] == "false"


def small_pipeline(tmp_path: Path, stages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "eval-register-errors", "store": str(tmp_path / "store"),
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "datasets": {"digits": {"source": "fixtures://digits?rows=8&seed=0", "converter": "digits"}},
            "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]}, *stages]}


@pytest.mark.parametrize(("stages", "expected"), [
    ([{"name": "eval", "kind": "eval", "after": ["ingest"], "data": "digits:test"}],
     "stages.eval.after: no upstream rl or sft stage"),
    ([{"name": "eval", "kind": "eval", "after": ["ingest"], "data": "digits:test", "checkpoint_from": "ingest"}],
     "stages.eval.checkpoint_from: 'ingest' is a stage of kind ingest, not rl"),
    ([{"name": "eval", "kind": "eval", "after": ["ingest"], "data": "digits:test", "checkpoint_from": "nope"}],
     "stages.eval.checkpoint_from: 'nope' is not a stage"),
    ([{"name": "register", "kind": "register", "after": ["ingest"], "model_name": "m"}],
     "stages.register.after: no upstream eval stage"),
])
def test_missing_upstream_stage_is_a_config_error(tmp_path: Path, stages: list[dict[str, Any]],
                                                   expected: str) -> None:
    """Caught when the pipeline is validated, before any stage runs."""
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        validate_pipeline(small_pipeline(tmp_path, stages))


def test_eval_and_register_config_keys() -> None:
    base = {"name": "p", "datasets": {"digits": {"source": "fixtures://digits?rows=8", "converter": "digits"}},
            "stages": [{"name": "rl", "kind": "rl", "data": "digits"},
                       {"name": "eval", "kind": "eval", "after": ["rl"], "data": "digits:test"},
                       {"name": "register", "kind": "register", "after": ["eval"], "model_name": "m"}]}
    config = validate_pipeline(base)
    evaluated, registered = config.stage("eval"), config.stage("register")
    assert (evaluated.split(), evaluated.greedy, evaluated.n) == (("digits", "test"), True, 1)
    assert (registered.metric, registered.greater_is_better, registered.margin) == ("val/reward_mean", True, 0.0)
    assert evaluated.pipeline_problem(config) is None and registered.pipeline_problem(config) is None
    bad = json.loads(json.dumps(base))
    bad["stages"][2]["promote_if"] = {"metric": "x"}
    with pytest.raises(ConfigError, match=r"stages\.register\.promote_if: unknown key"):
        validate_pipeline(bad)
    bad = json.loads(json.dumps(base))
    bad["stages"][1]["data"] = "gsm8k:test"
    with pytest.raises(ConfigError, match="stages.eval.data: 'gsm8k' is not under datasets"):
        validate_pipeline(bad)


def test_an_unchanged_rerun_registers_nothing_new(runs: dict[str, Any]) -> None:
    client: MlflowClient = runs["client"]
    again, third = runs["again"], runs["runs"][2]
    assert all(again.outcomes[s].cache_hit for s in ("ingest", "rl", "eval", "register"))
    assert outputs(again, "register") == {**outputs(third, "register"), "reused": True}
    assert len(client.search_model_versions(f"name='{MODEL_NAME}'")) == 3
    run = client.get_run(again.outcomes["register"].mlflow_run_id)
    assert (run.data.tags["omni.registered_model"], run.data.tags["omni.registered_version"]) == (MODEL_NAME, "3")


def greedy_responses(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> list[str]:
    prompts = encode_prompts(tokenizer, rows, 256)
    return generate_rollouts(model, tokenizer, prompts, n=1, sampling=Sampling(max_new_tokens=6, greedy=True),
                             seed=0).responses


def test_eval_of_a_lora_checkpoint_scores_the_base_model_with_the_trained_adapter(
        env: Path, tmp_path_factory: pytest.TempPathFactory, mlflow_db: Callable[[Path], str]) -> None:
    """A LoRA checkpoint holds only the adapter: the stage scores its rl stage's base model with it."""
    workdir = tmp_path_factory.mktemp("eval-lora")
    mlflow_db(workdir / "mlflow.db")
    data = pipeline(workdir, seed=0, samples=100)
    data["stages"][1].update(lora={"rank": 4, "alpha": 8}, trainer={"total_steps": 2, "batch_size": 2, "lr": 0.05})
    data["stages"] = data["stages"][:3]
    done = run(data)
    evaluated = outputs(done, "eval")
    folder = Path(evaluated["checkpoint_uri"].removeprefix("file://"))
    assert (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists()

    store = Store(done.config.store)
    rows = read_split(store, load_version(store, "digits", evaluated["dataset_version"]).shard_keys("test"))
    base, tokenizer = load_model("tiny://lm", seed=0, lora={"rank": 4, "alpha": 8})
    before = greedy_responses(base, tokenizer, rows)
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(base, load_file(folder / "adapter_model.safetensors"))
    after = greedy_responses(base, tokenizer, rows)
    assert after != before, "the trained adapter should change some greedy response"

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    eval_run_id = done.outcomes["eval"].mlflow_run_id
    table = json.loads(Path(client.download_artifacts(eval_run_id, SAMPLES_TABLE, str(workdir))).read_text())
    assert [row[table["columns"].index("response")] for row in table["data"]] == after
    assert evaluated["metrics"]["val/reward_mean"] == pytest.approx(
        sum((sum(map(ord, r)) % 97) / 96.0 for r in after) / len(after))


@pytest.mark.parametrize(("stage", "expected"), [
    ({"name": "on_pairs", "kind": "eval", "after": ["flow"], "data": "pairs:test"},
     "stages.on_pairs.data: 'pairs' holds preference pairs"),
    ({"name": "on_gsm8k", "kind": "eval", "after": ["flow"], "data": "gsm8k:test"},
     "stages.on_gsm8k.data: 'gsm8k' is not under datasets"),
])
def test_eval_refuses_what_it_cannot_score(stage: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate_pipeline({
            "name": "p", "datasets": {"pairs": {"source": "fixtures://omni_preference?rows=8",
                                                "converter": "omni_preference"},
                                      "ocr": {"source": "fixtures://ocr?rows=8", "converter": "ocr"},
                                      "digits": {"source": "fixtures://digits?rows=8", "converter": "digits"}},
            "stages": [{"name": "flow", "kind": "rl", "model": "tiny://sd3", "data": "ocr",
                        "algorithm": {"name": "flow_grpo"}}, stage]})
