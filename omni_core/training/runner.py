"""The driver of a training stage on Ray: schedules rollout, reward and training, checkpoints, and
restarts the actors from the latest committed checkpoint when one is lost.

Modes (`execution.mode`, docs/reference/training-on-ray.md):

- `sync`: for each step k: the rollout workers generate batch k with the current policy (version k),
  the reward workers score it, the trainer computes old log-probs and updates, the new weights are
  pushed. Nothing overlaps, so with one rollout worker and no rollout or reward resources of its own
  (`rollout_in_trainer`) the rollout worker is an object inside the trainer actor, as verl's hybrid
  engine colocates them: the same code and numbers (its own policy copy, the same pushes and seeds;
  the same weights with the default one CPU each), one process and one weight transfer a step fewer.
- `separate_async`: rollout workers generate ahead while the trainer updates. Batch k is generated with
  policy version `rollout_version(k)` (a function of k and the config only), so a run's numbers never
  depend on timing: the driver starts batch k as soon as that version has been pushed. With
  `async_reward` the reward workers score batch k while the rollout workers move on to batch k + 1.

Policy versions count trainer steps: version v is the policy after v steps. The trainer pushes its
trainable weights (only the LoRA adapter with LoRA) every `parameter_sync_step` steps.

Checkpoints (`checkpoint.save_freq`, and always at the end) hold the full training state
(`checkpoint.TrainingState`), including the weights of older versions that batches still to come
are generated with, so a resumed run generates exactly what the uninterrupted run would have.

Faults: a lost actor (killed, out of memory, its node gone) or a failed checkpoint write (storage
unreachable) stops the attempt; the driver kills the remaining actors, waits `retry_backoff_s`
(doubling), starts fresh actors and resumes from the latest committed checkpoint, at most
`max_failures` times; each recovery is tagged on the stage's MLflow run. A stage that did not start
from the latest checkpoint (`checkpoint.resume_mode` disable or resume_path, e.g. `omni run --force`)
recovers from the newest checkpoint it committed itself, else from where it started: the run key's
folder still holds an earlier run's checkpoints, newer than its own early steps. A half-written checkpoint
has no manifest and is never used (and is deleted by the next successful save). A dead driver is the
caller's to restart (the Prefect task retries): the new driver resumes the same way.

Placement: an attempt's actors are placed together or not at all (one Ray placement group, a bundle
per actor that asks for anything). Placed one by one, stages that share a cluster could each hold part
of what they need and wait for the rest forever: four runs of a sweep, each with its trainer placed and
its rollout worker waiting for the CPUs the other trainers hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ObjectLostError, OutOfMemoryError, RayActorError, RayTaskError, WorkerCrashedError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from omni_core.config.models import ExecutionConfig, RLStage
from omni_core.errors import OmniError, StorageError
from omni_core.storage import Store
from omni_core.training.actors import RewardWorker, RolloutActor, TrainerWorker
from omni_core.training.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_training_state,
    read_manifest,
    stage_prefix,
)
from omni_core.training.placement import actor_demand, actor_roles, rollout_in_trainer, separate_workers

_LOST = (RayActorError, OutOfMemoryError, WorkerCrashedError, ObjectLostError)


def rollout_version(step: int, execution: ExecutionConfig) -> int:
    """The policy version batch `step` is generated with (module docstring): `step` in sync mode;
    in separate_async max(0, step - max_staleness) rounded to a pushed version (a multiple of
    parameter_sync_step): up with staleness_policy wait, down with drop."""
    if execution.mode == "sync":
        return step
    lag, every = max(0, step - execution.max_staleness), execution.parameter_sync_step
    return -(-lag // every) * every if execution.staleness_policy == "wait" else lag // every * every


def is_dropped(step: int, execution: ExecutionConfig) -> bool:
    """With staleness_policy drop, a batch staler than max_staleness is generated but not trained on."""
    return (execution.mode == "separate_async" and execution.staleness_policy == "drop"
            and step - rollout_version(step, execution) > execution.max_staleness)



# How many times this process's trainings were told to stop (NativeBackend.cancel: Ctrl-C, a cancel's
# SIGTERM, a sweep pruning a variant). The actors end with the process, but until it is gone the driver
# thread would go on training and committing checkpoints; each runner compares this count with the one
# it started at before every step. A count, not a flag: a later run in the same process trains.
_cancels = [0]


def cancel_trainings() -> None:
    _cancels[0] += 1


class TrainingCancelled(OmniError):
    """The pipeline run was interrupted: the training stopped before its next step."""

class Recoverable(OmniError):
    """An attempt ended by a fault the runner restarts from (lost actor, storage error)."""


@dataclass
class StageRun:
    """What a stage run trains and where it writes (plain data: picklable into a Ray Job)."""

    pipeline: str
    stage: RLStage
    seed: int
    store: Store
    rows: list[dict[str, Any]]
    dataset_version: str
    run_key: str
    config_digest: str
    tracker: Any = None  # omni_core.lineage.Tracker; None: no MLflow logging
    mlflow_run_id: str | None = None
    progress: Callable[[str], None] = print
    local_ray: bool = False  # a Ray this process started: resources it lacks will never come
    on_step: Callable[[int, dict[str, float]], None] | None = None  # after each step (tests, benchmarks)
    metrics: list[dict[str, float]] = field(default_factory=list)  # per step of the last attempt


@dataclass
class _Attempt:
    trainer: Any
    rollout: list[Any]
    reward: list[Any]
    group: PlacementGroup | None = None

    def actors(self) -> list[Any]:
        return [self.trainer, *self.rollout, *self.reward]


class StageRunner:
    """`run()` trains `run.stage` from where its checkpoints say, surviving lost actors."""

    def __init__(self, run: StageRun):
        self.run_ = run
        self.stage = run.stage
        self.root = stage_prefix(run.pipeline, run.run_key, run.stage.name)
        self.recoveries = 0
        self.attempt: _Attempt | None = None
        # what a recovery resumes from when the stage does not resume from the latest checkpoint:
        # where the first attempt started (None: step 0), then each checkpoint this run commits
        self._own_checkpoint: dict[str, Any] | None = None
        self._cancels_at_start = _cancels[0]

    # ---- public --------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train to `trainer.total_steps`; returns the final checkpoint's manifest (with `metrics`)."""
        execution = self.stage.execution
        while True:
            try:
                return self._attempt(first=self.recoveries == 0)
            except Recoverable as exc:
                self.recoveries += 1
                self._stop()
                if self.recoveries > execution.max_failures:
                    raise OmniError(f"stage {self.stage.name}: gave up after {execution.max_failures} restart(s); "
                                    f"last fault: {exc}") from exc
                wait = execution.retry_backoff_s * 2 ** (self.recoveries - 1)
                self._log_recovery(str(exc))
                self.run_.progress(f"stage {self.stage.name}: {exc}; restart {self.recoveries}/"
                                   f"{execution.max_failures} from the latest checkpoint in {wait:.0f}s")
                time.sleep(wait)
            finally:
                if self.attempt is not None:
                    self._stop()

    def actor_pids(self) -> dict[str, int]:
        """The process id of each live actor (`trainer`, `rollout_0`, `reward_0`, ...)."""
        if self.attempt is None:
            return {}
        names = ["trainer", *[f"rollout_{i}" for i in range(len(self.attempt.rollout))],
                 *[f"reward_{i}" for i in range(len(self.attempt.reward))]]
        return dict(zip(names, ray.get([a.pid.remote() for a in self.attempt.actors()]), strict=True))

    # ---- one attempt -------------------------------------------------------------------------

    def _attempt(self, *, first: bool) -> dict[str, Any]:
        try:
            return self._train(first)
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, StorageError):
                raise Recoverable(f"storage error in an actor: {cause}") from exc
            if isinstance(cause, OmniError):  # a user-fixable error inside an actor: show it as such
                raise cause from None
            if isinstance(cause, _LOST):
                raise Recoverable(f"{type(cause).__name__}: {_first_line(cause)}") from exc
            raise
        except _LOST as exc:
            raise Recoverable(f"lost an actor ({type(exc).__name__}: {_first_line(exc)})") from exc
        except StorageError as exc:
            raise Recoverable(f"storage error: {exc}") from exc

    def _start(self) -> _Attempt:
        stage, run = self.stage, self.run_
        spec = stage.model_dump(mode="json")
        split = self._workers()
        ex = stage.execution
        self._check_capacity(split)
        roles = self._roles(split)
        group, placed = _gang(roles, stage.role_resources)
        rows = ray.put(run.rows)
        trainer = TrainerWorker.options(**placed[0]).remote(spec, run.seed, rows, rollout_in_trainer(stage))
        rollout = [RolloutActor.options(**placed[1 + i]).remote(spec, run.seed, rows, i, ex.rollout_workers)
                   for i in range(roles.count("rollout"))]
        reward = [RewardWorker.options(**placed[1 + len(rollout) + i]).remote(spec, run.seed, rows)
                  for i in range(roles.count("reward"))]
        self.attempt = _Attempt(trainer, rollout, reward, group)
        ray.get([a.pid.remote() for a in self.attempt.actors()])  # constructed (models loaded)
        return self.attempt

    def _workers(self) -> bool:
        return separate_workers(self.stage)

    def _roles(self, split: bool) -> list[str]:
        """One role per actor of an attempt (`split` is `_workers()`, which actor_roles reads itself)."""
        return actor_roles(self.stage)

    def _demand(self, split: bool) -> dict[str, float]:
        """The resources all of this stage's actors ask for together."""
        return actor_demand(self.stage)

    def _check_capacity(self, split: bool) -> None:
        """Ray waits, without a word, for resources that never come: a stage asking more than a
        local Ray has is refused here; on a cluster (an autoscaler may add nodes) it is said."""
        demand, total = self._demand(split), ray.cluster_resources()
        short = {k: (v, total.get(k, 0.0)) for k, v in demand.items() if v > total.get(k, 0.0) + 1e-9}
        if not short:
            return
        what = ", ".join(f"{k} {need:g} (the cluster has {have:g})" for k, (need, have) in short.items())
        if self.run_.local_ray:
            raise OmniError(f"stage {self.stage.name}: its actors need {what}: raise ray.num_cpus (or run on a "
                            "cluster), or lower the stage's resources / execution.rollout_workers / reward_workers")
        self.run_.progress(f"stage {self.stage.name}: waiting for the cluster to provide {what}")

    def _stop(self) -> None:
        if self.attempt is not None:
            for actor in self.attempt.actors():
                ray.kill(actor)
            if self.attempt.group is not None:
                remove_placement_group(self.attempt.group)
            self.attempt = None

    def _resume_manifest(self, first: bool) -> dict[str, Any] | None:
        cfg, store = self.stage.checkpoint, self.run_.store
        if not first and cfg.resume_mode != "auto":
            return self._own_checkpoint
        if cfg.resume_mode == "disable":
            return None
        manifest = (read_manifest(store, cfg.resume_from_path) if cfg.resume_mode == "resume_path"
                    else latest_checkpoint(store, self.root))
        if manifest is None:
            return None
        if manifest.get("config_digest") != self.run_.config_digest and not cfg.force_resume:
            raise CheckpointError(
                f"checkpoint {manifest['uri']} was written with config digest {manifest.get('config_digest')}, "
                f"this stage's is {self.run_.config_digest} (another model, data, algorithm or seed); "
                "resume from a checkpoint of this config, set checkpoint.resume_mode: disable to start over, "
                "or checkpoint.force_resume: true to load it anyway")
        self._own_checkpoint = manifest
        return manifest

    def _train(self, first: bool) -> dict[str, Any]:
        stage, run, ex = self.stage, self.run_, self.stage.execution
        total = stage.trainer.total_steps
        manifest = self._resume_manifest(first)
        attempt = self._start()
        published: dict[int, Any] = {0: None}  # version -> ObjectRef of its weights (None: the initial ones)
        start = 0
        if manifest is not None:
            state = load_training_state(run.store, manifest)
            start = state.info["global_step"]
            python_rng = state.info.get("python_rng", {})
            ray.get([attempt.trainer.restore.remote(state.policy, state.optimizer, start, state.rng["trainer"],
                                                    python_rng.get("trainer"))])
            named = self._named_workers()
            ray.get([actor.set_rng.remote(state.rng[name], python_rng.get(name))
                     for name, actor in named.items() if name in state.rng])
            published = {0: None, start: ray.put(state.policy),
                         **{v: ray.put(w) for v, w in state.rollout_versions.items()}}
            run.progress(f"stage {stage.name}: resuming at step {start}/{total} from {manifest['uri']}")
            if run.tracker is not None and run.mlflow_run_id:
                run.tracker.set_tags(run.mlflow_run_id, {"omni.resumed_from": manifest["uri"],
                                                         "omni.resumed_from_step": str(start)})
        if start >= total and manifest is not None:
            return {**manifest, "metrics": manifest.get("final_metrics", {})}
        split = self._workers()
        in_trainer = rollout_in_trainer(stage)
        worker_version = [0] * len(attempt.rollout)
        pending: dict[int, tuple[list[Any], list[Any]]] = {}
        next_batch = start
        run.metrics = []

        def launch_ready() -> None:
            nonlocal next_batch
            while split and next_batch < total and rollout_version(next_batch, ex) in published:
                version = rollout_version(next_batch, ex)
                parts = []
                for i, worker in enumerate(attempt.rollout):
                    weights = published[version] if worker_version[i] != version else None
                    worker_version[i] = version
                    parts.append(worker.generate.remote(next_batch, version, weights, not attempt.reward))
                scores = ([attempt.reward[i % len(attempt.reward)].score.remote(next_batch, part)
                           for i, part in enumerate(parts)] if attempt.reward else parts)
                pending[next_batch] = (parts, scores)
                next_batch += 1

        def cancelled(step: int) -> TrainingCancelled:
            return TrainingCancelled(f"stage {stage.name}: cancelled before step {step + 1}/{total}")

        def saves(version: int) -> bool:
            return version == total or bool(stage.checkpoint.save_freq and version % stage.checkpoint.save_freq == 0)

        def submit(step: int) -> Any:
            """The trainer's whole step `step` (no rollout workers), started now; None once cancelled."""
            if _cancels[0] != self._cancels_at_start:
                return None
            if in_trainer:
                return attempt.trainer.rollout_step.remote(step)
            return attempt.trainer.step_colocated.remote(step)

        metrics: dict[str, float] = {}
        last = time.perf_counter()
        manifest_out: dict[str, Any] | None = None
        # while the driver logs step N, the trainer actor already runs step N+1 (an actor runs its calls in
        # order); not across a checkpoint, which holds the state after step N
        running = None if split or start >= total else submit(start)
        for step in range(start, total):
            if split:
                if _cancels[0] != self._cancels_at_start:
                    raise cancelled(step)
                launch_ready()
                parts, scores = pending.pop(step)
                learned = attempt.trainer.learn.remote(step, is_dropped(step, ex), len(parts), *parts, *scores)
                launch_ready()  # batches whose version is already out start while the trainer trains
                metrics = dict(ray.get(learned))
                metrics.update(self._rollout_metrics(step, ray.get(parts), ray.get(scores)))
            else:
                if running is None:
                    raise cancelled(step)
                done, running = ray.get(running), None
                if step + 1 < total and not saves(step + 1):
                    running = submit(step + 1)
                if in_trainer:
                    learnt, part = done
                    metrics = {**learnt, **self._rollout_metrics(step, [part], [part])}
                else:
                    metrics = dict(done)
            version = step + 1
            if split and (ex.mode == "sync" or version % ex.parameter_sync_step == 0):
                published[version] = attempt.trainer.weights.remote()
            needed = {rollout_version(k, ex) for k in range(version, total)}
            for old in [v for v in published if v < min(needed, default=version)]:
                del published[old]
            if saves(version):
                manifest_out = self._save(version, metrics, sorted(v for v in needed if v < version and published.get(v)),
                                          published)
                metrics["timing_s/save_checkpoint"] = manifest_out["save_s"]
                if not split and version < total:
                    running = submit(version)
            now = time.perf_counter()
            metrics["timing_s/step"] = now - last
            last = now
            run.metrics.append(metrics)
            self._log(version, metrics)
            if run.on_step is not None:
                run.on_step(version, metrics)
        assert manifest_out is not None  # the last step always saves
        return {**manifest_out, "metrics": metrics}

    def _named_workers(self) -> dict[str, Any]:
        attempt = self.attempt
        assert attempt is not None
        return {**{f"rollout_{i}": a for i, a in enumerate(attempt.rollout)},
                **{f"reward_{i}": a for i, a in enumerate(attempt.reward)}}

    def _rollout_metrics(self, step: int, got_parts: list[dict[str, Any]], got_scores: list[dict[str, Any]],
                         ) -> dict[str, float]:
        ex = self.stage.execution
        samples = sum(p["samples"] for p in got_parts)
        staleness = step - got_parts[0]["version"]
        return {
            "timing_s/gen": max(p["gen_s"] for p in got_parts),
            "timing_s/reward": max(s["reward_s"] for s in got_scores),
            "timing_s/update_weights": max(p["update_weights_s"] for p in got_parts),
            "training/off_policy/staleness_mean": float(staleness),
            "training/off_policy/dropped_samples": float(samples if is_dropped(step, ex) else 0),
            "training/policy_version": float(got_parts[0]["version"]),
        }

    def _save(self, step: int, metrics: dict[str, float], versions: list[int], published: dict[int, Any],
              ) -> dict[str, Any]:
        run, stage = self.run_, self.stage
        named = self._named_workers()
        rngs = dict(zip(named, ray.get([a.rng.remote() for a in named.values()]), strict=True))
        metadata = {"run_key": run.run_key, "stage": stage.name, "seed": run.seed,
                    "dataset_version": run.dataset_version, "model": stage.model_uri,
                    "algorithm": stage.algorithm.name, "final_metrics": metrics,
                    "config_digest": run.config_digest, "mode": stage.execution.mode}
        info = {"policy_version": step, "data_cursor": {"next_step": step}, "config_digest": run.config_digest,
                "seed": run.seed, "lr_schedule": {"type": "constant", "lr": stage.trainer.lr}}
        manifest = ray.get(self.attempt.trainer.save.remote(  # type: ignore[union-attr]
            run.store.root, self.root, metadata, info, rngs, stage.checkpoint.max_to_keep, versions,
            *[published[v] for v in versions]))
        run.progress(f"stage {stage.name}: checkpoint global_step_{step} committed ({manifest['uri']})")
        self._own_checkpoint = manifest
        return manifest

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        run = self.run_
        if run.tracker is not None and run.mlflow_run_id:
            run.tracker.log_metrics(run.mlflow_run_id, metrics, step=step, timestamp_ms=int(time.time() * 1000))
        run.progress(f"[{self.stage.name}] step {step}/{self.stage.trainer.total_steps}  "
                     + progress_line(self.stage, metrics))

    def _log_recovery(self, message: str) -> None:
        run = self.run_
        if run.tracker is None or not run.mlflow_run_id:
            return
        run.tracker.set_tags(run.mlflow_run_id, {"omni.recoveries": str(self.recoveries),
                                                 f"omni.recovery.{self.recoveries}": message[:4000]})
        run.tracker.log_metrics(run.mlflow_run_id, {"training/recoveries": float(self.recoveries)},
                                step=len(run.metrics), timestamp_ms=int(time.time() * 1000))


