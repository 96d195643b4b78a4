"""The pipeline flow's stage graph and stage cache, through the Python API on a Prefect server.

Pipeline: ingest `gsm8k` and `digits` in parallel, ingest `extra` after `gsm8k`, then 2 GRPO steps on
`digits` after `digits` and `extra`. Store A: a first run, an unchanged re-run (all cache hits),
changed dataset configs (that stage and its dependents re-run), `force`. Store B: a fault injected
into `extra` fails the run in the middle; the re-run starts from `extra` and ends with store A's
digests. What ran is read from the Prefect task states ("Cached" for a cache hit).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from omni_core.errors import DataError
from omni_core.lineage import Tracker

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["gsm8k", "digits", "extra", "rl"]
REWARD = '''from pathlib import Path

FAULT = Path(__file__).with_name("fail-at-call")  # holds the call count at which to raise, once


def score(data_source, solution_str, ground_truth, extra_info=None):
    if FAULT.exists():
        left = int(FAULT.read_text()) - 1
        if left <= 0:
            FAULT.unlink()
            raise RuntimeError("injected fault in the reward")
        FAULT.write_text(str(left))
    return (len(solution_str) % 5) / 4.0  # varies within a group, so GRPO moves the weights
'''

pytestmark = pytest.mark.slow


def pipeline_config(workdir: Path, reward: Path) -> dict[str, Any]:
    return {
        "name": "cache-test", "store": str(workdir / "store"), "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}",
        "ray": {"address": "local", "num_cpus": 2}, "seed": 0,
        "datasets": {"gsm8k": {"source": "fixtures://gsm8k?rows=8&seed=0", "converter": "gsm8k"},
                     "digits": {"source": "fixtures://digits?rows=16&seed=0", "converter": "digits"},
                     "digits_extra": {"source": "fixtures://digits?rows=8&seed=1", "converter": "digits"}},
        "stages": [
            {"name": "gsm8k", "kind": "ingest", "datasets": ["gsm8k"]},
            {"name": "digits", "kind": "ingest", "datasets": ["digits"]},
            {"name": "extra", "kind": "ingest", "datasets": ["digits_extra"], "after": ["gsm8k"]},
            {"name": "rl", "kind": "rl", "after": ["digits", "extra"], "model": "tiny://lm", "data": "digits:train",
             "rollout": {"n": 2, "max_new_tokens": 6}, "reward": {"name": f"{reward}:score"},
             "trainer": {"total_steps": 2, "batch_size": 2, "lr": 1e-2}, "checkpoint": {"save_freq": 1}},
        ],
    }


@pytest.fixture(scope="module")
def prefect_api(pipeline_model_env: Path, prefect_client: Any) -> Any:
    """The flows of this module run against the session's Prefect server (conftest.prefect_server; the
    runs are told apart by their flow run ids); the model cache and the shared Ray are
    `pipeline_model_env`'s."""
    return prefect_client


