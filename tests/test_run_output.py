"""What `omni run` prints: the run, not its tools' start-up noise. A small ingest -> rl -> eval ->
register pipeline through `python -m flows.cli run` (as the demo runs): no Ray SIGTERM or
token-authentication warning, no transformers "Loading weights" bar, and no `None` anywhere (the
Prefect flow run shows no URL when Prefect knows no UI URL). Also `quiet_startup` itself: it keeps
what the user set and drops only those two Ray notices."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from pipeline_runs import digits_pipeline

from omni_core.quiet import DROPPED, SIGTERM_NOTICE, TOKEN_AUTH_NOTICE, quiet_startup

NOISE = ("SIGTERM handler is not set", "Token authentication", "RAY_AUTH_MODE", "Loading weights", "None")
# what the test environment may carry that would hide (or change) the defaults under test
UNSET = ("PREFECT_API_URL", "PREFECT_UI_URL", "RAY_ADDRESS", "RAY_AUTH_MODE", "HF_HUB_DISABLE_PROGRESS_BARS")


@pytest.mark.slow
def test_omni_run_prints_no_start_up_noise_and_no_none(tmp_path: Path, model_cache: Path) -> None:
    data = digits_pipeline(tmp_path, name="quiet-run", store=str(tmp_path / "store"),
                           tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", seed=0, model_name="quiet", samples=2)
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), OMNI_CACHE_DIR=str(model_cache),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    result = subprocess.run([sys.executable, "-m", "flows.cli", "run", "p.yaml"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "registered   quiet version 1" in out and "[rl] step 2/2" in out, out[-4000:]  # it did run
    [flow_run] = [line for line in out.splitlines() if "prefect flow run " in line]
    assert "/flow-runs/" not in flow_run  # no UI URL known: none printed
    for noise in NOISE:
        assert noise not in out, f"{noise!r} in the output of omni run:\n{out[-4000:]}"

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "quiet-run"]
    runs = client.search_runs([experiment.experiment_id])
    assert runs and all("prefect.flow_run_url" not in r.data.tags for r in runs)
    assert all(r.data.tags.get("prefect.flow_run_id") for r in runs if "mlflow.parentRunId" not in r.data.tags)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """What quiet_startup changes, reset here and put back after the test: the variables (also when it
    sets them), transformers' progress-bar switch and the filters of the two Ray loggers."""
    from transformers.utils import logging as hf_logging

    for name in UNSET:
        monkeypatch.setenv(name, "x")  # records the original value (or its absence) for the undo
        monkeypatch.delenv(name)
    bars = hf_logging.is_progress_bar_enabled()
    loggers = {name: list(logging.getLogger(name).filters) for name in DROPPED}
    hf_logging.enable_progress_bar()
    for name in DROPPED:
        logging.getLogger(name).filters.clear()
    yield monkeypatch
    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    for name, filters in loggers.items():
        logging.getLogger(name).filters[:] = filters


def test_quiet_startup_switches_off_transformers_bars(clean_env: pytest.MonkeyPatch) -> None:
    from transformers.utils import logging as hf_logging

    quiet_startup()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"  # for the Ray workers started later
    assert not hf_logging.is_progress_bar_enabled()  # this process imported transformers already
    assert "RAY_AUTH_MODE" not in os.environ  # Ray's authentication is left as Ray sets it up


def test_quiet_startup_keeps_what_the_user_set(clean_env: pytest.MonkeyPatch) -> None:
    from transformers.utils import logging as hf_logging

    clean_env.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    quiet_startup()
    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "0" and hf_logging.is_progress_bar_enabled()


def test_only_the_two_ray_notices_are_dropped(clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    quiet_startup()
    quiet_startup()  # idempotent: one filter a logger
    assert all(len(logging.getLogger(name).filters) == 1 for name in DROPPED)
    worker = logging.getLogger("ray._private.worker")
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    kept = ["Using address 127.0.0.1:6379 set in the environment variable RAY_ADDRESS",
            "Token authentication is disabled for this Ray cluster. Anyone with network access to the cluster "
            "can run arbitrary code and access its data."]
    with caplog.at_level(logging.WARNING):
        worker.warning(SIGTERM_NOTICE + ".")
        worker.warning(kept[0])
        auth.warning(TOKEN_AUTH_NOTICE + ". Set RAY_AUTH_MODE=disabled to opt out.")
        auth.warning(kept[1])
    assert [r.getMessage() for r in caplog.records] == kept
