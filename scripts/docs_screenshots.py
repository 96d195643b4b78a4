"""Pictures for the docs site, taken by headless Chromium from real runs (`make docs-screenshots`):

- mlflow-run-metrics.png: the text pipeline's rl run in MLflow, its training metrics charts;
- mlflow-eval-samples.png: its eval run's `eval_samples.json` table (prompt, response, score, baseline);
- mlflow-eval-grid.png: the diffusion pipeline's eval grid (`eval_grid.png`) in MLflow's artifact view;
- prefect-flow-run.png: the text pipeline's `pipeline` flow run in the Prefect UI;
- reward-curve-demo.png, reward-curve-flow-grpo.png: the rl stages' reward curves, from the store.

By default it runs configs/demo.yaml and configs/flow_grpo.yaml in a work folder (one store, one
MLflow database, one Prefect server: a `prefect server start` it starts with its UI's API URL set, so
the UI reaches its API), then starts `mlflow ui` on the database and drives Chromium through the
DevTools protocol (a page is captured once what it shows has loaded: the charts drawn, the table
filled). `--skip-run` takes the pictures of runs already made (the tutorials' test does, against its
own runs), with the Prefect UI at `--prefect-ui`.

    python scripts/docs_screenshots.py [--workdir DIR] [--out docs/images] [--quick]
    python scripts/docs_screenshots.py --skip-run --workdir DIR --prefect-ui URL \
        --text-pipeline my-project --diffusion-pipeline diffusion --out DIR
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WIDTH, HEIGHT = 1440, 900
QUICK = {  # fewer steps, the same pipelines
    "demo.yaml": ["stages.sft.trainer.total_steps=20", "stages.rl.trainer.total_steps=8"],
    "flow_grpo.yaml": ["stages.flow_grpo.trainer.total_steps=2"],
}


# ---- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}: "
                               f"{log.read_text()[-2000:] if log else ''}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


@contextlib.contextmanager
def server(argv: list[str], health: str, log: Path, env: dict[str, str] | None = None,
           timeout_s: float = 180) -> Iterator[None]:
    """A server process for the block's duration (its own process group, stopped at the end)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http(health, timeout_s, proc, log)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def prefect_server(workdir: Path, port: int) -> contextlib.AbstractContextManager[None]:
    """`prefect server start` with its UI's API URL set to itself (PREFECT_UI_API_URL: without it the UI
    asks http://127.0.0.1:4200/api and shows "Can't connect to Server API" on any other port)."""
    home = workdir / ".omni" / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}, "PREFECT_HOME": str(home),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}
    return server([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                  f"http://127.0.0.1:{port}/api/health", workdir / "prefect-server.log", env)


def mlflow_ui(workdir: Path, port: int) -> contextlib.AbstractContextManager[None]:
    """`mlflow ui` with one uvicorn worker and no job runner: MLflow's defaults (4 workers, a huey consumer
    per GenAI job queue, none of which a screenshot uses) started 12 processes, ~45 CPU s, against 2."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return server([str(BIN / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{workdir / '.omni' / 'mlflow.db'}",
                   "--host", "127.0.0.1", "--port", str(port), "--workers", "1"], f"http://127.0.0.1:{port}/health",
                  workdir / "mlflow-ui.log", env)


def run_pipelines(workdir: Path, api_url: str, quick: bool) -> None:
    env = {**{k: v for k, v in os.environ.items() if k not in ("OMNI_PREFECT_SERVER", "PYTHONDONTWRITEBYTECODE")},
           "PREFECT_API_URL": api_url}
    for name in ("demo.yaml", "flow_grpo.yaml"):
        print(f"== omni run configs/{name}", flush=True)
        subprocess.run([str(BIN / "omni"), "run", str(ROOT / "configs" / name), *(QUICK[name] if quick else [])],
                       cwd=workdir, env=env, check=True)


# ---- Chromium through the DevTools protocol ---------------------------------------------------------


class Chromium:
    """One headless Chromium page, driven over the DevTools protocol (websockets): navigate, wait for a
    condition in the page, click, type, capture. Chromium itself is the system's (SYSTEM_PACKAGES)."""

    FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
             "--disable-extensions", "--remote-debugging-port=0", "--remote-allow-origins=*")

    def __init__(self) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if not binary:
            raise RuntimeError("chromium is not installed (make setup installs it as root: SYSTEM_PACKAGES)")
        self.profile = tempfile.mkdtemp(prefix="omni-shots-")
        self.proc = subprocess.Popen([binary, *self.FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            page = next(t for t in json.load(response) if t["type"] == "page")
        from websockets.sync.client import connect

        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=30)
        self.ids = itertools.count(1)
        self.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self.ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=120))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")

    def goto(self, url: str, ready: str, timeout_s: float = 90) -> None:
        """Open `url` and wait until the JS expression `ready` is true in the page."""
        self.call("Page.navigate", url=url)
        self.wait(ready, timeout_s, url)

    def wait(self, condition: str, timeout_s: float = 60, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(f"Boolean({condition})"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what or 'page'}: not ready after {timeout_s:.0f} s ({condition})")
            time.sleep(0.5)

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def capture(self, path: Path) -> None:
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=0, y=HEIGHT - 1)  # no hover tooltips
        time.sleep(1.0)  # charts' and tables' own transitions
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)


