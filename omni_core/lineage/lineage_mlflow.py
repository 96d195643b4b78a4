"""Reading MLflow for lineage: resolving a target (model version, alias, run, logged model), and the
runs, registered versions, logged models and dataset inputs the chain is built from. Only reads."""

from __future__ import annotations

import json
import re
from typing import Any

from mlflow.exceptions import MlflowException

from omni_core.lineage.lineage_errors import LineageError
from omni_core.lineage.redact import redact_text

EVAL_METRIC_PREFIXES = ("val/", "val-core/", "eval_")  # verl's validation names, TRL's eval names
TRAINING_KINDS = ("rl", "sft")
TARGET_FORMS = ("models:/NAME@ALIAS, models:/NAME/VERSION, models:/NAME, an MLflow run id (32 hex characters), "
                "or nothing for the newest registered model version")

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_LOGGED_MODEL = re.compile(r"^m-[0-9a-f]{32}$")
_ALIAS = re.compile(r"^models:/(?P<name>[^@]+)@(?P<alias>[^/@]+)$")
_VERSION = re.compile(r"^models:/(?P<name>[^@]+)/(?P<version>\d+|latest)$")
_MODEL = re.compile(r"^models:/(?P<name>[^@/]+)$")
_RUN_URI = re.compile(r"^runs:/(?P<run_id>[^/]+)(?:/.*)?$")


def tracking_location(client: Any) -> str:
    """The tracking URI for messages and output, without credentials (user:password@ in a database URI)."""
    return redact_text(client.tracking_uri)


def _not_found(exc: MlflowException) -> bool:
    return exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in exc.message.lower()


# ---- resolving the target ---------------------------------------------------------------------


def _registered_model(client: Any, name: str, where: str) -> Any:
    try:
        return client.get_registered_model(name)
    except MlflowException as exc:
        if not _not_found(exc):
            raise
    known = sorted(m.name for m in client.search_registered_models(max_results=100))
    listed = f"registered models: {', '.join(known)}" if known else "no model is registered there yet"
    raise LineageError(f"no registered model '{name}' at {where} ({listed}); check the name, the tracking URI "
                       "(--tracking-uri / --pipeline), or run a pipeline with a register stage") from None


def _versions(client: Any, name: str) -> list[Any]:
    found = client.search_model_versions(f"name='{name}'", order_by=["version_number DESC"])
    return list(found)


def _version(client: Any, name: str, version: str) -> Any:
    try:
        return client.get_model_version(name, version)
    except MlflowException as exc:
        if not _not_found(exc):
            raise
    have = sorted(int(v.version) for v in _versions(client, name))
    raise LineageError(f"registered model '{name}' has no version {version} (versions: "
                       f"{', '.join(map(str, have)) or 'none'}); use models:/{name}/VERSION or models:/{name}@ALIAS"
                       ) from None


def _newest_version(client: Any, name: str | None, where: str) -> Any:
    query = f"name='{name}'" if name else None
    found = list(client.search_model_versions(query, max_results=1,
                                              order_by=["creation_timestamp DESC", "version_number DESC"]))
    if not found:
        what = f"registered model '{name}' has no version" if name else f"no registered model version at {where}"
        raise LineageError(f"{what}; run a pipeline with a register stage (e.g. configs/eval_register.yaml), "
                           "or give a training or eval run id")
    return client.get_model_version(found[0].name, found[0].version)  # search results leave out the aliases


def fetch_run(client: Any, run_id: str, what: str = "run") -> Any:
    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        if not _not_found(exc) and exc.error_code != "INVALID_PARAMETER_VALUE":
            raise
    raise LineageError(f"no MLflow {what} '{run_id}' at {tracking_location(client)}; give a run id from `omni run`'s "
                       "summary or the MLflow UI, and the tracking URI it was logged to (--tracking-uri / --pipeline)"
                       ) from None


def _logged_model(client: Any, model_id: str) -> Any:
    try:
        return client.get_logged_model(model_id)
    except MlflowException as exc:
        if not _not_found(exc):
            raise
    raise LineageError(f"no logged model '{model_id}' at {tracking_location(client)}; check the id and the tracking URI "
                       "(--tracking-uri / --pipeline)") from None


