"""An eval stage with `engine: trainer` on a job backend: the trained stage's own trainer, started with
`trainer.val_before_train=True trainer.val_only=True` as a Ray Job, validates the checkpoint and exits
(verl's `fit`: load, validate, log, return). Its file logger writes verl's validation metrics
(`val-core/{data_source}/{var}/mean@N`, `val-aux/...`), which the driver relays into the eval stage's
own MLflow run (jobs.metrics; MLflow spells `@` as `_at_`); they are read back from there as the
stage's metrics.

verl has no `val/reward_mean` (that name is ours, what `register` decides on by default): it is the mean
over data sources of each one's `reward/mean@N` (the reward's score, in val-core or, where the reward
also returns `acc`, val-aux; the largest N), else of the val-core means.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_core.backends.jobs.job import follow, log_tail, submit
from omni_core.backends.jobs.metrics import MetricsMissing
from omni_core.backends.jobs.runner import JobError, PreparedJob, failed_for_good, job_client, relay_for

VAL_ONLY = {"trainer.val_before_train": True, "trainer.val_only": True}
VAL_PREFIXES = ("val-core/", "val-aux/", "val/")
CORE_MEAN = re.compile(r"^val-core/.+/mean_at_\d+$")
REWARD_MEANS = re.compile(r"^val-(core|aux)/(?P<source>[^/]+)/reward/mean_at_(?P<n>\d+)$")
REWARD_MEAN = "val/reward_mean"


def val_kwargs(eval_stage: Any, prefix: str = "actor_rollout_ref.rollout.val_kwargs") -> dict[str, Any]:
    """The eval stage's sampling as verl's validation sampling (greedy: temperature 0, which is what
    verl's agent loop reads; `do_sample` is set to match)."""
    greedy = eval_stage.greedy
    return {f"{prefix}.n": eval_stage.n, f"{prefix}.do_sample": not greedy,
            f"{prefix}.temperature": 0.0 if greedy else eval_stage.temperature,
            f"{prefix}.top_p": 1.0 if greedy else eval_stage.top_p}


def with_overrides(overrides: list[str], values: dict[str, str]) -> list[str]:
    """`overrides` with every override of a key in `values` (formatted Hydra values) replaced by ours, at
    the end (a recipe's or the user's `trainer.val_before_train=False` is not left beside ours)."""
    def key(item: str) -> str:
        return item.partition("=")[0].lstrip("+~")

    return [item for item in overrides if key(item) not in values] + [f"{k}={v}" for k, v in values.items()]


def trainer_metrics(logged: dict[str, float], job_id: str) -> dict[str, float]:
    """verl's validation metrics among a run's metrics, plus `val/reward_mean` (module docstring)."""
    found = {name: value for name, value in logged.items() if name.startswith(VAL_PREFIXES)}
    if not found:
        raise MetricsMissing(f"validation job {job_id} succeeded but logged no validation metric (val-core/, "
                             "val-aux/, val/) on the eval run; is trainer.logger overridden (it must keep 'file')?")
    rewards: dict[str, tuple[int, float]] = {}  # data source -> (N, reward mean@N) at the largest N
    for name, value in found.items():
        if (match := REWARD_MEANS.match(name)) and int(match["n"]) >= rewards.get(match["source"], (0, 0.0))[0]:
            rewards[match["source"]] = (int(match["n"]), value)
    cores = [value for _, value in rewards.values()] or [v for name, v in found.items() if CORE_MEAN.match(name)]
    if cores and REWARD_MEAN not in found:  # a DPO recipe's pair metrics have none
        found[REWARD_MEAN] = sum(cores) / len(cores)
    return found


def job_eval_problem(eval_stage: Any) -> str | None:
    """What an `engine: trainer` eval stage sets that a trainer's validation job cannot honour."""
    where = f"stages.{eval_stage.name}"
    if eval_stage.baseline:
        return (f"{where}.baseline: a trainer's validation scores one checkpoint; use engine: native for a "
                "baseline (its starting model on the same rows and seeds)")
    if eval_stage.resources is not None:
        return (f"{where}.resources: the validation job places its workers as the trained stage's backend does "
                "(nnodes, n_gpus_per_node); remove it")
    return None


def run_validation_job(validation: Any, prepared: PreparedJob, label: str,
                       before_submit: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Submit `prepared` (a val-only command; `before_submit(client)` may refuse it first), follow it to its
    end, relaying its metrics into the eval's run, and read them back (module docstring)."""
    ctx = validation.ctx
    name, address = ctx.stage.name, ctx.config.ray.address
    client = job_client(address)
    if before_submit is not None:
        before_submit(client)
    # one submission per eval run (a retry of the same run after a failed job is `-attempt-N`)
    job = submit(client, prepared.command, pipeline=ctx.config.name, stage=name, run_key=ctx.mlflow_run_id[:16],
                 env=prepared.env, resources=prepared.resources, metrics_dir=prepared.metrics_dir)
    ctx.progress(f"stage {name}: {label}'s validation of {validation.outputs['checkpoint_uri']} as Ray Job "
                 f"{job.submission_id} ({'submitted' if job.submitted else job.status}) on {address}")
    ctx.tracker.set_tags(ctx.mlflow_run_id, {"omni.verl.submission_id": job.submission_id,
                                             "omni.verl.command": prepared.command.entrypoint[:5000]})
    ctx.tracker.log_dict(ctx.mlflow_run_id, {**prepared.record, "submission_id": job.submission_id},
                         "verl/command.json")
    with tempfile.TemporaryDirectory(prefix="omni-verl-val-") as logs:
        log_path = Path(logs) / f"{job.submission_id}.log"
        relay = relay_for(ctx.tracker, ctx.mlflow_run_id, prepared.metrics_dir, job.submission_id)
        status = follow(client, job.submission_id, total_steps=0, progress=lambda line: None, log_path=log_path,
                        on_poll=relay.poll)
        relay.poll()
        log = log_path.read_text() if log_path.exists() else ""
        if log:
            ctx.tracker.client.log_artifact(ctx.mlflow_run_id, str(log_path), "verl")
    if status != "SUCCEEDED":
        what = f"stage {name}: {label} validation job {job.submission_id}"
        failed_for_good(what, status, log)
        raise JobError(f"{what} ended {status}. Log tail:\n{log_tail(log)}")
    logged = ctx.tracker.client.get_run(ctx.mlflow_run_id).data.metrics
    metrics = trainer_metrics(logged, job.submission_id)
    return {"metrics": metrics, "logged": sorted(set(logged) & set(metrics)), "records": [], "timings": {},
            "where": {"job_id": job.submission_id}}
