"""The tutorials run: every command block of every page under docs/tutorials/ is executed (bash, in the
nav's order, in one temporary workspace, as a reader following them in one folder would), on the tiny
built-in models and fixtures, and the output holds each page's `<!-- expect: ... -->` fragments. A block
marked `<!-- not run: REASON -->` (it needs a GPU cluster or the server stack) is not run; its commands
are checked like every other page's (tests/test_docs_site.py: real commands, real options).

The workspace is what a user's is: `omni` on PATH, `.omni/` holding every project's store and MLflow
database. The differences, none visible to the pages: the Prefect server is one this module starts
(`prefect server start` with its UI, as scripts/docs_screenshots.py starts it; PREFECT_API_URL points the
pages at it) instead of omni's local server; `pip install` goes to a folder of the workspace on
PYTHONPATH (PIP_TARGET), not into the suite's environment; and the tiny models come from the suite's
shared cache ($OMNI_CACHE_DIR).

The runs are shared by the assertions after them: the metric names each training and eval run logged
are the ones docs/reference/metrics.md documents (the algorithms' and eval kinds' records), and the
screenshot code of `make docs-screenshots` takes its pictures of them.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from doc_pages import DOCS, ROOT, blocks, expectations, script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_screenshots  # noqa: E402


def tutorial_pages() -> list[Path]:
    """docs/tutorials/*.md in the nav's order (a page may continue the one before it)."""
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    section = next(item["Tutorials"] for item in nav if isinstance(item, dict) and "Tutorials" in item)
    listed = [DOCS / next(iter(entry.values())) for entry in section]
    rest = sorted(set((DOCS / "tutorials").glob("*.md")) - set(listed))
    return listed + rest


def page_env(workspace: Path, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "RAY_ADDRESS", "OMNI_PREFECT_SERVER", "PYTHONDONTWRITEBYTECODE",
                                "MLFLOW_"))}
    site = workspace / ".site-packages"
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMNI_CACHE_DIR=str(cache), PIP_TARGET=str(site),
               PYTHONPATH=str(site), PIP_DISABLE_PIP_VERSION_CHECK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               COLUMNS="200", PYTHONUNBUFFERED="1")
    return env


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory, prefect_db: Callable[[Path], Path],
              model_cache: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """The workspace folder and the pages' environment, with a Prefect server (UI on) for the module."""
    folder = tmp_path_factory.mktemp("tutorials")
    prefect_db(folder / ".omni" / "prefect" / "prefect.db")  # a migrated copy: the server skips migrations
    port = docs_screenshots.free_port()
    env = page_env(folder, model_cache)
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    with docs_screenshots.prefect_server(folder, port):
        yield folder, env


@pytest.fixture(scope="module")
def runs(workspace: tuple[Path, dict[str, str]]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each tutorial page run once, in order, in the workspace."""
    folder, env = workspace
    out = {}
    for page in tutorial_pages():
        started = time.monotonic()
        out[page.name] = run_page(page, folder, env)
        print(f"docs/tutorials/{page.name}: {time.monotonic() - started:.1f} s", flush=True)  # shown with -s
    return out


def run_page(page: Path, folder: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The page's script in a session of its own: on a timeout the whole session is killed (the `omni`
    commands the page started, their variants and Ray), not only bash, so nothing runs on after it."""
    proc = subprocess.Popen(["bash", "-c", script(page)], cwd=folder, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after {timeout:.0f} s)"
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("page", [p.name for p in tutorial_pages()])
def test_the_tutorial_runs_and_prints_what_it_says(page: str, runs: dict) -> None:
    result = runs[page]
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"docs/tutorials/{page} failed:\n{output[-6000:]}"
    missing = [text for text in expectations(DOCS / "tutorials" / page) if text not in output]
    assert not missing, f"docs/tutorials/{page}: not in the output: {missing}\n{output[-6000:]}"


def test_every_tutorial_runs_something() -> None:
    """A page whose blocks are all marked not run says so on the page; the rest run at least one block."""
    for page in tutorial_pages():
        runnable = [b for b in blocks(page) if b.not_run is None]
        assert runnable or "not run" in page.read_text(), page


def _logged_metrics(workspace: Path) -> dict[str, set[str]]:
    """MLflow metric names by the stage kind of the run that logged them (training runs by algorithm)."""
    db = sqlite3.connect(workspace / ".omni" / "mlflow.db")
    rows = db.execute("""select m.key, k.value, a.value, b.value from metrics m
                         join tags k on k.run_uuid = m.run_uuid and k.key = 'omni.stage_kind'
                         left join params a on a.run_uuid = m.run_uuid and a.key = 'algorithm'
                         left join tags b on b.run_uuid = m.run_uuid and b.key = 'omni.backend'""").fetchall()
    found: dict[str, set[str]] = {}
    for key, kind, algorithm, backend in rows:
        owner = "trl" if backend == "trl" else algorithm if kind in ("rl", "sft") and algorithm else kind
        found.setdefault(owner, set()).add(key)
    return found


def _documented(patterns: list[str]) -> re.Pattern[str]:
    """`val-core/{data_source}/reward/mean@{n}` -> a regex (MLflow's `@` spelling `_at_` too)."""
    def one(name: str) -> str:
        parts = re.split(r"\{[^}]+\}", name)
        return ".+".join(re.escape(p).replace("@", "(?:@|_at_)") for p in parts)
    return re.compile("|".join(f"(?:{one(p)})" for p in patterns))


def test_every_metric_the_runs_logged_is_documented(runs: dict, workspace: tuple[Path, dict[str, str]]) -> None:
    from omni_core.backends.trl.metrics import OWN_METRICS as TRL_OWN_METRICS
    from omni_core.config.algorithms import RUNNER_METRICS, get_algorithm
    from omni_core.evaluation.metrics import EVAL_KINDS
    from omni_core.lineage.datasets import INGEST_METRICS

    logged = _logged_metrics(workspace[0])
    assert {"grpo", "sft", "mpo", "flow_grpo", "eval", "ingest", "trl"} <= set(logged), sorted(logged)
    eval_names = [n for _, metrics in EVAL_KINDS.values() for n in metrics]
    eval_names += [f"{n}_baseline" for n in eval_names] + [f"{n}_gain" for n in eval_names]
    undocumented = {}
    for owner, names in logged.items():
        if owner == "eval":
            allowed = eval_names
        elif owner == "ingest":
            allowed = list(INGEST_METRICS)
        elif owner == "trl":  # TRL's own names (whatever its trainer logs), and the backend's: documented
            allowed = [*TRL_OWN_METRICS]
            names = {n for n in names if n.startswith(("trl/", "timing_s/"))}
        else:
            allowed = [*RUNNER_METRICS, *get_algorithm(owner).metrics]
        pattern = _documented(allowed)
        extra = sorted(n for n in names if not pattern.fullmatch(n))
        if extra:
            undocumented[owner] = extra
    assert not undocumented, ("metrics logged but not in their records (Algorithm.metrics, "
                              f"omni_core/evaluation/metrics.py): {undocumented}")


def test_the_screenshots_show_the_runs(runs: dict, workspace: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """`make docs-screenshots`' pictures, taken of the tutorials' runs: the MLflow run page with its
    metric charts, the eval samples table, the diffusion eval grid and the Prefect flow run. Each page is
    captured only once its text shows the run's name (and what the picture is of: the charts drawn, the
    table's cells, the grid loaded, the flow run's register task); each picture is a full, non-blank PNG."""
    from PIL import Image

    folder, env = workspace
    shots = docs_screenshots.take(folder, tmp_path, env["PREFECT_API_URL"].removesuffix("/api"), "my-project",
                                  "diffusion")
    assert [s.file for s in shots] == ["mlflow-run-metrics.png", "mlflow-eval-samples.png", "mlflow-eval-grid.png",
                                       "prefect-flow-run.png"]
    assert shots[0].name == "my-project rl" and shots[2].name == "diffusion eval"
    assert re.fullmatch(r"[a-z]+-[a-z]+", shots[3].name), shots[3].name  # a Prefect flow run's name
    for shot in shots:
        with Image.open(tmp_path / shot.file) as image:
            assert image.size == (docs_screenshots.WIDTH, docs_screenshots.HEIGHT), shot
            colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
            assert colours is None or len(colours) > 50, f"{shot.file}: {len(colours)} colours: blank?"
    for curve in ("reward-curve-demo.png", "reward-curve-flow-grpo.png"):
        assert (tmp_path / curve).read_bytes().startswith(b"\x89PNG"), curve
