"""An `sft` / `rl` stage with `backend: verl`, run through the shared skeleton
(omni_core.backends.jobs.runner): stage the inputs on the shared path, submit verl's command as a Ray
Job, follow it while mirroring its checkpoints to the store, then commit the final model as our
checkpoint.

1. The dataset version is exported (jobs.export.export_dataset, content-addressed) and the model staged
   (jobs.export.stage_model) under `backend.shared_dir`.
2. Before every (re)submission with resume_mode auto, `mirror.prepare_resume` puts the latest mirrored
   checkpoint back on a shared path that lost it (a new cluster) or refuses a stranded one (verl #7952).
3. The job's interpreter is asked for verl on the Ray nodes (a probe job: `require_verl_on_nodes`; a
   refusal names backend.python and submits nothing), then `job.submit` to `ray.address` with the
   deterministic submission id (run key and command digest; a retry after a failed attempt is
   `-attempt-N`), credentials forwarded by name. verl's file logger writes the metrics beside the
   checkpoints and the driver relays them into the stage's MLflow run (jobs.metrics): `train/loss` for
   sft, `critic/score/mean`, `actor/pg_loss`, ... for grpo/gspo; a job that logged none of its task's
   always-logged metric fails the stage.
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
   job's entry point before torchrun, `jobs.job.version_probe`), the submission id and the rendered command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.backends.jobs import export
from omni_core.backends.jobs.job import runtime_env
from omni_core.backends.jobs.runner import (
    MERGED,
    VERSION_LINE,
    FinishedJob,
    JobInputs,
    PreparedJob,
    Timed,
    commit_hf_folder,
    merge_fsdp_checkpoint,
    run_job,
)
from omni_core.backends.verl.render import PPO_MODULE, VerlCommand
from omni_core.backends.verl.stage import TASKS, command, layout, response_field
from omni_core.errors import ConfigError
from omni_core.rewards.registry import custom_reward_file

HF_DIR = "huggingface"  # verl's own Hugging Face save (checkpoint.save_contents with hf_model)
# what each task's trainer logs at every step (verl's names): a stage whose run received none failed
REQUIRED_METRICS = {"sft": ("train/loss",), "grpo": ("critic/score/mean",), "gspo": ("critic/score/mean",)}


def metrics_dir(command: VerlCommand) -> Path:
    """Where the job's file logger writes (jobs.metrics): beside its checkpoints, on the shared path."""
    return Path(command.default_local_dir) / "metrics"


def stage_reward_file(stage: Any) -> None:
    """A custom `path.py:function` reward, copied to where the rendered command reads it (stage.reward_script)."""
    if (path := custom_reward_file(stage.reward.name)) is not None:
        export.stage_reward(path, stage.backend.shared_dir)


def require_verl_on_nodes(client: Any, stage: Any, python: str, address: str) -> None:
    """ConfigError, before anything is submitted, when the job's interpreter has no verl where the cluster
    runs jobs (a probe job, kept on the cluster: jobs.job.probe_interpreter)."""
    from omni_core.backends.jobs.job import log_tail, probe_interpreter
    from omni_core.backends.verl.interpreter import how_to_set, resolve

    version, log = probe_interpreter(client, python)
    if version is None:
        chosen = resolve(stage.backend.python)
        raise ConfigError(f"stages.{stage.name}.backend.python: the job's interpreter {python} ({chosen.origin}) has "
                          f"no verl on the Ray nodes of {address}, so no job was submitted; {how_to_set(address)}. "
                          f"The probe said: {log_tail(log, 300).strip() or '(nothing)'}")


def entrypoint_resources(command: VerlCommand, n_gpus_per_node: int, device: str = "gpu") -> dict[str, float]:
    """`submit_job` keyword arguments for the entry point's own resources. `torchrun -m
    verl.trainer.sft_trainer` trains in the entrypoint's own processes, so an sft job asks for the node's
    GPUs (`entrypoint_num_gpus`). Without any entrypoint resources Ray sets
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 on the entrypoint (ray job_manager.py), and verl's Worker
    then looks its device up in Ray's accelerator ids of a process that has none (KeyError / IndexError,
    seen in the CPU test). main_ppo's driver only places Ray actors, which ask for their own GPUs. On CPU
    (`device: cpu`) one CPU: any entrypoint resource keeps that variable out of the job's env."""
    if device == "cpu":
        return {"entrypoint_num_cpus": 1}
    return {"entrypoint_num_gpus": n_gpus_per_node} if command.module.endswith("sft_trainer") else {}


