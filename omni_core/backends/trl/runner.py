"""The driver of a trl stage: one Ray Train `TorchTrainer` on the pipeline's Ray (local or a cluster).

1. A final checkpoint of the run key already committed is the result (nothing trains).
2. The worker group must fit: `num_workers` x `resources_per_worker` placed on the cluster's nodes, or the
   stage is refused before it starts, naming the resources (Ray would wait for them without a word).
3. `TorchTrainer(train_func, ScalingConfig(num_workers, use_gpu, resources_per_worker), TorchConfig(gloo on
   CPU), RunConfig(name, FailureConfig(max_failures=execution.max_failures)))`: a worker that dies makes
   Ray Train restart the group, whose workers resume from the last committed checkpoint
   (omni_core.backends.trl.worker). The driver follows `timing_s/step` in the stage's MLflow run for its
   progress lines.
4. The final checkpoint (committed by rank 0) is the stage's result.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from omni_core.backends import TrainingRun
from omni_core.errors import ConfigError, OmniError
from omni_core.training.checkpoint import latest_checkpoint, stage_prefix, weights_digest

FINAL_FORMAT = "huggingface"


class TrlTrainingError(RuntimeError):
    """The worker group failed more than `execution.max_failures` times. Not an OmniError: the orchestrator
    retries the stage, whose workers resume from the last committed checkpoint."""


def placement_problem(stage: Any, nodes: list[dict[str, Any]], where: str) -> str | None:
    """Why the stage's workers cannot all be placed on `nodes` (ray.nodes()), or None."""
    backend = stage.backend
    per = {k: v for k, v in backend.worker_resources().items() if v}
    fits = sum(min(int(node["Resources"].get(k, 0.0) // v) for k, v in per.items())
               for node in nodes if node.get("Alive"))
    if fits >= backend.num_workers:
        return None
    have = "; ".join(", ".join(f"{k} {v:g}" for k, v in sorted(n["Resources"].items()) if k in per)
                     for n in nodes if n.get("Alive")) or "no live nodes"
    return (f"stages.{stage.name}.backend: {backend.num_workers} Ray Train worker(s) of {per} do not fit on the Ray "
            f"cluster ({where}: {have}); only {fits} would: lower backend.num_workers or "
            "backend.resources_per_worker, or give Ray more (ray.num_cpus, more nodes)")


def run_trl(run: TrainingRun) -> Any:
    from omni_core.training.ray_env import is_local, start_ray
    from omni_core.training.ray_stage import RLStageResult

    ctx, stage = run.ctx, run.stage
    root = stage_prefix(ctx.config.name, run.run_key, stage.name)
    total = stage.trainer.total_steps
    done = latest_checkpoint(ctx.store, root)
    if done is not None and done.get("model_format") == FINAL_FORMAT and done["global_step"] >= total \
            and stage.checkpoint.resume_mode != "disable":
        ctx.progress(f"stage {stage.name}: checkpoint for run key {run.run_key} already committed; nothing to do")
        return RLStageResult(run.run_key, done["global_step"], done["uri"], weights_digest(done),
                             done.get("final_metrics", {}), reused=True)
    start_ray(ctx.config.ray)
    import ray

    if problem := placement_problem(stage, ray.nodes(), ctx.config.ray.address):
        raise ConfigError(problem)
    if stage.model_uri.startswith("tiny://"):  # built once here, not by each worker of this node at once
        from omni_core.models.factory import model_source

        model_source(stage.model_uri, ctx.config.seed)
    job = worker_job(run, root)
    if ctx.mlflow_run_id:
        ctx.tracker.set_tags(ctx.mlflow_run_id, {"omni.backend": "trl", "omni.trl.ray_train_run": job.ray_run,
                                                 "omni.trl.trainer": job.trainer})
    backend = stage.backend
    ctx.progress(f"stage {stage.name}: TRL's {job.trainer} on Ray Train, {backend.num_workers} "
                 f"{'GPU' if backend.use_gpu else 'CPU'} worker(s), {total} step(s) (run key {run.run_key}, "
                 f"Ray Train run {job.ray_run})")
    imported = time.perf_counter()
    trainer = _trainer(stage, job, local=is_local(ctx.config.ray))  # Ray Train's import: once per process
    driver_import_s = time.perf_counter() - imported
    fit_started = time.time()
    with _progress(run, job.trainer):
        _fit(stage, job, trainer)
    _log_driver_seconds(ctx, fit_started, driver_import_s, total)
    final = latest_checkpoint(ctx.store, root)
    if final is None or final.get("model_format") != FINAL_FORMAT or final["global_step"] < total:
        raise TrlTrainingError(f"stage {stage.name}: Ray Train run {job.ray_run} ended without the final "
                               f"checkpoint (latest committed: {final and final['global_step']})")
    ctx.progress(f"stage {stage.name}: checkpoint global_step_{final['global_step']} committed ({final['uri']})")
    restarts = _restarts(ctx)
    return RLStageResult(run.run_key, final["global_step"], final["uri"], weights_digest(final),
                         final.get("final_metrics", {}), reused=False, recoveries=restarts)


def worker_job(run: TrainingRun, root: str) -> Any:
    """What the workers are told (omni_core.backends.trl.worker.WorkerJob), all plain data."""
    from omni_core.backends.trl.render import render
    from omni_core.backends.trl.rewards import shipped_reward
    from omni_core.backends.trl.worker import WorkerJob
    from omni_core.training.ray_stage import config_digest

    ctx, stage = run.ctx, run.stage
    seed = ctx.config.seed
    rendered = render(stage, seed)
    reward = stage.reward.name if stage.record.reads("reward", "name") else None
    return WorkerJob(
        pipeline=ctx.config.name, stage=stage.name, algorithm=stage.algorithm.name, trainer=rendered.trainer,
        fields=rendered.fields, lora=rendered.lora, model_uri=stage.model_uri, seed=seed, store_root=ctx.store.root,
        shard_keys=run.version.shard_keys(run.split), stage_root=root,
        checkpoint=stage.checkpoint.model_dump(mode="json"),
        config_digest=config_digest(stage, seed, run.version.version),
        metadata={"run_key": run.run_key, "stage": stage.name, "seed": seed, "dataset_version": run.version.version,
                  "model": stage.model_uri, "algorithm": stage.algorithm.name, "backend": "trl"},
        ray_run=f"omni-{ctx.config.name}-{stage.name}-{run.run_key}-{uuid.uuid4().hex[:8]}",
        use_gpu=stage.backend.use_gpu, num_threads=stage.backend.num_threads,
        response=getattr(stage.algorithm, "response", "auto"), reward=reward, reward_file=shipped_reward(reward),
        tracking_uri=ctx.tracker.tracking_uri if ctx.mlflow_run_id else None, run_id=ctx.mlflow_run_id,
        extra_env={"TOKENIZERS_PARALLELISM": "false"})


def _trainer(stage: Any, job: Any, *, local: bool) -> Any:
    """The stage's `TorchTrainer` (not started)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from omni_core.backends.trl.worker import train_loop
    from omni_core.paths import cache_dir

    class Trainer(TorchTrainer):
        """Without Ray Data's `DatasetManager` actor, which Ray Train starts for every run (one more Python
        process booting beside the workers) though the workers read the store themselves. A private
        method of Ray Train's: should it change, Ray Train's own callbacks run unchanged."""

        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [c for c in callbacks if type(c).__name__ != "DatasetsCallback"]

    backend = stage.backend
    # Ray Train's workers send print() to its logger too, also while a library captures stdout (dill prints a
    # function's bytecode into a capture when datasets hashes TRL's map functions): into the driver's log
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if local:  # this process's own Ray: no node of it can be preempted, so no watcher actor (a process) for that
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    return Trainer(
        train_loop, train_loop_config={"job": asdict(job)},
        scaling_config=ScalingConfig(num_workers=backend.num_workers, use_gpu=backend.use_gpu,
                                     resources_per_worker=backend.worker_resources()),
        torch_config=TorchConfig(backend="nccl" if backend.use_gpu else "gloo"),
        run_config=RunConfig(name=job.ray_run, storage_path=str(cache_dir("ray-train")),
                             failure_config=FailureConfig(max_failures=stage.execution.max_failures)))


def _fit(stage: Any, job: Any, trainer: Any) -> None:
    main = threading.current_thread() is threading.main_thread()
    sigint = signal.getsignal(signal.SIGINT) if main else None
    try:
        trainer.fit()
    except Exception as exc:  # Ray Train's WorkerGroupError / ControllerError
        raise _cause(stage, job, exc) from exc
    finally:
        if main:  # fit() installs its own Ctrl-C handler (abort that run) and leaves it behind
            signal.signal(signal.SIGINT, sigint)


def _cause(stage: Any, job: Any, exc: Exception) -> Exception:
    """A worker's OmniError (bad data, a refused checkpoint) as it is; else a TrlTrainingError naming the run."""
    failures = list(getattr(exc, "worker_failures", {}).values())
    for failure in failures:
        for error in (failure, getattr(failure, "cause", None), failure.__cause__):
            if isinstance(error, OmniError) and type(error).__module__.startswith("omni_core"):
                return error
    first = str(failures[0] if failures else exc).strip().splitlines()
    return TrlTrainingError(f"stage {stage.name}: Ray Train run {job.ray_run} failed (its worker group restarted "
                            f"at most {stage.execution.max_failures} time(s), execution.max_failures): "
                            f"{first[-1] if first else type(exc).__name__}")


def _log_driver_seconds(ctx: Any, fit_started: float, driver_import_s: float, step: int) -> None:
    """`trl/start_s`: from `fit()` to the (last) worker group's start (Ray Train's controller, the workers'
    processes and their imports), and `trl/driver_import_s`, beside the workers' own `trl/*_s`."""
    if not ctx.mlflow_run_id:
        return
    seconds = {"trl/driver_import_s": driver_import_s}
    started = ctx.tracker.client.get_run(ctx.mlflow_run_id).data.tags.get("omni.trl.worker_started_at")
    if started:
        seconds["trl/start_s"] = float(started) - fit_started
    ctx.tracker.log_metrics(ctx.mlflow_run_id, seconds, step=step, timestamp_ms=int(time.time() * 1000))


def _restarts(ctx: Any) -> int:
    if not ctx.mlflow_run_id:
        return 0
    tags = ctx.tracker.client.get_run(ctx.mlflow_run_id).data.tags
    return max(0, int(tags.get("omni.trl.worker_group_starts", "1")) - 1)


@contextmanager
def _progress(run: TrainingRun, trainer: str) -> Iterator[None]:
    """Progress lines and the stage's step count from `timing_s/step` in the stage's MLflow run: polled each
    second, as a native stage's (each poll is a request to the tracking server), and once more when the fit
    ended, so that the last step's line is always there."""
    from omni_core.backends.trl.metrics import PROGRESS, STEP_METRIC
    from omni_core.pipeline.watch import StepWatcher

    ctx, stage = run.ctx, run.stage
    if not ctx.mlflow_run_id:
        yield
        return
    total = stage.trainer.total_steps

    def on_step(step: int) -> None:
        metrics = ctx.tracker.client.get_run(ctx.mlflow_run_id).data.metrics
        parts = [f"{label}={metrics[key]:.4g}" for key, label in PROGRESS[trainer] if key in metrics]
        ctx.progress("  ".join([f"[{stage.name}] step {step}/{total}", *parts,
                                f"{metrics.get(STEP_METRIC, 0.0):.2f}s"]))
        ctx.on_step(min(step, total), total)

    watcher = StepWatcher(ctx.tracker.tracking_uri, ctx.mlflow_run_id, STEP_METRIC, on_step)
    with watcher:
        yield
    watcher.poll()  # the steps logged since its last poll (its thread has ended)
