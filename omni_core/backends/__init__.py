"""Training backends: what trains an `sft` / `rl` stage (docs/design.md, "Backends").

Every backend implements one protocol, `Backend`, and registers one record in the config's backend
table (omni_core.config.backends: its name, its options model with the run-key rules of its options,
and "module:attribute" of its implementation). The stage runner, the planner, cancellation and
validation look the backend up there (`backend_of(stage)`), never by name or class:

- `native` (omni_core.backends.native): our trainer on Ray (the default).
- `verl` (omni_core.backends.verl): verl's own trainers as Ray Jobs on a cluster whose nodes share a path.
- `verl_omni` (omni_core.backends.verl_omni): a VeRL-Omni recipe as a Ray Job.

The two external backends share the job machinery in omni_core.backends.jobs (submit, follow,
checkpoint mirror, export to the shared path, the runner skeleton, helper jobs); neither imports
the other. Nothing here imports verl: the jobs run in verl's own environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from omni_core.training.ray_stage import RLStageResult


@dataclass(frozen=True)
class PlannedTraining:
    """What the planner knows about a training stage before anything ran; None: not known yet (an
    upstream ingest commits the dataset version, the run key depends on it)."""

    config: Any  # the PipelineConfig
    stage: Any  # the RLStage
    dataset: str
    split: str
    version: str | None
    shard_count: int | None
    splits: list[str] | None
    run_key: str | None
    model: str  # the model URI, or `<checkpoint of STAGE>`
    data: str  # `dataset@version:split` for the plan's line


@dataclass(frozen=True)
class TrainingRun:
    """One training to run: the stage (its `model: {from:}` resolved), its dataset version and run key,
    and where it reports (MLflow run, progress lines, step counter)."""

    ctx: Any  # the StageContext (config, store, tracker, mlflow_run_id, progress, on_step)
    stage: Any
    dataset: str
    split: str
    version: Any  # the DatasetVersion
    run_key: str

    @property
    def progress(self) -> Callable[[str], None]:
        return self.ctx.progress


@dataclass(frozen=True)
class CheckpointValidation:
    """A trained checkpoint scored by its trainer's own validation (an eval stage with `engine: trainer`):
    the eval stage's context, the trained stage (`model: {from:}` resolved) and its outputs, the split."""

    ctx: Any  # the eval stage's StageContext (its MLflow run receives the trainer's val metrics)
    trained: Any  # the RLStage
    outputs: dict[str, Any]  # the trained stage's outputs: checkpoint_uri, run_key, global_step
    dataset: str
    split: str
    version: Any  # the DatasetVersion


@runtime_checkable
class Backend(Protocol):
    """A training backend. `check` and `plan` read the config only (no cluster, no store writes)."""

    name: str

    def check(self, stage: Any, config: Any) -> str | None:
        """The first thing in `stage` (in `config`, the whole pipeline) this backend cannot run, as
        `stages.NAME.key: message`, or None. Runs at validation, after the algorithm's own checks."""

    def plan(self, planned: PlannedTraining) -> dict[str, Any]:
        """The plan entry: `does` (one line) and whatever the backend shows besides (a Ray Job's
        entry point, runtime env, staged files, checkpoints folder)."""

    def run(self, run: TrainingRun) -> RLStageResult:
        """Train (or find the committed checkpoint of `run.run_key`) and return the result."""

    def cancel(self) -> dict[str, str | None]:
        """Stop what runs outside this process (Ray Jobs) on an interruption; job -> last status."""

    def retries(self, stage: Any) -> tuple[int, list[float]] | None:
        """How an orchestrator retries a failed try of the stage, or None for the stage kind's default."""

    def validation_problem(self, eval_stage: Any, trained: Any) -> str | None:
        """Why `eval_stage` (`engine: trainer`) cannot score `trained`'s checkpoint with the trainer's own
        validation, as `stages.NAME.key: message`, or None."""

    def plan_validation(self, eval_stage: Any, trained: Any, config: Any) -> dict[str, Any]:
        """The plan entry of an `engine: trainer` eval of `trained`: `does`, and the job it submits."""

    def validate(self, validation: CheckpointValidation) -> dict[str, Any]:
        """Score the checkpoint with the trainer's validation: `metrics` (verl's `val-core/...` names as
        MLflow spells them, plus `val/reward_mean`), `logged` (the metric names the job already logged on
        the eval's run) and `where` (e.g. `job_id`)."""
