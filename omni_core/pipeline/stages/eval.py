"""Stage kind `eval`: score an upstream rl or sft stage's checkpoint on a dataset split, in a Ray task
with the stage's `resources` on the pipeline's Ray (`omni_core.evaluation`); this process only builds
the job and logs the result.

What is scored depends on the checkpoint and the split: a language model's responses to prompt rows
(our batched rollout engine; greedy by default) or a diffusion model's images (our diffusion engine,
the trained stage's sampler settings, ODE by default), scored by the dataset's reward: verl's
`val/reward_mean` and `val-core/{data_source}/reward/mean@{n}` (spelled `mean_at_{n}` in MLflow, which
refuses `@`, as verl's MLflow logger does); a preference model on held-out pairs against its
reference: TRL's `eval_rewards/*`, `eval_logps/*`, `eval_loss`. With `baseline: true` the trained
stage's starting model is scored on the same rows and seeds too: `{metric}_baseline` and
`{metric}_gain` for each metric (its scores cached in the store by its weights digest).

On the stage's MLflow run: the metrics, each linked to the checkpoint's logged model and the dataset
version (MLflow 3 model metrics), the dataset version as an `eval` input, the first `samples` rows as
the table `eval_samples.json` (candidate and baseline side by side), a diffusion checkpoint's image
grid (`eval_grid.png`, also a file of the stage's record for the Prefect artifact), and where the task
ran (`omni.eval.node_id`, `omni.eval.pid`, `omni.eval.task_id`).

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

from omni_core.config.algorithms import pair_converters
from omni_core.config.models import TRAINING_KINDS, EvalStage, RLStage, upstream_stage
from omni_core.data import load_version
from omni_core.errors import ConfigError
from omni_core.lineage import log_dataset_version
from omni_core.media_limits import MediaLimits, check_rows
from omni_core.pipeline.stages import register_stage
from omni_core.pipeline.stages.rl import dataset_for, input_dataset
from omni_core.rewards.registry import custom_reward_file
from omni_core.storage import file_sha256

SAMPLES_TABLE = "eval_samples.json"
GRID_IMAGE = "eval_grid.png"
TRAINER = "trainer"  # the kind of an `engine: trainer` eval: the trained stage's own validation
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


class _SourceContext:
    """What `resolved_stage` reads of a stage context, for the trained stage an eval scores."""

    def __init__(self, stage: RLStage, upstream: dict[str, Any]):
        self.stage, self.upstream = stage, upstream


def reward_file(stage: EvalStage) -> Path | None:
    return custom_reward_file(stage.reward.name) if stage.reward is not None else None


def absolute_reward(spec: str | None) -> str | None:
    """A custom `path.py:function` reward with its path made absolute: the job runs as a Ray task, or a Ray
    Job on a cluster's job server, whose working directory is not this process's."""
    path = custom_reward_file(spec)
    return f"{path.resolve()}:{spec.rpartition(':')[2]}" if path is not None and spec else spec


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



def eval_kind(ctx: Any, source: RLStage) -> str:
    from omni_core.evaluation.job import IMAGES, PAIRS, TEXT
    from omni_core.training.algorithms import DIFFUSION_MODEL

    if ctx.config.datasets[ctx.stage.split()[0]].converter in pair_converters():
        return PAIRS
    return IMAGES if source.record.model_kind == DIFFUSION_MODEL else TEXT


def trained_stage(ctx: Any, source: Any) -> RLStage:
    """The trained stage with `model: {from: STAGE}` resolved to the checkpoint it started from."""
    from omni_core.pipeline.stages.rl import resolved_stage

    rl: RLStage = ctx.config.stage(source.name)
    return rl if isinstance(rl.model, str) else resolved_stage(_SourceContext(rl, dict(ctx.upstream)))


def model_specs(ctx: Any, source: Any) -> tuple[Any, Any]:
    """(the checkpoint, the trained stage's starting model) as `ModelSpec`s. A full checkpoint is a model
    folder like any other; a LoRA one holds only the adapter (adapter_config.json and
    adapter_model.safetensors; an SD3 model's under transformer/): its stage's base model with them."""
    from omni_core.evaluation.job import ModelSpec
    from omni_core.training.checkpoint import checkpoint_prefix, stage_prefix

    trained = source.outputs
    rl = trained_stage(ctx, source)
    folder = checkpoint_prefix(stage_prefix(ctx.config.name, trained["run_key"], source.name), trained["global_step"])
    start = ModelSpec(rl.model_uri, seed=ctx.config.seed, adapter=rl.adapter, adapter_stage=rl.adapter_stage,
                      weights_sha256=None if isinstance(rl.model, str) else rl.model.weights_sha256)
    lora = rl.lora.model_dump() if rl.lora is not None else None
    manifest = ctx.store.read_json(f"{folder}/_manifest.json") if ctx.store.exists(f"{folder}/_manifest.json") else {}
    named = manifest.get("weights") or ""  # a backend's export may keep its adapter elsewhere (actor/lora_adapter/)
    candidates = [f"{folder}/{named}"] if named.endswith("adapter_model.safetensors") else []
    for adapter in (*candidates, f"{folder}/adapter_model.safetensors", f"{folder}/transformer/adapter_model.safetensors"):
        if ctx.store.exists(adapter):
            lora = lora or adapter_lora(ctx.store, adapter)
            return ModelSpec(rl.model_uri, seed=ctx.config.seed, adapter=rl.adapter, adapter_stage=rl.adapter_stage,
                             lora=lora, adapter_key=adapter), start
    return ModelSpec(trained["checkpoint_uri"], seed=ctx.config.seed), start


def adapter_lora(store: Any, adapter: str) -> dict[str, Any] | None:
    """The LoRA settings a PEFT adapter was saved with (its adapter_config.json), for a stage whose own
    `lora:` is unset (a backend recipe's)."""
    config_key = adapter.rsplit("/", 1)[0] + "/adapter_config.json"
    if not store.exists(config_key):
        return None
    saved = store.read_json(config_key)
    targets = saved.get("target_modules")
    return {"rank": saved["r"], "alpha": saved.get("lora_alpha", saved["r"]),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets}


def build_job(ctx: Any, source: Any, rows: list[dict[str, Any]]) -> Any:
    from omni_core.evaluation.job import IMAGES, PAIRS, EvalJob

    stage: EvalStage = ctx.stage
    rl = ctx.config.stage(source.name)
    kind = eval_kind(ctx, rl)
    candidate, start = model_specs(ctx, source)
    reward = stage.reward.name if stage.reward is not None else None
    sampler: dict[str, Any] = {}
    if kind == IMAGES:
        algorithm = rl.algorithm
        reward = reward or rl.reward.name
        sampler = {"num_steps": stage.num_steps or getattr(algorithm, "num_steps", 10),
                   "guidance_scale": stage.guidance_scale or getattr(algorithm, "guidance_scale", 1.0),
                   "noise_level": stage.noise_level, "negative_prompt": getattr(algorithm, "negative_prompt", "")}
    if kind == PAIRS:
        options = rl.algorithm.model_dump(mode="json")
        sampler = {"options": {**options, **({"beta": stage.beta} if stage.beta else {})}}
    path = reward_file(stage)
    return EvalJob(kind=kind, candidate=candidate, rows=rows, seed=ctx.config.seed, store=ctx.store,
                   settings=stage.model_dump(mode="json"),
                   reward=absolute_reward(reward), reward_sha256=file_sha256(path) if path else None, sampler=sampler,
                   baseline=start if stage.baseline else None,
                   reference=start if kind == PAIRS and candidate.adapter_key is None else None)


def with_baseline(metrics: dict[str, float], baseline: dict[str, float]) -> dict[str, float]:
    """The candidate's metrics, each baseline metric as `{name}_baseline` and the candidate's gain over
    it as `{name}_gain`."""
    out = dict(metrics)
    for name, value in baseline.items():
        out[f"{name}_baseline"] = value
        if name in metrics:
            out[f"{name}_gain"] = metrics[name] - value
    return out


def prompt_text(row: dict[str, Any]) -> str:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt or [])


def _answer(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return str(value.get("content", "")) if isinstance(value, dict) else str(value or "")


def samples_table(kind: str, rows: list[dict[str, Any]], result: dict[str, Any], samples: int
                  ) -> dict[str, list[Any]]:
    """The first `samples` rows' records (every response of each), with the baseline's beside them."""
    from omni_core.evaluation.job import PAIRS

    kept = [r for r in result["records"] if r["row"] < samples]
    baseline = result.get("baseline", {}).get("records")
    table: dict[str, list[Any]] = {
        "data_source": [rows[r["row"]].get("data_source", "") for r in kept],
        "prompt": [prompt_text(rows[r["row"]]) for r in kept]}
    if kind == PAIRS:
        table["chosen"] = [_answer(rows[r["row"]], "chosen") for r in kept]
        table["rejected"] = [_answer(rows[r["row"]], "rejected") for r in kept]
        table["chosen_reward"] = [r["chosen_reward"] for r in kept]
        table["rejected_reward"] = [r["rejected_reward"] for r in kept]
    else:
        if "response" in (kept[0] if kept else {}):
            table["response"] = [r["response"] for r in kept]
        table["ground_truth"] = [str((rows[r["row"]].get("reward_model") or {}).get("ground_truth", "")) for r in kept]
    table["score"] = [r["score"] for r in kept]
    if baseline is not None:
        base = baseline[:len(kept)]
        if "response" in table:
            table["baseline_response"] = [r["response"] for r in base]
        table["baseline_score"] = [r["score"] for r in base]
    return table


def log_result(ctx: Any, result: dict[str, Any], metrics: dict[str, float], rows: list[dict[str, Any]],
               kind: str, trained: dict[str, Any], dv: Any) -> dict[str, Any]:
    """Metrics (linked to the logged model), samples table, image grid and where the task ran."""
    stage: EvalStage = ctx.stage
    model_id = trained.get("model_id")
    now = int(time.time() * 1000)
    logged = set(result.get("logged", ()))  # a trainer's validation logged these on this run itself
    ctx.tracker.client.log_batch(ctx.mlflow_run_id, metrics=[
        Metric(mlflow_metric_name(name), value, now, trained["global_step"], model_id=model_id, dataset_name=dv.name,
               dataset_digest=dv.version) for name, value in sorted(metrics.items()) if name not in logged])
    report: dict[str, Any] = {"metrics": metrics, "rows": len(rows), "kind": kind, "where": result["where"],
                              "timings": result["timings"]}
    if stage.samples and result.get("records"):
        ctx.tracker.client.log_table(ctx.mlflow_run_id, data=samples_table(kind, rows, result, stage.samples),
                                     artifact_file=SAMPLES_TABLE)
        report["samples_table"] = SAMPLES_TABLE
    if result.get("grid_png"):
        import io

        from PIL import Image

        key = ctx.file_key(GRID_IMAGE)
        ctx.store.write_bytes(key, result["grid_png"])
        ctx.tracker.client.log_image(ctx.mlflow_run_id, Image.open(io.BytesIO(result["grid_png"])),
                                     artifact_file=GRID_IMAGE)
        report["image_grid"] = {"key": key, "uri": ctx.store.uri(key), "artifact": GRID_IMAGE,
                                "images": min(stage.samples, len(rows)) * stage.n}
    if "baseline" in result:
        report["baseline"] = {"cached": result["baseline"]["cached"], "uri": result["baseline"]["cache_uri"],
                              "weights_sha256": result["baseline"]["weights_sha256"]}
    where = result["where"]
    ctx.tracker.set_tags(ctx.mlflow_run_id, {f"omni.eval.{k}": str(where.get(k, ""))
                                             for k in ("node_id", "task_id", "pid", "job_id")})
    return report


@register_stage("eval", version="1", inputs=eval_inputs, digest=eval_digest, reuse=log_reused,
                reads=lambda stage: [stage.split()[0]], volatile_config=frozenset({"batch_size", "resources"}))
def run_eval(ctx: Any) -> dict[str, Any]:
    from omni_core.evaluation.job import run_on_ray
    from omni_core.evaluation.ray_job import is_jobs_api, run_as_ray_job
    from omni_core.training.ray_env import is_local, start_ray

    stage: EvalStage = ctx.stage
    source = source_outcome(ctx, "checkpoint_from", TRAINING_KINDS)
    trained = source.outputs
    key, split, dv = input_dataset(ctx)
    rows = dv.rows(ctx.store, split)[stage.skip_rows:][:stage.max_rows]
    if not rows:
        raise ConfigError(f"stages.{stage.name}.data: split '{split}' of dataset '{key}' ({dv.version}) has no rows")
    check_rows(rows, MediaLimits.of(ctx.config.datasets.get(key)), f"stages.{stage.name}: {key}@{dv.version}:{split}")
    model_id = trained.get("model_id")
    training = ctx.tracker.client.get_logged_model(model_id).source_run_id if model_id else source.mlflow_run_id
    by_trainer = stage.engine == "trainer"
    job = None if by_trainer else build_job(ctx, source, rows)
    kind = TRAINER if job is None else job.kind
    log_dataset_version(ctx.tracker, ctx.mlflow_run_id, dv, context="eval")
    ctx.tracker.log_params(ctx.mlflow_run_id, {
        "checkpoint_from": source.name, "checkpoint_uri": trained["checkpoint_uri"], "seed": ctx.config.seed,
        "dataset": f"{key}@{dv.version}:{split}", "rows": len(rows), "n": stage.n, "greedy": stage.greedy,
        "max_new_tokens": stage.max_new_tokens, "kind": kind, "engine": stage.engine,
        "baseline": stage.baseline,
        **({} if job is None else {f"sampler.{k}": v for k, v in job.sampler.items() if k != "options"}),
        "reward": (job.reward if job is not None else None) or "by data_source"})
    ctx.tracker.set_tags(ctx.mlflow_run_id, {
        "omni.model_id": model_id or "", "omni.checkpoint_uri": trained["checkpoint_uri"],
        "omni.checkpoint_sha256": trained["weights_sha256"], "omni.run_key": trained["run_key"],
        "omni.training_run_id": training or "", "omni.eval_run_id": ctx.mlflow_run_id})

    if by_trainer:  # the trained stage's own validation, as its backend runs it (a Ray Job)
        from omni_core.backends import CheckpointValidation
        from omni_core.config.backends import backend_of

        rl = trained_stage(ctx, source)
        ctx.on_step(0, len(rows))
        result = backend_of(rl).validate(CheckpointValidation(ctx, rl, trained, key, split, dv))
        ctx.on_step(len(rows), len(rows))
        return eval_outputs(ctx, result, result["metrics"], rows, kind, trained, dv, model_id, training, key, split)

    resources = stage.task_resources()
    ctx.progress(f"stage {stage.name}: scoring {trained['checkpoint_uri']} (step {trained['global_step']}) "
                 f"on {len(rows)} rows of {key}:{split} ({job.kind}; a Ray task with "
                 f"{', '.join(f'{k} {v:g}' for k, v in resources.items())}"
                 f"{'; baseline: the starting model too' if stage.baseline else ''})")
    ctx.on_step(0, len(rows))
    name = f"omni-eval:{ctx.config.name}:{stage.name}"
    if is_jobs_api(ctx.config.ray.address):  # a cluster's Jobs API (as the verl backends use): a Ray Job
        result = run_as_ray_job(job, resources, name=name, address=ctx.config.ray.address, ray_config=ctx.config.ray,
                                store_root=ctx.store.root)
    else:
        start_ray(ctx.config.ray)
        result = run_on_ray(job, resources, name=name, local=is_local(ctx.config.ray))
    ctx.on_step(len(rows), len(rows))
    metrics = result["metrics"]
    if "baseline" in result:
        metrics = with_baseline(metrics, result["baseline"]["metrics"])
    return eval_outputs(ctx, result, metrics, rows, job.kind, trained, dv, model_id, training, key, split)


def eval_outputs(ctx: Any, result: dict[str, Any], metrics: dict[str, float], rows: list[dict[str, Any]], kind: str,
                 trained: dict[str, Any], dv: Any, model_id: str | None, training: str | None, key: str,
                 split: str) -> dict[str, Any]:
    ctx.report["eval"] = log_result(ctx, result, metrics, rows, kind, trained, dv)
    return {"model_id": model_id, "checkpoint_uri": trained["checkpoint_uri"],
            "weights_sha256": trained["weights_sha256"], "global_step": trained["global_step"],
            "run_key": trained["run_key"], "metrics": metrics, "dataset_version": dv.version,
            "dataset": f"{key}:{split}", "eval_run_id": ctx.mlflow_run_id, "training_run_id": training,
            "kind": kind}
