"""The names in a pipeline file that only a registry knows: each dataset's converter and each stage's
reward. `omni validate`, `plan`, `run` and `sweep` check them before anything runs, so a misspelt name is
an error naming its key instead of a failure once the run reaches the stage (the config models cannot
check them: `omni_core.config` sits below the registries, which plugins extend)."""

from __future__ import annotations

from omni_core.config import PipelineConfig


def unknown_names(config: PipelineConfig) -> list[str]:
    """One error per converter or reward no registry (plugins included) or file provides, by key."""
    import omni_core.data  # noqa: F401 - registers the built-in converters
    import omni_core.rewards  # noqa: F401 - registers the built-in rewards
    from omni_core.data.converter import converter_problem
    from omni_core.rewards.registry import reward_problem

    errors = [f"datasets.{key}.converter: {problem}" for key, dataset in config.datasets.items()
              if (problem := converter_problem(dataset.converter))]
    for stage in config.stages:
        reward = getattr(stage, "reward", None)
        if reward is not None and (problem := reward_problem(reward.name)):
            errors.append(f"stages.{stage.name}.reward.name: {problem}")
    return errors
