"""Lineage against a real `mlflow server` (SQLite backend, artifacts proxied to the moto S3 server) and
an S3 store: the eval/register pipeline of configs/eval_register.yaml (digits fixture, 2 GRPO steps on
tiny://lm, eval on the test split, register) run twice, seeds 0 and 1, so the two checkpoints score
differently (the reward depends on every character of the response). Then the run tree, the tags, the
dataset inputs, the logged models, the registry and `omni lineage models:/NAME@champion --json` are
checked against the store's manifests. Then the eval and register stages of those runs (verl's metric
names linked to the logged model and the dataset, `components.evaluate`'s numbers, the work in a Ray
task, the samples table, the registry's versions, aliases and decisions), after seed 0 again with a
margin no score can beat (rl and eval cache hits, a third version kept out of `champion`) and that run
once more (every stage a cache hit: no fourth version).

Also, fast and without a server: target parsing and errors of `omni_core.lineage.chain` on a SQLite
tracking store with hand-made runs, a logged model, a registered model and a local store.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from mlflow_server import MlflowServer, s3_environment
from pipeline_runs import digits_pipeline, run_in_order
from typer.testing import CliRunner

from omni_core.data import load_version
from omni_core.lineage import Tracker, verify_target
from omni_core.lineage.chain import MISMATCH, MISSING, OK, LineageError, format_lineage, lineage
from omni_core.lineage.models import log_checkpoint_model
from omni_core.models import load_model
from omni_core.pipeline.stages.eval import SAMPLE_COLUMNS, SAMPLES_TABLE
from omni_core.storage import Store
from omni_core.training.components import Sampling, evaluate
from omni_core.training.ray_stage import read_split

MODEL_NAME = "digits-lineage"
PIPELINE = "lineage-server"
# Credentials no name, path or URI of this test contains (secret env values are redacted from MLflow).
S3_KEYS = {"AWS_ACCESS_KEY_ID": "AKIDLINEAGE7Q2", "AWS_SECRET_ACCESS_KEY": "lineage-secret-5xq9w"}


def pipeline(workdir: Path, store: str, tracking_uri: str, seed: int, margin: float = 0.0) -> dict[str, Any]:
    return digits_pipeline(workdir, name=PIPELINE, store=store, tracking_uri=tracking_uri, seed=seed,
                           model_name=MODEL_NAME, samples=2, register={"margin": margin})


def run_pipeline(data: dict[str, Any]) -> Any:
    from omni_core.config import validate_pipeline

    return run_in_order(validate_pipeline(data))


@pytest.fixture(scope="module")
def served(model_cache_env: Path, mlflow_server: MlflowServer,  # own Ray: S3 keys
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import boto3
    import ray

    workdir = tmp_path_factory.mktemp("lineage-server")
    if ray.is_initialized():  # left by another module: its workers would not have the S3 settings
        ray.shutdown()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**s3_environment(mlflow_server.s3_endpoint), **S3_KEYS}.items():
            mp.setenv(name, value)
        mp.setenv("AWS_CONFIG_FILE", str(workdir / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(workdir / "no-aws-credentials"))
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            mp.delenv(var, raising=False)
        s3 = boto3.client("s3", endpoint_url=mlflow_server.s3_endpoint, region_name="us-east-1")
        bucket = "lineage-store"
        s3.create_bucket(Bucket=bucket)
        store = f"s3://{bucket}/omni"
        runs = [run_pipeline(pipeline(workdir, store, mlflow_server.url, seed)) for seed in (0, 1)]
        client = MlflowClient(mlflow_server.url)
        for done in runs:  # the Ray job of the training run, where the stage did not tag it itself
            rl_run = done.outcomes["rl"].mlflow_run_id
            if not client.get_run(rl_run).data.tags.get("ray.job_id"):
                client.set_tag(rl_run, "ray.job_id", f"raysubmit_seed{done.config.seed}")
        try:
            yield {"runs": runs, "store": Store(store), "server": mlflow_server, "s3": s3, "client": client,
                   "workdir": workdir}
        finally:
            ray.shutdown()


def outputs(run: Any, stage: str) -> dict[str, Any]:
    return run.outcomes[stage].outputs


def checkpoint_manifest(store: Store, checkpoint_uri: str) -> dict[str, Any]:
    return store.read_json(checkpoint_uri.removeprefix(store.root + "/") + "/_manifest.json")


def weights_sha256(manifest: dict[str, Any]) -> str:
    return next(f["sha256"] for f in manifest["files"] if f["path"] == manifest["weights"])


@pytest.mark.slow
def test_run_tree_and_tags(served: dict[str, Any]) -> None:
    client: MlflowClient = served["client"]
    experiment = client.get_experiment_by_name(PIPELINE)
    runs = client.search_runs([experiment.experiment_id], max_results=100)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(p.info.run_id for p in parents) == sorted(r.parent_run_id for r in served["runs"])
    digests = set()
    for done in served["runs"]:
        parent = client.get_run(done.parent_run_id)
        tags = parent.data.tags
        assert (tags["omni.pipeline"], tags["omni.config_digest"]) == (PIPELINE, done.config_digest)
        assert tags["omni.git_commit"] and tags["omni.store"] == served["store"].root
        digests.add(tags["omni.config_digest"])
        children = {r.data.tags["mlflow.runName"]: r for r in runs
                    if r.data.tags.get("mlflow.parentRunId") == done.parent_run_id}
        assert sorted(children) == ["eval", "ingest", "register", "rl"]  # one child per stage
        for name, child in children.items():
            assert child.info.run_id == done.outcomes[name].mlflow_run_id and child.info.status == "FINISHED"
            # the closing tags, sent in the background, are in before the pipeline run ends
            assert child.data.tags.get("omni.cache_key", "") == done.outcomes[name].cache_key
            assert child.data.tags["omni.cache_hit"] in ("true", "false") and child.data.tags["omni.stage_cache"]
            for key in ("omni.pipeline", "omni.config_digest", "omni.git_commit", "omni.store"):
                assert child.data.tags.get(key) == tags[key], (name, key)
            assert (child.data.tags["omni.stage"], child.data.tags["omni.stage_kind"]) == (name, name)
        for name in ("rl", "eval"):
            assert children[name].data.tags["omni.run_key"] == outputs(done, "rl")["run_key"]
        assert children["register"].data.tags["omni.registered_version"] == outputs(done, "register")["version"]
    assert len(digests) == 2  # the seed is part of the config


@pytest.mark.slow
def test_config_artifact_is_on_s3(served: dict[str, Any]) -> None:
    client: MlflowClient = served["client"]
    parent = served["runs"][0].parent_run_id
    assert "config/pipeline.json" in [a.path for a in client.list_artifacts(parent, "config")]
    keys = [o["Key"] for o in served["s3"].list_objects_v2(Bucket=served["server"].bucket,
                                                           Prefix="mlartifacts/")["Contents"]]
    assert any(k.endswith(f"{parent}/artifacts/config/pipeline.json") for k in keys), keys


@pytest.mark.slow
def test_dataset_inputs_carry_the_store_versions(served: dict[str, Any]) -> None:
    client: MlflowClient = served["client"]
    store: Store = served["store"]
    version = store.read_text("datasets/digits/LATEST").strip()
    for done in served["runs"]:
        assert outputs(done, "rl")["dataset_version"] == version
        for stage, context in (("ingest", None), ("rl", "training"), ("eval", "eval")):
            run = client.get_run(done.outcomes[stage].mlflow_run_id)
            inputs = run.inputs.dataset_inputs
            assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("digits", version)], stage
            source = json.loads(inputs[0].dataset.source)
            assert source["uri"] == store.uri(f"datasets/digits/{version}")
            if context:
                assert {t.key: t.value for t in inputs[0].tags}["mlflow.data.context"] == context


@pytest.mark.slow
def test_logged_models_point_at_the_checkpoints(served: dict[str, Any]) -> None:
    client: MlflowClient = served["client"]
    shas = set()
    for done in served["runs"]:
        trained = outputs(done, "rl")
        rl_run = client.get_run(done.outcomes["rl"].mlflow_run_id)
        assert [o.model_id for o in rl_run.outputs.model_outputs] == [trained["model_id"]]
        model = client.get_logged_model(trained["model_id"])
        manifest = checkpoint_manifest(served["store"], trained["checkpoint_uri"])
        assert model.source_run_id == rl_run.info.run_id
        assert model.tags["omni.checkpoint_uri"] == trained["checkpoint_uri"] == manifest["uri"]
        assert model.tags["omni.checkpoint_sha256"] == weights_sha256(manifest) == trained["weights_sha256"]
        assert model.tags["omni.global_step"] == "2" == str(manifest["global_step"])
        shas.add(trained["weights_sha256"])
    assert len(shas) == 2


def champion_and_scores(served: dict[str, Any]) -> tuple[str, list[float]]:
    scores = [outputs(r, "eval")["metrics"]["val/reward_mean"] for r in served["runs"]]
    assert scores[0] != scores[1], "the two seeds should give checkpoints that score differently"
    return ("2" if scores[1] > scores[0] else "1"), scores


@pytest.mark.slow
def test_registry_versions_and_aliases(served: dict[str, Any]) -> None:
    client: MlflowClient = served["client"]
    champion, scores = champion_and_scores(served)
    listed = sorted(str(v.version) for v in client.search_model_versions(f"name='{MODEL_NAME}'"))
    assert listed == ["1", "2"]
    versions = {v: client.get_model_version(MODEL_NAME, v) for v in listed}
    assert [v for v in listed if "champion" in versions[v].aliases] == [champion]
    assert [v for v in listed if "candidate" in versions[v].aliases] == ["2"]
    for v, done, score in zip(listed, served["runs"], scores, strict=True):
        assert versions[v].source == f"models:/{outputs(done, 'rl')['model_id']}"
        assert float(versions[v].tags["omni.score"]) == pytest.approx(score)
    assert versions["2"].tags["omni.promotion"] == ("promoted" if champion == "2" else "kept")


def lineage_cli(*args: str) -> Any:
    from flows.cli import app

    return CliRunner().invoke(app, ["lineage", *args])


@pytest.mark.slow
def test_lineage_cli_of_the_champion_matches_the_store(served: dict[str, Any]) -> None:
    store: Store = served["store"]
    champion, scores = champion_and_scores(served)
    done = served["runs"][int(champion) - 1]
    result = lineage_cli(f"models:/{MODEL_NAME}@champion", "--json", "--tracking-uri", served["server"].url,
                         "--store", store.root)
    assert result.exit_code == 0, (result.output, result.exception)
    chain = json.loads(result.stdout)

    mv = chain["model_version"]
    assert (mv["name"], mv["version"], mv["promotion"]) == (MODEL_NAME, champion, "promoted")
    assert "champion" in mv["aliases"] and ("candidate" in mv["aliases"]) == (champion == "2")
    assert mv["score"] == pytest.approx(max(scores)) and mv["metric"] == "val/reward_mean"

    evaluated = outputs(done, "eval")
    assert chain["eval"]["run_id"] == done.outcomes["eval"].mlflow_run_id
    assert chain["eval"]["metrics"]["val/reward_mean"] == pytest.approx(evaluated["metrics"]["val/reward_mean"])
    assert "val-core/digits_rotate/reward/mean_at_1" in chain["eval"]["metrics"]
    assert chain["eval"]["dataset"] == {"name": "digits", "version": evaluated["dataset_version"], "split": "test"}

    parent = served["client"].get_run(done.parent_run_id).data.tags
    [training] = chain["training"]
    assert training["run_id"] == done.outcomes["rl"].mlflow_run_id and training["role"] == "trained the checkpoint"
    assert (training["algorithm"], training["run_key"]) == ("grpo", outputs(done, "rl")["run_key"])
    assert (training["config_digest"], training["git_commit"]) == (parent["omni.config_digest"],
                                                                   parent["omni.git_commit"])
    assert training["ray_job_id"] == served["client"].get_run(training["run_id"]).data.tags["ray.job_id"]
    assert training["params"]["seed"] == str(int(champion) - 1)

    trained = outputs(done, "rl")
    manifest = checkpoint_manifest(store, trained["checkpoint_uri"])
    ck = chain["checkpoint"]
    assert (ck["uri"], ck["global_step"], ck["model_id"]) == (manifest["uri"], 2, trained["model_id"])
    assert ck["sha256"] == weights_sha256(manifest) and ck["store_check"]["status"] == OK

    version = store.read_text("datasets/digits/LATEST").strip()
    dataset_manifest = store.read_json(f"datasets/digits/{version}/_manifest.json")
    [dataset] = chain["datasets"]
    assert (dataset["name"], dataset["version"], dataset["digest"]) == ("digits", version, version)
    assert dataset["uri"] == store.uri(f"datasets/digits/{version}") and dataset["store_check"]["status"] == OK
    assert sorted(dataset["contexts"]) == ["eval", "training"]
    assert dataset["rows"] == {s: e["rows"] for s, e in dataset_manifest["splits"].items()}
    assert dataset["raw_source_uri"] == dataset_manifest["source_uri"] == "fixtures://digits?rows=16&seed=0"
    assert dataset["raw_files"] == [{"path": f["path"], "sha256": f["sha256"]} for f in dataset_manifest["raw_files"]]
    assert dataset["raw_files"]

    # every digest shown can be re-checked with `omni verify`: the commands name what the manifests hold
    assert [r["command"] for r in chain["recheck"]] == [f"omni verify {ck['uri']}",
                                                        f"omni verify {dataset['uri']} --raw"]
    for item in chain["recheck"]:
        summary, checks = verify_target(item["uri"], store.root, raw=item["command"].endswith("--raw"))
        assert summary.ok and summary.total > 0, item
    raw_checked = {c.key: c.expected_sha256 for c in checks if c.kind == "raw"}  # the fixture regenerated
    assert raw_checked == {f["path"]: f["sha256"] for f in dataset["raw_files"]}


@pytest.mark.slow
def test_lineage_cli_tree_of_the_newest_version(served: dict[str, Any]) -> None:
    store: Store = served["store"]
    result = lineage_cli("--tracking-uri", served["server"].url, "--store", store.root)
    assert result.exit_code == 0, (result.output, result.exception)
    out = result.stdout
    assert out.startswith(f"model {MODEL_NAME} version 2 [")  # the newest: candidate
    trained = outputs(served["runs"][1], "rl")
    version = store.read_text("datasets/digits/LATEST").strip()
    for fragment in (f"training run {served['runs'][1].outcomes['rl'].mlflow_run_id}",
                     f"weights sha256 {trained['weights_sha256']}", f"dataset digits@{version} ",
                     f"re-check: omni verify {trained['checkpoint_uri']}",
                     f"re-check: omni verify {store.uri(f'datasets/digits/{version}')}", "raw files "):
        assert fragment in out, out


# ---- the eval and register stages of these runs, then seed 0 again with a margin no score can beat (rl
# and eval are cache hits; register decides again: a third version, kept out of `champion`), then that
# run again (every stage a cache hit: no fourth version). After the tests above: they see two versions.

METRICS = ("val/reward_mean", "val-core/digits_rotate/reward/mean@1")  # verl's names (the stage's outputs)
LOGGED = {"val/reward_mean": "val/reward_mean",  # as verl's MLflow logger spells them (MLflow refuses `@`)
          "val-core/digits_rotate/reward/mean@1": "val-core/digits_rotate/reward/mean_at_1"}


@pytest.fixture(scope="module")
def reruns(served: dict[str, Any]) -> dict[str, Any]:
    third = run_pipeline(pipeline(served["workdir"], served["store"].root, served["server"].url, 0, margin=1e6))
    again = run_pipeline(pipeline(served["workdir"], served["store"].root, served["server"].url, 0, margin=1e6))
    return {"runs": [*served["runs"], third], "again": again, "client": served["client"],
            "workdir": served["workdir"]}


@pytest.mark.slow
def test_eval_logs_verl_metrics_linked_to_the_model_and_dataset(reruns: dict[str, Any]) -> None:
    client: MlflowClient = reruns["client"]
    for run in reruns["runs"][:2]:
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


@pytest.mark.slow
def test_eval_matches_the_evaluate_component_on_the_checkpoint(reruns: dict[str, Any]) -> None:
    """The stage's numbers are `components.evaluate`'s on the committed checkpoint and the test rows."""
    run = reruns["runs"][0]
    evaluated = outputs(run, "eval")
    store = Store(run.config.store)
    rows = read_split(store, load_version(store, "digits", evaluated["dataset_version"]).shard_keys("test"))
    model, tokenizer = load_model(evaluated["checkpoint_uri"], seed=0)
    expected = evaluate(model, tokenizer, rows, reward=f"{reruns['workdir'] / 'reward.py'}:score",
                        sampling=Sampling(max_new_tokens=6, greedy=True), n=1, max_prompt_tokens=256, seed=0)
    assert evaluated["metrics"] == pytest.approx(expected)


@pytest.mark.slow
def test_eval_ran_as_a_ray_task_not_in_the_flow_process(reruns: dict[str, Any]) -> None:
    """The work ran in a Ray worker of the pipeline's Ray (a task of the driver's job on its node), with
    the stage's resources; the engine, not a `generate` loop, made the responses (equal to
    `evaluate`'s greedy ones, test above)."""
    import os

    import ray

    client: MlflowClient = reruns["client"]
    run = reruns["runs"][0]
    report = run.outcomes["eval"].report["eval"]
    tags = client.get_run(run.outcomes["eval"].mlflow_run_id).data.tags
    assert int(tags["omni.eval.pid"]) == report["where"]["pid"] != os.getpid()
    assert tags["omni.eval.task_id"] and tags["omni.eval.node_id"] == report["where"]["node_id"]
    assert ray.is_initialized() and tags["omni.eval.node_id"] == ray.get_runtime_context().get_node_id()
    assert tags["omni.eval.job_id"] == ray.get_runtime_context().get_job_id()
    assert report["kind"] == "text" and report["timings"]["load_s"] > 0 and report["timings"]["score_s"] > 0


