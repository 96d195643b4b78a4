"""An `rl` stage with `backend: verl_omni`, run: the recipe's command as a Ray Job through the verl
backend's machinery (omni_core.backends.verl: job.submit / follow, mirror.mirror_new / prepare_resume).

1. The model is staged (verl/export.stage_model: `s3://` downloaded once, `tiny://` copied, a hub id as
   is) and the dataset version exported in the layout the recipe reads (export.export_for_recipe, on the
   shared path; BAGEL's prompts pre-tokenized with the staged model's tokenizer; an imported entry point
   gets the store's verl Parquet, verl/export.export_dataset).
2. The recipe is rendered with those paths (stage.recipe_command): `trainer.logger=["console","mlflow"]`,
   `trainer.default_local_dir = shared_dir/runs/{pipeline}/{run_key}/{stage}/checkpoints` (absolute).
3. Before a (re)submission, mirror.prepare_resume puts the latest mirrored checkpoint back on a
   shared path that lost it; job.submit to `ray.address` (submission id `omni-verl-{pipeline}-{stage}-
   {run_key}`, `-attempt-N` after a failed one) with the script's exported variables
   (VERL_USE_EXTERNAL_MODULES=verl_omni, ...), MLFLOW_TRACKING_URI / MLFLOW_RUN_ID and the forwarded
   credentials in its runtime env.
4. job.follow tails the log into progress and mirrors each committed `global_step_N` to the store.
5. The result is what the recipe's last checkpoint holds (`final_weights`): a LoRA adapter
   (`actor/lora_adapter/*.safetensors`, PEFT format: the LoRA recipes, diffusion ones included), else
   a Hugging Face / diffusers folder (`actor/huggingface/`). A LoRA checkpoint of FSDP shards only
   (`actor/lora_train_meta.json`) gets VeRL-Omni's own `export_fsdp_lora_adapter` as a second Ray Job
   (what its DPO judge script does) into `actor/lora_adapter/`; a full fine-tune's shards go through
   verl's model merger as for backend verl. The mirrored checkpoint's manifest is written again (last)
   naming the weights. Not run here: the entry points need GPUs (or NPUs) and vLLM-Omni.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_core.backends.verl import export, mirror
from omni_core.backends.verl.job import follow, job_status, log_tail, submit
from omni_core.backends.verl.runner import VerlJobError, commit_merged, job_client, merge_checkpoint
from omni_core.backends.verl_omni.export import RECIPE_LAYOUTS, export_for_recipe
from omni_core.backends.verl_omni.render import split_override
from omni_core.backends.verl_omni.stage import (
    CHECKPOINTS,
    given_files,
    job_env,
    model_for,
    paths_for,
    recipe_command,
)
from omni_core.errors import ConfigError
from omni_core.storage import Store
from omni_core.training.checkpoint import MANIFEST, checkpoint_prefix, latest_checkpoint, stage_prefix

# what a recipe's checkpoint holds as its trained model, in the order looked for
LORA_ADAPTER = "lora_adapter"
WEIGHTS = ((f"{LORA_ADAPTER}/", "peft_lora"), ("huggingface/", "huggingface"))
MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([^']+)'")


def total_steps(overrides: list[str]) -> int | None:
    """`trainer.total_training_steps` of the rendered command (the last one wins), or None (epochs)."""
    found = None
    for item in overrides:
        _, key, value = split_override(item)
        if key == "trainer.total_training_steps" and value.strip().isdigit():
            found = int(value)
    return found


def final_weights(files: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(path of the weights file, model format) in a mirrored checkpoint's files, or None."""
    paths = [f["path"] for f in files]
    for marker, model_format in WEIGHTS:
        found = sorted(p for p in paths if marker in p and p.endswith(".safetensors"))
        if found:
            return found[0], model_format
    return None


def explain_failure(log: str, python: str) -> str:
    """One line on why the job failed where the log says it plainly (a module the job's python lacks)."""
    missing = MISSING_MODULE.findall(log)
    if missing:
        return (f"the job's python ({python}) cannot import {missing[-1]!r}: the Ray nodes must run the CUDA or "
                "Ascend image (infra/docker), which installs verl-omni, vLLM-Omni and the recipes' reward "
                "dependencies, or backend.python must name an interpreter that has them")
    return "see the log tail below"


