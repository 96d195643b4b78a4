"""Our options -> verl's command line: `torchrun -m verl.trainer.sft_trainer` (task sft) and
`python3 -m verl.trainer.main_ppo` (grpo, gspo), each with every Hydra override spelled out.

Order: our overrides (with `device: cpu`, cpu.py's added), then `backend.overrides` verbatim (Hydra applies the last value of a key, so a
user override wins). An option verl cannot honour is a ConfigError naming our key.

Version notes. The tests compose against verl 0.9.1 (PyPI); the CUDA image pins verl at git commit
8a694930 (2026-06-18, before the v0.9.0 tag), and we render for the pinned commit. Every key below
exists in both; the differences that matter (read from verl/trainer/config at both) are:
- `trainer.use_v1`: default false at the pin, true in 0.9.1, so it is always rendered (true: the V1
  trainer, which VeRL-Omni's recipes run with); otherwise one pipeline file would run two trainers.
- `actor_rollout_ref.rollout.seed` exists only in 0.9.1 (the pin would refuse it as an unknown key):
  the seed reaches the job through `data.seed` and `actor_rollout_ref.actor.data_loader_seed`, which
  both have.
- `actor_rollout_ref.rollout.max_num_seqs` defaults to 1024 at the pin, 256 in 0.9.1: not rendered
  (engine tuning; set it in `overrides:`).
The SFT trainer's config (sft_trainer_engine.yaml, model/hf_model.yaml, optim/fsdp.yaml) has the same
keys at both.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from omni_core.backends.jobs.job import version_probe
from omni_core.backends.verl.cpu import cpu_env, cpu_overrides
from omni_core.backends.verl.options import VerlBackend, VerlTraining
from omni_core.errors import ConfigError

SFT_MODULE = "verl.trainer.sft_trainer"
PPO_MODULE = "verl.trainer.main_ppo"
SFT_CONFIG = "sft_trainer_engine"
PPO_CONFIG = "ppo_trainer"
LOGGERS = ["console", "file"]  # verl's file logger: the driver relays it into MLflow (jobs.metrics)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RL_DEFAULTS = {"ppo_epochs": 1, "rollout_n": 4, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 512,
               "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg_mode": "token-mean", "kl_beta": 0.0,
               "adv_scale": "group"}
GSPO_DEFAULTS = {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}


@dataclass(frozen=True)
class VerlCommand:
    """What a Ray Job runs: `argv` (entry point and overrides), `env`, and where verl writes."""

    task: str
    module: str  # verl.trainer.sft_trainer | verl.trainer.main_ppo
    config_name: str  # the Hydra config the module composes (for the compose check)
    argv: list[str]
    overrides: list[str]  # every Hydra override, in order (ours, then backend.overrides)
    env: dict[str, str]
    default_local_dir: str

    @property
    def entrypoint(self) -> str:
        """The shell command line (Ray's JobSubmissionClient takes a string): for a verl module, the version
        probe in the same interpreter first, then verl."""
        if not self.module.startswith("verl."):
            return shlex.join(self.argv)
        return f"{shlex.join(version_probe(self.argv[0]))} && {shlex.join(self.argv)}"


def render(training: VerlTraining, backend: VerlBackend, default_local_dir: str | Path) -> VerlCommand:
    """The command for `training` (sft -> sft_trainer, grpo/gspo -> main_ppo)."""
    local_dir = Path(default_local_dir)
    if not local_dir.is_absolute():
        raise ConfigError(f"trainer.default_local_dir {str(local_dir)!r} is relative: verl resolves it against "
                          "each worker's working directory; pass backend.run_dir(...) (under shared_dir)")
    _check_common(training)
    backend = backend if backend.python is not None else backend.for_job()  # the job's interpreter (interpreter.py)
    if training.task == "sft":
        ours = _sft_overrides(training, backend, local_dir)
        module, config, argv0 = SFT_MODULE, SFT_CONFIG, [
            backend.python, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
            f"--nproc_per_node={backend.n_gpus_per_node}", "-m", SFT_MODULE]
    elif training.task in ("grpo", "gspo"):
        ours = _ppo_overrides(training, backend, local_dir)
        module, config, argv0 = PPO_MODULE, PPO_CONFIG, [backend.python, "-m", PPO_MODULE]
    else:
        raise ConfigError(f"task {training.task!r}: the verl backend runs sft, grpo or gspo")
    # Hydra's own run folder (the job's log and composed config) next to the checkpoints, not in the
    # job's working directory (on a Ray cluster: wherever the job server runs entrypoints)
    ours.append(f"hydra.run.dir={hydra_value(f'{local_dir}/hydra/${{now:%Y-%m-%d_%H-%M-%S}}')}")
    overrides = ours + list(backend.overrides)
    env = cpu_env(training.task, dict(backend.env)) if backend.device == "cpu" else dict(backend.env)
    return VerlCommand(training.task, module, config, argv0 + overrides, overrides, env, str(local_dir))


def _check_common(t: VerlTraining) -> None:
    if not t.train_files:
        raise ConfigError("data: no training files to give verl; export the dataset's train split first")
    if t.lora_rank is None and (t.lora_alpha is not None or t.lora_targets is not None):
        raise ConfigError("lora.alpha / lora.target_modules are set without lora.rank; set lora.rank")
    if t.lora_dropout:
        raise ConfigError(f"lora.dropout={t.lora_dropout}: verl's FSDP LoRA (model.lora_rank / lora_alpha / "
                          "target_modules) has no dropout; set lora.dropout: 0 or use backend: native")
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError("checkpoint.resume_mode=resume_path needs checkpoint.resume_from_path (a global_step_N "
                          "folder on the shared path)")
    if t.save_freq < 0:
        raise ConfigError(f"checkpoint.save_freq={t.save_freq}: use 0 (only at the end) or a positive step count")


def _common_trainer(t: VerlTraining, b: VerlBackend, local_dir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {
        "trainer.total_training_steps": t.total_steps,
        # 0 (only at the end): sft_trainer's -1 still saves the last step, main_ppo's saves nothing at all
        "trainer.save_freq": t.save_freq if t.save_freq > 0 else (-1 if t.task == "sft" else t.total_steps),
        "trainer.resume_mode": t.resume_mode,
        "trainer.default_local_dir": str(local_dir),
        "trainer.logger": LOGGERS,
        "trainer.project_name": t.project_name,
        "trainer.experiment_name": t.experiment_name,
        "trainer.nnodes": b.nnodes,
        "trainer.n_gpus_per_node": b.n_gpus_per_node,
    }
    if t.resume_from_path:
        out["trainer.resume_from_path"] = t.resume_from_path
    return out


def _lora(t: VerlTraining, prefix: str) -> dict[str, Any]:
    if t.lora_rank is None:
        return {}
    out: dict[str, Any] = {f"{prefix}.lora_rank": t.lora_rank}
    if t.lora_alpha is not None:
        if float(t.lora_alpha) != int(t.lora_alpha):
            raise ConfigError(f"lora.alpha={t.lora_alpha}: verl's lora_alpha is an integer; use a whole number")
        out[f"{prefix}.lora_alpha"] = int(t.lora_alpha)
    if t.lora_targets is not None:
        out[f"{prefix}.target_modules"] = t.lora_targets
    return out


def _sft_overrides(t: VerlTraining, b: VerlBackend, local_dir: Path) -> list[str]:
    rl_set = [f.name for f in fields(t) if f.name in VerlTraining.RL_ONLY and getattr(t, f.name) is not None]
    if rl_set:
        raise ConfigError(f"option(s) {', '.join(rl_set)} only apply to RL (grpo/gspo); verl's sft_trainer "
                          "cannot honour them: remove them from the sft stage")
    if b.nnodes != 1:
        raise ConfigError(f"backend.nnodes={b.nnodes}: the sft task runs one torchrun in one Ray Job, on one node; "
                          "use nnodes: 1 (and n_gpus_per_node for more GPUs)")
    values: dict[str, Any] = {
        "model.path": t.model,
        "data.train_files": t.train_files,
        "data.val_files": t.val_files or None,
        "data.messages_key": "messages",
        "data.train_batch_size": t.batch_size,
        "data.micro_batch_size_per_gpu": t.micro_batch_size_per_gpu,
        "data.max_length": t.max_length,
        "optim.lr": t.lr,
        "optim.clip_grad": t.max_grad_norm,
        "trainer.seed": t.seed,
        # verl's sft_trainer stops after total_epochs (default 1) even before total_training_steps: with at
        # least one step an epoch, total_steps epochs never cut the run short
        "trainer.total_epochs": t.total_steps,
        "trainer.max_ckpt_to_keep": t.max_to_keep,
        "checkpoint.save_contents": save_contents(b),
        **_common_trainer(t, b, local_dir),
        **_lora(t, "model"),
    }
    return _listed(t.task, b, values)


def save_contents(b: VerlBackend) -> list[str]:
    """verl's checkpoint.save_contents: its default, plus `hf_model` with `backend.hf_model: save` (its FSDP
    checkpoint manager then writes global_step_N/huggingface/ with the full weights at every save)."""
    return ["model", "optimizer", "extra", *(["hf_model"] if b.hf_model == "save" else [])]


def _ppo_overrides(t: VerlTraining, b: VerlBackend, local_dir: Path) -> list[str]:
    defaults = {**RL_DEFAULTS, **(GSPO_DEFAULTS if t.task == "gspo" else {})}
    rl = {name: getattr(t, name) if getattr(t, name) is not None else default for name, default in defaults.items()}
    if rl["loss_agg_mode"] not in LOSS_AGG_MODES:
        raise ConfigError(f"algorithm.loss_agg_mode={rl['loss_agg_mode']!r}: verl takes one of {', '.join(LOSS_AGG_MODES)}")
    if rl["adv_scale"] == "batch":
        raise ConfigError("algorithm.adv_scale=batch: verl's grpo advantage scales by the group's std or not at all "
                          "(norm_adv_by_std_in_grpo); use adv_scale: group or none")
    mini = t.ppo_mini_batch_size or t.batch_size
    if t.batch_size % mini:
        raise ConfigError(f"trainer.ppo_mini_batch_size={mini} does not divide trainer.batch_size={t.batch_size}")
    kl = float(rl["kl_beta"])
    actor = "actor_rollout_ref.actor"
    values: dict[str, Any] = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.norm_adv_by_std_in_grpo": rl["adv_scale"] == "group",
        "algorithm.use_kl_in_reward": False,
        "data.train_files": t.train_files,
        "data.val_files": t.val_files or t.train_files,
        "data.train_batch_size": t.batch_size,
        "data.max_prompt_length": t.max_prompt_tokens,
        "data.max_response_length": rl["max_new_tokens"],
        "data.seed": t.seed,
        "actor_rollout_ref.model.path": t.model,
        f"{actor}.optim.lr": t.lr,
        f"{actor}.optim.clip_grad": t.max_grad_norm,
        f"{actor}.ppo_mini_batch_size": mini,
        f"{actor}.ppo_micro_batch_size_per_gpu": t.micro_batch_size_per_gpu,
        f"{actor}.ppo_epochs": rl["ppo_epochs"],
        f"{actor}.data_loader_seed": t.seed,
        f"{actor}.policy_loss.loss_mode": "gspo" if t.task == "gspo" else "vanilla",
        f"{actor}.clip_ratio_low": rl["clip_ratio_low"],
        f"{actor}.clip_ratio_high": rl["clip_ratio_high"],
        f"{actor}.loss_agg_mode": rl["loss_agg_mode"],
        f"{actor}.entropy_coeff": 0,
        f"{actor}.use_kl_loss": kl > 0,
        f"{actor}.kl_loss_coef": kl,
        f"{actor}.kl_loss_type": "low_var_kl",  # k3, as our kl_beta
        "actor_rollout_ref.rollout.name": b.rollout_engine,
        "actor_rollout_ref.rollout.n": rl["rollout_n"],
        "actor_rollout_ref.rollout.temperature": rl["temperature"],
        "actor_rollout_ref.rollout.top_p": rl["top_p"],
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": t.micro_batch_size_per_gpu,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": t.micro_batch_size_per_gpu,
        "trainer.use_v1": True,  # module docstring: the pin defaults to the legacy trainer
        "trainer.max_actor_ckpt_to_keep": t.max_to_keep,
        f"{actor}.checkpoint.save_contents": save_contents(b),
        **_common_trainer(t, b, local_dir),
        **_lora(t, "actor_rollout_ref.model"),
    }
    if t.reward_file:
        values.update({"reward.custom_reward_function.path": t.reward_file,
                       "reward.custom_reward_function.name": t.reward_function})
    return _listed(t.task, b, values)


def _listed(task: str, b: VerlBackend, values: dict[str, Any]) -> list[str]:
    if b.device == "cpu":
        values = cpu_overrides(task, values, b.python)
    return [f"{k}={hydra_value(v)}" for k, v in values.items()]


_PLAIN = re.compile(r"^[A-Za-z0-9_./@:+-][A-Za-z0-9_./@:+\-]*$")
_NUMBER_LIKE = re.compile(r"^[+-]?(\d[\d_]*\.?\d*([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?|inf|nan)$", re.IGNORECASE)
_KEYWORDS = {"null", "true", "false", "none"}


def hydra_value(value: Any) -> str:
    """A Python value as Hydra's override grammar reads it back: lists `[a,b]`, None `null`, bools
    `true`/`false`, and strings quoted where they would otherwise parse as something else."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.match(text) and not _NUMBER_LIKE.match(text) and text.lower() not in _KEYWORDS:
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