@pytest.mark.slow
def test_eval_samples_table(reruns: dict[str, Any]) -> None:
    client: MlflowClient = reruns["client"]
    run = reruns["runs"][0]
    eval_run_id = run.outcomes["eval"].mlflow_run_id
    assert SAMPLES_TABLE in [a.path for a in client.list_artifacts(eval_run_id)]
    table = json.loads(Path(client.download_artifacts(eval_run_id, SAMPLES_TABLE, str(reruns["workdir"]))).read_text())
    assert tuple(table["columns"]) == SAMPLE_COLUMNS
    assert len(table["data"]) == 2  # samples: 2 rows, n 1
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    for row in rows:
        assert row["data_source"] == "digits_rotate" and "Rotate" in row["prompt"]
        assert row["ground_truth"].isdigit() and len(row["ground_truth"]) == 4
        assert row["score"] == pytest.approx((sum(map(ord, row["response"])) % 97) / 96.0)


@pytest.mark.slow
def test_register_versions_aliases_and_decisions(reruns: dict[str, Any]) -> None:
    client: MlflowClient = reruns["client"]
    first, second, third = (outputs(r, "register") for r in reruns["runs"])
    listed = sorted(str(v.version) for v in client.search_model_versions(f"name='{MODEL_NAME}'"))
    assert listed == ["1", "2", "3"]
    versions = {v: client.get_model_version(MODEL_NAME, v) for v in listed}  # search leaves out aliases
    assert [first["version"], second["version"], third["version"]] == ["1", "2", "3"]
    scores = [outputs(r, "eval")["metrics"]["val/reward_mean"] for r in reruns["runs"]]
    assert scores[0] != scores[1], "the two seeds should give checkpoints that score differently"
    assert scores[2] == scores[0]  # seed 0 again: the same checkpoint, eval taken from the cache
    assert reruns["runs"][2].outcomes["eval"].cache_hit and reruns["runs"][2].outcomes["rl"].cache_hit

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
    for v, run in zip(("1", "2", "3"), reruns["runs"], strict=True):
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


