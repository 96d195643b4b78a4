"""An eval stage with `engine: trainer`: the trained stage's own validation (`trainer.val_only=True`) as a
Ray Job, for `backend: verl` (grpo / gspo) and `backend: verl_omni` (a recipe, from its own checkpoint):
refused where it cannot run, naming the key; the val-only command planned (and composed by verl's own
Hydra config: tests/test_backend_verl_cpu_options.py); verl's metric names read back into ours. (Run for real on CPU, on a real
Ray head: tests/test_backend_verl_pipeline.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_backend_verl_stage import error_of, pipeline

from omni_core.backends.jobs.metrics import MetricsMissing
from omni_core.backends.jobs.validation import trainer_metrics, with_overrides
from omni_core.config import load_pipeline, validate_pipeline
from omni_core.pipeline.plan import format_plan, plan_pipeline

REPO = Path(__file__).resolve().parents[1]
CPU = {"name": "verl", "shared_dir": "/s", "device": "cpu", "overrides": ["trainer.val_before_train=false"]}


def with_eval(tmp_path: Path, rl: dict | None = None, **eval_keys) -> dict:
    data = pipeline(tmp_path, rl={"backend": {**CPU, "shared_dir": str(tmp_path / "shared")}, **(rl or {})})
    data["stages"].append({"name": "eval", "kind": "eval", "after": ["rl"], "data": "gsm8k:test",
                           "engine": "trainer", **eval_keys})
    return data


@pytest.mark.parametrize(("change", "expected"), [
    ({"checkpoint_from": "sft"}, "stages.eval.engine: trainer: stage 'sft' runs verl's sft_trainer, whose validation "
                                 "is a loss on held-out messages (no generation, no reward); use engine: native"),
    ({"baseline": True}, "stages.eval.baseline: a trainer's validation scores one checkpoint; use engine: native"),
    ({"resources": {"CPU": 2}}, "stages.eval.resources: the validation job places its workers as the trained stage's "
                                "backend does"),
    ({"reward": {"name": "digits"}}, "stages.eval.reward: verl's validation scores with the trained stage's reward "
                                     "(gsm8k)"),
])
def test_what_a_trainer_validation_cannot_honour_is_refused(tmp_path, change, expected):
    assert expected in error_of(with_eval(tmp_path, **change))


def test_a_native_stage_has_no_trainer_validation(tmp_path):
    data = with_eval(tmp_path)
    data["stages"][1]["backend"] = "native"
    data["stages"][1]["model"] = "tiny://lm"
    data["stages"][1]["after"] = []
    assert "stages.eval.engine: trainer: stage 'rl' trains with backend native, whose validation is our eval " \
           "itself; use engine: native" in error_of(data)


def test_the_plan_shows_verls_val_only_job(tmp_path):
    config = validate_pipeline(with_eval(tmp_path, max_rows=4, max_new_tokens=8, samples=2))
    entry = {e["name"]: e for e in plan_pipeline(config)}["eval"]
    assert entry["backend"] == "verl" and "validates the checkpoint of rl with verl's own trainer" in entry["does"]
    overrides = entry["overrides"]
    # the trained stage's command (its GSPO loss, the CPU rollout) with the val-only keys last
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=gspo" in overrides
    assert "actor_rollout_ref.rollout.name=omni_cpu" in overrides
    assert overrides[-3:] == ["trainer.val_before_train=true", "trainer.val_only=true", "data.val_max_samples=4"]
    keys = [o.split("=", 1)[0] for o in overrides]
    for key in ("trainer.val_before_train", "trainer.resume_mode", "data.max_response_length"):
        assert keys.count(key) == 1, key  # the user's `trainer.val_before_train=false` replaced, not left beside
    assert {"trainer.val_before_train=true", "trainer.val_only=true", "trainer.resume_mode=disable",
            "data.val_max_samples=4", "data.max_response_length=8", "trainer.log_val_generations=2",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.0",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false"} <= set(overrides)
    assert "actor_rollout_ref.model.path='<checkpoint of rl>'" in overrides
    # verl dumps the validated rows beside the job's run folder (logged as the eval run's artifacts)
    [dumped] = [o for o in overrides if o.startswith("trainer.validation_data_dir=")]
    assert dumped.rstrip("'").endswith("/generations")
    text = format_plan([entry])
    assert "trainer.val_only=true" in text and "stages model: <checkpoint of rl>" in text
    assert "global_step_N" not in text  # nothing is saved by a validation

    # verl 0.9.1's own Hydra composition of it: tests/test_backend_verl_cpu_options.py (`omni plan`)


def test_the_verl_omni_example_validates_its_recipe_checkpoint_with_the_recipes_val_kwargs():
    config = load_pipeline(REPO / "configs" / "verl_omni_mmk12_gspo.yaml")
    entry = {e["name"]: e for e in plan_pipeline(config)}["eval"]
    overrides = entry["overrides"]
    keys = [o.split("=", 1)[0] for o in overrides]
    assert keys.count("trainer.val_before_train") == 1  # the recipe's `false`, replaced
    assert overrides[-5:] == [
        "trainer.val_before_train=true", "trainer.val_only=true", "trainer.resume_mode=resume_path",
        "trainer.resume_from_path=/mnt/shared/runs/verl-omni-mmk12-gspo/<run_key>/gspo/checkpoints/global_step_<N>",
        "trainer.log_val_generations=16"]
    # the recipe's own validation sampling (the published 0.833 is measured with it)
    assert {"actor_rollout_ref.rollout.val_kwargs.n=1", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "actor_rollout_ref.rollout.val_kwargs.top_p=0.7"} <= set(overrides)
    assert entry["runtime_env"]["env_vars"]["VERL_FILE_LOGGER_PATH"].endswith("/<submission id>.jsonl")
    # sampling set on the eval stage replaces the recipe's
    greedy = load_pipeline(REPO / "configs" / "verl_omni_mmk12_gspo.yaml", ["stages.eval.greedy=true"])
    overrides = {e["name"]: e for e in plan_pipeline(greedy)}["eval"]["overrides"]
    assert "actor_rollout_ref.rollout.val_kwargs.temperature=0.0" in overrides
    assert "actor_rollout_ref.rollout.val_kwargs.temperature=1.0" not in overrides


def test_verls_metric_names_become_ours():
    logged = {"val-core/digits/acc/mean_at_1": 0.25, "val-aux/digits/reward/mean_at_1": 0.5,
              "val-aux/gsm8k/reward/mean_at_1": 0.1, "val-aux/gsm8k/reward/mean_at_4": 0.3,
              "val-core/gsm8k/reward/mean_at_4": 0.3, "train/loss": 1.0, "critic/score/mean": 0.2}
    metrics = trainer_metrics(logged, "job")
    assert "train/loss" not in metrics and "critic/score/mean" not in metrics
    # the reward's own score per data source at its largest N, averaged over data sources
    assert metrics["val/reward_mean"] == pytest.approx((0.5 + 0.3) / 2)
    dpo = trainer_metrics({"val/reward_accuracy": 0.75, "val/dpo_loss": 0.6}, "job")
    assert dpo == {"val/reward_accuracy": 0.75, "val/dpo_loss": 0.6}  # pairs: no reward mean made up
    with pytest.raises(MetricsMissing, match="logged no validation metric"):
        trainer_metrics({"train/loss": 1.0}, "job-1")


def test_with_overrides_replaces_keys_whatever_their_prefix():
    assert with_overrides(["a=1", "+b=2", "c=3", "++b=4"], {"b": "5", "d": "6"}) == ["a=1", "c=3", "b=5", "d=6"]
