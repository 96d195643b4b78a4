"""verl's own Hydra composition of every verl stage's command, before anything is exported or submitted
(`omni validate`, `omni plan`, `omni run`): a misspelled key in `backend.overrides` is refused with
Hydra's message instead of surfacing as a failed Ray Job.

The interpreter is the one the job runs (interpreter.py decides it for both): the stage's
`backend.python`, else this checkout's `.venv-verl`, else `python3`. When the job's interpreter has no
verl on this machine (the cluster image's), `.venv-verl` composes the command in its stead and the note
says so; where neither has verl, the check is skipped and says why (the command is then composed by the
cluster's verl when the job starts).

Each verdict is kept in omni's cache (`verl-compose/`), keyed by the interpreter, its verl version and
config files' newest mtime, and the command: `omni validate`, then `omni plan`, then `omni run` of one
file start verl's interpreter once (importing verl costs ~7 CPU s), and a changed override or a
reinstalled verl is checked again. VeRL-Omni recipes compose VeRL-Omni's own config tree,
whose package needs vLLM-Omni (GPU-only): their stages are skipped, naming that.

The stages' commands are rendered with placeholders for what is not known yet (the dataset's files,
the staged model, the run key): an eval stage with `engine: trainer` on a verl stage is its val-only
command (omni_core.backends.verl.validation). Composition and verl's `validate_config` read none of these files
(sft_trainer's model section, which loads the model's config, is not converted here).
"""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.backends.verl.check import compose_all
from omni_core.backends.verl.interpreter import Interpreter, resolve
from omni_core.errors import ConfigError, StorageError
from omni_core.paths import cache_dir
from omni_core.storage import Store


@dataclass(frozen=True)
class HydraCheck:
    stage: str
    status: str  # ok | skipped | refused
    message: str


def _cache_key(install: str, command: Any) -> str:
    key = json.dumps([install, command.config_name, command.overrides, sorted(command.env.items())])
    return f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _compose_cached(python: str, install: str, commands: list[Any]) -> list[ConfigError | None]:
    """For each command: None (verl composes it) or the ConfigError verl refuses it with; the verdicts
    not in the cache are asked of verl's interpreter (one start for all) and kept."""
    cache = Store(str(cache_dir("verl-compose")))  # its writes are atomic: a reader sees a verdict whole or none
    keys = [_cache_key(install, c) for c in commands]
    verdicts: list[ConfigError | None | bool] = []
    for key in keys:
        try:
            kept = cache.read_json(key)
            verdicts.append(None if kept["ok"] else ConfigError(kept["error"]))
        except (StorageError, ValueError, KeyError, TypeError):
            verdicts.append(False)  # not known yet
    missing = [i for i, v in enumerate(verdicts) if v is False]
    if missing:
        outcomes = compose_all([commands[i] for i in missing], python, load_model=False)
        for i, outcome in zip(missing, outcomes, strict=True):
            refused = isinstance(outcome, ConfigError)
            verdicts[i] = outcome if refused else None
            with suppress(StorageError):  # a cache that cannot be written is only slower next time
                cache.write_json(keys[i], {"ok": not refused, "error": str(outcome) if refused else ""})
    return verdicts  # type: ignore[return-value]


def _placeholder_command(stage: Any, pipeline: str, seed: int):
    from omni_core.backends.verl.stage import command

    data = Path(stage.backend.shared_dir) / "datasets" / "DATASET" / "VERSION" / "train-00000.parquet"
    return command(stage, pipeline=pipeline, run_key="RUN_KEY", model="MODEL", train_files=[str(data)], seed=seed)


def _validation_command(config: Any, eval_stage: Any) -> tuple[Any, Any] | None:
    """(the trained verl stage, the val-only command) of an `engine: trainer` eval, or None (not verl)."""
    from omni_core.backends.verl.options import VerlBackend
    from omni_core.backends.verl.validation import placeholder_command
    from omni_core.config.models import TRAINING_KINDS, upstream_stage

    trained = config.stage(upstream_stage(config, eval_stage.name, "checkpoint_from", eval_stage.checkpoint_from,
                                          TRAINING_KINDS))
    if not isinstance(trained.backend, VerlBackend):
        return None
    return trained, placeholder_command(eval_stage, trained, config.name, config.seed)


def check_pipeline(config: Any) -> list[HydraCheck]:
    """One HydraCheck per verl / VeRL-Omni stage of `config` (one interpreter start per interpreter, none
    for the commands whose verdict is in the cache)."""
    from omni_core.backends.verl.options import VerlBackend

    results: list[HydraCheck] = []
    pending: dict[Interpreter, list[tuple[str, Any]]] = {}

    for stage in config.stages:
        if getattr(stage, "engine", None) == "trainer":  # an eval by a verl stage's own validation
            command = _validation_command(config, stage)
            if command is None:
                continue
            backend_python, cmd = command[0].backend.python, command[1]
        else:
            backend = getattr(stage, "backend", "native")
            if backend == "native":
                continue
            if not isinstance(backend, VerlBackend):
                results.append(HydraCheck(stage.name, "skipped", "VeRL-Omni's config tree is composed by its own "
                                          "package, which needs vLLM-Omni (GPU images only); the recipe's overrides "
                                          "are checked when its Ray Job starts"))
                continue
            backend_python, cmd = backend.python, _placeholder_command(stage, config.name, config.seed)
        interpreter = resolve(backend_python)
        if interpreter.check is None:
            results.append(HydraCheck(stage.name, "skipped", interpreter.check_origin))
            continue
        pending.setdefault(interpreter, []).append((stage.name, cmd))
    for interpreter, items in pending.items():
        verdicts = _compose_cached(interpreter.check, interpreter.install, [cmd for _, cmd in items])
        runs = "" if interpreter.checked_by_job_interpreter else \
            f"; the job runs {interpreter.job} ({interpreter.origin}) on the Ray nodes"
        for (name, _), refused in zip(items, verdicts, strict=True):
            if refused is not None:
                results.append(HydraCheck(name, "refused", str(refused)))
            else:
                results.append(HydraCheck(name, "ok", f"composed by {interpreter.check_origin}{runs}"))
    order = [s.name for s in config.stages]
    return sorted(results, key=lambda r: order.index(r.stage))


def refuse(results: list[HydraCheck]) -> None:
    """ConfigError naming every stage verl refused."""
    refused = [r for r in results if r.status == "refused"]
    if refused:
        raise ConfigError("; ".join(f"stages.{r.stage}.backend.overrides: {r.message}" for r in refused))