@pytest.mark.slow
def test_an_unchanged_rerun_registers_nothing_new(reruns: dict[str, Any]) -> None:
    client: MlflowClient = reruns["client"]
    again, third = reruns["again"], reruns["runs"][2]
    assert all(again.outcomes[s].cache_hit for s in ("ingest", "rl", "eval", "register"))
    assert outputs(again, "register") == {**outputs(third, "register"), "reused": True}
    assert len(client.search_model_versions(f"name='{MODEL_NAME}'")) == 3
    run = client.get_run(again.outcomes["register"].mlflow_run_id)
    assert (run.data.tags["omni.registered_model"], run.data.tags["omni.registered_version"]) == (MODEL_NAME, "3")



# ---- fast: target parsing and errors on a SQLite tracking store ---------------------------------------


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory, mlflow_db: Any) -> dict[str, Any]:
    """Hand-made lineage on SQLite: a pipeline run with rl (+ a cache-hit rl run), eval and register
    runs, a logged model, two versions of model `m` (aliases champion, candidate), a local store."""
    folder = tmp_path_factory.mktemp("lineage-local")
    store = Store(str(folder / "store"))
    shard = b"parquet bytes"
    version = "0123456789abcdef"
    store.write_bytes(f"datasets/d/{version}/train-00000.parquet", shard)
    store.write_json(f"datasets/d/{version}/_manifest.json", {
        "version": version, "source_uri": "fixtures://d?rows=3", "converter": {"name": "d", "version": "1"},
        "raw_files": [{"path": "raw/train.jsonl", "sha256": "ab" * 32}], "counts": {"rows": 3},
        "splits": {"train": {"rows": 3, "shards": [{"key": f"datasets/d/{version}/train-00000.parquet",
                                                    "sha256": hashlib.sha256(shard).hexdigest(), "bytes": 13}]}}})
    weights = b"weights"
    folder_key = "runs/p/key1/rl/checkpoints/global_step_2"
    store.write_bytes(f"{folder_key}/model.safetensors", weights)
    sha = hashlib.sha256(weights).hexdigest()
    store.write_json(f"{folder_key}/_manifest.json", {
        "global_step": 2, "uri": store.uri(folder_key), "weights": "model.safetensors",
        "files": [{"path": "model.safetensors", "sha256": sha, "bytes": 7}]})

    tracker = Tracker(mlflow_db(folder / "mlflow.db"))
    client = tracker.client
    common = {"omni.pipeline": "p", "omni.config_digest": "cfg1", "omni.git_commit": "abc123"}
    parent = tracker.start_run("p", "p", common)
    profile = {"splits": {"train": 3}, "counts": {"rows": 3}, "converter": {"name": "d", "version": "1"}}

    def dataset(run_id: str, context: str) -> None:
        tracker.log_dataset_input(run_id, name="d", digest=version, source_uri=store.uri(f"datasets/d/{version}"),
                                  raw_source_uri="fixtures://d?rows=3", schema=[], context=context, profile=profile)

    rl = tracker.start_run("p", "rl", {**common, "omni.stage": "rl", "omni.stage_kind": "rl", "omni.run_key": "key1",
                                       "omni.checkpoint_uri": store.uri(folder_key), "omni.checkpoint_sha256": sha,
                                       "omni.image.trainer.digest": "sha256:" + "c" * 64, "ray.job_id": "raysubmit_1"},
                           parent_run_id=parent)
    tracker.log_params(rl, {"algorithm": "gspo", "seed": 0})
    dataset(rl, "training")
    model_id = log_checkpoint_model(tracker, rl, "p", name="p-rl", checkpoint_uri=store.uri(folder_key),
                                    weights_sha256=sha, global_step=2, run_key="key1", params={})
    cached = tracker.start_run("p", "rl", {**common, "omni.stage": "rl", "omni.stage_kind": "rl",
                                           "omni.run_key": "key1", "omni.cache_hit": "true",
                                           "omni.checkpoint_uri": store.uri(folder_key), "omni.checkpoint_sha256": sha})
    dataset(cached, "training")
    ev = tracker.start_run("p", "eval", {**common, "omni.stage": "eval", "omni.stage_kind": "eval",
                                         "omni.run_key": "key1", "omni.training_run_id": rl, "omni.model_id": model_id},
                           parent_run_id=parent)
    tracker.log_params(ev, {"dataset": f"d@{version}:train"})
    tracker.log_metrics(ev, {"val/reward_mean": 0.5, "val-core/d/reward/mean_at_1": 0.5, "other": 1.0}, 2, 0)
    dataset(ev, "eval")
    client.create_registered_model("m")
    for score in ("0.5", "0.25"):
        client.create_model_version("m", store.uri(folder_key), run_id=ev, tags={
            "omni.eval_run_id": ev, "omni.model_id": model_id, "omni.checkpoint_uri": store.uri(folder_key),
            "omni.checkpoint_sha256": sha, "omni.global_step": "2", "omni.run_key": "key1",
            "omni.metric": "val/reward_mean", "omni.score": score, "omni.promotion": "promoted"})
    client.set_registered_model_alias("m", "champion", "1")
    client.set_registered_model_alias("m", "candidate", "2")
    register = tracker.start_run("p", "register", {**common, "omni.stage_kind": "register",
                                                   "omni.registered_model": "m", "omni.registered_version": "1"},
                                 parent_run_id=parent)
    return {"tracker": tracker, "store": store, "ids": {"parent": parent, "rl": rl, "eval": ev, "register": register,
                                                        "cached": cached, "model": model_id}, "sha": sha,
            "version": version, "folder": folder}


