"""The VeRL-Omni catalog against the pinned recipe scripts.

tests/data/verl_omni/scripts/ holds each script verbatim from verl-project/verl-omni at the commit the
CUDA image pins; tests/data/verl_omni_recipes.json is the fact table (path, sha256, entry point,
exported variables, overrides in order). Checked here: the files are the pinned ones, bash itself
expands each script's python3 line to the fact table's argv, and every recipe renders the script's
command after the substitutions listed in SUBSTITUTED.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from pathlib import Path

import pytest

from omni_core.backends.verl_omni.catalog import VERL_OMNI_COMMIT, get_recipe, recipes
from omni_core.backends.verl_omni.render import RecipeOptions, RecipePaths, render_recipe, split_override
from omni_core.backends.verl_omni.script import parse_script, python_line
from omni_core.errors import ConfigError

DATA = Path(__file__).parent / "data"
FACTS = json.loads((DATA / "verl_omni_recipes.json").read_text())
BY_RECIPE = {s["recipe"]: s for s in FACTS["scripts"]}
PATHS = RecipePaths(train_files=["/shared/exports/ds/train.parquet"], val_files=["/shared/exports/ds/test.parquet"],
                    model="/shared/models/m", default_local_dir="/shared/runs/p/k/rl/checkpoints",
                    run_dir="/shared/runs/p/k/rl", experiment_name="p-rl", verl_omni_root="/opt/site",
                    verl_omni_examples="/opt/ex")
# what our pipeline writes in place of the script's value, per substitution kind (given PATHS)
SUBSTITUTED = {
    "train_files": lambda v: "['/shared/exports/ds/train.parquet']" if v.startswith("[") else PATHS.train_files[0],
    "val_files": lambda v: "['/shared/exports/ds/test.parquet']" if v.startswith("[") else PATHS.val_files[0],
    "model": lambda v: "/shared/models/m",
    "logger": lambda v: '["console","file"]',
    "default_local_dir": lambda v: "/shared/runs/p/k/rl/checkpoints",
    "run_dir": lambda v: "/shared/runs/p/k/rl/" + v.rsplit("/", 1)[-1],
    "package_file": lambda v: "/opt/site/" + v[v.index("verl_omni/"):],
    "experiment_name": lambda v: "p-rl",
}
# the v0.2.0 rows (issue 18) -> the recipes that cover them
ROWS = {
    "Qwen3-Omni GSPO GSM8K": ["qwen3-omni-thinker-gspo-gsm8k"],
    "Qwen3-Omni GSPO MMK12": ["qwen3-omni-thinker-gspo-mmk12", "qwen3-omni-thinker-gspo-mmk12-npu"],
    "Qwen3-Omni GSPO AVQA (NPU)": ["qwen3-omni-thinker-gspo-avqa-npu"],
    "Qwen3-Omni DPO Omni-Preference": ["qwen3-omni-dpo-omni-preference"],
    "Qwen-Image FlowGRPO OCR LoRA / full": ["qwen-image-flowgrpo-ocr-lora", "qwen-image-flowgrpo-ocr-full"],
    "SD3.5 FlowGRPO V1 sync / separate_async": ["sd35-medium-flowgrpo-ocr-lora-v1",
                                                "sd35-medium-flowgrpo-ocr-lora-v1-separate-async"],
    "LTX2.3": ["ltx2.3-flowgrpo-t2av-lora"], "Qwen-Image-Edit": ["qwen-image-edit-flowgrpo-pickscore-lora"],
    "BAGEL": ["bagel-flowgrpo-ocr-lora"], "SD3.5 + DiNa-LRM": ["sd35-medium-flowgrpo-drm-lora"],
    "Flow-DPPO Qwen-Image": ["qwen-image-flowdppo-ocr-lora"], "Wan2.2 DanceGRPO": ["wan2.2-dancegrpo-t2v-hpsv3"],
}
NAMES = sorted(BY_RECIPE)


def _script(name: str) -> str:
    return (DATA / "verl_omni/scripts" / BY_RECIPE[name]["path"]).read_text()


def test_fact_table_is_the_pinned_commit_and_covers_every_row() -> None:
    assert FACTS["commit"] == VERL_OMNI_COMMIT
    assert sorted(recipes()) == NAMES
    assert sorted(n for names in ROWS.values() for n in names) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_script_file_and_parse_match_the_fact_table(name: str) -> None:
    fact, text = BY_RECIPE[name], _script(name)
    assert hashlib.sha256(text.encode()).hexdigest() == fact["sha256"]
    cmd = parse_script(text, fact["path"])
    assert (cmd.python, cmd.module, cmd.env, cmd.overrides) == (fact["python"], fact["module"], fact["env"],
                                                                fact["overrides"])


@pytest.mark.parametrize("name", NAMES)
def test_bash_expands_the_python_line_to_the_fact_table(name: str, tmp_path: Path) -> None:
    """The variables as read, then bash runs the script's own python3 line with python3 printing its argv."""
    cmd = parse_script(_script(name))
    lines = ["python3() { printf '%s\\0' \"$@\"; }", "set --"]
    lines += [f"{k}={shlex.quote(v)}" for k, v in cmd.variables.items()]
    lines.append(python_line(_script(name)))
    out = subprocess.run(["bash", "-c", "\n".join(lines)], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    argv = out.split("\0")[:-1]
    assert ["python3", *argv] == [cmd.python, "-m", BY_RECIPE[name]["module"], *BY_RECIPE[name]["overrides"]]


def _expected(name: str, example_env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    recipe, fact = get_recipe(name), BY_RECIPE[name]
    rows = [list(split_override(o)) for o in fact["overrides"]]
    keys = [k for _, k, _ in rows]
    for key, kind in recipe.substitutions.items():
        if kind.startswith("examples_file:"):
            value = "/opt/ex/" + kind.split(":", 1)[1]
        else:
            value = SUBSTITUTED[kind](rows[keys.index(key)][2] if key in keys else "")
        if key in keys:
            rows[keys.index(key)][2] = value
        else:
            rows.append(["", key, value])
            keys.append(key)
    env = {k: v for k, v in fact["env"].items() if k not in ("WANDB_MODE", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")}
    return [f"{p}{k}={v}" for p, k, v in rows], {**env, **example_env}


@pytest.mark.parametrize("name", NAMES)
def test_example_options_render_the_script_command(name: str) -> None:
    recipe = get_recipe(name)
    example = dict(recipe.example)
    command = render_recipe(name, example, PATHS)
    overrides, env = _expected(name, example.get("env", {}))
    assert command.module == BY_RECIPE[name]["module"]
    assert command.argv == [BY_RECIPE[name]["python"], "-m", BY_RECIPE[name]["module"], *overrides]
    assert command.env == env
    # the substitutions cover every key that named the script's machine, and only listed ones changed
    assert set(recipe.substitutions) >= {"trainer.logger", "trainer.default_local_dir", "data.train_files"}
    assert not any("${" in o for o in command.overrides)
    # the example sets every option the recipe honours from its script; none is a no-op on the keys
    assert example["algorithm"] == recipe.algorithm


def test_options_write_their_keys_in_place_and_overrides_come_last() -> None:
    base = render_recipe("qwen3-omni-thinker-gspo-mmk12", {}, PATHS).overrides
    cmd = render_recipe("qwen3-omni-thinker-gspo-mmk12", {
        "rollout_n": 4, "clip_ratio_low": 0.001, "lora_rank": 8, "lora_alpha": 16, "lr": 3e-6, "total_steps": 5,
        "nnodes": 2, "n_gpus_per_node": 8, "overrides": ["trainer.save_freq=7"]}, PATHS)
    got = cmd.overrides
    assert got[base.index("actor_rollout_ref.rollout.n=16")] == "actor_rollout_ref.rollout.n=4"
    assert got[base.index("actor_rollout_ref.actor.clip_ratio_low=3e-4")] == "actor_rollout_ref.actor.clip_ratio_low=0.001"
    assert got[base.index("actor_rollout_ref.model.lora_rank=32")] == "actor_rollout_ref.model.lora_rank=8"
    assert got[base.index("trainer.nnodes=1")] == "trainer.nnodes=2"
    assert "actor_rollout_ref.actor.optim.lr=3e-6" in got  # same value: the script's spelling
    assert got[-2:] == ["trainer.total_training_steps=5", "trainer.save_freq=7"]
    lora = render_recipe("qwen-image-flowgrpo-ocr-lora", {"max_num_seqs": 16}, PATHS).overrides
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm_omni.max_num_seqs=16" in lora
    full = render_recipe("qwen-image-flowgrpo-ocr-full", {"step_execution": False}, PATHS).overrides
    assert "actor_rollout_ref.rollout.step_execution=false" in full
    sep = render_recipe("sd35-medium-flowgrpo-ocr-lora-v1-separate-async", {
        "execution_mode": "separate_async", "parameter_sync_step": 2, "max_staleness": 3,
        "staleness_policy": "drop"}, PATHS).overrides
    assert {"trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
            "trainer.v1.sampler.max_off_policy_threshold=3",
            "trainer.v1.sampler.max_off_policy_strategy=drop"} <= set(sep)
    sync = render_recipe("sd35-medium-flowgrpo-ocr-lora-v1", {"execution_mode": "sync"}, PATHS).overrides
    assert "trainer.v1.trainer_mode=sync" in sync


@pytest.mark.parametrize(("name", "options", "named"), [
    ("qwen3-omni-thinker-gspo-mmk12", {"step_execution": True}, "backend.step_execution"),
    ("qwen3-omni-thinker-gspo-mmk12", {"clip_ratio": 0.1}, "backend.clip_ratio"),
    ("qwen-image-flowgrpo-ocr-lora", {"clip_ratio_low": 0.1}, "backend.clip_ratio_low"),
    ("qwen3-omni-thinker-gspo-mmk12", {"execution_mode": "separate_async"}, "backend.execution_mode"),
    ("sd35-medium-flowgrpo-ocr-lora-v1", {"execution_mode": "separate_async"}, "backend.execution_mode"),
    ("sd35-medium-flowgrpo-ocr-lora-v1", {"parameter_sync_step": 2}, "backend.parameter_sync_step"),
    ("sd35-medium-flowgrpo-ocr-lora-v1-separate-async", {"staleness_policy": "wait"}, "backend.staleness_policy"),
    ("qwen3-omni-thinker-gspo-mmk12", {"algorithm": "grpo"}, "backend.algorithm"),
    ("qwen3-omni-dpo-omni-preference", {"rollout_n": 4}, "backend.rollout_n"),
    ("no-such-recipe", {}, "backend.recipe"),
])
def test_an_option_the_recipe_cannot_honour_is_a_config_error(name: str, options: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        render_recipe(name, options, PATHS)


def test_paths_and_machine_folders_are_checked() -> None:
    with pytest.raises(ConfigError, match="default_local_dir"):
        render_recipe("qwen3-omni-thinker-gspo-gsm8k", {}, RecipePaths(["/a"], ["/b"], "/m", "ckpt"))
    with pytest.raises(ConfigError, match=r"backend\.env\.custom_reward_model_path"):
        render_recipe("wan2.2-dancegrpo-t2v-hpsv3", {}, PATHS)  # the reward checkpoint is the user's
    with pytest.raises(ConfigError, match=r"backend\.rollout: Extra inputs"):
        render_recipe("qwen3-omni-thinker-gspo-gsm8k", {"rollout": 4}, PATHS)
    assert render_recipe("qwen3-omni-thinker-gspo-gsm8k", RecipeOptions(rollout_n=2), PATHS).overrides