def progress_line(stage: RLStage, metrics: dict[str, float]) -> str:
    """`label=value` for the algorithm's headline metrics (those present), then the step time."""
    parts = [f"{label}={metrics[key]:.4g}" for key, label in stage.record.progress if key in metrics]
    return "  ".join([*parts, f"{metrics['timing_s/step']:.2f}s"])


def _gang(roles: list[str], resources_of: Callable[[str], dict[str, float]]) -> tuple[PlacementGroup | None,
                                                                                       list[dict[str, Any]]]:
    """The actor options of `roles` (one actor each), their resources reserved together (module docstring):
    a placement group with one bundle per actor that asks for any, ready before any actor is created. An
    actor that asks for nothing takes no bundle (Ray refuses empty ones; it cannot hold anyone up)."""
    options = [_options(resources_of(role)) for role in roles]
    bundles = [{k: v for k, v in resources_of(role).items() if v} for role in roles]
    wanted = [b for b in bundles if b]
    if not wanted:
        return None, options
    group = placement_group(wanted, strategy="PACK")
    ray.get(group.ready())
    index = 0
    for option, bundle in zip(options, bundles, strict=True):
        if bundle:
            option["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            index += 1
    return group, options


def _options(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options of a role's resources: CPU and GPU by name, the rest (NPU, ...) as custom."""
    out: dict[str, Any] = {"num_cpus": resources.get("CPU", 0.0), "max_restarts": 0}
    if resources.get("GPU"):
        out["num_gpus"] = resources["GPU"]
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU") and v}
    if custom:
        out["resources"] = custom
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
