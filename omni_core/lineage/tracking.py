"""MLflow run hierarchy: a parent run per pipeline run, a child run per stage, dataset inputs.

Everything goes through `MlflowClient` with explicit run ids (no fluent "active run" state), so a
stage running in another process (a Ray actor, a Ray Job) logs to its run by id alone.

Every tag, param, dict artifact and dataset input passes through `omni_core.lineage.redact` first:
credentials (secret-named values, user:password@ in URIs, secret env values) never reach MLflow.
Write to MLflow through these methods, not through `client` directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from omni_core.errors import ConfigError
from omni_core.file_lock import file_lock
from omni_core.lineage.redact import env_secrets, redact, redact_mapping, redact_text

TAG_PREFIX = "omni."
LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves by default
# MLflow 3.x's UI opens an experiment on its GenAI overview unless told otherwise: the link's
# `workflowType` picks the Model training view (3.17 reads only that), the experiment's kind tag
# (read by earlier 3.x UIs; "custom_model_development" is the UI's "Machine learning") says it too.
MODEL_TRAINING_VIEW = "workflowType=machine_learning"
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
REACHABLE_TIMEOUT_S = 5.0
_SENDER_LOCK = threading.Lock()
BATCH = 100  # MLflow's log_batch takes at most 100 params and 1000 tags+params+metrics a request


def mlflow_ui_base(tracking_uri: str) -> str:
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else LOCAL_MLFLOW_UI


def mlflow_experiment_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs in MLflow's Model training view."""
    return f"{mlflow_ui_base(tracking_uri)}/#/experiments/{experiment_id}?{MODEL_TRAINING_VIEW}"


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{mlflow_ui_base(tracking_uri)}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING_VIEW}"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (relative paths are relative to the cwd)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(tracking_uri.removeprefix("sqlite:///")).expanduser()


def normalize_tracking_uri(tracking_uri: str) -> str:
    """Absolute sqlite paths, so Ray workers started elsewhere write to the same database."""
    db = sqlite_path(tracking_uri)
    return f"sqlite:///{db.resolve()}" if db is not None else tracking_uri


def sqlite_client(tracking_uri: str, db: Path) -> MlflowClient:
    """Creates (or migrates) the tracking and registry tables of a sqlite database once: MLflow does it
    when a process first opens a store, with no guard against a second process doing the same at once
    (`duplicate column name`, `table _alembic_tmp_experiments already exists`). Under a lock beside the
    database the first process creates them and the others wait, then find them current. MLflow keeps
    the opened stores per process (the lock is taken again, not the migration run)."""
    with file_lock(db.with_name(db.name + ".lock")):
        client = MlflowClient(tracking_uri=tracking_uri)  # opens the tracking store
        client.search_registered_models(max_results=1)  # opens the registry store
    return client


def inherited_tags(parent_tags: dict[str, str]) -> dict[str, str]:
    """The tags of a pipeline run that its stage runs carry too: omni.* and prefect.*."""
    return {k: v for k, v in parent_tags.items() if k.startswith((TAG_PREFIX, "prefect."))}