@pytest.mark.parametrize(("target", "version"), [
    (None, "2"), ("models:/m@champion", "1"), ("models:/m@candidate", "2"), ("models:/m/1", "1"),
    ("models:/m/latest", "2"), ("models:/m", "2"), ("register", "1"), ("parent", "1")])
def test_targets_naming_a_model_version(local: dict[str, Any], target: str | None, version: str) -> None:
    target = local["ids"].get(target, target) if target else None
    chain = lineage(local["tracker"], target, local["store"].root)
    mv = chain["model_version"]
    assert (mv["name"], mv["version"]) == ("m", version)
    assert mv["aliases"] == {"1": ["champion"], "2": ["candidate"]}[version]
    assert mv["score"] == {"1": 0.5, "2": 0.25}[version] and mv["model_id"] == local["ids"]["model"]
    assert chain["eval"]["run_id"] == local["ids"]["eval"]
    assert chain["eval"]["metrics"] == {"val/reward_mean": 0.5, "val-core/d/reward/mean_at_1": 0.5}
    assert [t["run_id"] for t in chain["training"]] == [local["ids"]["rl"]]
    [training] = chain["training"]
    assert (training["algorithm"], training["run_key"], training["config_digest"], training["git_commit"],
            training["ray_job_id"]) == ("gspo", "key1", "cfg1", "abc123", "raysubmit_1")
    assert chain["images"] == {"trainer": {"digest": "sha256:" + "c" * 64, "ref": ""}}
    ck = chain["checkpoint"]
    assert (ck["sha256"], ck["global_step"], ck["model_id"], ck["store_check"]["status"]) == (
        local["sha"], 2, local["ids"]["model"], OK)
    [dataset] = chain["datasets"]
    assert (dataset["version"], dataset["rows"], dataset["store_check"]["status"]) == (local["version"], {"train": 3}, OK)
    assert sorted(dataset["contexts"]) == ["eval", "training"]
    assert dataset["raw_files"] == [{"path": "raw/train.jsonl", "sha256": "ab" * 32}]
    for item in chain["recheck"]:  # what the hints name, `omni verify` re-checks
        summary, _ = verify_target(item["uri"], local["store"].root)
        assert summary.ok and summary.total == 1


