"""Lineage for humans: the chain `lineage()` returns as an indented plain-text tree.

A dataset version's raw source files are one line, their count and the sha256 of their sorted list
(`omni_core.storage.digest.file_list_sha256`: sha256 over the sorted `PATH<TAB>SHA256<LF>` lines);
`files=True` adds one line per file. The JSON chain always lists every file."""

from __future__ import annotations

from typing import Any


def _check_text(check: dict[str, str]) -> str:
    return check["status"] + (f" ({check['detail']})" if check.get("detail") else "")


def _run_line(run: dict[str, Any]) -> list[str]:
    parts = [f"pipeline {run['pipeline'] or '-'}", f"config digest {run['config_digest'] or '-'}",
             f"git commit {run['git_commit'] or '-'}"]
    if run["prefect_flow_run_id"]:
        parts.append(f"prefect flow run {run['prefect_flow_run_id']}"
                     + (f" ({run['prefect_flow_run_url']})" if run["prefect_flow_run_url"] else ""))
    if run["ray_job_id"] or run["ray_submission_id"]:
        parts.append(f"ray job {run['ray_job_id'] or '-'}"
                     + (f" (submission {run['ray_submission_id']})" if run["ray_submission_id"] else ""))
    return parts


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _run_url(chain: dict[str, Any], run: dict[str, Any]) -> str:
    from omni_core.lineage.tracking import mlflow_run_url

    return mlflow_run_url(chain.get("tracking_uri") or "", run.get("experiment_id") or "", run["run_id"])


def format_lineage(chain: dict[str, Any], files: bool = False) -> list[str]:
    """The chain as an indented tree, one string per line (plain text); `files`: every raw file too."""
    lines: list[str] = []

    def add(depth: int, text: str) -> None:
        lines.append("  " * depth + text)

    depth = 0
    mv = chain.get("model_version")
    if mv:
        aliases = ", ".join(mv["aliases"]) or "no alias"
        add(0, f"model {mv['name']} version {mv['version']} [{aliases}]  source {mv['source'] or '-'}")
        if mv["score"] is not None:
            decision = f"score {mv['metric']} {mv['score']:.6g}"
            if mv["promotion"]:
                decision += f", {mv['promotion']}"
            if mv["promotion_reason"]:
                decision += f" ({mv['promotion_reason']})"
            add(1, decision)
        if sweep := mv.get("sweep"):
            add(1, f"won sweep {sweep['name']} ({sweep['id']}, MLflow run {sweep['run_id'] or '-'}): variant "
                   f"{sweep['variant']}, rank {sweep['rank']} of {sweep['n_variants']}, {sweep['metric']} "
                   f"{_score(sweep['score_select'])} on {sweep['select_on']} (selected), "
                   f"{_score(sweep['score_report'])} on {sweep['report_on']} (reported)")
        depth = 1
    ev = chain.get("eval")
    if ev:
        ds = ev["dataset"]
        on = f" on {ds['name']}@{ds['version']}:{ds['split']}" if ds["name"] else ""
        add(depth, f"eval run {ev['run_id']} ({ev['pipeline'] or '-'}/{ev['run_name']}){on}")
        add(depth + 1, f"mlflow {_run_url(chain, ev)}")
        for name, value in ev["metrics"].items():
            add(depth + 1, f"{name} = {value:.6g}")
        depth += 1
    for t in chain.get("training", []):
        algo = f" {t['algorithm']}" if t["algorithm"] else ""
        algo += f" on {t['backend']}" if t.get("backend") else ""
        add(depth, f"training run {t['run_id']} ({t['pipeline'] or '-'}/{t['run_name']}){algo}: {t['role']}")
        add(depth + 1, f"run key {t['run_key'] or '-'}; " + "; ".join(_run_line(t)))
        add(depth + 1, f"mlflow {_run_url(chain, t)}")
        keys = ("model", "seed", "dataset", "rollout.n", "trainer.total_steps", "trainer.batch_size", "trainer.lr",
                "reward")
        shown = [f"{k}={t['params'][k]}" for k in keys if k in t["params"]]
        if shown:
            add(depth + 1, "params " + ", ".join(shown))
        for target, image in t["images"].items():
            add(depth + 1, f"image {target} {image['digest'] or '-'}" + (f" ({image['ref']})" if image["ref"] else ""))
    if chain.get("training"):
        depth += 1
    ck = chain.get("checkpoint")
    if ck:
        add(depth, f"checkpoint {ck['uri'] or '-'} (global_step {ck['global_step']})")
        add(depth + 1, f"weights sha256 {ck['sha256'] or '-'}" + (f" ({ck['weights_file']})" if ck["weights_file"] else ""))
        add(depth + 1, f"logged model {ck['model_id'] or '-'}; run key {ck['run_key'] or '-'}")
        add(depth + 1, f"store manifest: {_check_text(ck['store_check'])}")
        if ck["recheck"]:
            add(depth + 1, f"re-check: {ck['recheck']}")
    for d in chain.get("datasets", []):
        rows = ", ".join(f"{s}={n}" for s, n in d["rows"].items()) or "-"
        add(depth, f"dataset {d['name']}@{d['version']} ({', '.join(d['contexts']) or 'input'}) rows {rows}")
        add(depth + 1, f"store uri {d['uri'] or '-'}")
        add(depth + 1, f"digest {d['digest']}; store manifest: {_check_text(d['store_check'])}")
        add(depth + 1, f"raw source {d['raw_source_uri'] or '-'}")
        if d.get("raw_files_sha256"):  # known when the store's manifest was read
            add(depth + 1, f"raw files {d['raw_files_count']}, list sha256 {d['raw_files_sha256']}")
        for f in d["raw_files"] if files else []:
            add(depth + 2, f"raw file {f['path']} sha256 {f['sha256']}")
        add(depth + 1, f"re-check: {d['recheck']}")
    for warning in chain.get("warnings", []):
        add(0, f"warning: {warning}")
    return lines
