"""The comparison of a sweep's variants: the ranking (a setting's score is the mean over its seeds), one
row per variant (swept values, status, the metric on the selecting and the reporting eval, steps
trained, wall time), as plain rows, CSV, markdown with the plots, and the terminal's table columns.
Plain functions of the records and the spec, so `omni sweep status` shows what the sweep showed."""

from __future__ import annotations

import base64
import csv
import io
import statistics
from dataclasses import dataclass
from typing import Any

from omni_core.sweep.state import COMPLETED, FAILED, PRUNED


@dataclass
class Setting:
    index: int
    params: dict[str, Any]
    records: list[dict[str, Any]]
    status: str
    select: float | None = None
    select_std: float | None = None
    report: float | None = None
    report_std: float | None = None
    rank: int | None = None


def settings(records: list[dict[str, Any]], goal: str) -> list[Setting]:
    """The settings tried, ranked: completed ones by their mean selecting score (ties: the lower index),
    then the others in index order."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for record in sorted(records, key=lambda r: r["index"]):
        grouped.setdefault(int(record["setting"]), []).append(record)
    out = []
    for index, group in sorted(grouped.items()):
        statuses = {r["status"] for r in group}
        status = COMPLETED if statuses == {COMPLETED} else PRUNED if PRUNED in statuses else \
            FAILED if FAILED in statuses else sorted(statuses)[0]
        setting = Setting(index, group[0]["params"], group, status)
        if status == COMPLETED:
            setting.select, setting.select_std = _mean_std([r["select"] for r in group])
            setting.report, setting.report_std = _mean_std([r["report"] for r in group])
        out.append(setting)
    sign = -1.0 if goal == "maximize" else 1.0
    done = sorted((s for s in out if s.select is not None), key=lambda s: (sign * s.select, s.index))
    for rank, setting in enumerate(done, start=1):
        setting.rank = rank
    return done + [s for s in out if s.select is None]


def best_variant(setting: Setting, goal: str) -> dict[str, Any]:
    """The run of the best setting that registers: its seed with the best selecting score."""
    sign = -1.0 if goal == "maximize" else 1.0
    return min(setting.records, key=lambda r: (sign * r["select"], r["index"]))


def _mean_std(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def status_text(record: dict[str, Any]) -> str:
    if record["status"] == PRUNED and record.get("pruned"):
        return f"pruned@{record['pruned']['step']}"
    return record["status"]


def rows(spec: dict[str, Any], records: list[dict[str, Any]], goal: str,
         defaults: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per variant, best setting first; `defaults`: the pipeline's own values of the swept keys
    (the variant that has them all is marked)."""
    keys = list(spec["parameters"])
    select, report = spec["select_stage"], spec["report_stage"]
    out = []
    for setting in settings(records, goal):
        for record in setting.records:
            row: dict[str, Any] = {"variant": record["label"], "rank": setting.rank or "",
                                   "status": status_text(record)}
            row.update({k: record["params"][k] for k in keys})
            if len(spec["seeds"]) > 1:
                row["seed"] = record["seed"]
            row[f"{select}"] = _round(record.get("select"))
            if report != select:
                row[f"{report}"] = _round(record.get("report"))
            if len(spec["seeds"]) > 1:  # the setting's mean and spread over its seeds, on each of its rows
                row[f"{select} mean"], row[f"{select} std"] = _round(setting.select), _round(setting.select_std)
                if report != select:
                    row[f"{report} mean"], row[f"{report} std"] = _round(setting.report), _round(setting.report_std)
            row["steps"] = record.get("steps") or ""
            row["wall_s"] = record.get("wall_s") or ""
            if defaults is not None and all(record["params"][k] == defaults.get(k) for k in keys):
                row["note"] = "the pipeline's own settings"
            out.append(row)
    return out


def _round(value: float | None) -> float | str:
    return "" if value is None else round(float(value), 6)


def to_csv(table: list[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(k for row in table for k in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, columns)
    writer.writeheader()
    writer.writerows(table)
    return out.getvalue()


def headline(spec: dict[str, Any], records: list[dict[str, Any]], goal: str) -> dict[str, Any]:
    """The counts and the winner (its values, scores on both evals, its spread over seeds)."""
    ranked = settings(records, goal)
    counts = {status: sum(1 for r in records if r["status"] == status) for status in (COMPLETED, PRUNED, FAILED)}
    out: dict[str, Any] = {"variants": len(records), **counts, "best": None}
    best = ranked[0] if ranked and ranked[0].rank == 1 else None
    if best is not None:
        variant = best_variant(best, goal)
        out["best"] = {"setting": best.index, "variant": variant["label"], "index": variant["index"],
                       "params": best.params, "select": best.select, "select_std": best.select_std,
                       "report": best.report, "report_std": best.report_std, "seeds": len(best.records),
                       "mlflow_run_id": variant.get("mlflow_run_id", "")}
    return out


def markdown(spec: dict[str, Any], table: list[dict[str, Any]], head: dict[str, Any],
             plots: dict[str, bytes], extra: list[str] | None = None) -> str:
    metric, select, report = spec["metric"], spec["select_stage"], spec["report_stage"]
    lines = [f"# Sweep `{spec['name']}` of pipeline `{spec['pipeline']}`", "",
             f"{spec['method']} over {', '.join(f'`{k}`' for k in spec['parameters'])}: {head['variants']} variants, "
             f"{head[COMPLETED]} completed, {head[PRUNED]} pruned, {head[FAILED]} failed. Ranked by `{metric}` on "
             f"`{select}` ({spec['goal']}), reported on `{report}`.", ""]
    best = head["best"]
    if best:
        values = ", ".join(f"`{k}={v}`" for k, v in best["params"].items())
        lines += [f"**Best**: {best['variant']} ({values}): {metric} {best['select']:.4g} on {select}, "
                  f"{best['report']:.4g} on {report}.", ""]
    lines += [*(extra or []), ""] if extra else []
    if table:
        columns = list(dict.fromkeys(k for row in table for k in row))
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in table]
    for name, png in plots.items():
        lines += ["", f"## {name}", "", f"![{name}](data:image/png;base64,{base64.b64encode(png).decode()})"]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")