def _inputs(stage: Any, store: Store, dataset: str, version: str, split: str, seed: int) -> tuple[list, list, str]:
    """(train files, val files, model path) staged on the shared path."""
    backend = stage.backend
    model = export.stage_model(model_for(stage), backend.shared_dir, seed=seed)
    if backend.recipe and backend.recipe not in RECIPE_LAYOUTS and given_files(stage, "data.train_files"):
        train, val = given_files(stage, "data.train_files"), given_files(stage, "data.val_files")  # not exported
    elif backend.recipe:  # BAGEL's prompts are pre-tokenized with the staged model's tokenizer
        exported = export_for_recipe(store, dataset, version, backend.shared_dir, backend.recipe, tokenizer=model)
        train, val = exported.train_files, exported.val_files
    else:  # an imported entry point: the store's verl Parquet
        shards = export.export_dataset(store, dataset, version, backend.shared_dir, "rl")
        train = shards.files.get(split, [])
        val = shards.files.get("test") or shards.files.get("validation") or []
    if not train:
        raise ConfigError(f"stages.{stage.name}.data: dataset {dataset}@{version} has no {split} split to train on")
    return train, val, model


def run_verl_omni_stage(*, pipeline: str, stage: Any, seed: int, store: Store, dataset: str, version: str,
                        split: str, run_key: str, ray_address: str, tracking_uri: str | None,
                        mlflow_run_id: str | None, tracker: Any = None, progress: Callable[[str], None] = print,
                        on_step: Callable[[int, int], None] = lambda step, total: None, log_dir: str | Path,
                        poll_s: float = 1.0, timeout_s: float | None = None) -> dict[str, Any]:
    """Train `stage` with its VeRL-Omni recipe (module docstring); returns the final checkpoint's manifest
    plus `reused` and `submission_id`. A job that ends without its checkpoint raises VerlJobError (the
    stage's retry resubmits it and it resumes from the mirror)."""
    backend = stage.backend
    root = stage_prefix(pipeline, run_key, stage.name)
    train, val, model = _inputs(stage, store, dataset, version, split, seed)
    run_dir = backend.run_dir(pipeline, run_key, stage.name)
    cmd = recipe_command(stage, paths_for(stage, pipeline=pipeline, run_key=run_key, model=model, train_files=train,
                                          val_files=val))
    total = total_steps(cmd.overrides)
    done = latest_checkpoint(store, root)
    if done is not None and done.get("weights") and (total is None or done["global_step"] >= total) \
            and stage.checkpoint.resume_mode != "disable":
        progress(f"stage {stage.name}: checkpoint for run key {run_key} already committed; nothing to do")
        return {**done, "reused": True}
    ckpt_dir = run_dir / CHECKPOINTS
    if stage.checkpoint.resume_mode == "auto":
        resumed = mirror.prepare_resume(ckpt_dir, store, root)
        if resumed is not None:
            progress(f"stage {stage.name}: the recipe resumes from global_step_{resumed}")
    client = job_client(ray_address)
    env = job_env(cmd, tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id)
    job = submit(client, cmd, pipeline=pipeline, stage=stage.name, run_key=run_key, env=env,  # type: ignore[arg-type]
                 resources=dict(backend.entrypoint_resources or {}))
    progress(f"stage {stage.name}: VeRL-Omni recipe {cmd.recipe} as Ray Job {job.submission_id} "
             f"({'submitted' if job.submitted else job.status}) on {ray_address}")
    if tracker is not None and mlflow_run_id:
        tracker.set_tags(mlflow_run_id, {"omni.backend": "verl_omni", "omni.verl_omni.recipe": cmd.recipe,
                                         "omni.verl.submission_id": job.submission_id,
                                         "omni.verl.command": cmd.entrypoint[:5000]})
        tracker.log_dict(mlflow_run_id, {"entrypoint": cmd.entrypoint, "argv": cmd.argv, "overrides": cmd.overrides,
                                         "env": cmd.env, "substituted": cmd.substituted,
                                         "submission_id": job.submission_id}, "verl/command.json")

    def on_progress(line: str) -> None:
        progress(f"stage {stage.name}: {line}")
        if total and (match := re.match(r"step (\d+) of", line)):
            on_step(min(int(match.group(1)), total), total)

    keep = stage.checkpoint.max_to_keep
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{job.submission_id}.log"
    status = follow(client, job.submission_id, total_steps=total or 0, progress=on_progress, poll_s=poll_s,
                    on_poll=lambda: mirror.mirror_new(ckpt_dir, store, root, keep=keep), log_path=log_path,
                    timeout_s=timeout_s)
    if tracker is not None and mlflow_run_id and log_path.exists():
        tracker.client.log_artifact(mlflow_run_id, str(log_path), "verl")
    mirror.mirror_new(ckpt_dir, store, root, keep=keep)
    if status != "SUCCEEDED":
        log = log_path.read_text() if log_path.exists() else ""
        raise VerlJobError(f"stage {stage.name}: VeRL-Omni job {job.submission_id} ended {status}: "
                           f"{explain_failure(log, cmd.python)}. A retry resubmits it and resumes from the last "
                           f"mirrored checkpoint. Log tail:\n{log_tail(log)}")
    step = mirror.local_latest(ckpt_dir)
    if step is None or (total is not None and step < total):
        raise VerlJobError(f"stage {stage.name}: VeRL-Omni job {job.submission_id} succeeded but its latest checkpoint "
                           f"is step {step}, not {total} (is trainer.save_freq overridden?)")
    return {**_commit_final(store, root, step, ckpt_dir, client, cmd, job.submission_id, env, poll_s, progress,
                            model=model), "reused": False, "submission_id": job.submission_id}


