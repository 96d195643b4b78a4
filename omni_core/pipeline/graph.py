"""The stage graph of a pipeline: dependencies, which stages may start, which a failure blocks.

Orchestrators start every stage whose `after:` stages have finished (so independent stages run in
parallel) and never one downstream of a failure. A stage sees only its ancestors' results, so what it
computes never depends on which of its siblings happened to finish first.
"""

from __future__ import annotations

from omni_core.config import PipelineConfig
from omni_core.errors import ConfigError
from omni_core.pipeline.stages import stage_kind


class StageGraph:
    def __init__(self, config: PipelineConfig):
        self.order = [s.name for s in config.ordered_stages()]  # dependency order, file order among ready
        self.after = {s.name: list(s.after) for s in config.stages}

    def ancestors(self, name: str) -> list[str]:
        """Every stage `name` depends on, directly or not, in dependency order."""
        found: set[str] = set()
        pending = list(self.after[name])
        while pending:
            dep = pending.pop()
            if dep not in found:
                found.add(dep)
                pending.extend(self.after[dep])
        return [n for n in self.order if n in found]

    def descendants(self, name: str) -> list[str]:
        return [n for n in self.order if name in self.ancestors(n)]

    def ready(self, done: set[str], started: set[str]) -> list[str]:
        """Stages not started yet whose dependencies are all done, in dependency order."""
        return [n for n in self.order if n not in started and all(d in done for d in self.after[n])]

    def blocked_by(self, name: str, failed: set[str]) -> list[str]:
        """The failed stages upstream of `name`."""
        return [a for a in self.ancestors(name) if a in failed]


def check_data_flow(config: PipelineConfig) -> None:
    """A stage that reads a dataset another stage of this pipeline writes must run after that stage;
    otherwise which version it reads would depend on timing."""
    graph = StageGraph(config)
    producers: dict[str, list[str]] = {}
    for stage in config.stages:
        for key in stage_kind(stage.kind).produces(stage):
            producers.setdefault(key, []).append(stage.name)
    for stage in config.stages:
        ancestors = set(graph.ancestors(stage.name))
        for key in stage_kind(stage.kind).reads(stage):
            missing = [p for p in producers.get(key, []) if p not in ancestors and p != stage.name]
            if missing:
                raise ConfigError(f"stages.{stage.name}.after: it reads dataset '{key}', which stage "
                                  f"'{missing[0]}' writes; add '{missing[0]}' to its after: list")
