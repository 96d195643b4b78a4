"""An `rl` stage with `backend: verl_omni`, run: the recipe's command as a Ray Job through the shared job
skeleton (omni_core.backends.jobs: runner.run_job, job.submit / follow, mirror.mirror_new / prepare_resume).

1. The model is staged (jobs/export.stage_model: `s3://` downloaded once, `tiny://` copied, a hub id as
   is) and the dataset version exported in the layout the recipe reads (export.export_for_recipe, on the
   shared path; BAGEL's prompts pre-tokenized with the staged model's tokenizer; an imported entry point
   gets the store's verl Parquet, jobs/export.export_dataset).
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

from omni_core.backends.jobs import export, mirror
from omni_core.backends.jobs.job import log_tail, run_helper_job
from omni_core.backends.jobs.runner import (
    FinishedJob,
    JobError,
    JobInputs,
    PreparedJob,
    Timed,
    commit_hf_folder,
    merge_fsdp_checkpoint,
    run_job,
)
from omni_core.backends.verl_omni.export import RECIPE_LAYOUTS, export_for_recipe
from omni_core.backends.verl_omni.render import split_override
from omni_core.backends.verl_omni.stage import (
    CHECKPOINTS,
    METRICS,
    given_files,
    job_env,
    model_for,
    paths_for,
    recipe_command,
)
from omni_core.errors import ConfigError
from omni_core.storage import Store
from omni_core.training.checkpoint import MANIFEST, checkpoint_prefix

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


def planned_total_steps(stage: Any) -> int | None:
    """`trainer.total_training_steps` the recipe's command will have (rendered with placeholder paths)."""
    placeholder = str(Path(stage.backend.shared_dir) / "datasets" / "DATASET" / "VERSION")
    cmd = recipe_command(stage, paths_for(stage, pipeline="PIPELINE", run_key="RUN_KEY", model="MODEL",
                                          train_files=[f"{placeholder}/train.parquet"],
                                          val_files=[f"{placeholder}/test.parquet"]))
    return total_steps(cmd.overrides)


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


class RecipeTrainer:
    """What backend verl_omni adds to the job skeleton (omni_core.backends.jobs.runner.JobTrainer)."""

    label = "VeRL-Omni"
    resumes = "the recipe"

    def total_steps(self, inputs: JobInputs) -> int | None:
        return planned_total_steps(inputs.stage)

    def prepare(self, inputs: JobInputs, timed: Timed) -> PreparedJob:
        stage = inputs.stage
        with timed("export"):
            train, val, model = _inputs(stage, inputs.store, inputs.dataset, inputs.version, inputs.split, inputs.seed)
        run_dir = stage.backend.run_dir(inputs.pipeline, inputs.run_key, stage.name)
        cmd = recipe_command(stage, paths_for(stage, pipeline=inputs.pipeline, run_key=inputs.run_key, model=model,
                                              train_files=train, val_files=val))
        return PreparedJob(
            command=cmd, env=job_env(cmd), metrics_dir=run_dir / METRICS,
            resources=dict(stage.backend.entrypoint_resources or {}), checkpoints=run_dir / CHECKPOINTS,
            announce=f"VeRL-Omni recipe {cmd.recipe} as Ray Job",
            tags={"omni.backend": "verl_omni", "omni.verl_omni.recipe": cmd.recipe},
            record={"entrypoint": cmd.entrypoint, "argv": cmd.argv, "overrides": cmd.overrides, "env": cmd.env,
                    "substituted": cmd.substituted}, model=model)

    def required_metrics(self, inputs: JobInputs) -> tuple[str, ...]:
        return ()  # a recipe's metrics are its own (diffusion, DPO, omni RL): relayed, not required by name

    def before_submit(self, client: Any, prepared: PreparedJob, inputs: JobInputs) -> None:
        return None  # its packages (verl_omni, vLLM-Omni) are the CUDA image's; explain_failure names what is missing

    def explain_failure(self, log: str, prepared: PreparedJob) -> str:
        return f": {explain_failure(log, prepared.command.python)}"  # type: ignore[attr-defined]

    def finish(self, done: FinishedJob, timed: Timed) -> dict[str, Any]:
        inputs = done.inputs
        with timed("commit"):
            return _commit_final(inputs.store, inputs.root, done.step, done.prepared.checkpoints, done.client,
                                 done.prepared.command, done.submission_id, done.prepared.env, inputs.poll_s,
                                 inputs.progress, model=done.prepared.model)


def run_verl_omni_stage(**inputs: Any) -> dict[str, Any]:
    """Train `stage` with its VeRL-Omni recipe (module docstring); returns the final checkpoint's manifest
    plus `reused` and `submission_id`. Keywords: `JobInputs`'s fields. A job that ends without its
    checkpoint raises JobError (the stage's retry resubmits it and it resumes from the mirror)."""
    return run_job(JobInputs(**inputs), RecipeTrainer())


def _export_lora(client: Any, cmd: Any, actor: Path, model: str, job_id: str, env: dict[str, Any], poll_s: float,
                 progress: Callable[[str], None]) -> Path:
    """VeRL-Omni's own `export_fsdp_lora_adapter` as a Ray Job: FSDP shards with `lora_train_meta.json` ->
    `actor/lora_adapter/` (PEFT `adapter_config.json` + `adapter_model.safetensors`)."""
    target = actor / LORA_ADAPTER
    code = ("from verl_omni.utils.fsdp_utils import export_fsdp_lora_adapter; "
            f"export_fsdp_lora_adapter({str(actor)!r}, {str(target)!r}, {model!r})")
    export_id = f"{job_id}-lora-{actor.parent.name}"
    progress(f"exporting the LoRA adapter of {actor.parent.name} (Ray Job {export_id})")
    status, log = run_helper_job(client, shlex.join([cmd.python, "-c", code]), export_id, env, poll_s)
    if status != "SUCCEEDED" or not (target / "adapter_model.safetensors").is_file():
        raise JobError(f"VeRL-Omni's LoRA export ({export_id}) ended {status}: {log_tail(log)}")
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
        added = [mirror.upload_file(store, step_dir, prefix, rel) for rel in rels]
        manifest = {**manifest, "files": [f for f in manifest["files"] if f["path"] not in set(rels)] + added}
        found = final_weights(manifest["files"])
    if found is None:  # FSDP shards only (a full fine-tune): verl's model merger, as for backend verl
        merge_fsdp_checkpoint(client, cmd.argv[0], actor, job_id, env, poll_s, progress)
        return commit_hf_folder(store, root, step, actor / "merged", extra)
    weights, model_format = found
    manifest = {**manifest, **extra, "weights": weights, "model_format": model_format}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)  # the commit point, again
    return manifest
