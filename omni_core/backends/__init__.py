"""Training backends: what trains an `sft` / `rl` stage (docs/concepts/backends.md#how-a-backend-plugs-in).

Every backend implements one protocol, `Backend`, and registers one record in the config's backend
table (omni_core.config.backends: its name, its options model with the run-key rules of its options,
and "module:attribute" of its implementation). The stage runner, the planner, cancellation and
validation look the backend up there (`backend_of(stage)`), never by name or class:

- `native` (omni_core.backends.native): our trainer on Ray (the default).
- `verl` (omni_core.backends.verl): verl's own trainers as Ray Jobs on a cluster whose nodes share a path.
- `verl_omni` (omni_core.backends.verl_omni): a VeRL-Omni recipe as a Ray Job.
- `trl` (omni_core.backends.trl): TRL's SFT, GRPO and DPO trainers on Ray Train (a `TorchTrainer`).

`omni validate`, `omni plan` and `omni run` call every used backend's `precheck` (`precheck_pipeline`)
before anything runs: what a backend checks with its own trainer's code (verl's Hydra composition,
TRL's config fields) without running it.

The two Ray Job backends share the job machinery in omni_core.backends.jobs (submit, follow,
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


@dataclass(frozen=True)
class PrecheckResult:
    """One backend check of one stage before anything runs: `ok` and `skipped` are notes (the CLI prints
    them on stderr), `refused` is an error at `stages.{stage}.{key}`."""

    stage: str
    status: str  # ok | skipped | refused
    message: str
    check: str  # what checked it, e.g. "verl hydra check": the note's subject
    key: str = "backend.overrides"  # where under stages.NAME a refusal points

    @property
    def refused(self) -> bool:
        return self.status == "refused"

    def error(self) -> str:
        return f"stages.{self.stage}.{self.key}: {self.message}"

    def note(self) -> str:
        return f"{self.check}, stage {self.stage}: {self.status}: {self.message}"


@runtime_checkable
class Backend(Protocol):
    """A training backend. `check` and `plan` read the config only (no cluster, no store writes)."""

    name: str

    def check(self, stage: Any, config: Any) -> str | None:
        """The first thing in `stage` (in `config`, the whole pipeline) this backend cannot run, as
        `stages.NAME.key: message`, or None. Runs at validation, after the algorithm's own checks."""

    def precheck(self, config: Any) -> list[PrecheckResult]:
        """The checks of this backend's stages in `config` that need the trainer's own code or environment
        (no cluster, no store writes): `omni validate`, `omni plan` and `omni run` call it once per backend
        the pipeline uses, after the config loaded. May be slow (another interpreter): cache what it can."""

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


def precheck_pipeline(config: Any) -> list[PrecheckResult]:
    """Every used backend's `precheck` of `config` (a backend without one checks nothing more), in stage
    order."""
    from omni_core.config.backends import backend_name, backend_of_name

    used = dict.fromkeys(backend_name(s.backend) for s in config.stages if hasattr(s, "backend"))
    results = [r for name in used for r in (getattr(backend_of_name(name), "precheck", None) or _none)(config)]
    order = [s.name for s in config.stages]
    return sorted(results, key=lambda r: order.index(r.stage) if r.stage in order else len(order))


def _none(config: Any) -> list[PrecheckResult]:
    return []
