"""`omni init TEMPLATE [DIR]`: what it writes and what it refuses. That each template's pipeline runs as
written is tests/test_tutorials.py's (grpo, mpo and flow_grpo through `omni run`; verl through
`omni validate` with verl's own Hydra check and `omni plan`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from flows.cli_init import Template
from omni_core.config import load_pipeline
from omni_core.rewards.registry import get_reward


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("template", [t.value for t in Template])
def test_each_template_writes_a_pipeline_that_validates(template: str, in_tmp: Path) -> None:
    result = CliRunner().invoke(app, ["init", template, "proj"])
    assert result.exit_code == 0, result.output
    config = load_pipeline(in_tmp / "proj" / "pipeline.yaml")
    assert config.name == "proj"
    text = (in_tmp / "proj" / "pipeline.yaml").read_text()
    assert "__" not in text  # every placeholder filled in
    if template in ("grpo", "flow_grpo", "verl"):  # the reward stub, named as omni run resolves it from here
        spec = next(s for s in config.stages if s.kind == "rl").reward.name
        assert spec == "proj/reward.py:compute_score"
        reward = get_reward(spec)
        if template in ("grpo", "verl"):
            assert reward("openai/gsm8k", "so 3 + 4 = 7", "7") == 1.0
            assert reward("openai/gsm8k", "8", "7") == 0.1 and reward("openai/gsm8k", "no idea", "7") == 0.0
        else:
            import numpy as np

            assert reward("flow_grpo/ocr", np.full((8, 8, 3), 255, np.uint8)) == 1.0
    else:
        assert not (in_tmp / "proj" / "reward.py").exists()
    if template == "verl":
        assert all(s.backend.shared_dir == str(in_tmp / "proj" / "shared") for s in config.stages
                   if s.kind in ("sft", "rl"))


def test_it_refuses_to_overwrite_without_force(in_tmp: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["init", "grpo"]).exit_code == 0  # the current folder
    assert load_pipeline(in_tmp / "pipeline.yaml").stage("rl").reward.name == "reward.py:compute_score"
    (in_tmp / "reward.py").write_text("# mine\n")
    refused = runner.invoke(app, ["init", "grpo"])
    assert refused.exit_code != 0 and "already exist" in str(refused.exception) and "--force" in str(refused.exception)
    assert (in_tmp / "reward.py").read_text() == "# mine\n"  # nothing written
    forced = runner.invoke(app, ["init", "grpo", "--force"])
    assert forced.exit_code == 0 and "compute_score" in (in_tmp / "reward.py").read_text()
    assert runner.invoke(app, ["init", "nope"]).exit_code != 0


def test_the_pipeline_name_comes_from_the_folder_and_any_folder_name_is_quoted(in_tmp: Path) -> None:
    folder = 'My "Project": #1!'
    os.mkdir(folder)
    assert CliRunner().invoke(app, ["init", "grpo", folder]).exit_code == 0
    config = load_pipeline(in_tmp / folder / "pipeline.yaml")
    assert config.name == "My-Project-1"
    assert next(s for s in config.stages if s.kind == "rl").reward.name == f"{folder}/reward.py:compute_score"