# ---- the pictures -------------------------------------------------------------------------------


@dataclass
class Shot:
    file: str
    url: str
    name: str  # the run's name, which the page must show


def js_text(fragment: str) -> str:
    return f"(document.body !== null && document.body.innerText.includes({json.dumps(fragment)}))"


# MLflow's run page opens its assistant panel beside the content: closed before a capture
CLOSE_ASSISTANT = """(() => {
  for (const button of document.querySelectorAll('button[aria-label="Close"]')) {
    for (let box = button.parentElement, i = 0; box && i < 6; box = box.parentElement, i++) {
      if ((box.innerText || '').includes('MLflow Assistant')) { button.click(); return true; }
    }
  }
  return false; })()"""


def runs_of(client: Any, pipeline: str) -> dict[str, Any]:
    """The newest run of each stage of `pipeline`'s experiment, by run name (the parent run under its name)."""
    experiment = client.get_experiment_by_name(pipeline)
    if experiment is None:
        raise RuntimeError(f"no MLflow experiment {pipeline!r}: run the pipeline first")
    runs: dict[str, Any] = {}
    for run in client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"]):
        runs.setdefault(run.info.run_name, run)
    return runs


def mlflow_shots(browser: Chromium, ui: str, text_pipeline: str, diffusion_pipeline: str, out: Path) -> list[Shot]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(ui)
    text, diffusion = runs_of(client, text_pipeline), runs_of(client, diffusion_pipeline)
    rl, evaluation, grid = text["rl"], text["eval"], diffusion["eval"]
    view = "?workflowType=machine_learning"
    shots = [
        Shot("mlflow-run-metrics.png", f"{ui}/#/experiments/{rl.info.experiment_id}/runs/{rl.info.run_id}/model-metrics"
             f"{view}", f"{text_pipeline} rl"),
        Shot("mlflow-eval-samples.png", f"{ui}/#/experiments/{evaluation.info.experiment_id}/runs/"
             f"{evaluation.info.run_id}/artifacts/eval_samples.json{view}", f"{text_pipeline} eval"),
        Shot("mlflow-eval-grid.png", f"{ui}/#/experiments/{grid.info.experiment_id}/runs/{grid.info.run_id}/artifacts/"
             f"eval_grid.png{view}", f"{diffusion_pipeline} eval"),
    ]
    ready = {
        "mlflow-run-metrics.png": "document.querySelectorAll('.js-plotly-plot, svg.main-svg').length > 0",
        "mlflow-eval-samples.png": "document.querySelectorAll('table td, [role=cell], [role=gridcell]').length > 4",
        "mlflow-eval-grid.png": "[...document.images].some(i => i.complete && i.naturalWidth > 100)",
    }
    for shot in shots:
        pipeline, stage = shot.name.split()
        browser.goto(shot.url, f"{js_text(pipeline)} && {js_text(stage)} && {ready[shot.file]}")
        browser.evaluate(CLOSE_ASSISTANT)
        if shot.file == "mlflow-run-metrics.png":  # the reward first: filter the charts to critic/score
            browser.evaluate("""(() => { const i = document.querySelector('input[placeholder*="Search metric"]');
              if (!i) return false; const set = Object.getOwnPropertyDescriptor(HTMLInputElement.prototype, 'value').set;
              set.call(i, 'critic/score'); i.dispatchEvent(new Event('input', {bubbles: true})); return true; })()""")
            browser.wait(ready[shot.file], 30, shot.url)
        browser.capture(out / shot.file)
    return shots


