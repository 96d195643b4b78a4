"""`omni recipes import`: each pinned script gives back a stage that renders the script's command; a
changed script keeps its recipe with the changes as overrides; an unknown one keeps its overrides
verbatim. `omni recipes list/show` through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omni_core.backends.verl_omni.catalog import get_recipe
from omni_core.backends.verl_omni.importer import import_script
from omni_core.backends.verl_omni.render import render_recipe, render_stage, split_override
from omni_core.errors import ConfigError
from tests.test_backend_verl_omni_catalog import BY_RECIPE, NAMES, PATHS, _expected, _script

ROOT = Path(__file__).resolve().parents[1]


def _omni(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def _last_values(overrides: list[str]) -> dict[str, str]:
    return {key: value for _, key, value in map(split_override, overrides)}


@pytest.mark.parametrize("name", NAMES)
def test_import_of_each_pinned_script_renders_the_same_command(name: str) -> None:
    backend = import_script(_script(name), BY_RECIPE[name]["path"])
    assert backend == {"name": "verl_omni", "recipe": name}
    # a folder of the script's machine in an exported variable (Wan2.2's reward checkpoint) is the user's
    machine_env = get_recipe(name).example.get("env", {})
    command = render_stage({**backend, "env": machine_env}, PATHS)
    overrides, env = _expected(name, machine_env)
    assert command.argv == [BY_RECIPE[name]["python"], "-m", BY_RECIPE[name]["module"], *overrides]
    assert command.argv == render_recipe(name, get_recipe(name).example, PATHS).argv
    assert command.env == env


def test_a_changed_script_keeps_its_recipe_and_runs_its_values() -> None:
    text = _script("qwen3-omni-thinker-gspo-mmk12").replace("actor_rollout_ref.rollout.n=16", "actor_rollout_ref.rollout.n=8")
    text = text.replace("    trainer.total_epochs=10 \\\n", "    trainer.total_epochs=10 \\\n    +my.extra=1 \\\n")
    text = text.replace("export VERL_USE_EXTERNAL_MODULES=verl_omni", "export VERL_USE_EXTERNAL_MODULES=verl_omni\nexport FOO=bar")
    backend = import_script(text)
    assert backend == {"name": "verl_omni", "recipe": "qwen3-omni-thinker-gspo-mmk12",
                       "overrides": ["actor_rollout_ref.rollout.n=8", "+my.extra=1"], "env": {"FOO": "bar"}}
    command = render_stage(backend, PATHS)
    values = _last_values(command.overrides)  # Hydra: the last value of a key
    assert values["actor_rollout_ref.rollout.n"] == "8" and values["my.extra"] == "1"
    assert command.env["FOO"] == "bar"


def test_an_unknown_script_keeps_its_overrides_verbatim() -> None:
    text = ("#!/bin/bash\nexport VERL_USE_EXTERNAL_MODULES=verl_omni\nDATA=$HOME/d\n"
            "python3 -m verl_omni.trainer.main_omni \\\n    data.train_files=$DATA/train.parquet \\\n"
            "    data.val_files=$DATA/test.parquet \\\n    actor_rollout_ref.model.path=Qwen/X \\\n"
            "    trainer.logger='[\"console\",\"wandb\"]' \\\n    algorithm.adv_estimator=grpo \"$@\"\n")
    backend = import_script(text)
    assert backend == {"name": "verl_omni", "entry_point": "verl_omni.trainer.main_omni",
                       "overrides": ["data.train_files=${HOME}/d/train.parquet", "data.val_files=${HOME}/d/test.parquet",
                                     "actor_rollout_ref.model.path=Qwen/X", 'trainer.logger=["console","wandb"]',
                                     "algorithm.adv_estimator=grpo"],
                       "env": {"VERL_USE_EXTERNAL_MODULES": "verl_omni"}}
    command = render_stage(backend, PATHS)
    assert command.argv == ["python3", "-m", "verl_omni.trainer.main_omni",
                            "data.train_files=/shared/exports/ds/train.parquet",
                            "data.val_files=/shared/exports/ds/test.parquet", "actor_rollout_ref.model.path=/shared/models/m",
                            'trainer.logger=["console","file"]', "algorithm.adv_estimator=grpo",
                            "trainer.default_local_dir=/shared/runs/p/k/rl/checkpoints"]
    with pytest.raises(ConfigError, match="python3 -m"):
        import_script("echo hi\n", "x.sh")


def test_cli_list_show_import(tmp_path: Path) -> None:
    listed = _omni("recipes", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert sorted(r["name"] for r in rows) == NAMES
    mmk12 = next(r for r in rows if r["name"] == "qwen3-omni-thinker-gspo-mmk12")
    assert mmk12["entry_point"] == "python3 -m verl_omni.trainer.main_omni" and mmk12["algorithm"] == "GSPO"
    shown = _omni("recipes", "show", "qwen-image-flowgrpo-ocr-lora", "--shared-dir", "/nfs")
    assert shown.returncode == 0, shown.stderr
    assert "python3 -m verl_omni.trainer.main_diffusion \\" in shown.stdout
    assert "trainer.default_local_dir=/nfs/runs/PIPELINE/RUN_KEY/rl/checkpoints" in shown.stdout
    snippet = yaml.safe_load(shown.stdout.split("# pipeline stage to start from:\n", 1)[1])
    backend = snippet["stages"][0]["backend"]
    assert backend["recipe"] == "qwen-image-flowgrpo-ocr-lora" and backend["max_num_seqs"] == 8
    assert render_stage(backend, PATHS).argv == render_recipe("qwen-image-flowgrpo-ocr-lora", {}, PATHS).argv
    script = ROOT / "tests/data/verl_omni/scripts" / BY_RECIPE["bagel-flowgrpo-ocr-lora"]["path"]
    imported = _omni("recipes", "import", str(script))
    assert imported.returncode == 0, imported.stderr
    assert yaml.safe_load(imported.stdout) == {"backend": {"name": "verl_omni", "recipe": "bagel-flowgrpo-ocr-lora"}}
    bad = _omni("recipes", "show", "nope")
    assert bad.returncode == 2 and "backend.recipe" in bad.stderr
    missing = _omni("recipes", "import", str(tmp_path / "none.sh"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
