"""What a pipeline run shows: a markdown summary, a metrics table, the reward curve as a PNG.

Plain functions of a run summary (`PipelineRun.summary()`); the Prefect layer publishes them as
artifacts, anything else (a notebook, a CI log) can print them.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

from omni_core.lineage import sqlite_path, ui_command
from omni_core.lineage.tracking import (  # noqa: F401  (re-exported)
    LOCAL_MLFLOW_UI,
    mlflow_experiment_url,
    mlflow_run_url,
    mlflow_ui_base,
)


def _short(digest: str, n: int = 12) -> str:
    return digest[:n] + "…" if len(digest) > n else digest


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def stage_result(stage: dict[str, Any]) -> str:
    """One line naming what a stage produced (dataset versions, checkpoint, images) or why it did not."""
    if stage["status"] in ("failed", "not_run"):
        return _cell(stage["error"])
    out = stage["outputs"]
    parts = [f"{key}@`{d['version']}` ({sum(d.get('rows', {}).values())} rows)"
             for key, d in out.get("datasets", {}).items()]
    if "checkpoint_uri" in out:
        parts.append(f"global_step_{out['global_step']} (sha256 `{_short(out['weights_sha256'])}`)")
    parts += [f"{target} `{_short(i.get('digest') or i.get('tag') or '')}`" for target, i in out.get("images", {}).items()]
    return ", ".join(parts)


def summary_markdown(summary: dict[str, Any], flow_run_url: str = "") -> str:
    """Stages (status, cache, seconds, result, MLflow run), then dataset versions, checkpoints,
    images and the MLflow parent run."""
    tracking, experiment = summary["tracking_uri"], summary["mlflow_experiment_id"]
    stages = summary["stages"]
    hits = sum(1 for s in stages if s["cache"] == "hit")
    lines = [f"# Pipeline `{summary['pipeline']}`: {summary['status']}", ""]
    lines.append(f"{len(stages)} stages, {hits} cache hit(s)"
                 + (f"; forced: {', '.join(summary['forced'])}" if summary["forced"] else "")
                 + (f"; [Prefect flow run]({flow_run_url})" if flow_run_url else ""))
    lines += ["", "| stage | kind | status | cache | seconds | result | MLflow run |",
              "|---|---|---|---|---|---|---|"]
    for s in stages:
        cache = f"{s['cache']} `{s['cache_key']}`" if s["cache_key"] else s["cache"]
        link = f"[{s['mlflow_run_id'][:8]}]({mlflow_run_url(tracking, experiment, s['mlflow_run_id'])})" \
            if s["mlflow_run_id"] else ""
        lines.append(f"| {s['name']} | {s['kind']} | {s['status']} | {cache} | {s['seconds']:.1f} | "
                     f"{stage_result(s)} | {link} |")
    datasets = [(s["name"], key, d) for s in stages for key, d in s["outputs"].get("datasets", {}).items()]
    if datasets:
        lines += ["", "## Dataset versions", ""]
        lines += [f"- `{key}` version `{d['version']}` ({stage}): {d['uri']}" for stage, key, d in datasets]
    checkpoints = [s for s in stages if "checkpoint_uri" in s["outputs"]]
    if checkpoints:
        lines += ["", "## Checkpoints", ""]
        lines += [f"- {s['name']}: {s['outputs']['checkpoint_uri']} (run key `{s['outputs']['run_key']}`, "
                  f"weights sha256 `{s['outputs']['weights_sha256']}`)" for s in checkpoints]
    images = [(s["name"], t, i) for s in stages for t, i in s["outputs"].get("images", {}).items()]
    if images:
        lines += ["", "## Images", ""]
        lines += [f"- {target} ({stage}): `{i['pinned_ref']}` digest `{i.get('digest') or 'n/a'}`"
                  for stage, target, i in images]
    lines += ["", "## MLflow", "", f"[Runs of experiment {summary['pipeline']}]"
              f"({mlflow_experiment_url(tracking, experiment)}) (Model training view)", "",
              f"Parent run [{summary['mlflow_parent_run_id']}]"
              f"({mlflow_run_url(tracking, experiment, summary['mlflow_parent_run_id'])}) at `{tracking}`"]
    if sqlite_path(tracking) is not None:
        lines.append(f"(links open after `{ui_command(tracking)}`)")
    lines += ["", f"Store `{summary['store']}`, config digest `{_short(summary['config_digest'], 16)}`"]
    return "\n".join(lines) + "\n"


def metrics_table(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per final (or eval) metric of each stage that reports metrics."""
    rows = []
    for s in summary["stages"]:
        metrics = s["outputs"].get("final_metrics") or s["outputs"].get("metrics") or {}
        rows += [{"stage": s["name"], "metric": name, "value": round(float(value), 6)}
                 for name, value in sorted(metrics.items())]
    return rows


def curve_png(points: Sequence[Sequence[float]], metric: str, title: str) -> bytes:
    """A line plot of (step, value) points as PNG bytes (matplotlib's Agg canvas, no pyplot state)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.2), dpi=100)
    ax = fig.subplots()
    steps = [p[0] for p in points]
    values = [p[1] for p in points]
    ax.plot(steps, values, marker="o", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def curve_markdown(stage: str, curve: dict[str, Any], png: bytes) -> str:
    """The PNG embedded (data URI) with a link to its copy in the store, and the points as a table."""
    data = base64.b64encode(png).decode()
    lines = [f"# Reward curve of stage `{stage}`", "",
             f"![{curve['metric']} per step](data:image/png;base64,{data})", "",
             f"PNG in the store: {curve['uri']}", "", f"| step | {curve['metric']} |", "|---|---|"]
    lines += [f"| {step} | {value:.6g} |" for step, value in curve["points"]]
    return "\n".join(lines) + "\n"


def image_grid_markdown(stage: str, grid: dict[str, Any], png: bytes, metrics: dict[str, float]) -> str:
    """An eval's image grid (data URI) with a link to its copy in the store, and the eval's metrics."""
    data = base64.b64encode(png).decode()
    lines = [f"# Images of eval stage `{stage}`", "",
             f"![the first {grid['images']} images with their scores](data:image/png;base64,{data})", "",
             f"PNG in the store: {grid['uri']} (MLflow artifact `{grid['artifact']}`)", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {_cell(name)} | {value:.6g} |" for name, value in sorted(metrics.items())]
    return "\n".join(lines) + "\n"
