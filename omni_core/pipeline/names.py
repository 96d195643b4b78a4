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
    from omni_core.data.converter import converter_names
    from omni_core.rewards.registry import reward_problem

    errors = []
    converters = converter_names()
    for key, dataset in config.datasets.items():
        if dataset.converter not in converters:
            errors.append(f"datasets.{key}.converter: unknown converter {dataset.converter!r}; known: "
                          f"{', '.join(converters)} (or one a plugin registers: docs/concepts/plugins.md)")
    for stage in config.stages:
        reward = getattr(stage, "reward", None)
        if reward is not None and (problem := reward_problem(reward.name)):
            errors.append(f"stages.{stage.name}.reward.name: {problem}")
    return errors
