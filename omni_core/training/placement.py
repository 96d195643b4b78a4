"""Which actors a native training stage starts and the Ray resources they reserve together (one
placement group: omni_core.training.runner). Plain functions of the stage's config, without Ray or
torch, so a sweep can tell before anything runs how many variants a Ray can place at once."""

from __future__ import annotations

from omni_core.config.models import RLStage


def rollout_in_trainer(stage: RLStage) -> bool:
    """Sync mode, one rollout worker, no rollout or reward resources: the trainer actor generates and
    scores (omni_core.training.runner's docstring); rollout workers would only wait their turn."""
    ex = stage.execution
    return (stage.record.separate_async and ex.mode == "sync" and ex.rollout_workers == 1
            and not {"rollout", "reward"} & set(stage.resources))


def separate_workers(stage: RLStage) -> bool:
    """Rollout (and reward) actors of their own; else the trainer generates (`rollout_in_trainer`) or
    runs its whole step (an algorithm without separate rollout)."""
    return stage.record.separate_async and not rollout_in_trainer(stage)


def actor_roles(stage: RLStage) -> list[str]:
    """One role per actor of an attempt: the trainer, then its rollout and reward workers."""
    ex, split = stage.execution, separate_workers(stage)
    return ["trainer"] + ["rollout"] * (ex.rollout_workers if split else 0) \
        + ["reward"] * (ex.reward_workers if split and ex.async_reward else 0)


def actor_demand(stage: RLStage) -> dict[str, float]:
    """The resources all of the stage's actors ask for together."""
    demand: dict[str, float] = {}
    for role in actor_roles(stage):
        for name, amount in stage.role_resources(role).items():
            demand[name] = demand.get(name, 0.0) + amount
    return {k: v for k, v in demand.items() if v}
