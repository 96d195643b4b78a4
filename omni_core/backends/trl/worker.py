"""What every Ray Train worker of a trl stage runs (`train_func`): TRL's trainer built from the base
model, on the committed dataset version, resumed from the stage's last committed checkpoint; rank 0
logs TRL's metrics to the stage's MLflow run and commits the final model. Imports TRL: it runs only in
the workers (and in the driver's tests).

Everything arrives as plain data (`WorkerJob`, built by omni_core.backends.trl.runner), so a worker on
any Ray node can run it: the store's root, the shard keys, the rendered TRL config, the reward (a custom
file's bytes), the MLflow run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_core.backends.trl.metrics import DRIVER_SECONDS, OWN_SECONDS, STEP_METRIC, SUMMARY_KEYS


@dataclass(frozen=True)
class WorkerJob:
    pipeline: str
    stage: str
    algorithm: str
    trainer: str  # GRPOTrainer | DPOTrainer | SFTTrainer
    fields: dict[str, Any]  # the TRL config's fields (omni_core.backends.trl.render)
    lora: dict[str, Any] | None
    model_uri: str
    seed: int
    store_root: str
    shard_keys: list[str]
    stage_root: str
    checkpoint: dict[str, Any]  # the stage's CheckpointConfig
    config_digest: str
    metadata: dict[str, Any]  # what every manifest records (run key, dataset version, ...)
    ray_run: str
    use_gpu: bool
    num_threads: int
    response: str = "auto"  # sft: which field of a row is the target
    reward: str | None = None  # the reward spec (GRPO)
    reward_file: dict[str, Any] | None = None  # a custom reward's file (omni_core.backends.trl.rewards)
    tracking_uri: str | None = None
    run_id: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def train_loop(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`: `config["job"]` is a WorkerJob as a dict."""
    train_func(WorkerJob(**config["job"]))


def train_func(job: WorkerJob) -> None:
    import ray.train

    os.environ.update(job.extra_env)
    _quiet()
    import torch

    torch.set_num_threads(job.num_threads)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    with tempfile.TemporaryDirectory(prefix=f"omni-trl-{job.stage}-rank{rank}-") as tmp:
        Worker(job, rank, world, Path(tmp)).run()


def local_model(uri: str, seed: int) -> Path:
    """The model's local folder (TRL loads it by path, and builds its reference model from it). A `tiny://`
    model not built on this node yet is built by a child process: transformers' `save_pretrained` writes
    nothing on a rank but 0 of an initialized process group, so a worker would cache an empty model."""
    from omni_core.models.factory import model_source
    from omni_core.models.tiny import tiny_model_built

    if uri.startswith("tiny://") and tiny_model_built(uri.removeprefix("tiny://"), seed=seed) is None:
        build = "import sys; from omni_core.models.factory import model_source; model_source(sys.argv[1], int(sys.argv[2]))"
        subprocess.run([sys.executable, "-c", build, uri, str(seed)], check=True, capture_output=True)
    return Path(model_source(uri, seed))


def _quiet() -> None:
    """No progress bars, per-step prints or deprecation notices of TRL's stack in the driver's log (Ray
    forwards every worker's output there); the metrics go to MLflow and the driver's progress lines."""
    import warnings

    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")


