"""Prefect artifacts of a pipeline run: the markdown summary, the metrics table, the reward curves,
the eval stages' image grids.

The content comes from omni_core.pipeline.report; this module only publishes it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from omni_core.pipeline.report import curve_markdown, image_grid_markdown, metrics_table, summary_markdown
from omni_core.storage import Store

log = logging.getLogger(__name__)


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys take lowercase letters, digits and dashes only."""
    return "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts)


def publish_run_artifacts(summary: dict[str, Any], flow_run_url: str = "") -> None:
    pipeline = summary["pipeline"]
    create_markdown_artifact(summary_markdown(summary, flow_run_url), key=artifact_key(pipeline, "summary"),
                             description=f"pipeline {pipeline}: stages, cache hits, datasets, checkpoints, MLflow runs")
    rows = metrics_table(summary) or [{"stage": "", "metric": "no stage reported metrics", "value": None}]
    create_table_artifact(rows, key=artifact_key(pipeline, "metrics"),
                          description=f"pipeline {pipeline}: final metrics of each stage")
    store = Store(summary["store"])
    for stage in summary["stages"]:
        publish_image_grid(store, pipeline, stage)
        curve = stage["report"].get("reward_curve")
        if not curve:
            continue
        try:
            png = store.read_bytes(curve["key"])
        except Exception as exc:  # the summary still names the stage; a missing plot is not a failed run
            log.warning("stage %s: reward curve %s not readable (%s)", stage["name"], curve["uri"], exc)
            continue
        create_markdown_artifact(curve_markdown(stage["name"], curve, png),
                                 key=artifact_key(pipeline, stage["name"], "reward-curve"),
                                 description=f"stage {stage['name']}: {curve['metric']} per training step")


def publish_image_grid(store: Store, pipeline: str, stage: dict[str, Any]) -> None:
    evaluated = stage["report"].get("eval") or {}
    grid = evaluated.get("image_grid")
    if not grid:
        return
    try:
        png = store.read_bytes(grid["key"])
    except Exception as exc:  # the summary still names the stage; a missing grid is not a failed run
        log.warning("stage %s: image grid %s not readable (%s)", stage["name"], grid["uri"], exc)
        return
    create_markdown_artifact(image_grid_markdown(stage["name"], grid, png, evaluated.get("metrics") or {}),
                             key=artifact_key(pipeline, stage["name"], "images"),
                             description=f"stage {stage['name']}: the first images the eval scored, with their scores")