def resolve(client: Any, target: str | None) -> tuple[str, Any]:
    """("version", ModelVersion), ("run", Run) or ("model", LoggedModel) that `target` names."""
    where = tracking_location(client)
    text = (target or "").strip()
    if not text:
        return "version", _newest_version(client, None, where)
    if match := _ALIAS.match(text):
        name, alias = match["name"], match["alias"]
        model = _registered_model(client, name, where)
        aliases = dict(model.aliases or {})
        if alias not in aliases:
            have = ", ".join(f"{a} (version {v})" for a, v in sorted(aliases.items())) or "none"
            raise LineageError(f"registered model '{name}' has no alias '{alias}' (aliases: {have}); use "
                               f"models:/{name}@ALIAS with one of these, or models:/{name}/VERSION")
        return "version", client.get_model_version(name, str(aliases[alias]))
    if match := _VERSION.match(text):
        name, version = match["name"], match["version"]
        _registered_model(client, name, where)
        if version == "latest":
            return "version", _newest_version(client, name, where)
        return "version", _version(client, name, version)
    if (match := _MODEL.match(text)) and _LOGGED_MODEL.match(match["name"]):
        return "model", _logged_model(client, match["name"])
    if match:
        _registered_model(client, match["name"], where)
        return "version", _newest_version(client, match["name"], where)
    if match := _RUN_URI.match(text):
        return "run", fetch_run(client, match["run_id"])
    if _RUN_ID.match(text):
        return "run", fetch_run(client, text)
    if _LOGGED_MODEL.match(text):
        return "model", _logged_model(client, text)
    hint = ""
    try:
        client.get_registered_model(text)
        hint = f" ('{text}' is a registered model: models:/{text}@champion or models:/{text}/VERSION)"
    except MlflowException:
        pass
    raise LineageError(f"lineage target '{text}' is not one of: {TARGET_FORMS}{hint}")


# ---- reading MLflow ---------------------------------------------------------------------------


def run_tags(run: Any) -> dict[str, str]:
    return dict(run.data.tags)


def _ui_url(url: str) -> str:
    """A recorded UI link, or "" when it is none (runs of older versions recorded "None/flow-runs/..."
    when Prefect knew no UI URL)."""
    return url if url.startswith(("http://", "https://")) else ""


def _run_common(run: Any) -> dict[str, Any]:
    tags = run_tags(run)
    return {
        "run_id": run.info.run_id, "run_name": run.info.run_name, "experiment_id": run.info.experiment_id,
        "status": run.info.status, "parent_run_id": tags.get("mlflow.parentRunId", ""),
        "pipeline": tags.get("omni.pipeline", ""), "stage": tags.get("omni.stage", ""),
        "stage_kind": tags.get("omni.stage_kind", ""), "config_digest": tags.get("omni.config_digest", ""),
        "git_commit": tags.get("omni.git_commit", ""), "prefect_flow_run_id": tags.get("prefect.flow_run_id", ""),
        "prefect_flow_run_url": _ui_url(tags.get("prefect.flow_run_url", "")), "ray_job_id": tags.get("ray.job_id", ""),
        "ray_submission_id": tags.get("ray.submission_id", ""),
        "cache_hit": tags.get("omni.cache_hit", ""), "cached_from_run": tags.get("omni.cached_from_run", ""),
    }


def _images(run: Any) -> dict[str, dict[str, str]]:
    images: dict[str, dict[str, str]] = {}
    for key, value in run_tags(run).items():
        match = re.fullmatch(r"omni\.image\.(?P<target>.+)\.(?P<field>digest|ref)", key)
        if match:
            images.setdefault(match["target"], {"digest": "", "ref": ""})[match["field"]] = value
    return dict(sorted(images.items()))


