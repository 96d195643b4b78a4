"""Stage kind `register`: the checkpoint an upstream eval stage scored becomes a new version of a
registered model; alias `candidate` moves to it, alias `champion` only when it wins.

The version's source is the checkpoint's MLflow 3 logged model (`models:/{model_id}`, no weights
copied); its run is the eval run, and its tags link back to the run key, the checkpoint URI and
sha256, the training and eval runs and the dataset version. `champion` moves when `metric` beats
the current champion's score (its eval run's metric) by more than `margin` in the direction
`greater_is_better` says; without a champion the new version becomes it. The decision and both
scores are tags on the version either way: `omni.promotion` (promoted | kept), `omni.score`,
`omni.champion_score`.

Several runs may register into one model at once (omni_core.lineage.model_registry): a version per
registration (two identical runs at once share one), `candidate` on the newest version, and a
`champion` that two racing promotions settle on the better of.

Cache inputs: the eval result's digest (a re-run with the same checkpoint and scores registers
nothing new while its version is still in the registry). Outputs: model_name, version, promoted,
score, champion_version.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking._tracking_service.utils import _use_tracking_uri
from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS

from omni_core.config.models import RegisterStage
from omni_core.errors import ConfigError
from omni_core.lineage.model_registry import (
    CANDIDATE,
    CHAMPION,
    KEPT,
    PROMOTED,
    REGISTER_KEY,
    ensure_registered_model,
    keep_first_of_key,
    set_version_tags,
    settle_candidate,
    settle_champion,
)
from omni_core.lineage.redact import redact_mapping, redact_text
from omni_core.pipeline.stages import register_stage
from omni_core.pipeline.stages.eval import eval_digest, mlflow_metric_name, source_outcome

_global_uri_lock = threading.Lock()


def register_inputs(ctx: Any) -> dict[str, Any]:
    evaluated = source_outcome(ctx, "eval_from", "eval")
    return {"eval": {"stage": evaluated.name, "result": eval_digest(evaluated.outputs)}}


def version_still_there(ctx: Any, outputs: dict[str, Any]) -> bool:
    try:
        ctx.tracker.client.get_model_version(outputs["model_name"], outputs["version"])
    except MlflowException:
        return False
    return True


def log_reused(ctx: Any, record: Any) -> None:
    ctx.tracker.set_tags(ctx.mlflow_run_id, {"omni.registered_model": record.outputs["model_name"],
                                             "omni.registered_version": record.outputs["version"]})


def beats(score: float, champion: float, stage: RegisterStage) -> bool:
    """Whether `score` is better than `champion` by more than the margin."""
    if stage.greater_is_better:
        return score > champion + stage.margin
    return score < champion - stage.margin


def baseline_gain(stage: RegisterStage, metrics: dict[str, float], score: float) -> float:
    """How much `score` beats the eval's baseline score of the metric (in the better direction)."""
    name = mlflow_metric_name(f"{stage.metric}_baseline")
    if name not in metrics:
        raise ConfigError(f"stages.{stage.name}.min_gain_over_baseline: the eval stage scored no baseline "
                          f"({stage.metric}_baseline); set baseline: true on it, or drop min_gain_over_baseline")
    baseline = float(metrics[name])
    return score - baseline if stage.greater_is_better else baseline - score


def champion_of(client: Any, name: str) -> Any | None:
    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def score_of(client: Any, version: Any, metric: str) -> float | None:
    """A version's `metric` from the eval run recorded on it, else its `omni.score` tag for that metric."""
    run_id = version.tags.get("omni.eval_run_id")
    if run_id:
        try:
            value = client.get_run(run_id).data.metrics.get(metric)
        except MlflowException:
            value = None
        if value is not None:
            return float(value)
    if version.tags.get("omni.metric") == metric and version.tags.get("omni.score") not in (None, ""):
        return float(version.tags["omni.score"])
    return None


def create_version(tracker: Any, name: str, model_id: str | None, checkpoint_uri: str, key: str = "",
                   **options: Any) -> Any:
    """A new version of `name` whose source is the logged model `models:/{model_id}` (else the checkpoint
    URI), recorded on the logged model as MLflow's `register_model` does (tag mlflow.modelVersions).
    With `key` (tag omni.register_key): the version registered under that key first when a concurrent
    run registered it too (`keep_first_of_key`).

    MLflow's SQL registry resolves a `models:/` source with a client of the process-wide tracking URI,
    not this client's: that URI is set to ours for the call (under a lock; our clients all name theirs).
    """
    client = tracker.client
    # the registry is written through the client directly: its tags and description are redacted here
    options = {**options, "tags": redact_mapping(options.get("tags") or {}),
               "description": redact_text(options.get("description") or "")}
    checkpoint_uri = redact_text(checkpoint_uri)
    if key:
        options["tags"][REGISTER_KEY] = key
    if model_id is None:
        version = client.create_model_version(name, source=checkpoint_uri, **options)
        return keep_first_of_key(client, name, version, key)[0] if key else version
    with _global_uri_lock, _use_tracking_uri(tracker.tracking_uri):
        version = client.create_model_version(name, source=f"models:/{model_id}", model_id=model_id, **options)
    if key:
        version, created = keep_first_of_key(client, name, version, key)
        if not created:  # the other run records it on its logged model
            return version
    listed = client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS)
    entries = (json.loads(listed) if listed else []) + [{"name": name, "version": version.version}]
    client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps(entries)})
    return version