def test_training_and_eval_runs_and_logged_models_as_targets(local: dict[str, Any]) -> None:
    ids = local["ids"]
    for target in (ids["rl"], f"runs:/{ids['rl']}", f"models:/{ids['model']}", ids["eval"]):
        chain = lineage(local["tracker"], target, local["store"].root)
        assert chain["model_version"] is None
        assert (chain["eval"] or {}).get("run_id") == (ids["eval"] if target == ids["eval"] else None)
        assert [t["run_id"] for t in chain["training"]] == [ids["rl"]], target
        assert chain["checkpoint"]["model_id"] == ids["model"]
    # a cache-hit rl run: the run that trained the checkpoint first, then it
    chain = lineage(local["tracker"], ids["cached"], local["store"].root)
    assert [(t["run_id"], t["role"]) for t in chain["training"]] == [
        (ids["rl"], "trained the checkpoint"), (ids["cached"], "took the checkpoint from the cache")]
    assert [d["contexts"] for d in chain["datasets"]] == [["training"]]


def test_human_tree(local: dict[str, Any]) -> None:
    lines = format_lineage(lineage(local["tracker"], "models:/m@champion", local["store"].root))
    text = "\n".join(lines)
    assert lines[0].startswith("model m version 1 [champion]  source ")
    assert lines[1] == "  score val/reward_mean 0.5, promoted"
    assert f"\n  eval run {local['ids']['eval']} (p/eval) on d@{local['version']}:train\n" in text
    assert f"    training run {local['ids']['rl']} (p/rl) gspo: trained the checkpoint" in text
    assert f"        re-check: omni verify {local['store'].uri('runs/p/key1/rl/checkpoints/global_step_2')}" in text
    listed = sorted_list_sha256(["raw/train.jsonl\t" + "ab" * 32])
    assert f"        raw files 1, list sha256 {listed}" in text
    assert "raw file raw/train.jsonl" not in text  # one line per source, not per file: unless asked
    with_files = format_lineage(lineage(local["tracker"], "models:/m@champion", local["store"].root), files=True)
    assert f"          raw file raw/train.jsonl sha256 {'ab' * 32}" in with_files


