"""A training stage submitted as a Ray Job (`python -m omni_core.training submit`) to a real Ray head
with its job server on 127.0.0.1: the submission id is deterministic, so submitting the same training
again finds the job instead of starting a second; after a stopped attempt the next submission is
`...-attempt-2`. The job logs its training as a child of the given MLflow run, tagged with its Ray ids."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from job_head import start_job_head

from omni_core.config import DatasetConfig
from omni_core.config.loader import load_pipeline
from omni_core.data import ingest
from omni_core.lineage import Tracker
from omni_core.storage import Store
from omni_core.training.__main__ import main, rl_stage, submission_id

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_server() -> Any:
    """A Ray head with its job server (tests/job_head.py); yields its address and a client."""
    head, client = start_job_head(num_cpus=2)
    yield head.job_server, client
    head.stop()


def test_a_resubmitted_training_is_found_not_run_twice(job_server: Any, tmp_path: Path, capsys: Any,
                                                       mlflow_db: Callable[[Path], str]) -> None:
    address, client = job_server
    store = tmp_path / "store"
    dataset = DatasetConfig(source="fixtures://digits?rows=8&seed=0", converter="digits")
    version = ingest(Store(str(store)), "digits", dataset, progress=lambda _: None).version
    pipeline = tmp_path / "pipeline.yaml"
    mlflow_db(tmp_path / "mlflow.db")
    pipeline.write_text(yaml.safe_dump({
        "name": "job-test", "store": str(store), "seed": 3, "datasets": {"digits": dataset.model_dump()},
        "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "stages": [{"name": "rl", "kind": "rl", "data": "digits", "model": "tiny://lm", "reward": {"name": "digits"},
                    "trainer": {"total_steps": 1, "batch_size": 2}, "rollout": {"n": 2, "max_new_tokens": 4}}]}))
    config = load_pipeline(pipeline)
    expected = submission_id(config, rl_stage(config, "rl"), version)
    assert expected.startswith("omni-job-test-rl-") and expected == submission_id(
        load_pipeline(pipeline), rl_stage(load_pipeline(pipeline), "rl"), version)
    assert expected != submission_id(load_pipeline(pipeline, ["seed=4"]), rl_stage(config, "rl"), version)

    tracker = Tracker(config.tracking_uri)
    parent = tracker.start_run("job-test", run_name="job-test", tags={"omni.pipeline": "job-test", "omni.marker": "p"})

    def submit(*overrides: str) -> dict[str, Any]:
        sets = [item for kv in overrides for item in ("--set", kv)]
        assert main(["submit", str(pipeline), "--stage", "rl", "--address", address,
                     "--mlflow-parent-run-id", parent, *sets]) == 0
        return yaml.safe_load(capsys.readouterr().out.strip().splitlines()[-1])

    def wait(job: str, until: tuple[str, ...], seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while (status := str(client.get_job_status(job)).rsplit(".", 1)[-1]) not in until:
            assert time.monotonic() < deadline, f"job {job} still {status}:\n{client.get_job_logs(job)[-3000:]}"
            time.sleep(0.5)
        return status

    first = submit()
    assert first == {"submission_id": expected, "submitted": True, "status": "PENDING"}
    again = submit()  # a retried submission (e.g. the submitting task's retry): the same job, not a new one
    assert again["submission_id"] == expected and not again["submitted"]
    assert again["status"] in ("PENDING", "RUNNING", "SUCCEEDED")
    assert [j.submission_id for j in client.list_jobs() if j.submission_id != "warm-up"] == [expected]
    entrypoint = client.get_job_info(expected).entrypoint
    assert "-m omni_core.training run" in entrypoint and f"--dataset-version {version}" in entrypoint
    assert wait(expected, ("SUCCEEDED", "FAILED", "STOPPED"), 300) == "SUCCEEDED", client.get_job_logs(expected)
    assert submit() == {"submission_id": expected, "submitted": False, "status": "SUCCEEDED"}  # done: not again

    # the job's training is a child run of the pipeline run, with the parent's tags and its Ray ids
    children = tracker.client.search_runs([tracker.experiment_id("job-test")],
                                          filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert [r.info.status for r in children] == ["FINISHED"]
    tags = children[0].data.tags
    assert tags["ray.submission_id"] == expected and len(tags["ray.job_id"]) >= 8
    assert tags["omni.marker"] == "p" and tags["omni.stage"] == "rl" and expected.endswith(tags["omni.run_key"])
    assert "timing_s/step" in children[0].data.metrics  # the per-step metrics reached it
    models = tracker.client.search_logged_models(experiment_ids=[tracker.experiment_id("job-test")])
    assert [m.tags["omni.run_key"] for m in models] == [tags["omni.run_key"]]
    assert [d.dataset.digest for d in children[0].inputs.dataset_inputs] == [version]

    # another training (seed 4), stopped: the next submission is a new attempt (it resumes from the checkpoint)
    other = submit("seed=4")
    assert other["submitted"] and other["submission_id"] != expected
    client.stop_job(other["submission_id"])
    status = wait(other["submission_id"], ("STOPPED", "FAILED", "SUCCEEDED"), 60)
    retry = submit("seed=4")
    if status == "SUCCEEDED":  # it finished before the stop arrived: done, nothing to resubmit
        assert retry == {**other, "submitted": False, "status": "SUCCEEDED"}
    else:
        assert retry == {"submission_id": f"{other['submission_id']}-attempt-2", "submitted": True,
                         "status": "PENDING"}
        client.stop_job(retry["submission_id"])
