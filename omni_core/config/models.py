"""Pydantic models of a pipeline file. They are the source of truth for what a pipeline may say.

Every model forbids unknown keys, so a typo fails before anything runs, naming the key.
Stage models are discriminated by `kind`; adding a stage kind means adding one model here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RayConfig(Strict):
    address: str = Field("local", description="'local' starts Ray in-process; else a cluster address.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs for a local Ray (default: all).")


class DatasetConfig(Strict):
    source: str = Field(description="fixtures://NAME?rows=N&seed=S, a local directory, s3://... or hf://...")
    converter: str = Field(description="Name of the converter in omni_core.data (e.g. gsm8k).")
    shard_rows: int = Field(10_000, ge=1, description="Rows per output Parquet shard.")
    max_quarantine_fraction: float = Field(
        0.05, ge=0, le=1, description="Fail the ingest when more than this share of rows is quarantined.")


class StageBase(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    after: list[str] = Field(default_factory=list, description="Stages that must finish first.")


class IngestStage(StageBase):
    kind: Literal["ingest"] = "ingest"
    datasets: list[str] = Field(min_length=1, description="Keys of `datasets:` to ingest.")
    workers: int = Field(1, ge=1, description="Processes converting rows in parallel.")


class BuildImagesStage(StageBase):
    kind: Literal["build_images"] = "build_images"
    targets: list[str] = Field(min_length=1, description="cuda, ascend, or image spec files (.yaml/.json).")
    push: bool = False
    registry: str | None = Field(None, description="HOST[:PORT][/NAMESPACE]; default $OMNI_IMAGE_REGISTRY.")
    builder: Literal["auto", "buildah", "docker"] = "auto"


class AlgorithmConfig(Strict):
    name: Literal["grpo", "gspo"] = "grpo"
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    adv_scale: Literal["group", "batch", "none"] = "group"
    kl_beta: float = Field(0.0, ge=0)


class RolloutConfig(Strict):
    n: int = Field(4, ge=1, description="Responses per prompt (the GRPO group size).")
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)


class RewardConfig(Strict):
    name: str = Field("gsm8k", description="Registered reward name, data_source, or path.py:function.")


class TrainerConfig(Strict):
    total_steps: int = Field(3, ge=1)
    batch_size: int = Field(4, ge=1, description="Prompts per step.")
    lr: float = Field(1e-4, gt=0)
    max_grad_norm: float = Field(1.0, gt=0)
    max_prompt_tokens: int = Field(256, ge=8)
    ppo_epochs: int = Field(1, ge=1, description="Passes over each rollout batch (verl actor.ppo_epochs).")
    ppo_mini_batch_size: int | None = Field(
        None, ge=1, description="Prompts per optimizer step within a pass (with their n responses); "
                                "default: the whole batch, one step per pass.")


class RLStage(StageBase):
    kind: Literal["rl"] = "rl"
    model: str = "tiny://lm"
    data: str = Field(description="Dataset key, optionally with a split: `gsm8k` or `gsm8k:train`.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved for the trainer actor.")


AnyStage = IngestStage | BuildImagesStage | RLStage
Stage = Annotated[AnyStage, Field(discriminator="kind")]


class PipelineConfig(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
    store: str = ".omni/store"
    tracking_uri: str = "sqlite:///.omni/mlflow.db"
    ray: RayConfig = Field(default_factory=RayConfig)
    seed: int = 0
    datasets: dict[str, DatasetConfig] = Field(default_factory=dict)
    stages: list[Stage] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_references(self) -> PipelineConfig:
        names = [s.name for s in self.stages]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"stages: duplicate stage names: {', '.join(duplicates)}")
        for stage in self.stages:
            for dep in stage.after:
                if dep not in names:
                    raise ValueError(f"stages.{stage.name}.after: '{dep}' is not a stage (stages: {', '.join(names)})")
            for key in _dataset_refs(stage):
                if key not in self.datasets:
                    known = ", ".join(self.datasets) or "none declared"
                    field = "datasets" if isinstance(stage, IngestStage) else "data"
                    raise ValueError(f"stages.{stage.name}.{field}: '{key}' is not under datasets: ({known})")
        self.ordered_stages()  # raises on a cycle
        return self

    def ordered_stages(self) -> list[AnyStage]:
        """Stages in dependency order; among ready stages, file order (so runs are reproducible)."""
        done: list[str] = []
        pending = list(self.stages)
        while pending:
            ready = [s for s in pending if all(d in done for d in s.after)]
            if not ready:
                raise ValueError("stages: after: dependencies form a cycle among " + ", ".join(s.name for s in pending))
            done.append(ready[0].name)
            pending.remove(ready[0])
        return [self.stage(n) for n in done]

    def stage(self, name: str) -> AnyStage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)


def _dataset_refs(stage: AnyStage) -> list[str]:
    if isinstance(stage, IngestStage):
        return list(stage.datasets)
    if isinstance(stage, RLStage):
        return [stage.data.split(":", 1)[0]]
    return []