def sorted_list_sha256(lines: list[str]) -> str:
    """The raw-file list digest as `omni lineage --help` defines it, computed by coreutils."""
    text = "".join(f"{line}\n" for line in lines)
    result = subprocess.run("LC_ALL=C sort | sha256sum", shell=True, input=text.encode(), capture_output=True,
                            check=True)
    return result.stdout.split()[0].decode()


@pytest.fixture
def many_raw_files(local: dict[str, Any]) -> Iterator[list[dict[str, str]]]:
    """The dataset version's manifest listing 3000 raw files (as a real AVQA or MMK12 source does), in
    no particular order, with non-ASCII and nested paths; put back afterwards."""
    import random

    store: Store = local["store"]
    key = f"datasets/d/{local['version']}/_manifest.json"
    saved = store.read_bytes(key)
    files = [{"path": f"{split}/{i // 100:02d}/clip-{i:05d}{'-é' if i % 7 == 0 else ''}.wav",
              "sha256": hashlib.sha256(f"{split}{i}".encode()).hexdigest()}
             for split in ("train", "test") for i in range(1500)]
    random.Random(0).shuffle(files)
    store.write_json(key, {**json.loads(saved), "raw_files": files})
    try:
        yield files
    finally:
        store.write_bytes(key, saved)


def test_many_raw_files_are_a_count_and_one_digest(local: dict[str, Any], many_raw_files: list[dict[str, str]]) -> None:
    """`omni lineage` prints 3000 raw files as one line (count, sha256 of the sorted list); --files lists
    each; --json has all of them and the same count and digest."""
    expected = sorted_list_sha256([f"{f['path']}\t{f['sha256']}" for f in many_raw_files])
    options = ["models:/m@champion", "--tracking-uri", local["tracker"].tracking_uri, "--store", local["store"].root]

    result = lineage_cli(*options)
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    assert [line.strip() for line in lines if "raw file" in line] == [f"raw files 3000, list sha256 {expected}"]
    assert len(lines) < 40

    listed = lineage_cli(*options, "--files")
    assert listed.exit_code == 0, (listed.output, listed.exception)
    each = [line.strip() for line in listed.stdout.splitlines() if line.strip().startswith("raw file ")]
    assert each == [f"raw file {f['path']} sha256 {f['sha256']}" for f in many_raw_files]  # manifest order

    as_json = lineage_cli(*options, "--json")
    assert as_json.exit_code == 0, (as_json.output, as_json.exception)
    [dataset] = json.loads(as_json.stdout)["datasets"]
    assert dataset["raw_files"] == many_raw_files
    assert (dataset["raw_files_count"], dataset["raw_files_sha256"]) == (3000, expected)