@pytest.fixture(scope="module")
def reward(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reward") / "rewards.py"
    path.write_text(REWARD)
    return path


@dataclasses.dataclass
class Run:
    state: Any
    flow_run_id: Any
    tasks: dict[str, Any]  # stage -> final task run
    found: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def summary(self) -> dict[str, Any]:
        return self.state.result()

    def stage(self, name: str) -> dict[str, Any]:
        return next(s for s in self.summary["stages"] if s["name"] == name)

    def state_names(self) -> dict[str, str]:
        return {name: task.state.name for name, task in self.tasks.items()}

    def ran(self) -> set[str]:
        return {n for n, s in self.state_names().items() if s == "Completed"}

    def cached(self) -> set[str]:
        return {n for n, s in self.state_names().items() if s == "Cached"}


def task_runs(client: Any, flow_run_id: Any, expected: int) -> dict[str, Any]:
    """The flow run's task runs by name, once each has reached a final state (the API may lag)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 30
    while True:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        if (len(runs) >= expected and all(r.state and r.state.is_final() for r in runs)) or time.monotonic() > deadline:
            return {r.name: r for r in runs}
        time.sleep(0.2)


def run_pipeline(client: Any, config: dict[str, Any], *overrides: str, force: tuple[str, ...] = (),
                 expected: int = len(STAGES)) -> Run:
    from flows.pipeline import pipeline

    state = pipeline(config=config, overrides=list(overrides), force=list(force), return_state=True)
    flow_run_id = state.state_details.flow_run_id
    return Run(state, flow_run_id, task_runs(client, flow_run_id, expected))


def artifacts(client: Any, run: Run) -> dict[str, Any]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.flow_run_id])))
    return {a.key: a for a in found}


def digests(run: Run) -> dict[str, Any]:
    """What a clean run must reproduce: each stage's output digest, dataset versions, trained weights."""
    return {"outputs": {s["name"]: s["output_digest"] for s in run.summary["stages"]},
            "keys": {s["name"]: s["cache_key"] for s in run.summary["stages"]},
            "versions": {k: d["version"] for s in run.summary["stages"] for k, d in s["outputs"].get("datasets", {}).items()},
            "weights": run.stage("rl")["outputs"]["weights_sha256"]}


@pytest.fixture(scope="module")
def store_a(prefect_api: Any, reward: Path, tmp_path_factory: pytest.TempPathFactory,
            mlflow_db: Callable[[Path], str]) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("store-a")
    mlflow_db(workdir / "mlflow.db")
    config = pipeline_config(workdir, reward)
    runs = {"first": run_pipeline(prefect_api, config)}
    runs["second"] = run_pipeline(prefect_api, config)
    runs["gsm8k_changed"] = run_pipeline(prefect_api, config, "datasets.gsm8k.source=fixtures://gsm8k?rows=6&seed=0")
    runs["extra_changed"] = run_pipeline(prefect_api, config,
                                         "datasets.digits_extra.source=fixtures://digits?rows=6&seed=1")
    runs["force_extra"] = run_pipeline(prefect_api, config, force=("extra",))
    runs["force_rl"] = force_rl_without_training(prefect_api, config)
    # the reward file edited in place (the same path, other bytes): every response now scores 0
    original = reward.read_text()
    reward.write_text(original + "\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    try:
        runs["reward_edited"] = run_pipeline(prefect_api, config)
    finally:
        reward.write_text(original)
    return {"config": config, "workdir": workdir, **runs}


def force_rl_without_training(client: Any, config: dict[str, Any]) -> Run:
    """`force=rl` with the Ray training replaced by a stand-in that notes the stage it was handed (its
    resume_mode: with `auto` a real training would find the committed checkpoint and skip or resume) and
    whether the committed checkpoint is still there, and reports the same checkpoint (what training again
    gives: the store B test shows a clean training reproduces the weights). Saves a training."""
    import omni_core.training as training
    from omni_core.training import RLStageResult, latest_checkpoint, rl_run_key, stage_prefix

    def retrain(**kw: Any) -> RLStageResult:
        root = stage_prefix(kw["pipeline"], rl_run_key(kw["stage"], kw["seed"], kw["dataset_version"]), kw["stage"].name)
        found["committed"] = latest_checkpoint(kw["store"], root)
        found["resume_mode"] = kw["stage"].checkpoint.resume_mode
        return RLStageResult(previous["run_key"], previous["global_step"], previous["checkpoint_uri"],
                             previous["weights_sha256"], previous["final_metrics"], reused=False)

    found: dict[str, Any] = {}
    previous = json.loads(next((Path(config["store"]) / "runs/cache-test/stages/rl").glob("*.json")).read_text())["outputs"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(training, "run_rl_stage", retrain)  # what the native backend calls
        run = run_pipeline(client, config, force=("rl",))
    run.found = found
    return run


@pytest.fixture(scope="module")
def store_b(prefect_api: Any, reward: Path, tmp_path_factory: pytest.TempPathFactory,
            mlflow_db: Callable[[Path], str]) -> dict[str, Any]:
    """A fault in `extra` (a stage with an upstream and a downstream), then a re-run without it."""
    from omni_core.pipeline.stages import _KINDS

    workdir = tmp_path_factory.mktemp("store-b")
    mlflow_db(workdir / "mlflow.db")
    config = pipeline_config(workdir, reward)
    ingest = _KINDS["ingest"]

    def faulty(ctx: Any) -> dict[str, Any]:
        if ctx.stage.name == "extra":
            raise DataError("injected fault in stage extra")
        return ingest.run(ctx)

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_KINDS, "ingest", dataclasses.replace(ingest, run=faulty))
        failed = run_pipeline(prefect_api, config, expected=3)
    # and in the re-run, the reward fails once in the rl stage's second step (2 prompts x 2 responses a
    # step): the stage's Prefect retry resumes from checkpoint global_step_1
    fault = reward.with_name("fail-at-call")
    fault.write_text("5")
    rerun = run_pipeline(prefect_api, config)
    return {"workdir": workdir, "failed": failed, "rerun": rerun, "fault_left": fault.exists(),
            "tracking_uri": config["tracking_uri"]}


# ---- store A ---------------------------------------------------------------------------------------

def test_first_run_runs_every_stage_and_commits_records(store_a: dict) -> None:
    first = store_a["first"]
    assert first.state.is_completed() and first.ran() == set(STAGES)
    for stage in first.summary["stages"]:
        record = Path(stage["record_uri"])
        assert record == store_a["workdir"] / "store/runs/cache-test/stages" / stage["name"] / f"{stage['cache_key']}.json"
        saved = json.loads(record.read_text())
        assert saved["output_digest"] == stage["output_digest"] and saved["key_inputs"]["kind"] == stage["kind"]
    rl = first.stage("rl")["outputs"]
    assert rl["global_step"] == 2 and not rl["reused"]


def test_independent_stages_have_no_edges_between_them(store_a: dict) -> None:
    tasks = store_a["first"].tasks
    upstream = {name: {i.id for inputs in t.task_inputs.values() for i in inputs if i.input_type == "task_run"}
                for name, t in tasks.items()}
    ids = {name: t.id for name, t in tasks.items()}
    assert upstream["gsm8k"] == upstream["digits"] == set()  # both start at once
    assert upstream["extra"] == {ids["gsm8k"]}
    assert upstream["rl"] == {ids["gsm8k"], ids["digits"], ids["extra"]}  # its ancestors' outcomes


def test_second_run_is_all_cache_hits_with_the_same_outputs(store_a: dict) -> None:
    first, second = store_a["first"], store_a["second"]
    assert second.state.is_completed() and second.cached() == set(STAGES)
    assert all("cache hit" in t.state.message for t in second.tasks.values())
    assert digests(second) == digests(first)
    for stage in second.summary["stages"]:
        assert stage["status"] == "reused" and stage["cache"] == "hit"
    assert second.stage("rl")["outputs"]["checkpoint_uri"] == first.stage("rl")["outputs"]["checkpoint_uri"]


def test_a_changed_config_reruns_that_stage_and_its_dependents(store_a: dict) -> None:
    first, changed = store_a["first"], store_a["gsm8k_changed"]
    assert changed.ran() == {"gsm8k", "extra"} and changed.cached() == {"digits", "rl"}
    assert "upstream gsm8k" in changed.tasks["extra"].state.message
    assert digests(changed)["versions"]["gsm8k"] != digests(first)["versions"]["gsm8k"]
    # extra re-ran because its upstream changed, produced the same dataset, so rl's key did not move
    assert changed.stage("extra")["output_digest"] == first.stage("extra")["output_digest"]

    changed = store_a["extra_changed"]
    assert changed.ran() == {"extra", "rl"} and changed.cached() == {"gsm8k", "digits"}
    assert changed.stage("rl")["cache_key"] != first.stage("rl")["cache_key"]
    # rl trains on `digits`, so its run key is unchanged: the checkpoint is found, nothing is trained
    assert changed.stage("rl")["outputs"]["reused"] and digests(changed)["weights"] == digests(first)["weights"]
    # and its reward curve is the one of the MLflow run that trained that checkpoint
    assert changed.stage("rl")["report"]["reward_curve"]["mlflow_run_id"] == first.stage("rl")["mlflow_run_id"]


def test_an_edited_reward_file_trains_the_stage_again(store_a: dict) -> None:
    """The reward file's bytes are in the rl stage's cache key and in its run key: after an edit (same
    path) the stage is not a cache hit, and it trains (a checkpoint of another run key), rather than
    finding the checkpoint the old reward trained."""
    from omni_core.training.checkpoint import stage_prefix

    first, edited = store_a["first"], store_a["reward_edited"]
    assert edited.ran() == {"rl"} and edited.cached() == {"gsm8k", "digits", "extra"}
    rl, before = edited.stage("rl"), first.stage("rl")
    assert rl["cache_key"] != before["cache_key"]
    assert "reward_file_sha256" in json.dumps(json.loads(Path(rl["record_uri"]).read_text())["key_inputs"])
    assert rl["outputs"]["run_key"] != before["outputs"]["run_key"] and not rl["outputs"]["reused"]
    assert rl["outputs"]["global_step"] == 2
    # every score 0: no advantage, no gradient; the checkpoint is its own, committed under the new run key
    assert rl["outputs"]["checkpoint_uri"].startswith(
        str(store_a["workdir"] / "store" / stage_prefix("cache-test", rl["outputs"]["run_key"], "rl")))


def test_force_redoes_a_stage_and_only_the_dependents_whose_inputs_change(store_a: dict) -> None:
    first, forced = store_a["first"], store_a["force_extra"]
    assert forced.ran() == {"extra"} and forced.cached() == {"gsm8k", "digits", "rl"}
    extra = forced.stage("extra")
    assert extra["cache"] == "forced" and not extra["outputs"]["datasets"]["digits_extra"]["reused"]  # converted again
    assert extra["output_digest"] == first.stage("extra")["output_digest"]

    forced = store_a["force_rl"]
    assert forced.ran() == {"rl"} and forced.cached() == {"gsm8k", "digits", "extra"}
    assert forced.stage("rl")["cache"] == "forced" and not forced.stage("rl")["outputs"]["reused"]
    # trained from step 0 on purpose; the committed checkpoints stay (a registered model may point at them)
    assert forced.found["resume_mode"] == "disable" and forced.found["committed"] is not None


def test_artifacts_of_a_run(store_a: dict, prefect_api: Any) -> None:
    first = artifacts(prefect_api, store_a["first"])
    summary = first["cache-test-summary"]
    assert summary.type == "markdown"
    rl = store_a["first"].stage("rl")
    for fragment in ("| rl | rl | completed |", rl["outputs"]["checkpoint_uri"], rl["outputs"]["weights_sha256"],
                     store_a["first"].stage("gsm8k")["outputs"]["datasets"]["gsm8k"]["version"],
                     f"/runs/{rl['mlflow_run_id']}", "mlflow ui --backend-store-uri"):
        assert fragment in summary.data, fragment
    table = first["cache-test-metrics"]
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert {"stage": "rl", "metric": "critic/score/mean"}.items() <= next(
        r for r in rows if r["metric"] == "critic/score/mean").items()
    progress = first["cache-test-rl-progress"]
    assert progress.type == "progress" and float(progress.data) == 100.0
    curve = first["cache-test-rl-reward-curve"]
    assert "data:image/png;base64," in curve.data and "| 2 |" in curve.data
    png = Path(rl["report"]["reward_curve"]["uri"])
    assert png.read_bytes().startswith(b"\x89PNG") and png.parent.name == rl["cache_key"]

    second = artifacts(prefect_api, store_a["second"])
    assert "4 cache hit(s)" in second["cache-test-summary"].data
    assert "cache-test-rl-reward-curve" in second  # from the record: the curve of the run that trained


# ---- store B: a failure in the middle, then the re-run ----------------------------------------------

def test_a_failed_stage_stops_its_dependents_and_the_rerun_starts_there(store_b: dict, store_a: dict,
                                                                       prefect_api: Any) -> None:
    failed = store_b["failed"]
    assert failed.state.is_failed() and "injected fault in stage extra" in failed.state.message
    assert failed.state_names() == {"gsm8k": "Completed", "digits": "Completed", "extra": "Failed"}  # rl never started
    assert failed.tasks["extra"].run_count == 1  # a user error (OmniError) is not retried
    summary = artifacts(prefect_api, failed)["cache-test-summary"].data
    assert "# Pipeline `cache-test`: failed" in summary and "| extra | ingest | failed |" in summary
    assert "| rl | rl | not_run |" in summary and "upstream stage extra failed" in summary

    rerun = store_b["rerun"]
    assert rerun.state.is_completed()
    assert rerun.cached() == {"gsm8k", "digits"} and rerun.ran() == {"extra", "rl"}
    assert not store_b["fault_left"] and rerun.tasks["rl"].run_count == 2  # the reward fault, then the retry
    tags = Tracker(store_b["tracking_uri"]).client.get_run(rerun.stage("rl")["mlflow_run_id"]).data.tags
    assert tags["omni.resumed_from_step"] == "1" and tags["omni.resumed_from"].endswith("/global_step_1")
    assert digests(rerun) == digests(store_a["first"])  # same keys, versions, weights as a clean run


# ---- parameters ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"overrides": ["stages.rl.trainer.total_steps=many"]},
         "stages.rl.trainer.total_steps: Input should be a valid integer"),
        ({"overrides": ["stages.extra.after=[nowhere]"]}, "stages.extra.after: 'nowhere' is not a stage"),
        ({"force": ["nope"]}, "--force nope: no stage 'nope'"),
        ({"pipeline_file": "configs/demo.yaml"}, "give either pipeline_file"),
        ({"overrides": ["stages.rl.after=[extra]"]},  # which version of digits it read would depend on timing
         "stages.rl.after: it reads dataset 'digits', which stage 'digits' writes; add 'digits'"),
    ],
)
def test_invalid_parameters_fail_before_any_work(prefect_api: Any, reward: Path, tmp_path: Path,
                                                 params: dict, expected: str) -> None:
    from flows.pipeline import pipeline

    state = pipeline(config=pipeline_config(tmp_path, reward), **params, return_state=True)
    assert state.is_failed() and expected in state.message, state.message
    assert not task_runs(prefect_api, state.state_details.flow_run_id, 0)
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()