def model_version_summary(version: Any) -> dict[str, Any]:
    tags = dict(version.tags or {})
    source = version.source or ""
    model_id = getattr(version, "model_id", None) or tags.get("omni.model_id") or (
        source.removeprefix("models:/") if _LOGGED_MODEL.match(source.removeprefix("models:/")) else "")
    score = tags.get("omni.score", "")
    return {
        "name": version.name, "version": str(version.version), "uri": f"models:/{version.name}/{version.version}",
        "aliases": sorted(version.aliases or []), "source": source, "run_id": version.run_id or "",
        "model_id": model_id, "status": version.status, "created_ms": version.creation_timestamp,
        "description": version.description or "", "metric": tags.get("omni.metric", ""),
        "score": float(score) if score else None, "promotion": tags.get("omni.promotion", ""),
        "promotion_reason": tags.get("omni.promotion_reason", ""),
        "champion_score": float(tags["omni.champion_score"]) if tags.get("omni.champion_score") else None,
        "champion_version": tags.get("omni.champion_version", ""), "tags": dict(sorted(tags.items())),
        "sweep": sweep_summary(tags),
    }


def sweep_summary(tags: dict[str, str]) -> dict[str, Any] | None:
    """The sweep a version won (omni_core.sweep tags it), or None."""
    if not tags.get("omni.sweep.id"):
        return None
    def number(key: str) -> float | None:
        return float(tags[key]) if tags.get(key) else None

    return {"name": tags.get("omni.sweep.name", ""), "id": tags["omni.sweep.id"],
            "run_id": tags.get("omni.sweep.run_id", ""), "variant": tags.get("omni.sweep.variant", ""),
            "rank": tags.get("omni.sweep.rank", ""), "metric": tags.get("omni.sweep.metric", ""),
            "select_on": tags.get("omni.sweep.select_on", ""), "report_on": tags.get("omni.sweep.report_on", ""),
            "score_select": number("omni.sweep.score_select"), "score_report": number("omni.sweep.score_report"),
            "n_variants": tags.get("omni.sweep.n_variants", ""), "spec_digest": tags.get("omni.sweep.spec_digest", ""),
            "overrides": tags.get("omni.sweep.overrides", "")}


def eval_summary(run: Any) -> dict[str, Any]:
    tags, params = run_tags(run), dict(run.data.params)
    metrics = {k: v for k, v in sorted(run.data.metrics.items()) if k.startswith(EVAL_METRIC_PREFIXES)}
    dataset = params.get("dataset", "")  # NAME@VERSION:SPLIT
    name, _, rest = dataset.partition("@")
    version, _, split = rest.partition(":")
    return {**_run_common(run), "metrics": metrics, "dataset": {"name": name, "version": version, "split": split},
            "params": dict(sorted(params.items())), "model_id": tags.get("omni.model_id", ""),
            "checkpoint_uri": tags.get("omni.checkpoint_uri", ""), "training_run_id": tags.get("omni.training_run_id", "")}


def training_summary(run: Any, role: str) -> dict[str, Any]:
    tags, params = run_tags(run), dict(run.data.params)
    return {**_run_common(run), "role": role, "algorithm": params.get("algorithm", ""), "model": params.get("model", ""),
            "backend": tags.get("omni.backend", ""),  # "" for our own trainer, which sets no such tag
            "seed": params.get("seed", ""), "params": dict(sorted(params.items())), "run_key": tags.get("omni.run_key", ""),
            "checkpoint_uri": tags.get("omni.checkpoint_uri", ""), "checkpoint_sha256": tags.get("omni.checkpoint_sha256", ""),
            "images": _images(run)}


def dataset_inputs(run: Any) -> list[dict[str, Any]]:
    found = []
    for item in (run.inputs.dataset_inputs if run.inputs else []) or []:
        ds = item.dataset
        context = {t.key: t.value for t in item.tags or []}.get("mlflow.data.context", "")
        try:
            source = json.loads(ds.source) if ds.source else {}
        except ValueError:
            source = {"uri": ds.source}
        try:
            profile = json.loads(ds.profile) if ds.profile else {}
        except ValueError:
            profile = {}
        found.append({"name": ds.name, "version": ds.digest, "digest": ds.digest, "context": context,
                      "uri": source.get("uri", "") if isinstance(source, dict) else str(source),
                      "raw_source_uri": source.get("raw_source_uri", "") if isinstance(source, dict) else "",
                      "rows": dict((profile.get("splits") or {}) if isinstance(profile, dict) else {}),
                      "counts": profile.get("counts", {}) if isinstance(profile, dict) else {},
                      "converter": profile.get("converter", {}) if isinstance(profile, dict) else {},
                      "runs": [run.info.run_id]})
    return found


