"""`quiet_startup`, which keeps `omni run`'s output to the run, not its tools' start-up noise: it
switches off transformers' progress bars, keeps what the user set and drops only two Ray notices.
That `omni run` prints no such noise (and no `None`) is checked on the demo's own output, in
tests/test_demo_pipeline.py (one pipeline run fewer)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from omni_core.quiet import DROPPED, SIGTERM_NOTICE, TOKEN_AUTH_NOTICE, quiet_startup

# what the test environment may carry that would hide (or change) the defaults under test
UNSET = ("PREFECT_API_URL", "PREFECT_UI_URL", "RAY_ADDRESS", "RAY_AUTH_MODE", "HF_HUB_DISABLE_PROGRESS_BARS")


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