def test_pipeline_file_and_the_ui_form(tmp_path: Path, reward: Path) -> None:
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline
    from omni_core.pipeline import resolve_pipeline

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline_config(tmp_path, reward)))
    from_file = resolve_pipeline(str(path), None, ["seed=3"])
    inline = resolve_pipeline(None, pipeline_config(tmp_path, reward), ["seed=3"])
    assert from_file == inline and inline.seed == 3
    assert resolve_pipeline(None, inline, []) == inline  # the model itself, as a Python caller passes it
    schema = parameter_schema(pipeline.fn).model_dump()
    assert set(schema["properties"]) == {"pipeline_file", "config", "overrides", "force"}
    definitions = schema["definitions"]
    stages = definitions["PipelineConfig"]["properties"]["stages"]["items"]["anyOf"]
    forms = {form["$ref"].rpartition("/")[2] if "$ref" in form else form["title"]: form for form in stages}
    # the UI renders a form per stage kind from these, each with its kind's own keys
    assert {"RLStage", "IngestStage", "EvalStage", "RegisterStage"} <= set(forms)
    assert "datasets" in forms["IngestStage"]["properties"]
    assert "algorithm" in definitions["RLStage"]["properties"]


def test_cli_force_names_a_stage(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs/demo.yaml"),
                             "--force", "rl", "--force", "nope"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "error: --force nope: no stage 'nope' in pipeline digits-grpo-demo (stages: ingest, sft, rl, eval_sft, eval, register)" in result.stderr
    assert not (tmp_path / ".omni").exists()  # nothing started


# ---- progress: steps seen from the driver ----------------------------------------------------------

def test_step_watcher_reports_the_steps_a_trainer_logged(tmp_path: Path, mlflow_db: Callable[[Path], str]) -> None:
    from omni_core.lineage import Tracker
    from omni_core.pipeline.watch import StepWatcher

    tracker = Tracker(mlflow_db(tmp_path / "mlflow.db"))
    run_id = tracker.start_run("watch", run_name="rl", tags={})
    seen: list[int] = []
    watcher = StepWatcher(tracker.tracking_uri, run_id, "timing_s/step", seen.append)
    watcher.poll()
    for step in (1, 2, 3):
        tracker.log_metrics(run_id, {"timing_s/step": 0.1}, step=step, timestamp_ms=0)
    watcher.poll()
    watcher.poll()
    assert seen == [3]


def test_step_progress_is_updated_from_another_thread(prefect_api: Any) -> None:
    import threading

    from prefect import flow, task

    from tasks.stages import StepProgress

    @task
    def train() -> None:
        progress = StepProgress("progress-test", "rl")
        progress(0, 4)  # created in the task's thread
        reporter = threading.Thread(target=lambda: [progress(step, 4) for step in (1, 2)])
        reporter.start()
        reporter.join()

    @flow
    def training() -> None:
        train()

    state = training(return_state=True)
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    found = prefect_api.read_artifacts(artifact_filter=ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    assert [(a.key, float(a.data)) for a in found] == [("progress-test-rl-progress", 50.0)]


def test_latest_record_reads_the_newest_by_time_and_breaks_ties_by_finished_at(store: Any) -> None:
    """`latest_record` (the "changed since" note) takes the newest record from the listing's times and
    reads only it, or those modified within SAME_TIME_S of it, choosing by finished_at among them."""
    import os

    from omni_core.pipeline import cache

    assert cache.latest_record(store, "p", "s") is None

    def record(key: str, finished_at: str) -> cache.StageRecord:
        return cache.StageRecord(pipeline="p", stage="s", kind="noop", cache_key=key, key_inputs={}, outputs={},
                                 output_digest="", seconds=0.0, mlflow_run_id="", tracking_uri="",
                                 finished_at=finished_at)

    # written within a second of each other (their times tie on S3): the latest finished_at wins
    for key, at in [("k1", "2026-01-01T00:00:02+00:00"), ("k3", "2026-01-01T00:00:03+00:00"),
                    ("k2", "2026-01-01T00:00:01+00:00")]:
        cache.save_record(store, record(key, at))
    store.write_json(f"{cache.files_prefix('p', 's', 'k9')}/note.json", {})  # a record's file, not a record
    assert cache.latest_record(store, "p", "s").cache_key == "k3"
    assert set(cache.record_times(store, "p", "s")) == {cache.record_key("p", "s", k) for k in ("k1", "k2", "k3")}
    if store.uri("").startswith("s3:"):
        return
    # an hour older on disk: not read at all (unreadable here), whatever its finished_at says
    for key in ("k1", "k3"):
        path = os.path.join(store.root, cache.record_key("p", "s", key))
        Path(path).write_text("not json")
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    assert cache.latest_record(store, "p", "s").cache_key == "k2"
