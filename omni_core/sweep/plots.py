"""A sweep's plots as PNG bytes (matplotlib's Agg canvas, no pyplot state): the metric against each swept
key, every variant's training curve on one chart (pruned ones dashed, ending at an x), and a
parallel-coordinates chart of the swept values and the metric."""

from __future__ import annotations

import io
import math
from typing import Any

from omni_core.sweep.state import COMPLETED, PRUNED


def _png(fig: Any) -> bytes:
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _log_scale(values: list[Any], param: dict[str, Any]) -> bool:
    if param.get("distribution") == "log_uniform":
        return True
    positive = [float(v) for v in values if _numeric([v]) and v > 0]
    return len(positive) == len(values) and len(values) > 1 and max(positive) / min(positive) >= 20


def metric_by_parameter(spec: dict[str, Any], records: list[dict[str, Any]]) -> bytes:
    """One panel per swept key: each completed variant's selecting score (filled) and reported score
    (hollow) against its value."""
    from matplotlib.figure import Figure

    keys = list(spec["parameters"])
    fig = Figure(figsize=(4.2 * len(keys), 3.4), dpi=100)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    done = [r for r in records if r["status"] == COMPLETED]
    for ax, key in zip(axes, keys, strict=True):
        values = [r["params"][key] for r in done]
        choices = spec["parameters"][key].get("values")
        if _numeric(values):
            xs = [float(v) for v in values]
            if _log_scale(values, spec["parameters"][key]):
                ax.set_xscale("log")
        else:
            labels = [str(v) for v in (choices or sorted({str(v) for v in values}))]
            xs = [labels.index(str(v)) for v in values]
            ax.set_xticks(range(len(labels)), labels, rotation=20)
        ax.scatter(xs, [r["select"] for r in done], label=spec["select_stage"], zorder=3)
        if spec["report_stage"] != spec["select_stage"]:
            ax.scatter(xs, [r["report"] for r in done], facecolors="none", edgecolors="tab:orange",
                       label=spec["report_stage"], zorder=3)
        ax.set_xlabel(key.removeprefix("stages."))
        ax.set_ylabel(spec["metric"])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"sweep {spec['name']}: {spec['metric']} by swept value", fontsize=10)
    return _png(fig)


def training_curves(spec: dict[str, Any], records: list[dict[str, Any]]) -> bytes:
    """Every variant's training metric per step; pruned variants dashed with an x where they stopped;
    the rungs as vertical lines."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.subplots()
    metric = next((r.get("curve_metric") for r in records if r.get("curve_metric")), "") or "training metric"
    for record in sorted(records, key=lambda r: r["index"]):
        curve = record.get("curve") or []
        if not curve:
            continue
        steps, values = [c[0] for c in curve], [c[1] for c in curve]
        pruned = record["status"] == PRUNED
        line = ax.plot(steps, values, linestyle="--" if pruned else "-", linewidth=1.2, alpha=0.6 if pruned else 0.9,
                       label=record["label"] + (" (pruned)" if pruned else ""))[0]
        if pruned:
            ax.plot(steps[-1], values[-1], marker="x", markersize=8, color=line.get_color())
    for rung in (spec.get("asha") or {}).get("rungs", []):
        ax.axvline(rung, color="grey", linewidth=0.8, alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"sweep {spec['name']}: training curves", fontsize=10)
    ax.grid(alpha=0.3)
    if len(records) <= 16:
        ax.legend(fontsize=7, ncol=2)
    return _png(fig)


def parallel_coordinates(spec: dict[str, Any], records: list[dict[str, Any]]) -> bytes:
    """An axis per swept key and one for the metric (each scaled to its range; log for log-spread keys);
    a line per variant coloured by its score, pruned and failed ones grey and dashed."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    keys = list(spec["parameters"])
    axes_names = [*keys, spec["metric"]]
    fig = Figure(figsize=(max(6.0, 2.0 * len(axes_names)), 4), dpi=100)
    ax = fig.subplots()
    columns = []
    for key in keys:
        values = [r["params"][key] for r in records]
        if _numeric(values):
            log = _log_scale(values, spec["parameters"][key])
            xs = [math.log10(float(v)) if log else float(v) for v in values]
            labels = (min(values), max(values))
        else:
            order = [str(v) for v in (spec["parameters"][key].get("values") or sorted({str(v) for v in values}))]
            xs = [float(order.index(str(v))) for v in values]
            labels = (order[0], order[-1])
        columns.append((xs, labels))
    scores = [r.get("select") for r in records]
    known = [s for s in scores if s is not None]
    columns.append(([s if s is not None else math.nan for s in scores], (min(known, default=0), max(known, default=0))))
    scaled = []
    for xs, _ in columns:
        finite = [x for x in xs if not math.isnan(x)]
        low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
        scaled.append([(x - low) / (high - low) if high > low else 0.5 for x in xs])
    cmap = colormaps["viridis"]
    low, high = (min(known), max(known)) if known else (0.0, 1.0)
    for i, record in enumerate(records):
        ys = [column[i] for column in scaled]
        if record.get("select") is None:
            ax.plot(range(len(axes_names)), ys, color="grey", linestyle="--", alpha=0.5)
        else:
            shade = (record["select"] - low) / (high - low) if high > low else 1.0
            ax.plot(range(len(axes_names)), ys, color=cmap(shade), linewidth=1.8)
    for x, (_, labels) in enumerate(columns):
        ax.axvline(x, color="black", linewidth=0.8)
        ax.text(x, -0.08, _label(labels[0]), ha="center", va="top", fontsize=7)
        ax.text(x, 1.04, _label(labels[1]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(axes_names)), [n.removeprefix("stages.") for n in axes_names], fontsize=8, rotation=10)
    ax.set_yticks([])
    ax.set_ylim(-0.15, 1.15)
    ax.set_title(f"sweep {spec['name']}: parallel coordinates (colour: {spec['metric']}; grey: pruned or failed)",
                 fontsize=10)
    return _png(fig)


def _label(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def all_plots(spec: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, bytes]:
    """name -> PNG; the metric plots only once a variant completed."""
    out = {}
    if any(r["status"] == COMPLETED for r in records):
        out["metric_by_parameter.png"] = metric_by_parameter(spec, records)
    if any(r.get("curve") for r in records):
        out["training_curves.png"] = training_curves(spec, records)
    if records:
        out["parallel_coordinates.png"] = parallel_coordinates(spec, records)
    return out
