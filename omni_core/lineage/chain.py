"""Lineage queries: from a registered model version back to the raw bytes it was trained on.

    model version (name, version, aliases, source, decision and score)
      -> eval run (val/... and val-core/... metrics, the dataset version it scored)
        -> training run(s) (algorithm, params, run key, config digest, git commit, Prefect flow run,
           Ray job, image digests)
          -> checkpoint (URI, global step, weights sha256, the MLflow 3 logged model)
          -> dataset versions (name, version, store URI, digest, rows per split)
            -> raw source URI and raw file sha256s (from the store's _manifest.json), with their count
               and list digest (`omni_core.storage.digest.file_list_sha256`)

`lineage(tracker, target, store_root)` reads all of it from MLflow (tags, params, metrics, dataset
inputs, logged models, the registry) and, where the store can be read, cross-checks the checkpoint
and each dataset version against its `_manifest.json` (the manifests `omni verify` re-hashes
against). It only reads: nothing is written to MLflow or the store.

Targets: `models:/NAME@ALIAS`, `models:/NAME/VERSION` (or `/latest`), `models:/NAME` (its newest
version), `models:/m-...` (a logged model), an MLflow run id (a register, eval or training stage run,
or a pipeline's parent run: the chain from there down), or nothing (the newest registered model
version of all registered models).

The parts live in their own modules: lineage_mlflow (resolving the target, reading runs, versions,
logged models and dataset inputs), lineage_store (the manifests' cross-checks), lineage_format (the
plain-text tree) and lineage_errors (LineageError); this module ties them together.
"""

from __future__ import annotations

from typing import Any

from mlflow.exceptions import MlflowException

from omni_core.lineage.lineage_errors import LineageError
from omni_core.lineage.lineage_format import format_lineage
from omni_core.lineage.lineage_mlflow import (
    EVAL_METRIC_PREFIXES,
    TARGET_FORMS,
    TRAINING_KINDS,
    dataset_inputs,
    eval_summary,
    fetch_run,
    merge_datasets,
    model_of_run,
    model_version_summary,
    resolve,
    run_tags,
    sibling_training_run,
    start_of_chain,
    tracking_location,
    training_summary,
)
from omni_core.lineage.lineage_store import (
    MANIFEST,
    MISMATCH,
    MISSING,
    OK,
    UNKNOWN,
    UNREACHABLE,
    check_dataset,
    checkpoint_summary,
)
from omni_core.lineage.redact import redact_text

__all__ = ["EVAL_METRIC_PREFIXES", "MANIFEST", "MISMATCH", "MISSING", "OK", "TARGET_FORMS", "TRAINING_KINDS", "UNKNOWN",
           "UNREACHABLE", "LineageError", "format_lineage", "lineage", "resolve"]


def lineage(tracker: Any, target: str | None, store_root: str | None = None) -> dict[str, Any]:
    """The chain for `target` (see the module docstring) as plain JSON data. Raises LineageError
    (an OmniError) naming an unknown model, alias, version or run and how to give a known one."""
    client = tracker.client
    try:
        return _lineage(client, target, store_root, tracking_location(client))
    except MlflowException as exc:
        hint = ("; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an "
                "MLflow user's" if exc.error_code in ("UNAUTHENTICATED", "PERMISSION_DENIED") else "")
        raise LineageError(f"lineage of {target or 'the newest registered model version'}: MLflow at "
                           f"{tracking_location(client)} answered: {redact_text(exc.message)}{hint}") from exc