def prefect_shot(browser: Chromium, prefect_ui: str, tracking_ui: str, text_pipeline: str, out: Path) -> Shot:
    """The flow run that ran `text_pipeline` (the MLflow parent run's prefect.flow_run_id)."""
    from mlflow.tracking import MlflowClient

    parent = runs_of(MlflowClient(tracking_ui), text_pipeline)[text_pipeline]
    flow_run_id = parent.data.tags["prefect.flow_run_id"]
    with urllib.request.urlopen(f"{prefect_ui}/api/flow_runs/{flow_run_id}", timeout=30) as response:
        name = json.load(response)["name"]
    shot = Shot("prefect-flow-run.png", f"{prefect_ui}/runs/flow-run/{flow_run_id}", name)
    browser.goto(shot.url, f"{js_text(name)} && {js_text('register')} && !{js_text('connect to Server API')}")
    browser.capture(out / shot.file)
    return shot


def reward_curves(workdir: Path, out: Path, pipelines: dict[str, str]) -> list[Path]:
    """The newest reward curve PNG of each pipeline's rl stage, from the store."""
    written = []
    for pipeline, target in pipelines.items():
        curves = sorted((workdir / ".omni" / "store" / "runs" / pipeline / "stages").glob("*/*/reward_curve.png"),
                        key=lambda p: p.stat().st_mtime)
        if curves:
            shutil.copyfile(curves[-1], out / target)
            written.append(out / target)
    return written


def take(workdir: Path, out: Path, prefect_ui: str, text_pipeline: str, diffusion_pipeline: str) -> list[Shot]:
    """Every picture of runs already in `workdir` (its .omni/mlflow.db and store), into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with mlflow_ui(workdir, port):
        browser = Chromium()
        try:
            ui = f"http://127.0.0.1:{port}"
            shots = mlflow_shots(browser, ui, text_pipeline, diffusion_pipeline, out)
            shots.append(prefect_shot(browser, prefect_ui.rstrip("/"), ui, text_pipeline, out))
        finally:
            browser.close()
    reward_curves(workdir, out, {text_pipeline: "reward-curve-demo.png",
                                 diffusion_pipeline: "reward-curve-flow-grpo.png"})
    return shots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=ROOT / ".omni-screenshots",
                        help="where the pipelines run (their .omni/); default .omni-screenshots")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--quick", action="store_true", help="fewer training steps")
    parser.add_argument("--skip-run", action="store_true", help="picture runs already in --workdir")
    parser.add_argument("--prefect-ui", help="with --skip-run: the Prefect server whose UI shows the runs")
    parser.add_argument("--text-pipeline", default="digits-grpo-demo")
    parser.add_argument("--diffusion-pipeline", default="ocr-flow-grpo")
    args = parser.parse_args(argv)
    workdir, out = args.workdir.resolve(), args.out.resolve()
    if args.skip_run:
        if not args.prefect_ui:
            parser.error("--skip-run needs --prefect-ui")
        shots = take(workdir, out, args.prefect_ui, args.text_pipeline, args.diffusion_pipeline)
    else:
        shutil.rmtree(workdir / ".omni", ignore_errors=True)  # fresh runs: the pictures show this code's
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        with prefect_server(workdir, port):
            run_pipelines(workdir, f"http://127.0.0.1:{port}/api", args.quick)
            shots = take(workdir, out, f"http://127.0.0.1:{port}", args.text_pipeline, args.diffusion_pipeline)
    for shot in shots:
        print(f"wrote {out / shot.file} ({shot.url})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
