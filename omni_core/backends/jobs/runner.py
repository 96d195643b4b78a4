"""The runner skeleton both external backends share: a training as a Ray Job, start to commit.

1. A checkpoint of the run key already committed (at the final step, with weights) is the result.
2. The backend prepares the job (`JobTrainer.prepare`): it stages the inputs on the shared path
   (export.export_dataset / stage_model) and renders its command, runtime env and entry point resources.
3. With resume_mode auto, `mirror.prepare_resume` puts the latest mirrored checkpoint back on a
   shared path that lost it (a new cluster), or refuses a stranded one (verl #7952).
4. `JobTrainer.before_submit` asks the cluster what only it can answer (verl: does the job's interpreter
   have verl on the Ray nodes), then `job.submit` to `ray.address` (deterministic submission id: run key
   and command digest; `-attempt-N` after a failed one); the training run is tagged with the submission
   id and the command (MLflow artifact `verl/command.json`).
5. `job.follow` turns the trainer's `step:N` lines into progress and the stage's step count, keeps the
   log (MLflow artifact `verl/{id}.log`), relays verl's metrics into the stage's run (jobs.metrics) and
   mirrors each committed `global_step_N` to the store.
6. A job that failed for a reason a retry cannot change raises JobFailed (not retried); one that ended
   without its final checkpoint otherwise raises JobError (the orchestrator retries: the next attempt
   resumes from the mirror); one that succeeded without the metrics its task always logs raises
   MetricsMissing; else the backend commits the final weights (`JobTrainer.finish`: e.g.
   `merge_fsdp_checkpoint`, a helper job, then `commit_hf_folder`).
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from omni_core.backends.jobs import mirror
from omni_core.backends.jobs.job import (
    VERSION_PREFIX,
    JobCommand,
    JobFailed,
    follow,
    log_tail,
    permanent_failure,
    run_helper_job,
    submit,
    version_probe,
)
from omni_core.storage import Store
from omni_core.training.checkpoint import MANIFEST, checkpoint_prefix, latest_checkpoint, stage_prefix

MERGED = "merged"
VERSION_LINE = re.compile(rf"^{VERSION_PREFIX}(\d\S*)$", re.MULTILINE)
Timed = Callable[[str], AbstractContextManager[None]]


class JobError(RuntimeError):
    """The job ended without the trained checkpoint (failed, stopped, or too few steps). Not an
    OmniError: the orchestrator retries it (a lost node, a killed trainer), resuming from the mirror."""


def job_client(address: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


@dataclass
class JobInputs:
    """One training as a Ray Job: the stage and where its inputs, checkpoints and reports go."""

    pipeline: str
    stage: Any
    seed: int
    store: Store
    dataset: str
    version: str
    split: str
    run_key: str
    ray_address: str
    tracking_uri: str | None
    mlflow_run_id: str | None
    tracker: Any = None
    progress: Callable[[str], None] = print
    on_step: Callable[[int, int], None] = lambda step, total: None
    log_dir: str | Path = "."
    poll_s: float = 1.0
    timeout_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def root(self) -> str:
        return stage_prefix(self.pipeline, self.run_key, self.stage.name)


@dataclass
class PreparedJob:
    """What the backend submits: the command (entry point, env), the runtime env, the entry point's
    resources, where the trainer writes `global_step_N`, and how the run is announced and tagged."""

    command: JobCommand
    env: dict[str, Any]
    resources: dict[str, float]
    checkpoints: Path
    announce: str  # "Ray Job" / "VeRL-Omni recipe X as Ray Job": the progress line's subject
    tags: dict[str, str]  # MLflow tags of the training run (besides the submission id and command)
    record: dict[str, Any]  # the MLflow artifact verl/command.json (besides the submission id)
    model: str = ""  # the staged model
    metrics_dir: Path | None = None  # where verl's file logger writes (jobs.metrics), on the shared path


@dataclass
class FinishedJob:
    """A job that succeeded with its final checkpoint mirrored: what `JobTrainer.finish` commits."""

    inputs: JobInputs
    prepared: PreparedJob
    client: Any
    submission_id: str
    step: int
    log_path: Path

    @property
    def step_dir(self) -> Path:
        return self.prepared.checkpoints / f"global_step_{self.step}"

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""


class JobTrainer(Protocol):
    """What one external backend adds to the skeleton."""

    label: str  # "verl", "VeRL-Omni": in messages
    resumes: str  # "verl", "the recipe": who resumes from a restored checkpoint

    def total_steps(self, inputs: JobInputs) -> int | None: ...

    def required_metrics(self, inputs: JobInputs) -> tuple[str, ...]:
        """The metrics the trainer always logs (at least one must reach the run); () checks nothing."""
        ...

    def prepare(self, inputs: JobInputs, timed: Timed) -> PreparedJob: ...

    def before_submit(self, client: Any, prepared: PreparedJob, inputs: JobInputs) -> None:
        """Refuse (an OmniError) what would make the job fail at once, asked of the cluster."""
        ...

    def explain_failure(self, log: str, prepared: PreparedJob) -> str: ...

    def finish(self, done: FinishedJob, timed: Timed) -> dict[str, Any]: ...


def run_job(inputs: JobInputs, trainer: JobTrainer) -> dict[str, Any]:
    """Train `inputs.stage` as a Ray Job (module docstring); returns the final checkpoint's manifest plus
    `reused` and `submission_id` (and what `trainer.finish` adds). `inputs.timings` gets the seconds of
    each phase (export, model, resume, submit, follow, mirror_during_job, mirror_final, and the finish's)."""
    timings = inputs.timings

    @contextmanager
    def timed(phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start

    stage, store, root, progress = inputs.stage, inputs.store, inputs.root, inputs.progress
    total = trainer.total_steps(inputs)
    done = latest_checkpoint(store, root)
    if done is not None and done.get("weights") and (total is None or done["global_step"] >= total) \
            and stage.checkpoint.resume_mode != "disable":
        progress(f"stage {stage.name}: checkpoint for run key {inputs.run_key} already committed; nothing to do")
        return {**done, "reused": True}
    prepared = trainer.prepare(inputs, timed)
    if stage.checkpoint.resume_mode == "auto":
        with timed("resume"):
            resumed = mirror.prepare_resume(prepared.checkpoints, store, root)
        if resumed is not None:
            progress(f"stage {stage.name}: {trainer.resumes} resumes from global_step_{resumed}")
    with timed("submit"):
        client = job_client(inputs.ray_address)
        trainer.before_submit(client, prepared, inputs)
        job = submit(client, prepared.command, pipeline=inputs.pipeline, stage=stage.name, run_key=inputs.run_key,
                     env=prepared.env, resources=prepared.resources, metrics_dir=prepared.metrics_dir)
    progress(f"stage {stage.name}: {prepared.announce} {job.submission_id} "
             f"({'submitted' if job.submitted else job.status}) on {inputs.ray_address}")
    tracked = inputs.tracker is not None and inputs.mlflow_run_id
    if tracked:
        inputs.tracker.set_tags(inputs.mlflow_run_id, {
            **prepared.tags, "omni.verl.submission_id": job.submission_id,
            "omni.verl.command": prepared.command.entrypoint[:5000]})
        inputs.tracker.log_dict(inputs.mlflow_run_id, {**prepared.record, "submission_id": job.submission_id},
                                "verl/command.json")

    def on_progress(line: str) -> None:
        progress(f"stage {stage.name}: {line}")
        if total and (match := re.match(r"step (\d+) of", line)):
            inputs.on_step(min(int(match.group(1)), total), total)

    keep = stage.checkpoint.max_to_keep
    log_dir = Path(inputs.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{job.submission_id}.log"

    relay = relay_for(inputs.tracker if tracked else None, inputs.mlflow_run_id, prepared.metrics_dir,
                      job.submission_id)

    def mirror_while_running() -> None:
        relay.poll()
        with timed("mirror_during_job"):
            mirror.mirror_new(prepared.checkpoints, store, root, keep=keep)

    with timed("follow"):
        status = follow(client, job.submission_id, total_steps=total or 0, progress=on_progress,
                        poll_s=inputs.poll_s, on_poll=mirror_while_running, log_path=log_path,
                        timeout_s=inputs.timeout_s)
    relay.poll()
    if tracked and log_path.exists():
        inputs.tracker.client.log_artifact(inputs.mlflow_run_id, str(log_path), "verl")
    with timed("mirror_final"):
        mirror.mirror_new(prepared.checkpoints, store, root, keep=keep)
    what = f"stage {stage.name}: {trainer.label} job {job.submission_id}"
    if status != "SUCCEEDED":
        log = log_path.read_text() if log_path.exists() else ""
        failed_for_good(what, status, log)
        raise JobError(f"{what} ended {status}{trainer.explain_failure(log, prepared)}; a retry resubmits it and "
                       f"resumes from the last mirrored checkpoint. Log tail:\n{log_tail(log)}")
    step = mirror.local_latest(prepared.checkpoints)
    if step is None or (total is not None and step < total):
        raise JobError(f"{what} succeeded but its latest checkpoint is step {step}, not {total} (is "
                       "trainer.save_freq overridden?)")
    if tracked:
        relay.require(trainer.required_metrics(inputs), what)
    finished = FinishedJob(inputs, prepared, client, job.submission_id, step, log_path)
    return {**trainer.finish(finished, timed), "reused": False, "submission_id": job.submission_id}


def relay_for(tracker: Any, run_id: str | None, metrics_dir: Path | None, job_id: str) -> Any:
    """The job's MetricsRelay into `run_id`, or one that relays nothing (no run, no metrics file)."""
    from omni_core.backends.jobs.metrics import MetricsRelay, metrics_file

    if tracker is None or not run_id or metrics_dir is None:
        return _NoRelay()
    return MetricsRelay(tracker.client, run_id, metrics_file(metrics_dir, job_id))


class _NoRelay:
    logged: set[str] = set()

    def poll(self) -> int:
        return 0

    def require(self, names: tuple[str, ...], what: str) -> None:
        return None


def failed_for_good(what: str, status: str, log: str) -> None:
    """JobFailed (not retried) when the log says another attempt would fail the same way."""
    if status == "FAILED" and (reason := permanent_failure(log)):
        raise JobFailed(f"{what} failed and is not retried, since another attempt would fail the same way: {reason}. "
                        f"Log tail:\n{log_tail(log)}")


def merge_fsdp_checkpoint(client: Any, python: str, step_dir: Path, job_id: str, env: dict[str, Any], poll_s: float,
                          progress: Callable[[str], None], shards_dir: Path | None = None) -> str:
    """verl's model merger as a helper Ray Job: FSDP shards (in `shards_dir`, default step_dir) ->
    step_dir/merged (a Hugging Face folder); returns the verl version the job printed."""
    merge = [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(shards_dir or step_dir),
             "--target_dir", str(step_dir / MERGED)]
    entry = f"{shlex.join(version_probe(python))} && {shlex.join(merge)}"
    merge_id = f"{job_id}-merge-{step_dir.name}"
    progress(f"merging {step_dir.name} into a Hugging Face folder (Ray Job {merge_id})")
    status, logs = run_helper_job(client, entry, merge_id, env, poll_s)
    if status != "SUCCEEDED" or not (step_dir / MERGED / "config.json").is_file():
        raise JobError(f"verl's model merger ({merge_id}) ended {status}: {log_tail(logs)}")
    found = VERSION_LINE.search(logs)
    return found.group(1) if found else "unknown"


def commit_hf_folder(store: Store, root: str, step: int, folder: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Add a Hugging Face folder's files at the top of the mirrored checkpoint `step` and commit its
    manifest again (last), naming the weights: the folder is then a model and still the trainer's resume point."""
    prefix = checkpoint_prefix(root, step)
    manifest = store.read_json(f"{prefix}/{MANIFEST}")
    rels = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    added = [mirror.upload_file(store, folder, prefix, rel) for rel in rels]
    kept = [f for f in manifest["files"] if f["path"] not in set(rels) and not f["path"].startswith(f"{MERGED}/")]
    weights = next((r for r in rels if r.endswith(".safetensors")), None)
    if weights is None:
        raise JobError(f"no .safetensors in {folder}: the trained model was not written")
    manifest = {**manifest, **extra, "files": kept + added, "weights": weights, "model_format": "huggingface"}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)  # the commit point, again
    return manifest
