"""`backend: {name: trl, ...}` on an `sft` or `rl` stage: TRL's SFTTrainer, GRPOTrainer or DPOTrainer on
Ray Train (docs/trl.md). Pydantic only: the config validates without TRL, torch or Ray."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from omni_core.config.backends import BackendOptions

GPU = "GPU"


class TrlBackend(BackendOptions):
    """Where and how TRL trains the stage; what it trains is the stage's own keys (omni_core.backends.trl.render)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # where it runs, not what it trains: the weights depend on the world size, the device and the
    # threads (trl's seeds are per rank; intra-op reductions split by thread), never on the Ray resources
    run_key_excluded: ClassVar[frozenset[str]] = frozenset({"resources_per_worker"})
    trains_stage_model: ClassVar[bool] = True

    name: Literal["trl"] = Field("trl", description="Backend trl: TRL's own trainers on Ray Train.")
    num_workers: int = Field(1, ge=1, description="Ray Train workers, one data-parallel (DDP) group; the world "
                                                  "size (part of the run key: it changes the weights).")
    use_gpu: bool = Field(False, description="One GPU per worker (NCCL); false: CPU workers (gloo, TRL's use_cpu).")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="Ray resources of each worker, e.g. {CPU: 2, GPU: 1}; default {CPU: 1} (plus GPU: 1 with "
                          "use_gpu). Not in the run key.")
    num_threads: int = Field(1, ge=1, description="torch intra-op threads per worker (part of the run key: "
                                                  "another count sums in another order and changes the weights).")
    vllm_mode: Literal["off", "colocate"] = Field(
        "off", description="GRPO's generation: off (transformers generate, on CPU too); colocate (one vLLM engine "
                           "per worker on its GPU: needs use_gpu and vllm in the workers' environment).")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Fields of TRL's config class (SFTConfig, GRPOConfig, DPOConfig) set "
                                          "last, as given; `omni validate` refuses a name the class does not have.")

    @field_validator("resources_per_worker")
    @classmethod
    def _non_negative(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for name, amount in (value or {}).items():
            if amount < 0:
                raise ValueError(f"resources_per_worker.{name}: {amount} is negative")
        return value

    @model_validator(mode="after")
    def _colocate_on_gpus(self) -> TrlBackend:
        if self.vllm_mode == "colocate" and not self.use_gpu:
            raise ValueError("vllm_mode: colocate runs a vLLM engine on each worker's GPU; set use_gpu: true")
        if self.use_gpu and (self.resources_per_worker or {}).get(GPU) == 0:
            raise ValueError("resources_per_worker.GPU: 0 with use_gpu: true; remove it or ask for a GPU")
        return self

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources of one worker."""
        default = {"CPU": 1.0, **({GPU: 1.0} if self.use_gpu else {})}
        return {**default, **(self.resources_per_worker or {})}

    def total_resources(self) -> dict[str, float]:
        """What the whole worker group asks of Ray."""
        return {k: v * self.num_workers for k, v in self.worker_resources().items() if v}
