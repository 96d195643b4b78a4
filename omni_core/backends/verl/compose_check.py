"""Compose a rendered verl command against verl's own Hydra config files and run verl's own config
validation, without training anything. Run as a script by the interpreter that has verl
(`check.compose`); it imports neither omni_core nor anything else of ours.

stdin: a list of {"config_name": "ppo_trainer" | "sft_trainer_engine", "overrides": [...], "load_model": bool}
stdout: one JSON line per request, in order (verl is imported once for all of them):
        {"ok": true, "verl_version": ..., "config": {...}} or
        {"ok": false, "stage": "compose" | "validate", "error_type": ..., "error": ...}

- `ppo_trainer` (main_ppo): `hydra.compose` under `initialize_config_dir(verl/trainer/config)`, then
  `verl.utils.config.validate_config` as main_ppo's `main` calls it.
- `sft_trainer_engine` (sft_trainer): the same composition, then the dataclass conversions
  `SFTTrainer._build_config` does (model, engine, optim, checkpoint, profiler): verl's validation of
  that config, which also loads the model's config and tokenizer from `model.path`.
"""

import json
import os
import sys


def main() -> int:
    for request in json.loads(sys.stdin.read()):
        print(json.dumps(check(request), default=str), flush=True)
    return 0


def check(request: dict) -> dict:
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            config = compose(config_name=request["config_name"], overrides=request["overrides"])
    except Exception as exc:
        return _failure("compose", exc)
    try:
        if request["config_name"] == "ppo_trainer":
            from verl.trainer.ppo.utils import need_critic, need_reference_policy
            from verl.utils.config import validate_config

            validate_config(config=config, use_reference_policy=need_reference_policy(config),
                            use_critic=need_critic(config))
        else:
            from verl.utils.config import omega_conf_to_dataclass

            sections = ("model",) if request.get("load_model", True) else ()
            for section in (*sections, "engine", "optim", "checkpoint", "profiler"):
                omega_conf_to_dataclass(config[section])
        resolved = OmegaConf.to_container(config, resolve=True)
    except Exception as exc:
        return _failure("validate", exc)
    return {"ok": True, "verl_version": verl.__version__, "config": resolved}


def _failure(stage: str, exc: Exception) -> dict:
    message = str(exc) or repr(exc)
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in message:
        message += f" ({cause})"
    return {"ok": False, "stage": stage, "error_type": type(exc).__name__, "error": message}


if __name__ == "__main__":
    sys.exit(main())
