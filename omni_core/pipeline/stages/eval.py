"""Stage kind `eval`: score an upstream rl or sft stage's checkpoint on a dataset split with the dataset's
reward functions.

The checkpoint comes from `checkpoint_from` (default: the nearest upstream rl or sft stage), the rows from
the dataset version an ancestor ingest stage produced (else the store's LATEST). Greedy by default.
On the stage's MLflow run: verl's `val/reward_mean` and `val-core/{data_source}/reward/mean@{n}`
(spelled `mean_at_{n}` in MLflow, which refuses `@`, as verl's MLflow logger does), each linked to the checkpoint's logged model and the dataset version (MLflow 3 model metrics), the
dataset version as an `eval` input, and the first `samples` rows (prompt, response, ground truth,
score) as the table `eval_samples.json`.

Cache inputs: the checkpoint's weights digest and step, the dataset version and split, the seed, and
the bytes of a custom reward file. Outputs: model_id, checkpoint_uri, weights_sha256, metrics,
dataset_version (and the MLflow run ids the register stage links back to).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric

from omni_core.config.models import TRAINING_KINDS, EvalStage, RLStage, upstream_stage
from omni_core.data import load_version
from omni_core.errors import ConfigError
from omni_core.lineage import log_dataset_version
from omni_core.pipeline.stages import register_stage
from omni_core.pipeline.stages.rl import dataset_for, input_dataset
from omni_core.storage import file_sha256
from omni_core.training.checkpoint import checkpoint_prefix, stage_prefix

SAMPLES_TABLE = "eval_samples.json"
SAMPLE_COLUMNS = ("data_source", "prompt", "response", "ground_truth", "score")
_NOT_IN_MLFLOW_NAMES = re.compile(r"[^/\w.\- :]")


def mlflow_metric_name(name: str) -> str:
    """The name verl's MLflow logger gives a metric: MLflow refuses `@`, so `mean@1` is `mean_at_1`
    (other characters MLflow refuses become `_`, repeated slashes one)."""
    return _NOT_IN_MLFLOW_NAMES.sub("_", re.sub(r"/+", "/", name.replace("@", "_at_")))


def check_pipeline(ctx: Any) -> None:
    """The stage's place in the pipeline (upstream stages, dataset key) is usable, else a ConfigError."""
    problem = ctx.stage.pipeline_problem(ctx.config)
    if problem:
        raise ConfigError(f"{ctx.config.name}: {problem}")


def source_outcome(ctx: Any, field: str, kind: str | tuple[str, ...]) -> Any:
    """The outcome of the upstream stage of `kind` this stage takes its input from."""
    check_pipeline(ctx)
    name = upstream_stage(ctx.config, ctx.stage.name, field, getattr(ctx.stage, field), kind)
    return ctx.upstream[name]


def load_checkpoint(ctx: Any, source: Any) -> tuple[Any, Any]:
    """(model, tokenizer or processor) of the rl stage `source`'s checkpoint. A full checkpoint is a
    model folder like any other; a LoRA one holds only the adapter (adapter_config.json,
    adapter_model.safetensors): its base model (the rl stage's `model`, seed and LoRA settings) with
    the trained adapter weights loaded."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load as load_safetensors

    from omni_core.models import load_model  # torch: only when an eval runs, not on a cached re-run

    trained = source.outputs
    folder = checkpoint_prefix(stage_prefix(ctx.config.name, trained["run_key"], source.name), trained["global_step"])
    if not ctx.store.exists(f"{folder}/adapter_config.json"):
        return load_model(trained["checkpoint_uri"], seed=ctx.config.seed)
    from omni_core.pipeline.stages.rl import resolved_stage

    rl: RLStage = ctx.config.stage(source.name)
    if not isinstance(rl.model, str):  # LoRA on an upstream checkpoint: that checkpoint is the base
        rl = resolved_stage(_SourceContext(rl, {n: ctx.upstream[n] for n in ctx.upstream}))
    model, text_io = load_model(rl.model_uri, seed=ctx.config.seed, adapter=rl.adapter, stage=rl.adapter_stage,
                                lora=rl.lora.model_dump() if rl.lora is not None else None)
    weights = load_safetensors(ctx.store.read_bytes(f"{folder}/adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    if getattr(result, "unexpected_keys", None):
        raise ConfigError(f"stages.{ctx.stage.name}: the LoRA checkpoint {trained['checkpoint_uri']} does not fit "
                          f"{rl.model_uri} with stages.{rl.name}.lora ({len(result.unexpected_keys)} unexpected keys, "
                          f"e.g. {result.unexpected_keys[0]})")
    return model.eval(), text_io


class _SourceContext:
    """What `resolved_stage` reads of a stage context, for the trained stage an eval scores."""

    def __init__(self, stage: RLStage, upstream: dict[str, Any]):
        self.stage, self.upstream = stage, upstream


def reward_file(stage: EvalStage) -> Path | None:
    if stage.reward is None:
        return None
    path, sep, _ = stage.reward.name.rpartition(":")
    return Path(path) if sep and path.endswith(".py") and Path(path).is_file() else None


def eval_inputs(ctx: Any) -> dict[str, Any]:
    trained = source_outcome(ctx, "checkpoint_from", TRAINING_KINDS).outputs
    key, split = ctx.stage.split()
    dv = dataset_for(ctx, key)
    inputs: dict[str, Any] = {
        "seed": ctx.config.seed, "dataset": {"name": key, "version": dv.version, "split": split},
        "checkpoint": {"weights_sha256": trained["weights_sha256"], "global_step": trained["global_step"]}}
    if (path := reward_file(ctx.stage)) is not None:
        inputs["reward_file_sha256"] = file_sha256(path)
    return inputs


def eval_digest(outputs: dict[str, Any]) -> dict[str, Any]:
    return {k: outputs[k] for k in ("weights_sha256", "metrics", "dataset_version")}


def log_reused(ctx: Any, record: Any) -> None:
    dataset = ctx.inputs["dataset"]
    log_dataset_version(ctx.tracker, ctx.mlflow_run_id, load_version(ctx.store, dataset["name"], dataset["version"]),
                        context="eval")
    ctx.tracker.set_tags(ctx.mlflow_run_id, {"omni.model_id": record.outputs.get("model_id") or "",
                                             "omni.eval_run_id": record.outputs["eval_run_id"]})


def score_rows(stage: EvalStage, model: Any, tokenizer: Any, rows: list[dict[str, Any]], seed: int,
               ) -> list[dict[str, Any]]:
    """One record per response (response j of row i is record i * n + j): the row, the response, its
    score (`omni_core.training.components.score_records`, training's own evaluation)."""
    from omni_core.training.components import Sampling, score_records

    sampling = Sampling(temperature=stage.temperature, top_p=stage.top_p, max_new_tokens=stage.max_new_tokens,
                        greedy=stage.greedy)
    return score_records(model, tokenizer, rows, reward=stage.reward.name if stage.reward is not None else None,
                         sampling=sampling, n=stage.n, max_prompt_tokens=stage.max_prompt_tokens,
                         batch_size=stage.batch_size, seed=seed)


def prompt_text(row: dict[str, Any]) -> str:
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in row.get("prompt") or [])