def test_the_raw_file_list_digest_names_the_set_of_files() -> None:
    from omni_core.storage.digest import file_list_sha256

    files = [("b/x.wav", "1" * 64), ("a/y.wav", "2" * 64), ("a/é.wav", "3" * 64)]
    digest = file_list_sha256(files)
    assert digest == file_list_sha256(reversed(files)) == sorted_list_sha256([f"{p}\t{s}" for p, s in files])
    assert digest != file_list_sha256(files[:2])  # a file dropped
    assert digest != file_list_sha256([("b/x.wav", "1" * 64), ("a/y.wav", "2" * 64), ("a/e.wav", "3" * 64)])  # renamed
    assert digest != file_list_sha256([("b/x.wav", "4" * 64), *files[1:]])  # changed
    assert file_list_sha256([]) == hashlib.sha256(b"").hexdigest()


def test_store_manifests_missing_or_different(local: dict[str, Any], tmp_path: Path) -> None:
    """A store that lacks the manifests (another store, or deleted): said so, the MLflow facts kept; a
    manifest that disagrees with what MLflow recorded: MISMATCH, naming the difference."""
    store: Store = local["store"]
    key = f"datasets/d/{local['version']}/_manifest.json"
    ck_key = "runs/p/key1/rl/checkpoints/global_step_2/_manifest.json"
    saved, saved_ck = store.read_bytes(key), store.read_bytes(ck_key)
    try:
        store.delete(key)
        chain = lineage(local["tracker"], "models:/m/1", str(tmp_path / "elsewhere"))
        [dataset] = chain["datasets"]
        assert dataset["store_check"]["status"] == MISSING and dataset["rows"] == {"train": 3}
        assert chain["checkpoint"]["store_check"]["status"] == OK  # found in the store its URI names

        manifest = json.loads(saved)
        manifest["splits"]["train"]["rows"] = 4
        store.write_json(key, manifest)
        manifest = json.loads(saved_ck)
        manifest["files"][0]["sha256"] = "0" * 64
        store.write_json(ck_key, manifest)
        chain = lineage(local["tracker"], "models:/m/1", store.root)
        [dataset] = chain["datasets"]
        assert dataset["store_check"] == {"status": MISMATCH, "detail": "rows per split {'train': 4} in the "
                                                                         "manifest, {'train': 3} in MLflow"}
        assert chain["checkpoint"]["store_check"]["status"] == MISMATCH
        assert f"weights sha256 {'0' * 64} in the manifest, {local['sha']} in MLflow" in \
            chain["checkpoint"]["store_check"]["detail"]
    finally:  # put them back for the other tests
        store.write_bytes(key, saved)
        store.write_bytes(ck_key, saved_ck)


