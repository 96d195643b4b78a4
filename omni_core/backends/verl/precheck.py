"""verl's own Hydra composition of every verl stage's command, before anything is exported or submitted
(`omni validate`, `omni plan`, `omni run`): a misspelled key in `backend.overrides` is refused with
Hydra's message instead of surfacing as a failed Ray Job.

The interpreter: the stage's `backend.python` when it has verl, else this checkout's `.venv-verl`. Where
neither has verl, the check is skipped and says why (on a laptop without verl the command is composed
by the cluster's verl when the job starts). VeRL-Omni recipes compose VeRL-Omni's own config tree,
whose package needs vLLM-Omni (GPU-only): their stages are skipped, naming that.

The stages' commands are rendered with placeholders for what is not known yet (the dataset's files,
the staged model, the run key): an eval stage with `engine: trainer` on a verl stage is its val-only
command (omni_core.backends.verl.validation). Composition and verl's `validate_config` read none of these files
(sft_trainer's model section, which loads the model's config, is not converted here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.backends.verl.check import compose_all
from omni_core.errors import ConfigError

REPO_VERL_PYTHON = Path(__file__).resolve().parents[3] / ".venv-verl" / "bin" / "python"
PROBE_TIMEOUT_S = 60


@dataclass(frozen=True)
class HydraCheck:
    stage: str
    status: str  # ok | skipped | refused
    message: str


def verl_version(python: str) -> str | None:
    """The verl version installed for `python` (read without importing verl), or None."""
    found = shutil.which(python) if os.sep not in python else (python if os.access(python, os.X_OK) else None)
    if not found:
        return None
    try:
        proc = subprocess.run([found, "-c", "from importlib.metadata import version; print(version('verl'))"],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def verl_interpreter(backend_python: str) -> tuple[str | None, str]:
    """(interpreter, where it comes from) or (None, why there is none)."""
    for python, origin in ((backend_python, "backend.python"), (str(REPO_VERL_PYTHON), ".venv-verl")):
        if version := verl_version(python):
            return python, f"verl {version} of {origin} ({python})"
    return None, (f"neither backend.python ({backend_python}) nor {REPO_VERL_PYTHON} has verl installed "
                  "(`make setup` builds .venv-verl)")


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
    """One HydraCheck per verl / VeRL-Omni stage of `config` (one interpreter start per interpreter)."""
    from omni_core.backends.verl.options import VerlBackend

    results: list[HydraCheck] = []
    pending: dict[str, list[tuple[str, Any]]] = {}
    origins: dict[str, str] = {}
    for stage in config.stages:
        if getattr(stage, "engine", None) == "trainer":  # an eval by a verl stage's own validation
            command = _validation_command(config, stage)
            if command is None:
                continue
            python, origin = verl_interpreter(command[0].backend.python)
            if python is None:
                results.append(HydraCheck(stage.name, "skipped", origin))
                continue
            origins[python] = origin
            pending.setdefault(python, []).append((stage.name, command[1]))
            continue
        backend = getattr(stage, "backend", "native")
        if backend == "native":
            continue
        if not isinstance(backend, VerlBackend):
            results.append(HydraCheck(stage.name, "skipped", "VeRL-Omni's config tree is composed by its own package, "
                                      "which needs vLLM-Omni (GPU images only); the recipe's overrides are checked "
                                      "when its Ray Job starts"))
            continue
        python, origin = verl_interpreter(backend.python)
        if python is None:
            results.append(HydraCheck(stage.name, "skipped", origin))
            continue
        origins[python] = origin
        pending.setdefault(python, []).append((stage.name, _placeholder_command(stage, config.name, config.seed)))
    for python, items in pending.items():
        outcomes = compose_all([cmd for _, cmd in items], python, load_model=False)
        for (name, _), outcome in zip(items, outcomes, strict=True):
            if isinstance(outcome, ConfigError):
                results.append(HydraCheck(name, "refused", str(outcome)))
            else:
                results.append(HydraCheck(name, "ok", f"composed by {origins[python]}"))
    order = [s.name for s in config.stages]
    return sorted(results, key=lambda r: order.index(r.stage))


def refuse(results: list[HydraCheck]) -> None:
    """ConfigError naming every stage verl refused."""
    refused = [r for r in results if r.status == "refused"]
    if refused:
        raise ConfigError("; ".join(f"stages.{r.stage}.backend.overrides: {r.message}" for r in refused))