def samples_table(records: list[dict[str, Any]], rows: int, n: int) -> dict[str, list[Any]]:
    kept = records[:rows * n]
    return {"data_source": [r["row"].get("data_source", "") for r in kept],
            "prompt": [prompt_text(r["row"]) for r in kept],
            "response": [r["response"] for r in kept],
            "ground_truth": [str(r["row"]["reward_model"]["ground_truth"]) for r in kept],
            "score": [r["score"] for r in kept]}


@register_stage("eval", version="1", inputs=eval_inputs, digest=eval_digest, reuse=log_reused,
                reads=lambda stage: [stage.split()[0]], volatile_config=frozenset({"batch_size"}))
def run_eval(ctx: Any) -> dict[str, Any]:
    from omni_core.training.components import val_metrics

    stage: EvalStage = ctx.stage
    source = source_outcome(ctx, "checkpoint_from", TRAINING_KINDS)
    trained = source.outputs
    key, split, dv = input_dataset(ctx)
    rows = dv.rows(ctx.store, split)[:stage.max_rows]
    if not rows:
        raise ConfigError(f"stages.{stage.name}.data: split '{split}' of dataset '{key}' ({dv.version}) has no rows")
    model_id = trained.get("model_id")
    training = ctx.tracker.client.get_logged_model(model_id).source_run_id if model_id else source.mlflow_run_id
    log_dataset_version(ctx.tracker, ctx.mlflow_run_id, dv, context="eval")
    ctx.tracker.log_params(ctx.mlflow_run_id, {
        "checkpoint_from": source.name, "checkpoint_uri": trained["checkpoint_uri"], "seed": ctx.config.seed,
        "dataset": f"{key}@{dv.version}:{split}", "rows": len(rows), "n": stage.n, "greedy": stage.greedy,
        "max_new_tokens": stage.max_new_tokens,
        "reward": stage.reward.name if stage.reward is not None else "by data_source"})
    ctx.tracker.set_tags(ctx.mlflow_run_id, {
        "omni.model_id": model_id or "", "omni.checkpoint_uri": trained["checkpoint_uri"],
        "omni.checkpoint_sha256": trained["weights_sha256"], "omni.run_key": trained["run_key"],
        "omni.training_run_id": training or "", "omni.eval_run_id": ctx.mlflow_run_id})

    ctx.progress(f"stage {stage.name}: scoring {trained['checkpoint_uri']} (step {trained['global_step']}) "
                 f"on {len(rows)} rows of {key}:{split}")
    ctx.on_step(0, len(rows))
    model, tokenizer = load_checkpoint(ctx, source)
    records = score_rows(stage, model, tokenizer, rows, ctx.config.seed)
    ctx.on_step(len(rows), len(rows))
    metrics = val_metrics(records, stage.n)

    now = int(time.time() * 1000)
    ctx.tracker.client.log_batch(ctx.mlflow_run_id, metrics=[
        Metric(mlflow_metric_name(name), value, now, trained["global_step"], model_id=model_id, dataset_name=dv.name,
               dataset_digest=dv.version) for name, value in sorted(metrics.items())])
    if stage.samples:
        ctx.tracker.client.log_table(ctx.mlflow_run_id, data=samples_table(records, stage.samples, stage.n),
                                     artifact_file=SAMPLES_TABLE)
    ctx.report["eval"] = {"metrics": metrics, "rows": len(rows), "samples_table": SAMPLES_TABLE}
    return {"model_id": model_id, "checkpoint_uri": trained["checkpoint_uri"],
            "weights_sha256": trained["weights_sha256"], "global_step": trained["global_step"],
            "run_key": trained["run_key"], "metrics": metrics, "dataset_version": dv.version,
            "dataset": f"{key}:{split}", "eval_run_id": ctx.mlflow_run_id, "training_run_id": training}
