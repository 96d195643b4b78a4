"""The docs site: the generated reference is complete and current, and the site builds.

- every field a pipeline file can hold (the pipeline, every registered stage kind, algorithm and
  backend, and what they nest) has a description, which `omni validate`'s messages and the generated
  reference both show;
- docs/reference/{config,cli,metrics}.md are what scripts/gen_docs_reference.py makes from the code now
  (`make docs-reference` rewrites them), and name every config key and every CLI option;
- `mkdocs build --strict` passes (a broken link or anchor, a missing page or an unlisted page in a
  section folder fails it), and a new page at the top of docs/ joins the nav's Guides by itself.

Fast: imports the config models and the CLI, builds the site twice (~2 s each), starts no server.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs_reference as reference  # noqa: E402

MKDOCS = Path(sys.executable).parent / "mkdocs"
def test_every_config_field_has_a_description() -> None:
    missing = reference.missing_descriptions()
    assert not missing, ("config fields without a description (add `description=` to the Field; the docs' "
                         "reference and omni validate show it):\n  " + "\n  ".join(missing))


def test_the_description_check_sees_a_field_without_one() -> None:
    class Options(BaseModel):
        described: int = Field(1, description="Has one.")
        bare: int = 2

    assert reference.missing_descriptions([Options]) == [f"{__name__}.{Options.__qualname__}.bare"]


def test_the_generated_reference_pages_are_current() -> None:
    stale = [str(p.relative_to(ROOT)) for p in reference.stale_pages()]
    assert not stale, f"stale generated pages (run `make docs-reference`): {stale}"


def test_the_reference_names_every_config_key_and_cli_option() -> None:
    config = (ROOT / "docs/reference/config.md").read_text()
    for model in reference.config_models():
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in config, f"{model.__name__}.{name} is not in docs/reference/config.md"
    cli = (ROOT / "docs/reference/cli.md").read_text()
    from flows.cli import app

    root = typer.main.get_command(app)
    for path, command in reference._commands(root, []):
        title = " ".join(["omni", *path])
        section = cli.split(f"## {title}\n", 1)
        assert len(section) == 2, f"{title} has no section in docs/reference/cli.md"
        body = section[1].split("\n## ", 1)[0]
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                assert all(f"`{opt}`" in body for opt in param.opts), f"{title} {param.opts} is not documented"
    metrics = (ROOT / "docs/reference/metrics.md").read_text()
    for metric in ("critic/score/mean", "train/loss", "actor/reward_accuracy", "val/reward_mean",
                   "eval_rewards/accuracies", "timing_s/step"):
        assert f"`{metric}`" in metrics


def build(docs_root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "--config-file", str(docs_root / "mkdocs.yml"),
                           "--site-dir", str(site)], cwd=docs_root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_site_builds_strict(tmp_path: Path) -> None:
    result = build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    page = (tmp_path / "site/reference/config/index.html").read_text()
    assert "clip_ratio_high" in page and "max_quarantine_fraction" in page
    assert (tmp_path / "site/tutorials/own-data/index.html").exists()


@pytest.fixture
def docs_copy(tmp_path: Path) -> Path:
    """mkdocs.yml, its hook and docs/ in a folder of their own, to change."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts/mkdocs_hooks.py", copy / "scripts")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    return copy


def test_a_new_top_page_joins_guides_and_an_unlisted_section_page_fails(docs_copy: Path, tmp_path: Path) -> None:
    (docs_copy / "docs/new-feature.md").write_text("# A new feature\n\nSee [the demo](get-started/demo.md).\n")
    result = build(docs_copy, tmp_path / "site")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    home = (tmp_path / "site/index.html").read_text()
    guides = home.split("Guides", 1)[1].split("Operations", 1)[0]
    assert re.search(r'href="new-feature/"', guides) and "A new feature" in guides, guides[:3000]

    (docs_copy / "docs/tutorials/orphan.md").write_text("# Orphan\n")
    result = build(docs_copy, tmp_path / "site2")
    assert result.returncode != 0 and "tutorials/orphan.md" in result.stderr, result.stderr[-3000:]


def test_every_command_on_every_page_is_real() -> None:
    """Each `omni ...` in a shell block of README.md or docs/ names a command and options it has (run or
    not: the scaled-out tutorial's blocks are checked here only), and each `make X` a Makefile target."""
    from doc_pages import blocks as shell_blocks
    from doc_pages import make_targets, makefile_targets, omni_commands, omni_problem, pages

    from flows.cli import app

    root = typer.main.get_command(app)
    targets = makefile_targets()
    problems, seen = [], 0
    for page in pages():
        for block in shell_blocks(page):
            where = f"{page.relative_to(ROOT)}:{block.line}"
            for args in omni_commands(block.code):
                seen += 1
                if problem := omni_problem(root, args):
                    problems.append(f"{where}: {problem}")
            problems += [f"{where}: make {t}: no such Makefile target" for t in make_targets(block.code)
                         if t not in targets]
    assert seen > 50, seen
    assert not problems, "commands in the docs that do not exist:\n  " + "\n  ".join(problems)


def test_the_command_check_catches_what_it_is_for() -> None:
    from doc_pages import commands, omni_commands, omni_problem

    from flows.cli import app

    root = typer.main.get_command(app)
    assert omni_problem(root, ["run", "p.yaml", "--dry-run"]) is None
    assert "no command 'rnu'" in omni_problem(root, ["rnu", "p.yaml"])
    assert "--dryrun" in omni_problem(root, ["run", "p.yaml", "--dryrun"])
    assert omni_problem(root, ["datasets", "show"])  # its argument is missing
    code = "omni init grpo x && omni run x/pipeline.yaml | grep y\ncat > f <<'EOF'\nomni nothing\nEOF\n" \
           "A=1 .venv/bin/omni validate \\\n  p.yaml seed=1  # a comment\n"
    assert omni_commands(code) == [["init", "grpo", "x"], ["run", "x/pipeline.yaml"], ["validate", "p.yaml", "seed=1"]]
    assert ["grep", "y"] in commands(code)


def test_validate_errors_say_what_the_key_is() -> None:
    """A wrong value's error carries the field's description, the same text as the reference's row."""
    import yaml

    from omni_core.config import ConfigValidationError, validate_pipeline
    from omni_core.config.models import RolloutConfig

    data = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    rl = next(s for s in data["stages"] if s["name"] == "rl")
    rl["rollout"]["n"] = 0
    rl["algorithm"]["clip_ratio_low"] = -1
    data["datasets"]["digits"]["shard_rows"] = 0
    with pytest.raises(ConfigValidationError) as caught:
        validate_pipeline(data, "demo.yaml")
    from omni_core.config.models import DatasetConfig
    from omni_core.training.algorithms.grpo import PolicyGradientOptions
    described = {"stages.rl.rollout.n": RolloutConfig.model_fields["n"].description,
                 "stages.rl.algorithm.clip_ratio_low": PolicyGradientOptions.model_fields["clip_ratio_low"].description,
                 "datasets.digits.shard_rows": DatasetConfig.model_fields["shard_rows"].description}
    for key, description in described.items():
        line = next(e for e in caught.value.errors if e.startswith(f"{key}:"))
        assert description.rstrip(".") in line, line
        assert description.rstrip(".") in (ROOT / "docs/reference/config.md").read_text()