def _helper_job(client: Any, entry: str, job_id: str, env: dict[str, Any], poll_s: float) -> tuple[str, str]:
    """Run `entry` as a Ray Job `job_id` (resubmitted after a failed one); (status, log)."""
    status = job_status(client, job_id)
    if status in (None, "FAILED", "STOPPED"):
        if status is not None:
            client.delete_job(job_id)
        client.submit_job(entrypoint=entry, submission_id=job_id, runtime_env=env, entrypoint_num_cpus=1)
    status = follow(client, job_id, total_steps=0, progress=lambda _: None, poll_s=poll_s)
    return status, client.get_job_logs(job_id)


def _export_lora(client: Any, cmd: Any, actor: Path, model: str, job_id: str, env: dict[str, Any], poll_s: float,
                 progress: Callable[[str], None]) -> Path:
    """VeRL-Omni's own `export_fsdp_lora_adapter` as a Ray Job: FSDP shards with `lora_train_meta.json` ->
    `actor/lora_adapter/` (PEFT `adapter_config.json` + `adapter_model.safetensors`)."""
    target = actor / LORA_ADAPTER
    code = ("from verl_omni.utils.fsdp_utils import export_fsdp_lora_adapter; "
            f"export_fsdp_lora_adapter({str(actor)!r}, {str(target)!r}, {model!r})")
    export_id = f"{job_id}-lora-{actor.parent.name}"
    progress(f"exporting the LoRA adapter of {actor.parent.name} (Ray Job {export_id})")
    status, log = _helper_job(client, shlex.join([cmd.python, "-c", code]), export_id, env, poll_s)
    if status != "SUCCEEDED" or not (target / "adapter_model.safetensors").is_file():
        raise VerlJobError(f"VeRL-Omni's LoRA export ({export_id}) ended {status}: {log_tail(log)}")
    return target


def _commit_final(store: Store, root: str, step: int, ckpt_dir: Path, client: Any, cmd: Any, job_id: str,
                  env: dict[str, Any], poll_s: float, progress: Callable[[str], None],
                  model: str = "") -> dict[str, Any]:
    """The mirrored final checkpoint's manifest, written again (last) naming the trained weights: a LoRA
    adapter or Hugging Face folder the checkpoint holds; else VeRL-Omni's LoRA export of the FSDP shards
    (a LoRA training: `actor/lora_train_meta.json`), or verl's model merger (a full fine-tune)."""
    prefix = checkpoint_prefix(root, step)
    manifest = store.read_json(f"{prefix}/{MANIFEST}")
    extra = {"submission_id": job_id, "recipe": cmd.recipe}
    found = final_weights(manifest["files"])
    step_dir = ckpt_dir / f"global_step_{step}"
    actor = step_dir / "actor" if (step_dir / "actor").is_dir() else step_dir
    if found is None and (actor / "lora_train_meta.json").is_file():
        target = _export_lora(client, cmd, actor, model, job_id, env, poll_s, progress)
        rels = sorted(p.relative_to(step_dir).as_posix() for p in target.rglob("*") if p.is_file())
        added = [mirror._upload(store, step_dir, prefix, rel) for rel in rels]
        manifest = {**manifest, "files": [f for f in manifest["files"] if f["path"] not in set(rels)] + added}
        found = final_weights(manifest["files"])
    if found is None:  # FSDP shards only (a full fine-tune): verl's model merger, as for backend verl
        merge_checkpoint(client, cmd, actor, job_id, env, poll_s, progress)
        return commit_merged(store, root, step, actor / "merged", extra)
    weights, model_format = found
    manifest = {**manifest, **extra, "weights": weights, "model_format": model_format}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)  # the commit point, again
    return manifest
