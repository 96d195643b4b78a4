"""The plan before the work (`omni plan PIPELINE`, `omni run PIPELINE --dry-run`): for every stage,
in run order, what it would do, read from the config and the store without changing either.

A training stage's entry is what its backend plans (omni_core.backends.Backend.plan): for a job
backend (verl, verl_omni) its Ray Job: the submission id, the exact entry point (every Hydra
override), the runtime environment (credentials shown by where they come from, never their values)
and the files it stages on the shared path. Values that only exist once an upstream stage ran (the
dataset version an ingest stage commits, the run key that depends on it, an upstream checkpoint)
appear as `<...>` placeholders.
"""

from __future__ import annotations

from typing import Any

from omni_core.backends import PlannedTraining
from omni_core.config import PipelineConfig
from omni_core.config.backends import backend_of
from omni_core.config.models import RLStage
from omni_core.data import load_version
from omni_core.errors import DataError
from omni_core.storage import Store


def plan_pipeline(config: PipelineConfig, store: Store | None = None) -> list[dict[str, Any]]:
    """One entry per stage, in run order: name, kind, after, and what it does."""
    store = store if store is not None else Store(config.store)
    ingested = {key for s in config.stages if s.kind == "ingest" for key in s.datasets}
    out = []
    for stage in config.ordered_stages():
        entry: dict[str, Any] = {"name": stage.name, "kind": stage.kind, "after": list(stage.after)}
        if isinstance(stage, RLStage):
            entry.update(_training(config, stage, store, ingested))
        elif stage.kind == "eval" and stage.engine == "trainer":
            entry.update(_trainer_validation(config, stage))
        else:
            entry["does"] = _other(config, stage)
        out.append(entry)
    return out


def _other(config: PipelineConfig, stage: Any) -> str:
    if stage.kind == "ingest":
        return "ingests " + ", ".join(f"{k} ({config.datasets[k].source})" for k in stage.datasets) \
            + f" into {config.store}"
    if stage.kind == "build_images":
        return f"builds images {', '.join(stage.targets)}" + (" and pushes them" if stage.push else "")
    if stage.kind == "eval":
        return f"scores the upstream checkpoint on {stage.data}"
    if stage.kind == "register":
        return f"registers the evaluated checkpoint as a version of {stage.model_name} ({stage.metric} decides champion)"
    return f"runs stage kind {stage.kind}"


def _trainer_validation(config: PipelineConfig, stage: Any) -> dict[str, Any]:
    """An `engine: trainer` eval: the val-only job its trained stage's backend submits."""
    from omni_core.config.models import TRAINING_KINDS, upstream_stage

    trained = config.stage(upstream_stage(config, stage.name, "checkpoint_from", stage.checkpoint_from, TRAINING_KINDS))
    return backend_of(trained).plan_validation(stage, trained, config)


def _training(config: PipelineConfig, stage: RLStage, store: Store, ingested: set[str]) -> dict[str, Any]:
    dataset, _, split = stage.data.partition(":")
    split = split or "train"
    version, shards, splits = None, None, None
    if dataset not in ingested:  # else an upstream ingest commits a version not known yet
        try:
            dv = load_version(store, dataset)
            version, shards, splits = dv.version, len(dv.shard_keys(split)) or None, sorted(dv.manifest["splits"])
        except (DataError, KeyError):
            pass
    model = stage.model if isinstance(stage.model, str) else f"<checkpoint of {stage.model.from_}>"
    run_key = None
    if version is not None and isinstance(stage.model, str):
        from omni_core.training.ray_stage import rl_run_key

        run_key = rl_run_key(stage, config.seed, version)
    data = f"{dataset}@{version or '<version>'}:{split}"
    planned = PlannedTraining(config=config, stage=stage, dataset=dataset, split=split, version=version,
                              shard_count=shards, splits=splits, run_key=run_key, model=model, data=data)
    return {"run_key": run_key, **backend_of(stage).plan(planned)}


def format_plan(entries: list[dict[str, Any]]) -> str:
    """The plan as text (one block per stage)."""
    import json

    lines = []
    for e in entries:
        after = f" after {', '.join(e['after'])}" if e["after"] else ""
        backend = f", backend {e['backend']}" if "backend" in e else ""
        lines.append(f"{e['name']} ({e['kind']}{backend}){after}: {e['does']}")
        if "entrypoint" in e:  # a job backend's Ray Job
            lines.append(f"  entrypoint: {e['entrypoint']}")
            lines.append(f"  runtime_env: {json.dumps(e['runtime_env'], sort_keys=True)}")
            ds, model = e["stages"]["dataset"], e["stages"]["model"]
            lines.append(f"  stages dataset: {ds['from']} -> {ds['to']}/ ({ds['layout']} layout; "
                         f"{', '.join(ds['files'])})")
            lines.append(f"  stages model: {model['from']} -> {model['to']}")
            if e.get("substituted"):
                lines.append(f"  substituted in the recipe's overrides: {'; '.join(e['substituted'])}")
            if "checkpoints" in e:
                lines.append(f"  checkpoints: {e['checkpoints']}/global_step_N (mirrored to the store)")
        lines += [f"  {line}" for line in e.get("details", ())]  # any backend's own lines
    return "\n".join(lines)