def _lineage(client: Any, target: str | None, store_root: str | None, tracking_uri: str) -> dict[str, Any]:
    version, eval_run, training_run, logged = start_of_chain(client, *resolve(client, target))
    warnings: list[str] = []
    chain: dict[str, Any] = {"target": target or "", "tracking_uri": tracking_uri, "store": store_root or "",
                             "model_version": None, "eval": None, "training": [], "checkpoint": None,
                             "datasets": [], "images": {}, "recheck": [], "warnings": warnings}

    version_tags: dict[str, str] = {}
    if version is not None:
        chain["model_version"] = model_version_summary(version)
        version_tags = chain["model_version"]["tags"]
        eval_id = version_tags.get("omni.eval_run_id") or version.run_id
        if eval_id:
            try:
                eval_run = fetch_run(client, eval_id, "eval run")
            except LineageError as exc:
                warnings.append(str(exc))

    model_id = (chain["model_version"] or {}).get("model_id", "") if version is not None else ""
    if eval_run is not None:
        chain["eval"] = eval_summary(eval_run)
        model_id = model_id or chain["eval"]["model_id"]
    if logged is None and model_id:
        try:
            logged = client.get_logged_model(model_id)
        except MlflowException as exc:
            warnings.append(f"logged model {model_id}: {exc.message}")
    if logged is None and training_run is not None:
        found = model_of_run(client, training_run)
        logged = client.get_logged_model(found) if found else None

    # the training run that produced the checkpoint, and the run the chain came through if another one
    # (an rl stage that found the checkpoint committed: a cache hit)
    producing_id = ((logged.source_run_id if logged is not None else "") or version_tags.get("omni.training_run_id")
                    or (chain["eval"] or {}).get("training_run_id", "")
                    or (run_tags(training_run).get("omni.cached_from_run", "") if training_run is not None else ""))
    runs: list[tuple[Any, str]] = []
    if producing_id and (training_run is None or training_run.info.run_id != producing_id):
        try:
            runs.append((fetch_run(client, producing_id, "training run"), "trained the checkpoint"))
        except LineageError as exc:
            warnings.append(str(exc))
    cached = "took the checkpoint from the cache"
    if training_run is not None:
        runs.append((training_run, cached if runs else "trained the checkpoint"))
    elif eval_run is not None:  # the eval's own pipeline run: its rl stage, when it was a cache hit
        sibling = sibling_training_run(client, eval_run)
        if sibling is not None and all(sibling.info.run_id != r.info.run_id for r, _ in runs):
            runs.append((sibling, cached if runs else "trained the checkpoint"))
    runs += starting_models(client, runs[0][0] if runs else None, warnings)
    chain["training"] = [training_summary(run, role) for run, role in runs]
    if not runs:
        warnings.append("no training run found (no omni.training_run_id tag or logged model source run)")

    trained = chain["training"][0] if chain["training"] else {}
    if logged is None and runs:
        found = model_of_run(client, runs[0][0])
        logged = client.get_logged_model(found) if found else None
    ltags = dict(logged.tags or {}) if logged is not None else {}
    uri = ltags.get("omni.checkpoint_uri") or version_tags.get("omni.checkpoint_uri") or trained.get("checkpoint_uri", "")
    sha = ltags.get("omni.checkpoint_sha256") or version_tags.get("omni.checkpoint_sha256") \
        or trained.get("checkpoint_sha256", "")
    step = ltags.get("omni.global_step") or version_tags.get("omni.global_step")
    run_key = ltags.get("omni.run_key") or version_tags.get("omni.run_key") or trained.get("run_key", "")
    if uri or sha:
        chain["checkpoint"] = checkpoint_summary(uri, sha, step, logged.model_id if logged is not None else model_id,
                                          run_key, store_root)

    datasets: dict[tuple[str, str], dict[str, Any]] = {}
    for run, _ in runs:
        merge_datasets(datasets, dataset_inputs(run))
    if eval_run is not None:
        merge_datasets(datasets, dataset_inputs(eval_run))
    for entry in datasets.values():
        check_dataset(entry, store_root)
    chain["datasets"] = list(datasets.values())

    for t in chain["training"]:
        for target_name, image in t["images"].items():
            chain["images"].setdefault(target_name, image)
    if chain["checkpoint"] and chain["checkpoint"]["recheck"]:
        chain["recheck"].append({"what": "checkpoint", "uri": chain["checkpoint"]["uri"],
                                 "command": chain["checkpoint"]["recheck"]})
    for entry in chain["datasets"]:
        chain["recheck"].append({"what": f"dataset {entry['name']}@{entry['version']}", "uri": entry["uri"],
                                 "command": entry["recheck"]})
    return chain



def starting_models(client: Any, run: Any, warnings: list[str], limit: int = 10) -> list[tuple[Any, str]]:
    """The training runs behind a `model: {from: STAGE}` start, nearest first (rl -> sft -> ...): each
    run's `omni.model_from.model_id` tag names the logged model whose source run trained it."""
    found: list[tuple[Any, str]] = []
    while run is not None and len(found) < limit:
        tags = run_tags(run)
        model_id = tags.get("omni.model_from.model_id")
        if not model_id:
            break
        try:
            run = fetch_run(client, client.get_logged_model(model_id).source_run_id, "training run")
        except (MlflowException, LineageError) as exc:
            warnings.append(f"starting model {model_id} of run {tags.get('mlflow.runName', '')}: {exc}")
            break
        found.append((run, f"trained the starting model (model: {{from: {tags.get('omni.model_from.stage', '')}}})"))
    return found
