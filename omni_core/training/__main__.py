"""A training stage as a Ray Job, or run in this process.

    python -m omni_core.training run PIPELINE.yaml --stage rl [--set key=value ...] [--dataset-version V]
                                     [--mlflow-parent-run-id RUN_ID]
    python -m omni_core.training submit PIPELINE.yaml --stage rl --address http://HEAD:8265 [--set ...]
                                        [--mlflow-parent-run-id RUN_ID]

`run` trains the stage (the dataset version: --dataset-version, else the store's LATEST of the
stage's dataset), resuming from its latest committed checkpoint, and prints the result as JSON.
`submit` sends that same command to a Ray cluster's job server with a deterministic submission id
(`submission_id`: pipeline, stage, run key), so a retried submission of the same training finds the
job already there (pending, running or succeeded) and never starts it twice; after a failed or
stopped attempt it submits `...-attempt-2`, `-3`, ..., which resumes from the checkpoint.

With `--mlflow-parent-run-id` (a pipeline run's MLflow run), `run` logs the training as a child run
of it in the pipeline's tracking store, like a stage run by the pipeline: the parent's tags, the
stage's metrics and checkpoints, and `ray.job_id` / `ray.submission_id` of the job it ran in.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from typing import Any

from omni_core.config.loader import load_pipeline
from omni_core.config.models import PipelineConfig, RLStage
from omni_core.errors import ConfigError, OmniError

ACTIVE = ("PENDING", "RUNNING", "SUCCEEDED")


def rl_stage(config: PipelineConfig, name: str) -> RLStage:
    for stage in config.stages:
        if stage.name == name:
            if not isinstance(stage, RLStage):
                raise ConfigError(f"stage {name} is a {stage.kind} stage; give an rl or sft stage")
            if not isinstance(stage.model, str):
                raise ConfigError(f"stages.{name}.model: from {stage.model.from_} is resolved by `omni run` from the "
                                  "upstream stage's result; for a single training job give the checkpoint folder: "
                                  f"stages.{name}.model=URI")
            return stage
    names = ", ".join(s.name for s in config.stages if isinstance(s, RLStage)) or "none"
    raise ConfigError(f"no stage named {name!r} in pipeline {config.name} (its rl stages: {names})")


def resolve(config: PipelineConfig, stage: RLStage, dataset_version: str | None) -> tuple[Any, Any, str]:
    """(store, dataset version, split) the stage trains on."""
    from omni_core.data import load_version
    from omni_core.storage import Store

    store = Store(config.store)
    key, _, split = stage.data.partition(":")
    dv = load_version(store, key, dataset_version)
    split = split or "train"
    if split not in dv.manifest["splits"]:
        raise ConfigError(f"stages.{stage.name}.data: dataset '{key}' has no split '{split}'")
    return store, dv, split


def submission_id(config: PipelineConfig, stage: RLStage, dataset_version: str, attempt: int = 1) -> str:
    """The Ray job id of one training (the same config, seed and data give the same id)."""
    from omni_core.training.ray_stage import rl_run_key

    base = f"omni-{config.name}-{stage.name}-{rl_run_key(stage, config.seed, dataset_version)}"
    return base if attempt == 1 else f"{base}-attempt-{attempt}"


def start_child_run(config: PipelineConfig, stage: RLStage, parent_run_id: str) -> tuple[Any, str]:
    """A child run of `parent_run_id` for this stage, tagged like the runs a pipeline creates."""
    from mlflow.exceptions import MlflowException

    from omni_core.config import config_digest
    from omni_core.lineage import Tracker, git_commit
    from omni_core.lineage.tracking import inherited_tags

    tracker = Tracker(config.tracking_uri)
    try:
        parent = tracker.client.get_run(parent_run_id)
    except MlflowException as exc:
        raise ConfigError(f"--mlflow-parent-run-id {parent_run_id}: no such run at {tracker.tracking_uri}; "
                          "give the pipeline run's MLflow run id") from exc
    tags = {**inherited_tags(parent.data.tags), "omni.pipeline": config.name, "omni.stage": stage.name, "omni.stage_kind": stage.kind,
            "omni.config_digest": config_digest(config), "omni.git_commit": git_commit()}
    experiment = tracker.client.get_experiment(parent.info.experiment_id).name
    return tracker, tracker.start_run(experiment, run_name=stage.name, tags=tags, parent_run_id=parent_run_id)


def run(config: PipelineConfig, stage: RLStage, dataset_version: str | None,
        parent_run_id: str | None = None) -> dict[str, Any]:
    from omni_core.lineage.training import log_training_result, log_training_start
    from omni_core.media_limits import MediaLimits
    from omni_core.training.ray_stage import run_rl_stage

    store, dv, split = resolve(config, stage, dataset_version)
    tracker, run_id = start_child_run(config, stage, parent_run_id) if parent_run_id else (None, None)
    try:
        if tracker is not None:
            log_training_start(tracker, run_id, stage, config.seed, dv, split)
        result = run_rl_stage(pipeline=config.name, stage=stage, seed=config.seed, store=store,
                              shard_keys=dv.shard_keys(split), dataset_version=dv.version, ray_config=config.ray,
                              tracking_uri=tracker.tracking_uri if tracker else None, mlflow_run_id=run_id,
                              progress=lambda line: print(line, flush=True),
                              media_limits=MediaLimits.of(config.datasets.get(stage.data.partition(":")[0])))
        model_id = None
        if tracker is not None:
            experiment = tracker.client.get_run(run_id).info.experiment_id
            model_id = log_training_result(
                tracker, run_id, pipeline=config.name, experiment=tracker.client.get_experiment(experiment).name,
                stage=stage, seed=config.seed, dataset=f"{dv.name}@{dv.version}:{split}", result=result)
    except BaseException:
        if tracker is not None:
            tracker.end_run(run_id, ok=False)
        raise
    if tracker is None:
        return asdict(result)
    tracker.end_run(run_id, ok=True)
    return {**asdict(result), "mlflow_run_id": run_id, "model_id": model_id}


def submit(config: PipelineConfig, stage: RLStage, args: argparse.Namespace, client: Any = None) -> dict[str, Any]:
    """Submit the `run` command unless a job of this training is already pending, running or done."""
    from ray.job_submission import JobSubmissionClient

    from omni_core.training.ray_env import merge_runtime_env
    from omni_core.training.ray_env import runtime_env as runtime_env_for
    from omni_core.training.ray_stage import SUBMISSION_ENV

    _, dv, _ = resolve(config, stage, args.dataset_version)
    client = client or JobSubmissionClient(args.address)
    command = [sys.executable if args.python is None else args.python, "-m", "omni_core.training", "run",
               args.pipeline, "--stage", stage.name, "--dataset-version", dv.version,
               *[item for kv in args.set for item in ("--set", kv)],
               *(["--mlflow-parent-run-id", args.mlflow_parent_run_id] if args.mlflow_parent_run_id else [])]
    # what the training's actors need (store, tracking, code) from this environment; --runtime-env wins
    runtime_env = merge_runtime_env(json.loads(args.runtime_env) if args.runtime_env else {},
                                    runtime_env_for(config.ray.model_copy(update={"address": args.address}), job=True))
    attempt = 1
    while True:
        job_id = submission_id(config, stage, dv.version, attempt)
        try:
            status = str(client.get_job_status(job_id)).rsplit(".", 1)[-1]
        except RuntimeError:  # no such job (the job server answers 404)
            status = None
        if status is None:
            env = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), SUBMISSION_ENV: job_id}}
            client.submit_job(entrypoint=shlex.join(command), submission_id=job_id, runtime_env=env)
            return {"submission_id": job_id, "submitted": True, "status": "PENDING"}
        if status in ACTIVE:
            return {"submission_id": job_id, "submitted": False, "status": status}
        attempt += 1  # FAILED or STOPPED: the next attempt resumes from the checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_core.training", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "submit"):
        p = sub.add_parser(name)
        p.add_argument("pipeline", help="pipeline file (YAML)")
        p.add_argument("--stage", required=True, help="name of the rl stage")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
        p.add_argument("--dataset-version", help="default: the store's LATEST of the stage's dataset")
        p.add_argument("--mlflow-parent-run-id", help="log the training as a child of this MLflow run")
        if name == "submit":
            p.add_argument("--address", required=True, help="Ray job server, e.g. http://127.0.0.1:8265")
            p.add_argument("--python", help="interpreter on the cluster (default: this one)")
            p.add_argument("--runtime-env", help="Ray runtime_env as JSON (e.g. a working_dir)")
    args = parser.parse_args(argv)
    try:
        config = load_pipeline(args.pipeline, args.set)
        stage = rl_stage(config, args.stage)
        out = (run(config, stage, args.dataset_version, args.mlflow_parent_run_id) if args.command == "run"
               else submit(config, stage, args))
    except OmniError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
