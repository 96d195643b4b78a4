"""An `sft` / `rl` stage with `backend: verl`, run: stage the inputs on the shared path, submit verl's
command as a Ray Job, follow it while mirroring its checkpoints to the store, then commit the final
model as our checkpoint.

1. The dataset version is exported (export.export_dataset, content-addressed) and the model staged
   (export.stage_model) under `backend.shared_dir`.
2. Before every (re)submission with resume_mode auto, `mirror.prepare_resume` puts the latest mirrored
   checkpoint back on a shared path that lost it (a new cluster) or refuses a stranded one (verl #7952).
3. `job.submit` to `ray.address` with the deterministic submission id (a retry after a failed attempt
   is `-attempt-N`), MLflow's URI and the stage's child run id in the runtime env (verl's own mlflow
   logger writes `train/loss` into it), credentials forwarded by name.
4. `job.follow` turns verl's `step:N` lines into progress and the stage's step count, keeps the log
   (logged as the MLflow artifact `verl/job.log`) and mirrors each committed `global_step_N`.
5. The result, by `backend.hf_model`. `save` (default): verl's trainer writes the full weights into
   `global_step_N/huggingface/` at every save (`checkpoint.save_contents` with `hf_model`; its FSDP
   checkpoint manager gathers them on rank 0), next to config and tokenizer; that folder of the final
   step is the model. `merge`: verl 0.9.1's checkpoint then holds only FSDP shards
   (`model_world_size_W_rank_R.pt`) and config/tokenizer in `huggingface/`, so a second Ray Job runs
   `python -m verl.model_merger merge --backend fsdp` (the cluster's verl, on the shared path) into
   `global_step_N/merged/` after the final step (a new interpreter importing torch and verl: seconds
   here, but each save stays shards only). Either folder's files are added at the top of the mirrored
   checkpoint folder and the manifest is written again (last) with `weights: model.safetensors`: the
   folder is then a Hugging Face model (what `eval` loads, `omni verify` checks and the registry points
   at) and still verl's resume point. The training run is tagged with verl's version (printed by the
   job's entry point before torchrun, `render.version_probe`), the submission id and the rendered command.
"""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omni_core.backends.verl import export, mirror
from omni_core.backends.verl.job import (
    entrypoint_resources,
    follow,
    job_status,
    log_tail,
    runtime_env,
    submit,
)
from omni_core.backends.verl.render import PPO_MODULE, VERSION_PREFIX, version_probe
from omni_core.backends.verl.stage import command, layout, response_field
from omni_core.errors import ConfigError
from omni_core.storage import Store
from omni_core.training.checkpoint import MANIFEST, checkpoint_prefix, latest_checkpoint, stage_prefix

MERGED = "merged"
HF_DIR = "huggingface"  # verl's own Hugging Face save (checkpoint.save_contents with hf_model)
VERSION_LINE = re.compile(rf"^{VERSION_PREFIX}(\d\S*)$", re.MULTILINE)


class VerlJobError(RuntimeError):
    """verl's job ended without the trained checkpoint (failed, stopped, or too few steps). Not an
    OmniError: the orchestrator retries it (a lost node, a killed trainer), resuming from the mirror."""


