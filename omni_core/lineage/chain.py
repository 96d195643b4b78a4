"""Lineage queries: from a registered model version back to the raw bytes it was trained on.

    model version (name, version, aliases, source, decision and score)
      -> eval run (val/... and val-core/... metrics, the dataset version it scored)
        -> training run(s) (algorithm, params, run key, config digest, git commit, Prefect flow run,
           Ray job, image digests)
          -> checkpoint (URI, global step, weights sha256, the MLflow 3 logged model)
          -> dataset versions (name, version, store URI, digest, rows per split)
            -> raw source URI and raw file sha256s (from the store's _manifest.json)

`lineage(tracker, target, store_root)` reads all of it from MLflow (tags, params, metrics, dataset
inputs, logged models, the registry) and, where the store can be read, cross-checks the checkpoint
and each dataset version against its `_manifest.json` (the manifests `omni verify` re-hashes
against). It only reads: nothing is written to MLflow or the store.

Targets: `models:/NAME@ALIAS`, `models:/NAME/VERSION` (or `/latest`), `models:/NAME` (its newest
version), `models:/m-...` (a logged model), an MLflow run id (a register, eval or training stage run,
or a pipeline's parent run: the chain from there down), or nothing (the newest registered model
version of all registered models).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from mlflow.exceptions import MlflowException

from omni_core.errors import OmniError
from omni_core.lineage.redact import redact_text
from omni_core.storage import Store

MANIFEST = "_manifest.json"
OK, MISMATCH, MISSING, UNREACHABLE, UNKNOWN = "ok", "MISMATCH", "MISSING", "UNREACHABLE", "not checked"
EVAL_METRIC_PREFIXES = ("val/", "val-core/")
TRAINING_KINDS = ("rl", "sft")
TARGET_FORMS = ("models:/NAME@ALIAS, models:/NAME/VERSION, models:/NAME, an MLflow run id (32 hex characters), "
                "or nothing for the newest registered model version")

_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_LOGGED_MODEL = re.compile(r"^m-[0-9a-f]{32}$")
_ALIAS = re.compile(r"^models:/(?P<name>[^@]+)@(?P<alias>[^/@]+)$")
_VERSION = re.compile(r"^models:/(?P<name>[^@]+)/(?P<version>\d+|latest)$")
_MODEL = re.compile(r"^models:/(?P<name>[^@/]+)$")
_RUN_URI = re.compile(r"^runs:/(?P<run_id>[^/]+)(?:/.*)?$")


class LineageError(OmniError):
    """A lineage target (model, alias, version, run) that does not exist or cannot be read."""


def _where(client: Any) -> str:
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


def _run(client: Any, run_id: str, what: str = "run") -> Any:
    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        if not _not_found(exc) and exc.error_code != "INVALID_PARAMETER_VALUE":
            raise
    raise LineageError(f"no MLflow {what} '{run_id}' at {_where(client)}; give a run id from `omni run`'s "
                       "summary or the MLflow UI, and the tracking URI it was logged to (--tracking-uri / --pipeline)"
                       ) from None


def _logged_model(client: Any, model_id: str) -> Any:
    try:
        return client.get_logged_model(model_id)
    except MlflowException as exc:
        if not _not_found(exc):
            raise
    raise LineageError(f"no logged model '{model_id}' at {_where(client)}; check the id and the tracking URI "
                       "(--tracking-uri / --pipeline)") from None


def resolve(client: Any, target: str | None) -> tuple[str, Any]:
    """("version", ModelVersion), ("run", Run) or ("model", LoggedModel) that `target` names."""
    where = _where(client)
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
        return "run", _run(client, match["run_id"])
    if _RUN_ID.match(text):
        return "run", _run(client, text)
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


def _tags(run: Any) -> dict[str, str]:
    return dict(run.data.tags)


def _run_common(run: Any) -> dict[str, Any]:
    tags = _tags(run)
    return {
        "run_id": run.info.run_id, "run_name": run.info.run_name, "experiment_id": run.info.experiment_id,
        "status": run.info.status, "parent_run_id": tags.get("mlflow.parentRunId", ""),
        "pipeline": tags.get("omni.pipeline", ""), "stage": tags.get("omni.stage", ""),
        "stage_kind": tags.get("omni.stage_kind", ""), "config_digest": tags.get("omni.config_digest", ""),
        "git_commit": tags.get("omni.git_commit", ""), "prefect_flow_run_id": tags.get("prefect.flow_run_id", ""),
        "prefect_flow_run_url": tags.get("prefect.flow_run_url", ""), "ray_job_id": tags.get("ray.job_id", ""),
        "ray_submission_id": tags.get("ray.submission_id", ""),
        "cache_hit": tags.get("omni.cache_hit", ""), "cached_from_run": tags.get("omni.cached_from_run", ""),
    }


def _images(run: Any) -> dict[str, dict[str, str]]:
    images: dict[str, dict[str, str]] = {}
    for key, value in _tags(run).items():
        match = re.fullmatch(r"omni\.image\.(?P<target>.+)\.(?P<field>digest|ref)", key)
        if match:
            images.setdefault(match["target"], {"digest": "", "ref": ""})[match["field"]] = value
    return dict(sorted(images.items()))


def _model_version(version: Any) -> dict[str, Any]:
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
    }


def _eval(run: Any) -> dict[str, Any]:
    tags, params = _tags(run), dict(run.data.params)
    metrics = {k: v for k, v in sorted(run.data.metrics.items()) if k.startswith(EVAL_METRIC_PREFIXES)}
    dataset = params.get("dataset", "")  # NAME@VERSION:SPLIT
    name, _, rest = dataset.partition("@")
    version, _, split = rest.partition(":")
    return {**_run_common(run), "metrics": metrics, "dataset": {"name": name, "version": version, "split": split},
            "params": dict(sorted(params.items())), "model_id": tags.get("omni.model_id", ""),
            "checkpoint_uri": tags.get("omni.checkpoint_uri", ""), "training_run_id": tags.get("omni.training_run_id", "")}


def _training(run: Any, role: str) -> dict[str, Any]:
    tags, params = _tags(run), dict(run.data.params)
    return {**_run_common(run), "role": role, "algorithm": params.get("algorithm", ""), "model": params.get("model", ""),
            "seed": params.get("seed", ""), "params": dict(sorted(params.items())), "run_key": tags.get("omni.run_key", ""),
            "checkpoint_uri": tags.get("omni.checkpoint_uri", ""), "checkpoint_sha256": tags.get("omni.checkpoint_sha256", ""),
            "images": _images(run)}


def _dataset_inputs(run: Any) -> list[dict[str, Any]]:
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


def _model_of_run(client: Any, run: Any) -> str:
    """The logged model a training run produced (its output), else the newest one of its run key."""
    outputs = getattr(run, "outputs", None)
    for output in (outputs.model_outputs if outputs else []) or []:
        return output.model_id
    run_key = _tags(run).get("omni.run_key")
    if not run_key:
        return ""
    found = client.search_logged_models(experiment_ids=[run.info.experiment_id],
                                        filter_string=f"tags.`omni.run_key` = '{run_key}'", max_results=1,
                                        order_by=[{"field_name": "creation_time", "ascending": False}])
    return found[0].model_id if found else ""


# ---- the store --------------------------------------------------------------------------------


def _split_root(uri: str, marker: str) -> tuple[str, str] | None:
    """(store root, key) of a store URI whose key starts with `marker` (datasets/ or runs/)."""
    index = uri.rfind(f"/{marker}/")
    if not uri or index < 0:
        return None
    return uri[:index] or "/", uri[index + 1:].rstrip("/")


def _read_manifest(roots: Iterable[str | None], key: str) -> tuple[Store | None, dict[str, Any] | None, str, str]:
    """The first store of `roots` holding `key/_manifest.json`: (store, manifest, status, detail);
    status MISSING when every store answered without it, UNREACHABLE when one could not be read."""
    problems, status, seen = [], MISSING, set()
    for root in roots:
        if not root or root in seen:
            continue
        seen.add(root)
        try:
            store = Store(root)
            manifest_key = f"{key}/{MANIFEST}"
            if store.exists(manifest_key):
                return store, store.read_json(manifest_key), OK, ""
            problems.append(f"no {store.uri(manifest_key)}")
        except (OmniError, OSError, ValueError) as exc:
            status = UNREACHABLE
            problems.append(f"{root}: {exc}")
    if not seen:
        return None, None, UNKNOWN, "no store to read (give --store)"
    return None, None, status, "; ".join(problems)


def _check_dataset(entry: dict[str, Any], store_root: str | None) -> None:
    key = f"datasets/{entry['name']}/{entry['version']}"
    derived = _split_root(entry["uri"], "datasets")
    store, manifest, status, detail = _read_manifest([store_root, derived[0] if derived else None], key)
    entry.update(raw_files=[], manifest_uri="", store_check={"status": status, "detail": detail})
    if manifest is None:
        entry["recheck"] = f"omni verify {entry['uri'] or entry['name'] + '@' + entry['version']} --raw"
        return
    assert store is not None
    entry["uri"] = entry["uri"] or store.uri(key)
    entry["manifest_uri"] = store.uri(f"{key}/{MANIFEST}")
    rows = {s: e.get("rows") for s, e in (manifest.get("splits") or {}).items()}
    differences = []
    if manifest.get("version", entry["version"]) != entry["version"]:
        differences.append(f"manifest version {manifest.get('version')} != MLflow digest {entry['version']}")
    if entry["rows"] and rows != entry["rows"]:
        differences.append(f"rows per split {rows} in the manifest, {entry['rows']} in MLflow")
    if entry["raw_source_uri"] and manifest.get("source_uri") not in (None, entry["raw_source_uri"]):
        differences.append(f"raw source {manifest.get('source_uri')} in the manifest, {entry['raw_source_uri']} in MLflow")
    entry["rows"] = rows
    entry["raw_source_uri"] = manifest.get("source_uri", entry["raw_source_uri"])
    entry["raw_files"] = [{"path": f.get("path", ""), "sha256": f.get("sha256", "")} for f in manifest.get("raw_files", [])]
    entry["counts"] = manifest.get("counts", entry["counts"])
    entry["converter"] = manifest.get("converter", entry["converter"])
    entry["store_check"] = {"status": MISMATCH if differences else OK, "detail": "; ".join(differences)}
    entry["recheck"] = f"omni verify {store.uri(key)} --raw"  # --raw: the raw files' sha256s too


def _checkpoint(uri: str, sha256: str, global_step: str | int | None, model_id: str, run_key: str,
                store_root: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"uri": uri, "global_step": int(global_step) if str(global_step or "").isdigit() else None,
                             "sha256": sha256, "model_id": model_id, "run_key": run_key, "weights_file": "",
                             "files": 0, "manifest_uri": "", "store_check": {"status": UNKNOWN, "detail": ""},
                             "recheck": f"omni verify {uri}" if uri else ""}
    derived = _split_root(uri, "runs")
    if derived is None:
        entry["store_check"] = {"status": UNKNOWN, "detail": f"{uri or 'no URI'} is not a checkpoint folder of a store"}
        return entry
    roots = [store_root] if store_root and uri.startswith(Store(store_root).root + "/") else []
    store, manifest, status, detail = _read_manifest([*roots, derived[0]], derived[1])
    if manifest is None:
        entry["store_check"] = {"status": status, "detail": detail}
        return entry
    assert store is not None
    entry["manifest_uri"] = store.uri(f"{derived[1]}/{MANIFEST}")
    files = manifest.get("files") or []
    path = manifest.get("weights")
    weights = next((f for f in files if (f.get("path") == path if path else f.get("path", "").endswith(".safetensors"))),
                   {})
    entry.update(weights_file=weights.get("path", ""), files=len(files))
    differences = []
    if weights.get("sha256") != sha256:
        differences.append(f"weights sha256 {weights.get('sha256')} in the manifest, {sha256} in MLflow")
    if entry["global_step"] is not None and manifest.get("global_step") not in (None, entry["global_step"]):
        differences.append(f"global_step {manifest.get('global_step')} in the manifest, {entry['global_step']} in MLflow")
    if entry["global_step"] is None:
        entry["global_step"] = manifest.get("global_step")
    entry["store_check"] = {"status": MISMATCH if differences else OK, "detail": "; ".join(differences)}
    return entry


# ---- the chain --------------------------------------------------------------------------------


def _start(client: Any, kind: str, obj: Any) -> tuple[Any, Any, Any, Any]:
    """(model version, eval run, training run, logged model) the resolved target starts from."""
    if kind == "version":
        return obj, None, None, None
    if kind == "model":
        return None, None, _run(client, obj.source_run_id, "training run") if obj.source_run_id else None, obj
    tags = _tags(obj)
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
                if _tags(child).get("omni.stage_kind") == wanted:
                    if wanted == "register" and not _tags(child).get("omni.registered_version"):
                        continue
                    return _start(client, "run", child)
        raise LineageError(f"pipeline run {obj.info.run_id} ({tags['omni.pipeline']}) has no register, eval or "
                           "training stage run to trace; give a model version or another run")
    raise LineageError(f"run {obj.info.run_id} is not an omni register, eval or training stage run (no omni.stage_kind "
                       "tag); give a model version (models:/NAME@ALIAS) or a run `omni run` printed")


def lineage(tracker: Any, target: str | None, store_root: str | None = None) -> dict[str, Any]:
    """The chain for `target` (see the module docstring) as plain JSON data. Raises LineageError
    (an OmniError) naming an unknown model, alias, version or run and how to give a known one."""
    client = tracker.client
    try:
        return _lineage(client, target, store_root, _where(client))
    except MlflowException as exc:
        raise LineageError(f"lineage of {target or 'the newest registered model version'}: MLflow at "
                           f"{_where(client)} answered: {redact_text(exc.message)}") from exc


def _lineage(client: Any, target: str | None, store_root: str | None, tracking_uri: str) -> dict[str, Any]:
    version, eval_run, training_run, logged = _start(client, *resolve(client, target))
    warnings: list[str] = []
    chain: dict[str, Any] = {"target": target or "", "tracking_uri": tracking_uri, "store": store_root or "",
                             "model_version": None, "eval": None, "training": [], "checkpoint": None,
                             "datasets": [], "images": {}, "recheck": [], "warnings": warnings}

    version_tags: dict[str, str] = {}
    if version is not None:
        chain["model_version"] = _model_version(version)
        version_tags = chain["model_version"]["tags"]
        eval_id = version_tags.get("omni.eval_run_id") or version.run_id
        if eval_id:
            try:
                eval_run = _run(client, eval_id, "eval run")
            except LineageError as exc:
                warnings.append(str(exc))

    model_id = (chain["model_version"] or {}).get("model_id", "") if version is not None else ""
    if eval_run is not None:
        chain["eval"] = _eval(eval_run)
        model_id = model_id or chain["eval"]["model_id"]
    if logged is None and model_id:
        try:
            logged = client.get_logged_model(model_id)
        except MlflowException as exc:
            warnings.append(f"logged model {model_id}: {exc.message}")
    if logged is None and training_run is not None:
        found = _model_of_run(client, training_run)
        logged = client.get_logged_model(found) if found else None

    # the training run that produced the checkpoint, and the run the chain came through if another one
    # (an rl stage that found the checkpoint committed: a cache hit)
    producing_id = ((logged.source_run_id if logged is not None else "") or version_tags.get("omni.training_run_id")
                    or (chain["eval"] or {}).get("training_run_id", "")
                    or (_tags(training_run).get("omni.cached_from_run", "") if training_run is not None else ""))
    runs: list[tuple[Any, str]] = []
    if producing_id and (training_run is None or training_run.info.run_id != producing_id):
        try:
            runs.append((_run(client, producing_id, "training run"), "trained the checkpoint"))
        except LineageError as exc:
            warnings.append(str(exc))
    cached = "took the checkpoint from the cache"
    if training_run is not None:
        runs.append((training_run, cached if runs else "trained the checkpoint"))
    elif eval_run is not None:  # the eval's own pipeline run: its rl stage, when it was a cache hit
        sibling = _sibling_training_run(client, eval_run)
        if sibling is not None and all(sibling.info.run_id != r.info.run_id for r, _ in runs):
            runs.append((sibling, cached if runs else "trained the checkpoint"))
    chain["training"] = [_training(run, role) for run, role in runs]
    if not runs:
        warnings.append("no training run found (no omni.training_run_id tag or logged model source run)")

    trained = chain["training"][0] if chain["training"] else {}
    if logged is None and runs:
        found = _model_of_run(client, runs[0][0])
        logged = client.get_logged_model(found) if found else None
    ltags = dict(logged.tags or {}) if logged is not None else {}
    uri = ltags.get("omni.checkpoint_uri") or version_tags.get("omni.checkpoint_uri") or trained.get("checkpoint_uri", "")
    sha = ltags.get("omni.checkpoint_sha256") or version_tags.get("omni.checkpoint_sha256") \
        or trained.get("checkpoint_sha256", "")
    step = ltags.get("omni.global_step") or version_tags.get("omni.global_step")
    run_key = ltags.get("omni.run_key") or version_tags.get("omni.run_key") or trained.get("run_key", "")
    if uri or sha:
        chain["checkpoint"] = _checkpoint(uri, sha, step, logged.model_id if logged is not None else model_id,
                                          run_key, store_root)

    datasets: dict[tuple[str, str], dict[str, Any]] = {}
    for run, _ in runs:
        _merge(datasets, _dataset_inputs(run))
    if eval_run is not None:
        _merge(datasets, _dataset_inputs(eval_run))
    for entry in datasets.values():
        _check_dataset(entry, store_root)
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


def _merge(datasets: dict[tuple[str, str], dict[str, Any]], found: list[dict[str, Any]]) -> None:
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


def _sibling_training_run(client: Any, eval_run: Any) -> Any | None:
    tags = _tags(eval_run)
    parent, run_key = tags.get("mlflow.parentRunId"), tags.get("omni.run_key")
    if not parent or not run_key:
        return None
    found = client.search_runs([eval_run.info.experiment_id],
                               f"tags.mlflow.parentRunId = '{parent}' and tags.`omni.run_key` = '{run_key}'",
                               max_results=10)
    return next((r for r in found if _tags(r).get("omni.stage_kind") in TRAINING_KINDS), None)


# ---- for humans -------------------------------------------------------------------------------


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


def format_lineage(chain: dict[str, Any]) -> list[str]:
    """The chain as an indented tree, one string per line (plain text)."""
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
        depth = 1
    ev = chain.get("eval")
    if ev:
        ds = ev["dataset"]
        on = f" on {ds['name']}@{ds['version']}:{ds['split']}" if ds["name"] else ""
        add(depth, f"eval run {ev['run_id']} ({ev['pipeline'] or '-'}/{ev['run_name']}){on}")
        for name, value in ev["metrics"].items():
            add(depth + 1, f"{name} = {value:.6g}")
        depth += 1
    for t in chain.get("training", []):
        algo = f" {t['algorithm']}" if t["algorithm"] else ""
        add(depth, f"training run {t['run_id']} ({t['pipeline'] or '-'}/{t['run_name']}){algo}: {t['role']}")
        add(depth + 1, f"run key {t['run_key'] or '-'}; " + "; ".join(_run_line(t)))
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
        for f in d["raw_files"]:
            add(depth + 2, f"raw file {f['path']} sha256 {f['sha256']}")
        add(depth + 1, f"re-check: {d['recheck']}")
    for warning in chain.get("warnings", []):
        add(0, f"warning: {warning}")
    return lines