@pytest.mark.parametrize(("target", "expected"), [
    ("models:/nope@champion", "no registered model 'nope' at sqlite:///"),
    ("models:/nope/1", "no registered model 'nope'"),
    ("models:/m@gold", "registered model 'm' has no alias 'gold' (aliases: candidate (version 2), champion "
                       "(version 1))"),
    ("models:/m/7", "registered model 'm' has no version 7 (versions: 1, 2)"),
    ("0" * 32, f"no MLflow run '{'0' * 32}' at sqlite:///"),
    ("models:/m-" + "0" * 32, "no logged model 'm-" + "0" * 32),
    ("m", "lineage target 'm' is not one of: models:/NAME@ALIAS"),
    ("parent-of-nothing", "lineage target 'parent-of-nothing' is not one of"),
])
def test_unknown_targets_are_lineage_errors(local: dict[str, Any], target: str, expected: str) -> None:
    with pytest.raises(LineageError) as info:
        lineage(local["tracker"], target)
    assert expected in str(info.value)
    if target == "m":
        assert "'m' is a registered model: models:/m@champion" in str(info.value)
    if target.startswith("models:/nope"):
        assert "(registered models: m);" in str(info.value)


def test_no_registered_version_and_no_database(tmp_path: Path) -> None:
    empty = Tracker(f"sqlite:///{tmp_path / 'empty.db'}")
    with pytest.raises(LineageError, match="no registered model version at .*run a pipeline with a register stage"):
        lineage(empty, None)
    result = lineage_cli("--tracking-uri", f"sqlite:///{tmp_path / 'absent.db'}")
    assert isinstance(result.exception, LineageError) and "no MLflow database at" in str(result.exception)
    assert not (tmp_path / "absent.db").exists()


def test_a_tracking_server_that_does_not_answer_fails_in_seconds() -> None:
    import socket
    import time

    from omni_core.errors import ConfigError

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    start = time.monotonic()
    result = lineage_cli("--tracking-uri", uri)
    assert isinstance(result.exception, ConfigError), (result.output, result.exception)
    assert f"tracking_uri {uri}: no MLflow server answers there" in str(result.exception)
    assert time.monotonic() - start < 30  # MLflow's own retries alone would take minutes


def test_cli_json_on_sqlite(local: dict[str, Any]) -> None:
    result = lineage_cli("models:/m@champion", "--json", "--tracking-uri", local["tracker"].tracking_uri,
                         "--store", local["store"].root)
    assert result.exit_code == 0, (result.output, result.exception)
    chain = json.loads(result.stdout)
    assert chain["model_version"]["version"] == "1" and chain["checkpoint"]["sha256"] == local["sha"]