class VerlTrainer:
    """What backend verl adds to the job skeleton (omni_core.backends.jobs.runner.JobTrainer)."""

    label = "verl"
    resumes = "verl"

    def total_steps(self, inputs: JobInputs) -> int | None:
        return inputs.stage.trainer.total_steps

    def prepare(self, inputs: JobInputs, timed: Timed) -> PreparedJob:
        stage, backend = inputs.stage, inputs.stage.backend
        with timed("export"):
            exported = export.export_dataset(inputs.store, inputs.dataset, inputs.version, backend.shared_dir,
                                             layout(stage),  # type: ignore[arg-type]
                                             response_field=response_field(stage) or "extra_info.answer")
        if inputs.split not in exported.files:
            raise ConfigError(f"stages.{stage.name}.data: dataset {inputs.dataset}@{inputs.version} has no split "
                              f"{inputs.split!r}")
        with timed("model"):
            model = export.stage_model(stage.model_uri, backend.shared_dir, seed=inputs.seed)
        stage_reward_file(stage)
        cmd = command(stage, pipeline=inputs.pipeline, run_key=inputs.run_key, model=model,
                      train_files=exported.files[inputs.split], seed=inputs.seed)
        resources = dict(backend.entrypoint_resources) if backend.entrypoint_resources is not None \
            else entrypoint_resources(cmd, backend.n_gpus_per_node, backend.device)
        return PreparedJob(
            command=cmd, env=runtime_env(cmd), resources=resources, checkpoints=Path(cmd.default_local_dir),
            announce="Ray Job", tags={"omni.backend": "verl"},
            record={"entrypoint": cmd.entrypoint, "argv": cmd.argv, "overrides": cmd.overrides}, model=model,
            metrics_dir=metrics_dir(cmd))

    def required_metrics(self, inputs: JobInputs) -> tuple[str, ...]:
        return REQUIRED_METRICS[TASKS[inputs.stage.algorithm.name]]

    def before_submit(self, client: Any, prepared: PreparedJob, inputs: JobInputs) -> None:
        require_verl_on_nodes(client, inputs.stage, prepared.command.argv[0], inputs.ray_address)  # type: ignore[attr-defined]

    def explain_failure(self, log: str, prepared: PreparedJob) -> str:
        return ""

    def finish(self, done: FinishedJob, timed: Timed) -> dict[str, Any]:
        """The final model by `backend.hf_model` (module docstring), committed into the final checkpoint."""
        inputs, cmd = done.inputs, done.prepared.command
        found = VERSION_LINE.search(done.log())
        verl_version = found.group(1) if found else "unknown"
        # main_ppo saves the actor's shards and Hugging Face folder under global_step_N/actor/
        actor_dir = done.step_dir / "actor" if cmd.module == PPO_MODULE else done.step_dir  # type: ignore[attr-defined]
        if inputs.stage.backend.hf_model == "merge":
            with timed("merge"):
                merged_version = merge_fsdp_checkpoint(done.client, cmd.argv[0], done.step_dir,  # type: ignore[attr-defined]
                                                       done.submission_id, done.prepared.env, inputs.poll_s,
                                                       inputs.progress, shards_dir=actor_dir)
            verl_version = verl_version if found else merged_version
            hf_dir = done.step_dir / MERGED
        else:
            hf_dir = actor_dir / HF_DIR
            if not any(hf_dir.glob("*.safetensors")):
                raise ConfigError(f"stages.{inputs.stage.name}: verl saved no weights in {hf_dir} although "
                                  "backend.hf_model is save (checkpoint.save_contents lacks hf_model: is it overridden "
                                  "in backend.overrides?); remove that override or set backend.hf_model: merge")
        with timed("commit"):
            manifest = commit_hf_folder(inputs.store, inputs.root, done.step, hf_dir,
                                        {"submission_id": done.submission_id, "verl_version": verl_version})
        if inputs.tracker is not None and inputs.mlflow_run_id:
            inputs.tracker.set_tags(inputs.mlflow_run_id, {"omni.verl.version": verl_version})
        return {**manifest, "verl_version": verl_version}


def run_verl_stage(**inputs: Any) -> dict[str, Any]:
    """Train `stage` with verl (module docstring); returns the final checkpoint's manifest plus `reused`,
    `submission_id` and `verl_version`. Keywords: `JobInputs`'s fields (`timings`, when given, gets the
    seconds of each phase: export, model, resume, submit, follow, mirror_during_job, mirror_final, merge,
    commit; bench/)."""
    if inputs.get("timings") is None:
        inputs.pop("timings", None)
    return run_job(JobInputs(**inputs), VerlTrainer())