def job_client(address: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def run_verl_stage(*, pipeline: str, stage: Any, seed: int, store: Store, dataset: str, version: str, split: str,
                   run_key: str, ray_address: str, tracking_uri: str | None, mlflow_run_id: str | None,
                   tracker: Any = None, progress: Callable[[str], None] = print,
                   on_step: Callable[[int, int], None] = lambda step, total: None, log_dir: str | Path,
                   poll_s: float = 1.0, timeout_s: float | None = None,
                   timings: dict[str, float] | None = None) -> dict[str, Any]:
    """Train `stage` with verl (module docstring); returns the final checkpoint's manifest plus
    `reused`, `submission_id` and `verl_version`. `timings`, when given, gets the seconds of each phase
    (export, model, resume, submit, follow, mirror_during_job, mirror_final, merge, commit; bench/)."""
    timings = {} if timings is None else timings

    @contextmanager
    def timed(phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start

    backend = stage.backend
    total = stage.trainer.total_steps
    root = stage_prefix(pipeline, run_key, stage.name)
    done = latest_checkpoint(store, root)
    if done is not None and done["global_step"] >= total and done.get("weights") \
            and stage.checkpoint.resume_mode != "disable":
        progress(f"stage {stage.name}: checkpoint for run key {run_key} already committed; nothing to do")
        return {**done, "reused": True}
    with timed("export"):
        exported = export.export_dataset(store, dataset, version, backend.shared_dir, layout(stage),  # type: ignore[arg-type]
                                         response_field=response_field(stage) or "extra_info.answer")
    if split not in exported.files:
        raise ConfigError(f"stages.{stage.name}.data: dataset {dataset}@{version} has no split {split!r}")
    with timed("model"):
        model = export.stage_model(stage.model_uri, backend.shared_dir, seed=seed)
    cmd = command(stage, pipeline=pipeline, run_key=run_key, model=model, train_files=exported.files[split], seed=seed)
    run_dir = Path(cmd.default_local_dir)
    if stage.checkpoint.resume_mode == "auto":
        with timed("resume"):
            resumed = mirror.prepare_resume(run_dir, store, root)
        if resumed is not None:
            progress(f"stage {stage.name}: verl resumes from global_step_{resumed}")
    with timed("submit"):
        client = job_client(ray_address)
        env = runtime_env(cmd, tracking_uri=tracking_uri, mlflow_run_id=mlflow_run_id)
        resources = dict(backend.entrypoint_resources) if backend.entrypoint_resources is not None \
            else entrypoint_resources(cmd, backend.n_gpus_per_node, backend.device)
        job = submit(client, cmd, pipeline=pipeline, stage=stage.name, run_key=run_key, env=env, resources=resources)
    progress(f"stage {stage.name}: Ray Job {job.submission_id} ({'submitted' if job.submitted else job.status}) "
             f"on {ray_address}")
    if tracker is not None and mlflow_run_id:
        tracker.set_tags(mlflow_run_id, {"omni.backend": "verl", "omni.verl.submission_id": job.submission_id,
                                         "omni.verl.command": cmd.entrypoint[:5000]})
        tracker.log_dict(mlflow_run_id, {"entrypoint": cmd.entrypoint, "argv": cmd.argv, "overrides": cmd.overrides,
                                         "submission_id": job.submission_id}, "verl/command.json")

    def on_progress(line: str) -> None:
        progress(f"stage {stage.name}: {line}")
        if match := re.match(r"step (\d+) of", line):
            on_step(min(int(match.group(1)), total), total)

    keep = stage.checkpoint.max_to_keep
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{job.submission_id}.log"
    def mirror_while_running() -> None:
        with timed("mirror_during_job"):
            mirror.mirror_new(run_dir, store, root, keep=keep)

    with timed("follow"):
        status = follow(client, job.submission_id, total_steps=total, progress=on_progress, poll_s=poll_s,
                        on_poll=mirror_while_running, log_path=log_path, timeout_s=timeout_s)
    if tracker is not None and mlflow_run_id:
        tracker.client.log_artifact(mlflow_run_id, str(log_path), "verl")
    with timed("mirror_final"):
        mirror.mirror_new(run_dir, store, root, keep=keep)
    if status != "SUCCEEDED":
        tail = log_tail(log_path.read_text()) if log_path.exists() else ""
        raise VerlJobError(f"stage {stage.name}: verl job {job.submission_id} ended {status}; a retry resubmits it "
                           f"and resumes from the last mirrored checkpoint. Log tail:\n{tail}")
    step = mirror.local_latest(run_dir)
    if step is None or step < total:
        raise VerlJobError(f"stage {stage.name}: verl job {job.submission_id} succeeded but its latest checkpoint is "
                           f"step {step}, not {total} (is trainer.save_freq overridden?)")
    step_dir = run_dir / f"global_step_{step}"
    # main_ppo saves the actor's shards and Hugging Face folder under global_step_N/actor/
    actor_dir = step_dir / "actor" if cmd.module == PPO_MODULE else step_dir
    found = VERSION_LINE.search(log_path.read_text()) if log_path.exists() else None
    verl_version = found.group(1) if found else "unknown"
    if backend.hf_model == "merge":
        with timed("merge"):
            merged_version = merge_checkpoint(client, cmd, step_dir, job.submission_id, env, poll_s, progress,
                                              shards_dir=actor_dir)
        verl_version = verl_version if found else merged_version
        hf_dir = step_dir / MERGED
    else:
        hf_dir = actor_dir / HF_DIR
        if not any(hf_dir.glob("*.safetensors")):
            raise ConfigError(f"stages.{stage.name}: verl saved no weights in {hf_dir} although backend.hf_model is "
                              "save (checkpoint.save_contents lacks hf_model: is it overridden in backend.overrides?); "
                              "remove that override or set backend.hf_model: merge")
    with timed("commit"):
        manifest = commit_merged(store, root, step, hf_dir,
                                  {"submission_id": job.submission_id, "verl_version": verl_version})
    if tracker is not None and mlflow_run_id:
        tracker.set_tags(mlflow_run_id, {"omni.verl.version": verl_version})
    return {**manifest, "reused": False, "submission_id": job.submission_id, "verl_version": verl_version}


def merge_checkpoint(client: Any, cmd: Any, step_dir: Path, job_id: str, env: dict[str, Any], poll_s: float,
           progress: Callable[[str], None], shards_dir: Path | None = None) -> str:
    """verl's model merger as a Ray Job: FSDP shards (in `shards_dir`, default step_dir) -> step_dir/merged
    (a Hugging Face folder)."""
    python = cmd.argv[0]
    merge = [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(shards_dir or step_dir),
             "--target_dir", str(step_dir / MERGED)]
    entry = f"{shlex.join(version_probe(python))} && {shlex.join(merge)}"
    merge_id = f"{job_id}-merge-{step_dir.name}"
    status = job_status(client, merge_id)
    if status in (None, "FAILED", "STOPPED"):
        if status is not None:
            client.delete_job(merge_id)
        client.submit_job(entrypoint=entry, submission_id=merge_id, runtime_env=env, entrypoint_num_cpus=1)
    progress(f"merging {step_dir.name} into a Hugging Face folder (Ray Job {merge_id})")
    status = follow(client, merge_id, total_steps=0, progress=lambda _: None, poll_s=poll_s)
    logs = client.get_job_logs(merge_id)
    if status != "SUCCEEDED" or not (step_dir / MERGED / "config.json").is_file():
        raise VerlJobError(f"verl's model merger ({merge_id}) ended {status}: {log_tail(logs)}")
    found = VERSION_LINE.search(logs)
    return found.group(1) if found else "unknown"


def commit_merged(store: Store, root: str, step: int, merged: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Add the merged Hugging Face files at the top of the mirrored checkpoint and commit its manifest again."""
    prefix = checkpoint_prefix(root, step)
    manifest = store.read_json(f"{prefix}/{MANIFEST}")
    rels = sorted(p.relative_to(merged).as_posix() for p in merged.rglob("*") if p.is_file())
    added = [mirror._upload(store, merged, prefix, rel) for rel in rels]
    kept = [f for f in manifest["files"] if f["path"] not in set(rels) and not f["path"].startswith(f"{MERGED}/")]
    weights = next((r for r in rels if r.endswith(".safetensors")), None)
    if weights is None:
        raise VerlJobError(f"verl's model merger wrote no .safetensors into {merged}")
    manifest = {**manifest, **extra, "files": kept + added, "weights": weights, "model_format": "huggingface"}
    store.write_json(f"{prefix}/{MANIFEST}", manifest)  # the commit point, again
    return manifest
