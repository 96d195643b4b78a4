"""An `sft` / `rl` stage with `backend: {name: verl, ...}` -> verl's training (`VerlTraining`), the
command rendered from it, and the plan `omni plan` prints (entry point, runtime env, staged files).

What maps (stage key -> verl):
- `algorithm.name` sft -> `verl.trainer.sft_trainer`; grpo / gspo -> `verl.trainer.main_ppo` (its
  options: clip ratios, loss_agg_mode, kl_beta, adv_scale); `algorithm.response` picks the exported
  SFT response (auto / answer -> `extra_info.answer`, ground_truth -> `reward_model.ground_truth`).
- `trainer.*` -> total steps, batch size, lr, clip_grad, max prompt length (grpo/gspo), ppo epochs
  and mini batch; `rollout.n / temperature / top_p / max_new_tokens`; `lora.rank / alpha /
  target_modules`; `checkpoint.save_freq / max_to_keep / resume_mode / resume_from_path`; `seed`.

What verl cannot honour is refused here, naming the stage key (at `omni validate`), never dropped:
other algorithms, `execution` scheduling (verl schedules its own workers), `resources` / `num_cpus` /
`adapter` / `adapter_stage` (verl places its workers from nnodes / n_gpus_per_node and loads Hugging
Face models), `rollout.max_num_seqs` / `step_execution` (engine knobs: `backend.overrides`), a reward
other than the rows' own `data_source` scorer, one of ours verl loads by path (digits) or a custom
`path.py:function` (verl's custom reward function, staged on the shared path), `checkpoint.force_resume`, an SFT
`trainer.max_prompt_tokens` (verl truncates the whole sequence: `data.max_length`), and whatever
the renderer refuses (lora.dropout, adv_scale batch, a mini batch that does not divide the batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_core.backends.jobs.export import planned_model_path, staged_reward_path
from omni_core.backends.jobs.job import command_digest, describe_env, runtime_env, submission_id
from omni_core.backends.jobs.metrics import metrics_file
from omni_core.backends.verl.cpu import cpu_problem
from omni_core.backends.verl.options import VerlBackend, VerlTraining
from omni_core.backends.verl.render import VerlCommand, render
from omni_core.errors import ConfigError
from omni_core.rewards.registry import custom_reward_file, custom_reward_spec

TASKS = {"sft": "sft", "grpo": "grpo", "gspo": "gspo"}
SFT_RESPONSE = {"auto": "extra_info.answer", "answer": "extra_info.answer", "ground_truth": "reward_model.ground_truth"}
# execution keys the stage itself honours around the job (resubmissions); the rest schedule our actors
EXECUTION_HONOURED = frozenset({"max_failures", "retry_backoff_s"})
DEFAULT_REWARD = "gsm8k"  # what the stage model defaults to; verl scores by the rows' data_source
# our rewards whose scorer verl loads by path (standard library only): reward.custom_reward_function.path
REWARD_FILES = {"digits": str(Path(__file__).resolve().parents[2] / "rewards" / "digits_score.py")}


def layout(stage: Any) -> str:
    """The export layout verl reads for this stage (sft: messages; grpo/gspo: verl's RL Parquet)."""
    return "sft" if stage.algorithm.name == "sft" else "rl"


def response_field(stage: Any) -> str | None:
    return SFT_RESPONSE.get(stage.algorithm.response) if stage.algorithm.name == "sft" else None


def verl_problem(stage: Any) -> str | None:
    """The first option of a verl stage that verl cannot honour, as `stages.NAME.key: message`, or None."""
    where = f"stages.{stage.name}"
    algo = stage.algorithm.name
    if algo not in TASKS:
        return (f"{where}.algorithm.name: {algo} has no verl trainer here (backend verl runs sft, grpo and gspo); "
                "use backend: native for it")
    if algo == "sft" and response_field(stage) is None:
        return (f"{where}.algorithm.response: {stage.algorithm.response} is not exported for verl's SFT dataset "
                f"(it takes one response field: {', '.join(SFT_RESPONSE)}); use backend: native for preference rows")
    set_keys = stage.model_fields_set
    for key, why in (("adapter", "verl loads the model with its own Hugging Face classes"),
                     ("adapter_stage", "verl loads the model with its own Hugging Face classes"),
                     ("resources", "verl places its workers from backend.nnodes and backend.n_gpus_per_node"),
                     ("num_cpus", "verl places its workers from backend.nnodes and backend.n_gpus_per_node")):
        if key in set_keys:
            return f"{where}.{key}: not used by backend verl ({why}); remove it"
    for key in sorted(stage.execution.model_fields_set - EXECUTION_HONOURED):
        return (f"{where}.execution.{key}: backend verl schedules its own workers (verl's trainer); remove it, or "
                "set verl's own options in backend.overrides")
    if algo != "sft":
        for key in sorted(stage.rollout.model_fields_set & {"max_num_seqs", "step_execution"}):
            return (f"{where}.rollout.{key}: an engine option of our rollout; for verl's engine set it in "
                    "backend.overrides (e.g. actor_rollout_ref.rollout.max_num_seqs=256)")
        if problem := reward_problem(stage):
            return f"{where}.{problem}"
    elif "max_prompt_tokens" in stage.trainer.model_fields_set:
        return (f"{where}.trainer.max_prompt_tokens: verl's sft_trainer truncates prompt and response together; "
                "set backend.overrides: [data.max_length=N] instead")
    backend = stage.backend
    if backend.device == "cpu" and (problem := cpu_problem(TASKS[algo], backend, backend.model_fields_set)):
        return f"{where}.backend.{problem}"
    if stage.checkpoint.force_resume:
        return (f"{where}.checkpoint.force_resume: verl resumes from its own checkpoints without a config check; "
                "remove it (a changed config has another run key, hence another checkpoint folder)")
    path = stage.checkpoint.resume_from_path
    if path and not Path(path).is_absolute():
        return (f"{where}.checkpoint.resume_from_path: {path!r}: verl reads a global_step_N folder on the shared "
                "path; give its absolute path")
    if problem := overrides_files_problem(backend):
        return f"{where}.backend.overrides: {problem}"
    try:
        placeholder = str(Path(stage.backend.shared_dir) / "datasets" / "DATASET" / "VERSION" / "train-00000.parquet")
        render(training(stage, model="MODEL", train_files=[placeholder], seed=0, pipeline="PIPELINE"),
               stage.backend.for_job(), stage.backend.run_dir("PIPELINE", "RUN_KEY", stage.name))
    except ConfigError as exc:
        return f"{where}.{exc}"
    return None


def reward_problem(stage: Any) -> str | None:
    """Why verl cannot score the stage's `reward` (`reward.name: ...`), or None."""
    name = stage.reward.name
    if name == DEFAULT_REWARD or name in REWARD_FILES or custom_reward_file(name) is not None:
        return None
    if (custom := custom_reward_spec(name)) is not None:
        return f"reward.name: {name}: the file {custom[0]} does not exist; fix the path"
    return (f"reward.name: {name}: verl scores each row with its data_source's reward (GSM8K: gsm8k), one of ours it "
            f"can load by path ({', '.join(REWARD_FILES)}), or a custom one written reward: {{name: "
            "path/to/file.py:function}} (verl's custom reward function, with its signature)")


def overrides_files_problem(backend: VerlBackend) -> str | None:
    """A reward file named in `backend.overrides` that the job could not read, or None."""
    for path in backend.input_files():
        if not Path(path).is_absolute():
            return (f"{path!r}: verl resolves a relative path against each worker's directory; give the reward "
                    "file's absolute path on the shared path, or write reward: {name: path/to/file.py:function}")
        if not Path(path).is_file():
            return f"reward file {path} does not exist; fix the path"
    return None


def reward_script(stage: Any) -> tuple[str, str] | None:
    """(the file verl loads, its function) for the stage's reward; None: the rows' data_source scorer.
    A custom file is read at its staged path on the shared path (jobs.export.stage_reward)."""
    name = stage.reward.name
    if name in REWARD_FILES:
        return REWARD_FILES[name], "compute_score"
    if (path := custom_reward_file(name)) is not None:
        return staged_reward_path(path, stage.backend.shared_dir), custom_reward_spec(name)[1]
    return None


def training(stage: Any, *, model: str, train_files: list[str], seed: int, pipeline: str,
             val_files: list[str] | None = None) -> VerlTraining:
    """The stage's options as one verl training (`model` and the files already on the shared path)."""
    algo, trainer, ckpt = stage.algorithm, stage.trainer, stage.checkpoint
    lora = stage.lora
    common: dict[str, Any] = dict(
        task=TASKS[algo.name], model=model, train_files=list(train_files), val_files=list(val_files or []),
        total_steps=trainer.total_steps, batch_size=trainer.batch_size, lr=trainer.lr,
        max_grad_norm=trainer.max_grad_norm, seed=seed, project_name=pipeline, experiment_name=stage.name,
        save_freq=ckpt.save_freq, max_to_keep=ckpt.max_to_keep, resume_mode=ckpt.resume_mode,
        resume_from_path=ckpt.resume_from_path,
        lora_rank=lora.rank if lora else None, lora_alpha=lora.alpha if lora else None,
        lora_dropout=lora.dropout if lora else 0.0, lora_targets=lora.target_modules if lora else None)
    if algo.name == "sft":
        return VerlTraining(**common)
    rollout = stage.rollout
    return VerlTraining(
        **common, max_prompt_tokens=trainer.max_prompt_tokens, ppo_mini_batch_size=trainer.ppo_mini_batch_size,
        ppo_epochs=trainer.ppo_epochs, rollout_n=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
        max_new_tokens=rollout.max_new_tokens, clip_ratio_low=algo.clip_ratio_low, clip_ratio_high=algo.clip_ratio_high,
        loss_agg_mode=algo.loss_agg_mode, kl_beta=algo.kl_beta, adv_scale=algo.adv_scale,
        **reward_options(stage))


def reward_options(stage: Any) -> dict[str, str]:
    script = reward_script(stage)
    return {"reward_file": script[0], "reward_function": script[1]} if script else {}


def command(stage: Any, *, pipeline: str, run_key: str, model: str, train_files: list[str], seed: int,
            val_files: list[str] | None = None) -> VerlCommand:
    """The rendered command, checkpoints under backend.run_dir(pipeline, run_key, stage)."""
    try:
        return render(training(stage, model=model, train_files=train_files, seed=seed, pipeline=pipeline,
                               val_files=val_files),
                      stage.backend.for_job(), stage.backend.run_dir(pipeline, run_key, stage.name))
    except ConfigError as exc:
        raise ConfigError(f"stages.{stage.name}.{exc}") from None


# ---- the plan ------------------------------------------------------------------------------------


def plan(stage: Any, *, pipeline: str, seed: int, dataset: str, split: str, version: str | None,
         shard_count: int | None, run_key: str | None, model_uri: str,
         tracking_uri: str | None, ray_address: str) -> dict[str, Any]:
    """What the stage would do, without doing it: the Ray Job's entry point and runtime env (credentials
    redacted) and the files it stages. Unknown values (a dataset version an upstream ingest has not
    committed yet, the run key that depends on it) appear as `<...>` placeholders."""
    backend: VerlBackend = stage.backend
    version_text = version or "<version>"
    key = run_key or "<run_key>"
    folder = Path(backend.shared_dir) / "datasets" / dataset / version_text / layout(stage)
    files = [str(folder / f"{split}-{i:05d}.parquet") for i in range(shard_count or 1)]
    model = planned_model_path(model_uri, backend.shared_dir, seed) if "<" not in model_uri else model_uri
    cmd = command(stage, pipeline=pipeline, run_key=key, model=model, train_files=files, seed=seed)
    job_id = submission_id(pipeline, stage.name, key, command_digest(cmd))
    env = runtime_env(cmd, metrics_file=metrics_file(Path(cmd.default_local_dir) / "metrics", job_id))
    return {
        "backend": "verl",
        "task": cmd.task,
        "ray_address": ray_address,
        "submission_id": job_id,
        "entrypoint": cmd.entrypoint,
        "overrides": cmd.overrides,
        "runtime_env": describe_env(env),
        "stages": {"dataset": {"from": f"{dataset}@{version_text}:{split}", "to": str(folder), "files": files,
                               "layout": layout(stage)},
                   "model": {"from": model_uri, "to": model}},
        "checkpoints": cmd.default_local_dir,
    }
