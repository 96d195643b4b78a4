"""verl's metrics reach the stage's run on every tracking URI the platform supports: the relay
(omni_core/backends/jobs/metrics.py) reads the lines verl's file logger writes (`{"step": N, "data":
{...}}`, as verl/utils/tracking.py FileLogger does) and logs them with our MLflow client, here into a
file store and a sqlite database (the MLflow server: tests/test_backend_verl_cpu.py; a whole job on
sqlite: tests/test_backend_verl_pipeline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from omni_core.backends.jobs.metrics import MetricsMissing, MetricsRelay, metrics_file, mlflow_key


def _line(step: int, data: dict) -> bytes:
    return (json.dumps({"step": step, "data": data}) + "\n").encode()


@pytest.mark.parametrize("store", ["file", "sqlite"])
def test_the_relay_logs_each_line_once_under_the_names_verls_mlflow_logger_wrote(tmp_path: Path, store: str,
                                                                                  mlflow_db, monkeypatch) -> None:
    # MLflow 3.17 keeps its file store for those who opt in (it is in maintenance mode)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file://{tmp_path / 'mlruns'}" if store == "file" else mlflow_db(tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("relay"))
    path = metrics_file(tmp_path / "metrics", "omni-verl-p-rl-k-d-attempt-2")
    assert path == tmp_path / "metrics" / "omni-verl-p-rl-k-d-attempt-2.jsonl"
    relay = MetricsRelay(client, run.info.run_id, path)
    assert relay.poll() == 0  # the job has not written yet

    path.parent.mkdir()
    with open(path, "wb", buffering=0) as out:
        out.write(_line(1, {"critic/score/mean": 0.25, "val-core/digits_rotate/acc/mean@1": 0.5,
                            "timing_s/step": 1.5, "note": "text", "flag": True, "nan": None}))
        out.write(b'{"step": 2, "data": {"critic/score/mean": 0.')  # a line still being written
        assert relay.poll() == 3  # the numbers of the whole line only
        out.write(b'75}}\n')
        assert relay.poll() == 1 and relay.poll() == 0  # its end came: once

    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.75)]
    logged = client.get_run(run.info.run_id).data.metrics
    assert logged["val-core/digits_rotate/acc/mean_at_1"] == 0.5  # `@` as verl's MLflow logger spelled it
    assert set(logged) == {"critic/score/mean", "val-core/digits_rotate/acc/mean_at_1", "timing_s/step"}
    relay.require(("critic/score/mean",), "stage rl: verl job j")  # logged: no error


def test_a_job_whose_run_got_none_of_its_metrics_is_an_error(tmp_path: Path, mlflow_db) -> None:
    client = MlflowClient(mlflow_db(tmp_path / "mlflow.db"))
    run = client.create_run(client.create_experiment("quiet"))
    never = MetricsRelay(client, run.info.run_id, tmp_path / "never.jsonl")
    never.poll()
    with pytest.raises(MetricsMissing, match="none of train/loss .*was never written.*keep 'file' in trainer.logger"):
        never.require(("train/loss",), "stage sft: verl job j")
    other = tmp_path / "other.jsonl"
    other.write_bytes(_line(1, {"perf/throughput": 3.0}))
    relay = MetricsRelay(client, run.info.run_id, other)
    relay.poll()
    with pytest.raises(MetricsMissing, match="holds 1 other metrics"):
        relay.require(("train/loss",), "stage sft: verl job j")
    relay.require((), "a recipe")  # nothing asked: nothing checked


def test_metric_names_mlflow_refuses_are_spelled_as_verl_spelled_them() -> None:
    assert mlflow_key("val-core/openai/gsm8k/reward/mean@4") == "val-core/openai/gsm8k/reward/mean_at_4"
    assert mlflow_key("a//b (x)") == "a/b _x_"