class Worker:
    def __init__(self, job: WorkerJob, rank: int, world: int, tmp: Path):
        from omni_core.storage import Store

        self.job, self.rank, self.world, self.tmp = job, rank, world, tmp
        self.store = Store(job.store_root)
        self.started = time.time()
        # the backend's own seconds around TRL's steps (rank 0's), logged at the end: `trl/{name}_s`
        self.seconds = {name: 0.0 for name in OWN_SECONDS if name not in DRIVER_SECONDS}

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def run(self) -> None:
        from omni_core.backends.trl.checkpoints import restore, resume_point
        from omni_core.config.models import CheckpointConfig

        job = self.job
        with self.timed("setup"):
            manifest = resume_point(self.store, job.stage_root, CheckpointConfig.model_validate(job.checkpoint),
                                    config_digest=job.config_digest, ray_run=job.ray_run)
            trainer = self.build_trainer(resumed=manifest["global_step"] if manifest else 0)
            self.tag_start(manifest)
        if manifest is not None:
            with self.timed("restore"):
                folder = restore(self.store, manifest, self.tmp / "restored")
            trainer.train(resume_from_checkpoint=str(folder))
        else:
            trainer.train()
        with self.timed("final_commit"):
            self.commit_final(trainer)
        self.log({f"trl/{name}_s": value for name, value in self.seconds.items()}, trainer.state.global_step)

    def build_trainer(self, resumed: int) -> Any:
        import trl
        from transformers import PrinterCallback

        from omni_core.backends.trl.callback import OmniCallback
        from omni_core.backends.trl.data import trl_dataset

        job = self.job
        model_dir = local_model(job.model_uri, job.seed)
        with self.timed("data"):
            dataset, _ = trl_dataset(self.store, job.shard_keys, job.algorithm, model_dir, response=job.response)
        config_class = getattr(trl, job.trainer.replace("Trainer", "Config"))
        save_freq = int(job.checkpoint.get("save_freq") or 0)
        args = config_class(
            output_dir=str(self.tmp / "output"), report_to="none", run_name=job.ray_run, use_cpu=not job.use_gpu,
            logging_steps=1, disable_tqdm=True, save_strategy="steps" if save_freq else "no",
            save_steps=save_freq or 500, save_total_limit=1, **job.fields)
        kwargs: dict[str, Any] = {"model": str(model_dir), "args": args, "train_dataset": dataset,
                                  "callbacks": [OmniCallback(self, resumed)]}
        if job.lora is not None:
            kwargs["peft_config"] = self.lora_config(model_dir)
        if job.trainer == "GRPOTrainer":
            kwargs["reward_funcs"] = [self.reward()]
        trainer = getattr(trl, job.trainer)(**kwargs)
        trainer.remove_callback(PrinterCallback)  # it prints every step's logs
        return trainer

    def lora_config(self, model_dir: Path) -> Any:
        import json

        from peft import LoraConfig

        from omni_core.models.adapters import resolve_adapter

        options = dict(self.job.lora or {})
        if options.get("target_modules") is None:  # the adapter's targets, as our own trainers use
            architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
            options["target_modules"] = resolve_adapter(architecture).lora_targets
        return LoraConfig(**options)

    def reward(self) -> Any:
        from omni_core.backends.trl.rewards import trl_reward, unpack_reward

        return trl_reward(unpack_reward(self.job.reward_file, self.job.reward, self.tmp / "reward"))

    # ---- rank 0's reports and commits ------------------------------------------------------------

    def tag_start(self, resumed: dict[str, Any] | None) -> None:
        """What the weights depend on (the versions, world size, threads) and where this start resumed from."""
        if self.rank != 0 or not self.job.tracking_uri or not self.job.run_id:
            return
        from importlib.metadata import version

        from mlflow.entities import RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.job.tracking_uri)
        starts = int(client.get_run(self.job.run_id).data.tags.get("omni.trl.worker_group_starts", "0")) + 1
        tags = {f"omni.{name}.version": version(name) for name in ("trl", "transformers", "accelerate", "torch")}
        tags.update({"omni.trl.world_size": str(self.world), "omni.trl.num_threads": str(self.job.num_threads),
                     "omni.trl.worker_group_starts": str(starts), "omni.trl.worker_started_at": f"{self.started:.3f}"})
        if resumed is not None:
            tags.update({"omni.resumed_from": resumed["uri"], "omni.resumed_from_step": str(resumed["global_step"])})
        # one request (the other ranks wait for rank 0 at the trainer's first collective meanwhile)
        client.log_batch(self.job.run_id, tags=[RunTag(key, value) for key, value in tags.items()])

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.rank != 0 or not self.job.tracking_uri or not self.job.run_id or not metrics:
            return
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        now = int(time.time() * 1000)
        MlflowClient(self.job.tracking_uri).log_batch(
            self.job.run_id, metrics=[Metric(k, v, now, step) for k, v in sorted(metrics.items())])

    def logged_steps(self) -> int:
        """The last step already in the run (a resumed worker group does not log the steps it retrains twice)."""
        if self.rank != 0 or not self.job.tracking_uri or not self.job.run_id:
            return 0
        from mlflow.tracking import MlflowClient

        history = MlflowClient(self.job.tracking_uri).get_metric_history(self.job.run_id, STEP_METRIC)
        return max((m.step for m in history), default=0)

    def commit(self, step: int, metrics: dict[str, float]) -> None:
        import torch.distributed as dist

        from omni_core.backends.trl.checkpoints import commit

        def gather(obj: Any) -> list[Any]:
            if not dist.is_initialized():
                return [obj]
            out: list[Any] = [None] * self.world
            dist.all_gather_object(out, obj)
            return out

        folder = self.tmp / "output" / f"checkpoint-{step}"
        with self.timed("checkpoint"):
            commit(self.store, self.job.stage_root, step, folder, rank=self.rank, gather=gather,
                   metadata=self.metadata(metrics), keep=self.job.checkpoint.get("max_to_keep"))

    def metadata(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {**self.job.metadata, "config_digest": self.job.config_digest, "ray_train_run": self.job.ray_run,
                "world_size": self.world, "final_metrics": metrics}

    def commit_final(self, trainer: Any) -> None:
        """Rank 0: the trained model (LoRA merged into it) and its tokenizer / processor as the final checkpoint."""
        if self.rank != 0:
            return
        from omni_core.training.checkpoint import save_checkpoint

        model = trainer.accelerator.unwrap_model(trainer.model)
        if hasattr(model, "merge_and_unload"):  # peft: a plain model, as eval and register take it
            model = model.merge_and_unload()
        step = trainer.state.global_step
        save_checkpoint(self.store, self.job.stage_root, step, model, trainer.processing_class,
                        {**self.metadata(self.last_metrics(trainer)), "source": "trl", "model_format": "huggingface"},
                        keep=self.job.checkpoint.get("max_to_keep"))

    @staticmethod
    def last_metrics(trainer: Any) -> dict[str, float]:
        last: dict[str, float] = {}
        for entry in trainer.state.log_history:
            last.update({k: float(v) for k, v in entry.items() if isinstance(v, int | float) and k not in SUMMARY_KEYS
                         and k != "step"})
        return last
