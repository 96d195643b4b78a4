"""Stage kinds: one module each, registered by `kind` with `register_stage`.

A kind is a runner plus what the stage cache and the orchestrator need to know about it:

    @register_stage("ingest", version="1", retries=2, inputs=..., digest=..., verify=..., reuse=...)
    def run_ingest(ctx: StageContext) -> dict: ...

- `run(ctx)` does the work and returns the outputs as plain JSON data (`reused: True` when it found
  its work already committed). `ctx.force` asks it to redo work it would otherwise find committed.
- `inputs(ctx)` digests what the stage reads besides its direct upstream stages' outputs (dataset
  versions, raw sources, images, seed); part of the cache key. `None`: it cannot tell without doing
  the work, so the stage always runs (its own content addressing decides what to redo).
- `digest(outputs)` the content of the outputs that dependents see (part of their keys): versions,
  weights and image digests, not URIs, timings or `reused`.
- `verify(ctx, outputs)` whether a recorded result is still in the store (else the stage re-runs).
- `reuse(ctx, record)` the lineage (MLflow tags, dataset inputs) of a result taken from the cache.
- `reads(stage)` / `produces(stage)` the dataset keys it reads / writes (to check the graph).
- `retries` / `retry_delay_s` how orchestrators retry a failed try (never for an OmniError);
  `retry_plan(stage)`, when given, decides them per stage (`StageKind.retry(stage)`).
- `volatile_config` config keys that do not change the result (e.g. worker counts): not in the key.
- `seeded` whether the pipeline's `seed` is among its inputs (a sweep over `seed` re-runs it); a kind
  that does not say is taken to read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_core.registry import Registry

Runner = Callable[[Any], dict[str, Any]]


def _no_inputs(ctx: Any) -> dict[str, Any]:
    return {}


def _outputs_digest(outputs: dict[str, Any]) -> Any:
    return {k: v for k, v in outputs.items() if k != "reused"}


def _still_there(ctx: Any, outputs: dict[str, Any]) -> bool:
    return True


def _nothing(ctx: Any, record: Any) -> None:
    return None


def _none(stage: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class StageKind:
    kind: str
    run: Runner
    version: str = "1"
    inputs: Callable[[Any], dict[str, Any] | None] = _no_inputs
    digest: Callable[[dict[str, Any]], Any] = _outputs_digest
    verify: Callable[[Any, dict[str, Any]], bool] = _still_there
    reuse: Callable[[Any, Any], None] = _nothing
    reads: Callable[[Any], list[str]] = _none
    produces: Callable[[Any], list[str]] = _none
    retries: int = 0
    retry_delay_s: float = 2.0
    volatile_config: frozenset[str] = frozenset()
    retry_plan: Callable[[Any], tuple[int, list[float]] | None] | None = None
    seeded: bool = True

    def retry(self, stage: Any) -> tuple[int, list[float]]:
        """How many times an orchestrator retries a failed try of `stage`, and the delay before each."""
        planned = self.retry_plan(stage) if self.retry_plan is not None else None
        return planned if planned is not None else (self.retries, [self.retry_delay_s] * self.retries)


_KINDS: Registry[StageKind] = Registry(
    "stage kind", hint="add a module with a @register_stage(KIND, ...) runner to omni_core/pipeline/stages/")


def register_stage(kind: str, **options: Any) -> Callable[[Runner], Runner]:
    def decorate(fn: Runner) -> Runner:
        _KINDS.add(kind, StageKind(kind, fn, **options))
        return fn

    return decorate


def stage_kind(kind: str) -> StageKind:
    return _KINDS.get(kind)


def stage_runner(kind: str) -> Runner:
    return stage_kind(kind).run


from omni_core.pipeline.stages import build_images, eval, ingest, register, rl  # noqa: E402,F401  (register the kinds)