def check_reachable(tracking_uri: str, timeout_s: float = REACHABLE_TIMEOUT_S) -> None:
    """An MLflow server at `tracking_uri` answers within `timeout_s`, else a ConfigError naming it.

    MLflow's own client retries a refused connection 7 times with exponential backoff, so against a
    server that is down every call waits minutes before it fails; one plain request up front fails in
    seconds. Any HTTP answer counts (a proxy may not serve /health); only no answer is an error."""
    try:
        with urllib.request.urlopen(tracking_uri.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConfigError(f"tracking_uri {tracking_uri}: no MLflow server answers there ({reason}); start it "
                          "(mlflow server --host HOST --port PORT) or give the tracking URI the runs were logged to") from exc


class Tracker:
    def __init__(self, tracking_uri: str):
        self.tracking_uri = normalize_tracking_uri(tracking_uri)
        db = sqlite_path(self.tracking_uri)
        if db is not None:
            try:
                db.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"tracking_uri {tracking_uri}: cannot create {db.parent} ({exc.strerror}); "
                                  "choose a writable location") from exc
        if urlparse(self.tracking_uri).scheme in ("http", "https"):
            check_reachable(self.tracking_uri)
        # MLflow's client prints a "View run" link when a run ends, reading the run again for it: a
        # request a stage would wait for on a tracking server. The pipeline prints its own UI link.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.client = (MlflowClient(tracking_uri=self.tracking_uri) if db is None
                       else sqlite_client(self.tracking_uri, db))
        self._experiments: dict[str, str] = {}  # name -> id: one lookup per experiment, not one per run
        # on a tracking server, a stage's closing calls go on one background thread (in order), off
        # the stage's path; `flush()` waits for them. A local sqlite store is written in place.
        self.background = urlparse(self.tracking_uri).scheme in ("http", "https")
        self._sender: ThreadPoolExecutor | None = None
        self._starter: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def experiment_id(self, name: str) -> str:
        if name not in self._experiments:
            self._experiments[name] = self._experiment_id(name)
        return self._experiments[name]

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            if EXPERIMENT_KIND_TAG not in experiment.tags:  # made before the tag was set (or by someone else)
                # a user who may only log runs there: the view's tag is not worth failing for
                with contextlib.suppress(MlflowException):
                    self.client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            return experiment.experiment_id
        db = sqlite_path(self.tracking_uri)
        # With a sqlite store MLflow would put artifacts in ./mlruns of whatever cwd; keep them beside the db.
        location = (db.parent / "mlartifacts" / name).resolve().as_uri() if db is not None else None
        try:
            return self.client.create_experiment(name, artifact_location=location,
                                                 tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException:  # another run created it since the lookup: use that one
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def start_run(self, experiment: str, run_name: str, tags: dict[str, str], parent_run_id: str | None = None) -> str:
        run_name = redact_text(run_name)
        all_tags = {MLFLOW_RUN_NAME: run_name, **redact_mapping(tags)}
        if parent_run_id:
            all_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        run = self.client.create_run(self.experiment_id(experiment), run_name=run_name, tags=all_tags)
        return run.info.run_id

    def start_run_soon(self, experiment: str, run_name: str, tags: dict[str, str],
                       parent_run_id: str | None = None) -> Future[str]:
        """`start_run` as a future: on a tracking server sent from a thread of its own (not the closing
        calls' thread, whose queue it would wait behind), so the caller works meanwhile; in place on a
        local store."""
        if not self.background:
            done: Future[str] = Future()
            try:
                done.set_result(self.start_run(experiment, run_name, tags, parent_run_id))
            except Exception as exc:
                done.set_exception(exc)
            return done
        with _SENDER_LOCK:
            if self._starter is None:
                self._starter = ThreadPoolExecutor(1, thread_name_prefix="omni-mlflow-start")
            return self._starter.submit(self.start_run, experiment, run_name, tags, parent_run_id)

    def end_run(self, run_id: str, ok: bool = True) -> None:
        status = RunStatus.to_string(RunStatus.FINISHED if ok else RunStatus.FAILED)
        self.client.set_terminated(run_id, status=status)

    def set_tags(self, run_id: str, tags: dict[str, Any], *, later: bool = False) -> None:
        """All tags in one request (log_batch), not one request a tag. `later`: sent in the background
        on a tracking server (see `flush`)."""
        items = [RunTag(k, v) for k, v in redact_mapping({k: str(v) for k, v in tags.items()}).items()]
        for i in range(0, len(items), BATCH):
            self._send(later, self.client.log_batch, run_id, tags=items[i:i + BATCH])

    def end_run_later(self, run_id: str, ok: bool = True) -> None:
        """`end_run` sent in the background on a tracking server, after the calls queued before it."""
        self._send(True, self.end_run, run_id, ok)

    def _send(self, later: bool, call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if not (later and self.background):
            call(*args, **kwargs)
            return
        with _SENDER_LOCK:
            if self._sender is None:
                self._sender = ThreadPoolExecutor(1, thread_name_prefix="omni-mlflow")
            self._pending.append(self._sender.submit(call, *args, **kwargs))

    def flush(self) -> None:
        """Waits for every call sent in the background; raises the first one's error."""
        with _SENDER_LOCK:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """All params in one request (log_batch), not one request a param."""
        items = [Param(k, str(v)) for k, v in redact_mapping(params).items()]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(run_id, params=items[i:i + BATCH])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int, timestamp_ms: int) -> None:
        batch = [Metric(key, float(value), timestamp_ms, step) for key, value in sorted(metrics.items())]
        self.client.log_batch(run_id, metrics=batch)

    def log_dict(self, run_id: str, obj: Any, artifact_file: str) -> None:
        secrets = env_secrets()
        self.client.log_dict(run_id, redact(obj, secrets=secrets), redact_text(artifact_file, secrets))

    def log_dataset_input(self, run_id: str, *, name: str, digest: str, source_uri: str, raw_source_uri: str,
                          schema: list[dict[str, str]], profile: dict[str, Any], context: str) -> None:
        """Logs a store dataset version as an MLflow dataset input (source = its URI in the store)."""
        secrets = env_secrets()
        name, source_uri, raw_source_uri = (redact_text(t, secrets) for t in (name, source_uri, raw_source_uri))
        schema, profile = redact(schema, secrets=secrets), redact(profile, secrets=secrets)
        scheme = urlparse(source_uri).scheme or "local"
        dataset = Dataset(
            name=name,
            digest=digest,
            source_type="local" if scheme == "file" else scheme,
            source=json.dumps({"uri": source_uri, "raw_source_uri": raw_source_uri}),
            schema=json.dumps({"columns": schema}),
            profile=json.dumps(profile, sort_keys=True),
        )
        tags = [InputTag("mlflow.data.context", redact_text(context, secrets))]
        for attempt in range(3):
            try:
                self.client.log_inputs(run_id, datasets=[DatasetInput(dataset, tags)])
                return
            except MlflowException as exc:
                # MLflow creates the experiment's dataset row on first use: two runs logging one dataset
                # version at once both insert it, and the slower one's transaction fails whole; again,
                # it finds the row and links it
                if attempt == 2 or not _lost_insert_race(exc):
                    raise
                time.sleep(0.2 * (attempt + 1))


def _lost_insert_race(exc: MlflowException) -> bool:
    text = str(exc).lower()
    return "unique" in text and ("constraint" in text or "violation" in text)


def git_commit(cwd: str | Path = ".") -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def ui_command(tracking_uri: str) -> str:
    uri = normalize_tracking_uri(tracking_uri)
    if sqlite_path(uri) is not None:
        return f"mlflow ui --backend-store-uri {uri}"
    return f"open {uri}"

