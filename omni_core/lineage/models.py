"""Checkpoints as MLflow 3 logged models: the model record points at our store, it copies no weights.

A logged model carries the checkpoint's URI, weights digest, step, run key and training algorithm as
tags, is linked to the run that trained it as an output at its step, and is what the registry
registers (`models:/{model_id}`).
"""

from __future__ import annotations

from typing import Any

from mlflow.entities import LoggedModelOutput

from omni_core.lineage.redact import redact_mapping

MODEL_TYPE = "omni-checkpoint"


def log_checkpoint_model(tracker: Any, run_id: str, experiment: str, *, name: str, checkpoint_uri: str,
                         weights_sha256: str, global_step: int, run_key: str, params: dict[str, Any]) -> str:
    """Create, finalize and link the logged model of one committed checkpoint; returns its model id."""
    client = tracker.client  # not through Tracker's methods: so the redaction is applied here
    model = client.create_logged_model(
        experiment_id=tracker.experiment_id(experiment), name=name, source_run_id=run_id, model_type=MODEL_TYPE,
        tags=redact_mapping({"omni.checkpoint_uri": checkpoint_uri, "omni.checkpoint_sha256": weights_sha256,
                             "omni.global_step": str(global_step), "omni.run_key": run_key}),
        params=redact_mapping({k: str(v) for k, v in params.items()}))
    client.finalize_logged_model(model.model_id, "READY")
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, global_step)])
    return model.model_id


def checkpoint_models(tracker: Any, experiment: str, run_key: str | None = None) -> list[Any]:
    """The logged models of checkpoints in `experiment` (of one run key), newest first."""
    query = f"tags.`omni.run_key` = '{run_key}'" if run_key else None
    return list(tracker.client.search_logged_models(experiment_ids=[tracker.experiment_id(experiment)],
                                                    filter_string=query, order_by=[{"field_name": "creation_time",
                                                                                    "ascending": False}]))
