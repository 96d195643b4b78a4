"""A training stage as a Ray Job, or run in this process.

    python -m omni_core.training run PIPELINE.yaml --stage rl [--set key=value ...] [--dataset-version V]
    python -m omni_core.training submit PIPELINE.yaml --stage rl --address http://HEAD:8265 [--set ...]

`run` trains the stage (the dataset version: --dataset-version, else the store's LATEST of the
stage's dataset), resuming from its latest committed checkpoint, and prints the result as JSON.
`submit` sends that same command to a Ray cluster's job server with a deterministic submission id
(`submission_id`: pipeline, stage, run key), so a retried submission of the same training finds the
job already there (pending, running or succeeded) and never starts it twice; after a failed or
stopped attempt it submits `...-attempt-2`, `-3`, ..., which resumes from the checkpoint.
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
                raise ConfigError(f"stage {name} is a {stage.kind} stage; give an rl stage")
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


def run(config: PipelineConfig, stage: RLStage, dataset_version: str | None) -> dict[str, Any]:
    from omni_core.training.ray_stage import run_rl_stage

    store, dv, split = resolve(config, stage, dataset_version)
    result = run_rl_stage(pipeline=config.name, stage=stage, seed=config.seed, store=store,
                          shard_keys=dv.shard_keys(split), dataset_version=dv.version, ray_config=config.ray,
                          tracking_uri=None, mlflow_run_id=None,
                          progress=lambda line: print(line, flush=True))
    return asdict(result)


def submit(config: PipelineConfig, stage: RLStage, args: argparse.Namespace, client: Any = None) -> dict[str, Any]:
    """Submit the `run` command unless a job of this training is already pending, running or done."""
    from ray.job_submission import JobSubmissionClient

    _, dv, _ = resolve(config, stage, args.dataset_version)
    client = client or JobSubmissionClient(args.address)
    command = [sys.executable if args.python is None else args.python, "-m", "omni_core.training", "run",
               args.pipeline, "--stage", stage.name, "--dataset-version", dv.version,
               *[item for kv in args.set for item in ("--set", kv)]]
    attempt = 1
    while True:
        job_id = submission_id(config, stage, dv.version, attempt)
        try:
            status = str(client.get_job_status(job_id)).rsplit(".", 1)[-1]
        except RuntimeError:  # no such job (the job server answers 404)
            status = None
        if status is None:
            client.submit_job(entrypoint=shlex.join(command), submission_id=job_id,
                              runtime_env=args.runtime_env and json.loads(args.runtime_env))
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
        if name == "submit":
            p.add_argument("--address", required=True, help="Ray job server, e.g. http://127.0.0.1:8265")
            p.add_argument("--python", help="interpreter on the cluster (default: this one)")
            p.add_argument("--runtime-env", help="Ray runtime_env as JSON (e.g. a working_dir)")
    args = parser.parse_args(argv)
    try:
        config = load_pipeline(args.pipeline, args.set)
        stage = rl_stage(config, args.stage)
        out = run(config, stage, args.dataset_version) if args.command == "run" else submit(config, stage, args)
    except OmniError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