def model_of_run(client: Any, run: Any) -> str:
    """The logged model a training run produced (its output), else the newest one of its run key."""
    outputs = getattr(run, "outputs", None)
    for output in (outputs.model_outputs if outputs else []) or []:
        return output.model_id
    run_key = run_tags(run).get("omni.run_key")
    if not run_key:
        return ""
    found = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                        filter_string=f"tags.`omni.run_key` = '{run_key}'", max_results=1,
                                        order_by=[{"field_name": "creation_time", "ascending": False}])
    return found[0].model_id if found else ""


# ---- the chain --------------------------------------------------------------------------------


def start_of_chain(client: Any, kind: str, obj: Any) -> tuple[Any, Any, Any, Any]:
    """(model version, eval run, training run, logged model) the resolved target starts from."""
    if kind == "version":
        return obj, None, None, None
    if kind == "model":
        return None, None, fetch_run(client, obj.source_run_id, "training run") if obj.source_run_id else None, obj
    tags = run_tags(obj)
    stage_kind = tags.get("omni.stage_kind", "")
    if stage_kind == "register" or tags.get("omni.registered_model"):
        if not tags.get("omni.registered_version"):
            raise LineageError(f"register run {obj.info.run_id} registered no model version (it failed?); "
                               "give an eval or training run id instead")
        return _version(client, tags["omni.registered_model"], tags["omni.registered_version"]), None, None, None
    if stage_kind == "eval":
        return None, obj, None, None
    if stage_kind in TRAINING_KINDS or tags.get("omni.checkpoint_uri"):
        return None, None, obj, None
    if tags.get("omni.pipeline") and not tags.get("mlflow.parentRunId"):  # a pipeline's parent run
        children = client.search_runs([obj.info.experiment_id], f"tags.mlflow.parentRunId = '{obj.info.run_id}'",
                                      max_results=200)
        for wanted in ("register", "eval", *TRAINING_KINDS):
            for child in children:
                if run_tags(child).get("omni.stage_kind") == wanted:
                    if wanted == "register" and not run_tags(child).get("omni.registered_version"):
                        continue
                    return start_of_chain(client, "run", child)
        raise LineageError(f"pipeline run {obj.info.run_id} ({tags['omni.pipeline']}) has no register, eval or "
                           "training stage run to trace; give a model version or another run")
    raise LineageError(f"run {obj.info.run_id} is not an omni register, eval or training stage run (no omni.stage_kind "
                       "tag); give a model version (models:/NAME@ALIAS) or a run `omni run` printed")



def merge_datasets(datasets: dict[tuple[str, str], dict[str, Any]], found: list[dict[str, Any]]) -> None:
    for entry in found:
        key = (entry["name"], entry["version"])
        if key not in datasets:
            datasets[key] = {**entry, "contexts": [entry["context"]] if entry["context"] else []}
            del datasets[key]["context"]
            continue
        known = datasets[key]
        if entry["context"] and entry["context"] not in known["contexts"]:
            known["contexts"].append(entry["context"])
        known["runs"] += [r for r in entry["runs"] if r not in known["runs"]]


def sibling_training_run(client: Any, eval_run: Any) -> Any | None:
    tags = run_tags(eval_run)
    parent, run_key = tags.get("mlflow.parentRunId"), tags.get("omni.run_key")
    if not parent or not run_key:
        return None
    found = client.search_runs([eval_run.info.experiment_id],
                               f"tags.mlflow.parentRunId = '{parent}' and tags.`omni.run_key` = '{run_key}'",
                               max_results=10)
    return next((r for r in found if run_tags(r).get("omni.stage_kind") in TRAINING_KINDS), None)

