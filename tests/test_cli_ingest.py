"""`omni ingest` (the Prefect ingest flow, logged to MLflow) and `omni datasets list|show`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow
API_URL: list[str] = []  # the session's Prefect server (set by the `workdir` fixture)


def omni(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`omni` in `cwd`; its flows run on the session's Prefect server (conftest.prefect_server: no
    temporary server per command; `omni run` on the embedded default is test_demo_pipeline's)."""
    env = {**os.environ, "PREFECT_HOME": str(cwd / "prefect"), "OMNI_CACHE_DIR": str(cwd / "cache"),
           "PREFECT_API_URL": API_URL[0]}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str]) -> Path:
    API_URL[:] = [prefect_server["PREFECT_API_URL"]]
    return tmp_path_factory.mktemp("ingest-cli")


def test_ingest_twice_then_list_and_show(workdir: Path) -> None:
    args = ["ingest", "gsm8k", "--source", "fixtures://gsm8k?rows=20&seed=1&bad_rows=1",
            "--max-quarantine-fraction", "0.1", "--store", "store", "--tracking-uri", "sqlite:///m.db", "--json"]
    first = omni(*args, cwd=workdir)
    assert first.returncode == 0, first.stderr[-2000:]
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert result["counts"] == {"read": 26, "rows": 25, "quarantined": 1, "skipped": 0}
    assert result["rows"] == {"test": 5, "train": 20} and not result["reused"]
    version_dir = workdir / "store/datasets/gsm8k" / result["version"]
    mtimes = {p: p.stat().st_mtime_ns for p in version_dir.iterdir()}

    second = omni(*args, cwd=workdir)
    again = json.loads(second.stdout.strip().splitlines()[-1])
    assert again["version"] == result["version"] and again["reused"]
    assert {p: p.stat().st_mtime_ns for p in version_dir.iterdir()} == mtimes  # no writes

    client = MlflowClient(f"sqlite:///{workdir / 'm.db'}")
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["gsm8k.version"] == result["version"]
    [dataset_input] = run.inputs.dataset_inputs
    assert dataset_input.dataset.digest == result["version"]
    assert json.loads(dataset_input.dataset.profile)["splits"] == {"test": 5, "train": 20}
    manifest_path = f"datasets/gsm8k/{result['version']}/_manifest.json"
    local = client.download_artifacts(run.info.run_id, manifest_path, str(workdir / "dl"))
    assert json.loads(Path(local).read_text())["version"] == result["version"]

    listing = omni("datasets", "list", "--store", "store", cwd=workdir)
    assert listing.returncode == 0 and result["version"][:8] in listing.stdout
    show = omni("datasets", "show", f"gsm8k@{result['version']}", "--store", "store", "--rows", "1", cwd=workdir)
    assert show.returncode == 0, show.stderr
    assert "train: 20 rows in 1 shard(s)" in show.stdout and "ground_truth" in show.stdout


def test_failed_ingest_is_one_line_and_leaves_no_version(workdir: Path) -> None:
    result = omni("ingest", "bad", "--converter", "gsm8k", "--source", "fixtures://gsm8k?rows=10&bad_rows=5",
                  "--store", "store", "--tracking-uri", "sqlite:///m.db", cwd=workdir)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "over max_quarantine_fraction=0.05" in result.stderr
    assert not (workdir / "store/datasets/bad").exists() or not any((workdir / "store/datasets/bad").rglob("*.json"))
    missing = omni("datasets", "show", "nope", "--store", "store", cwd=workdir)
    assert missing.returncode == 2 and "run its ingest stage first" in missing.stderr


SHOW_THREADS = """
import json, os, sys
import pyarrow.parquet  # its allocator's background thread starts on import: counted before
from flows.cli import app

def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

before = threads()
sys.argv = ["omni", "datasets", "show", sys.argv[1], "--store", "store", "--rows", "2"]
try:
    app()
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps([before, threads()]))
"""


def test_datasets_show_reads_its_sample_without_arrow_threads(tmp_path: Path) -> None:
    """A short command that leaves Arrow pool threads behind can abort at exit (SIGABRT, "terminate called
    without an active exception": apache/arrow#34314; once in the suite): `datasets show` starts none."""
    from omni_core.config import DatasetConfig
    from omni_core.data import ingest
    from omni_core.storage import Store

    ingest(Store(str(tmp_path / "store")), "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=8&seed=0",
                                                                   converter="gsm8k"), progress=lambda _: None)
    probe = subprocess.run([sys.executable, "-c", SHOW_THREADS, "gsm8k"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert probe.returncode == 0, probe.stderr[-2000:]
    before, after = json.loads(probe.stdout.strip().splitlines()[-1])
    assert "train[1]" in probe.stdout or "test[1]" in probe.stdout  # it did decode its sample rows
    assert after == before, (before, after)
