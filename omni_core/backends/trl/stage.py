"""What a stage on TRL may say: every key TRL cannot honour is a config error naming it (`trl_problem`,
run by `omni validate` through the `Backend` protocol's `check`); the overrides' field names are
checked against TRL's own config class by `precheck` (omni_core.backends.trl.fields)."""

from __future__ import annotations

from typing import Any

from omni_core.backends.trl.render import (
    DPO_LOSS_TYPES,
    GENERATORS,
    RUNTIME_FIELDS,
    STAGE_FIELDS,
    TRAINERS,
    per_device_batch,
    render,
)

# stage keys TRL has no counterpart for: refused when the file sets them, with where to go instead
NOT_HONOURED = {
    "trainer.max_prompt_tokens": "TRL 1.16 does not truncate prompts (GRPOConfig has no max_prompt_length); "
                                 "SFT and DPO truncate whole sequences: backend.overrides.max_length",
    "trainer.ppo_epochs": "TRL counts every pass as a step of its own: backend.overrides.num_iterations",
    "trainer.ppo_mini_batch_size": "TRL counts every optimizer step as a step: backend.overrides."
                                   "steps_per_generation",
    "rollout.max_num_seqs": "TRL generates a step's batch at once (vllm_mode: colocate batches it on a GPU)",
    "rollout.step_execution": "TRL generates with transformers' generate (or vLLM), not our engines",
    "execution.mode": "TRL generates inside its trainer on each worker (sync)",
    "execution.parameter_sync_step": "TRL generates with the weights it trains",
    "execution.max_staleness": "TRL generates with the weights it trains",
    "execution.staleness_policy": "TRL generates with the weights it trains",
    "execution.async_reward": "TRL scores in its trainer, on every worker",
    "execution.rollout_workers": "TRL generates on its trainer workers: backend.num_workers",
    "execution.reward_workers": "TRL scores on its trainer workers: backend.num_workers",
    "execution.retry_backoff_s": "Ray Train restarts the worker group at once (execution.max_failures times)",
    "num_cpus": "each Ray Train worker's resources are backend.resources_per_worker",
    "resources": "each Ray Train worker's resources are backend.resources_per_worker",
    "adapter": "TRL loads the model with transformers' Auto classes, whole",
    "adapter_stage": "TRL loads the model with transformers' Auto classes, whole",
    "algorithm.average_log_prob": "TRL's DPO sums the log-probs (loss_type ipo normalises by length)",
    "algorithm.modality_weights": "TRL samples the pairs without modality groups",
}
MEDIA_COLUMNS_TRL_CANNOT_TAKE = ("audios", "videos")  # TRL's trainers take images only
# our built-in models TRL cannot load with its Auto classes
NOT_TRANSFORMERS_MODELS = {"tiny://qwen3-omni": "a Qwen3-Omni thinker/talker our adapters load",
                           "tiny://sd3": "a diffusion pipeline"}


def trl_problem(stage: Any, config: Any) -> str | None:
    """The first thing in `stage` TRL cannot run, as `stages.NAME.key: message`, or None."""
    where = f"stages.{stage.name}"
    name = stage.algorithm.name
    if name not in TRAINERS:
        return (f"{where}.algorithm.name: backend trl runs {', '.join(TRAINERS)} (TRL's SFTTrainer, GRPOTrainer, "
                f"DPOTrainer), not {name}; use backend: native for it")
    given = set(stage.keys_given()) | {k for k in ("num_cpus", "resources", "adapter", "adapter_stage")
                                       if k in stage.model_fields_set}
    for key, why in NOT_HONOURED.items():
        if key in given and not _default_is_fine(stage, key):
            return f"{where}.{key}: backend trl cannot honour it ({why}); remove it"
    if isinstance(stage.model, str) and stage.model in NOT_TRANSFORMERS_MODELS:
        return (f"{where}.model: {stage.model} is {NOT_TRANSFORMERS_MODELS[stage.model]}, which TRL cannot load; "
                "use tiny://lm, a save_pretrained folder or a hub id")
    if name in ("dpo", "mpo") and (unknown := [t for t in stage.algorithm.loss_types if t not in DPO_LOSS_TYPES]):
        return f"{where}.algorithm.loss_type: {', '.join(unknown)} is not a loss type of TRL's DPOTrainer"
    total, workers = per_device_batch(stage)[0], stage.backend.num_workers
    if total % workers:
        unit = "completions (trainer.batch_size x rollout.n)" if name in GENERATORS else "rows (trainer.batch_size)"
        return (f"{where}.backend.num_workers: {workers} workers cannot split a step's {total} {unit} evenly; "
                f"make it a multiple of {workers}")
    if problem := _overrides_problem(stage):
        return f"{where}.backend.overrides.{problem}"
    rendered = render(stage, 0)
    block, save = rendered.generation_block, stage.checkpoint.save_freq
    if save and save % block:
        return (f"{where}.checkpoint.save_freq: {save} is not a multiple of the {block} steps that train on one "
                "generation (steps_per_generation x num_iterations): TRL resumes exactly from a generation boundary "
                "only")
    if name in GENERATORS and (media := _media_columns(config, stage)):
        return (f"{where}.data: its rows have {', '.join(media)} columns, which TRL's GRPOTrainer cannot take "
                "(images only); use a text or image dataset, or backend: native")
    return None


def _default_is_fine(stage: Any, key: str) -> bool:
    """A key set to what TRL does anyway is no refusal (ppo_epochs: 1, mode: sync, ...)."""
    section, _, field = key.rpartition(".")
    value = getattr(getattr(stage, section), field) if section else getattr(stage, field)
    return {"trainer.ppo_epochs": 1, "execution.mode": "sync", "rollout.step_execution": False,
            "algorithm.average_log_prob": False, "algorithm.modality_weights": None}.get(key, object()) == value \
        or (key == "trainer.ppo_mini_batch_size" and value == stage.trainer.batch_size)


def _overrides_problem(stage: Any) -> str | None:
    """An override of a field the stage's keys or the worker set: `FIELD: message`."""
    by_field: dict[str, list[str]] = {}
    for key, field in STAGE_FIELDS.items():
        by_field.setdefault(field, []).append(key)
    for field in stage.backend.overrides:
        if field in by_field:
            return f"{field}: set by the stage's {' / '.join(by_field[field])}; set it there"
        if field in RUNTIME_FIELDS:
            return f"{field}: set by omni for every run (output, device, logging, saving, resume); remove it"
    return None


def _media_columns(config: Any, stage: Any) -> list[str]:
    """The audio / video columns of the stage's dataset (its converter's schema), if the converter is known."""
    from omni_core.data.converter import get_converter
    from omni_core.errors import OmniError

    dataset = config.datasets.get(stage.data.split(":", 1)[0])
    if dataset is None:
        return []
    try:
        names = get_converter(dataset.converter).schema.names
    except (OmniError, KeyError, AttributeError):
        return []
    return [c for c in MEDIA_COLUMNS_TRL_CANNOT_TAKE if c in names]