@register_stage("register", version="1", seeded=False, inputs=register_inputs, verify=version_still_there, reuse=log_reused)
def run_register(ctx: Any) -> dict[str, Any]:
    stage: RegisterStage = ctx.stage
    client = ctx.tracker.client
    evaluated = source_outcome(ctx, "eval_from", "eval").outputs
    metrics = {mlflow_metric_name(k): v for k, v in evaluated["metrics"].items()}
    metric = mlflow_metric_name(stage.metric)  # `mean@1` or MLflow's `mean_at_1`
    if metric not in metrics:
        raise ConfigError(f"stages.{stage.name}.metric: '{stage.metric}' is not a metric of the eval stage "
                          f"(it logged: {', '.join(sorted(evaluated['metrics']))}); use one of these")
    score = float(metrics[metric])
    gain = baseline_gain(stage, metrics, score) if stage.min_gain_over_baseline is not None else None
    model_id = evaluated.get("model_id")
    ensure_registered_model(client, stage.model_name, ctx.config.name)
    tags = {"omni.pipeline": ctx.config.name, "omni.run_key": evaluated["run_key"],
            "omni.checkpoint_uri": evaluated["checkpoint_uri"], "omni.checkpoint_sha256": evaluated["weights_sha256"],
            "omni.global_step": str(evaluated["global_step"]), "omni.model_id": model_id or "",
            "omni.training_run_id": evaluated.get("training_run_id") or "",
            "omni.eval_run_id": evaluated["eval_run_id"], "omni.register_run_id": ctx.mlflow_run_id,
            "omni.dataset": evaluated["dataset"], "omni.dataset_version": evaluated["dataset_version"],
            "omni.metric": metric, "omni.score": repr(score)}
    version = create_version(
        ctx.tracker, stage.model_name, model_id, evaluated["checkpoint_uri"],
        key="" if ctx.force else ctx.cache_key,  # --force register: a new version on purpose
        run_id=evaluated["eval_run_id"], tags=tags,
        description=f"{evaluated['checkpoint_uri']} ({stage.metric} {score:.6g})")
    settle_candidate(client, stage.model_name)
    champion = champion_of(client, stage.model_name)
    champion_score = score_of(client, champion, metric) if champion is not None else None

    if champion is not None and str(champion.version) == str(version.version):
        # a concurrent identical run registered this version (keep_first_of_key) and promoted it already
        promoted, why = True, champion.tags.get("omni.promotion_reason") or "promoted by the run that registered it"
        champion_score = float(champion.tags["omni.champion_score"]) if champion.tags.get("omni.champion_score") else None
    else:
        if champion is None:
            promoted, why = True, "no champion yet"
        elif champion_score is None:
            promoted, why = True, f"champion version {champion.version} has no {stage.metric} to compare"
        else:
            promoted = beats(score, champion_score, stage)
            better = "greater" if stage.greater_is_better else "lower"
            why = (f"{stage.metric} {score:.6g} vs champion version {champion.version}'s {champion_score:.6g} "
                   f"({better} is better, margin {stage.margin:g})")
        if gain is not None:
            if gain <= stage.min_gain_over_baseline:
                promoted = False
            why += (f"; gain over the baseline {gain:.6g} "
                    f"{'>' if gain > stage.min_gain_over_baseline else '<='} min_gain_over_baseline "
                    f"{stage.min_gain_over_baseline:g}")
        # omni.promotion last: settle_champion reads the versions it names, with the rest of the decision
        decision = {"omni.champion_score": "" if champion_score is None else repr(champion_score),
                    "omni.champion_version": str(champion.version) if champion is not None else "",
                    "omni.promotion_reason": why,
                    **({"omni.baseline_gain": repr(gain)} if gain is not None else {}),
                    "omni.promotion": PROMOTED if promoted else KEPT}
        set_version_tags(client, stage.model_name, version.version, redact_mapping(decision))
    champion_version = str(champion.version) if champion is not None else ""
    if promoted:  # the champion's race-safe move: the best of this version and any that raced it
        champion_version = settle_champion(client, stage.model_name, metric, stage.greater_is_better,
                                           lambda v: score_of(client, v, metric)) or ""
        if champion_version != str(version.version):
            promoted = False
            why = (f"{why}; but version {champion_version}, registered at the same time, scored better and is "
                   f"{CHAMPION}")
            set_version_tags(client, stage.model_name, version.version,
                             redact_mapping({"omni.promotion_reason": why, "omni.promotion": KEPT}))
    ctx.tracker.set_tags(ctx.mlflow_run_id, {"omni.registered_model": stage.model_name,
                                             "omni.registered_version": version.version,
                                             "omni.promotion": PROMOTED if promoted else KEPT})
    ctx.progress(f"stage {stage.name}: {stage.model_name} version {version.version} is {CANDIDATE}; "
                 f"{'promoted to' if promoted else 'kept out of'} {CHAMPION}: {why}")
    ctx.report["registry"] = {"model_name": stage.model_name, "version": version.version, "reason": why}
    return {"model_name": stage.model_name, "version": str(version.version), "promoted": promoted, "score": score,
            "champion_version": str(champion_version), "champion_score": champion_score}
