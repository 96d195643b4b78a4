"""`omni init TEMPLATE [DIR]`: a starter pipeline file and a reward stub, which `omni validate` accepts and
`omni run` runs on the tiny built-in models as written.

The files' paths (the reward file, a verl stage's shared folder) are written relative to the folder the
command runs in, as `omni run` resolves them: `omni init grpo my-project` writes
`reward: {name: my-project/reward.py:compute_score}`, and `omni run my-project/pipeline.yaml` from the same
folder finds it (and keeps every project's runs in that folder's `.omni/`).
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from omni_core.errors import ConfigError

TEMPLATES = Path(__file__).resolve().parent / "templates"
console = Console(highlight=False, soft_wrap=True)


class Template(StrEnum):
    grpo = "grpo"
    mpo = "mpo"
    flow_grpo = "flow_grpo"
    verl = "verl"


# template -> (what it is, its reward stub or None)
ABOUT = {
    Template.grpo: ("text: supervised warm start, then GRPO with your reward; eval with a baseline; register",
                    "reward_text.py"),
    Template.mpo: ("preference pairs: MPO (sigmoid + BCO-pair + SFT); eval on held-out pairs; register", None),
    Template.flow_grpo: ("diffusion: FlowGRPO on a text-to-image model with your image reward; eval grid; register",
                         "reward_image.py"),
    Template.verl: ("verl as the trainer: SFT then GRPO with your reward as Ray Jobs (device: cpu on one machine); "
                    "eval; register", "reward_text.py"),
}


def pipeline_name(directory: Path, template: Template) -> str:
    """The folder's name as a pipeline name (one path segment), else `my-TEMPLATE`."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", directory.resolve().name).strip(".-")[:64]
    return name or f"my-{template.value.replace('_', '-')}"


def prefix(directory: Path) -> str:
    """How the pipeline file names a file of `directory`, relative to the folder omni runs in (escaped for
    the double-quoted YAML strings the templates put it in)."""
    text = directory.as_posix()
    text = "" if text in ("", ".") else text.rstrip("/") + "/"
    return text.replace("\\", "\\\\").replace('"', '\\"')


def render(template: Template, directory: Path) -> dict[str, str]:
    """File name -> text of what `omni init` writes into `directory`."""
    text = (TEMPLATES / f"{template.value}.yaml").read_text(encoding="utf-8")
    text = text.replace("__DIR__", prefix(directory)).replace("__NAME__", pipeline_name(directory, template))
    files = {"pipeline.yaml": text}
    stub = ABOUT[template][1]
    if stub:
        files["reward.py"] = (TEMPLATES / stub).read_text(encoding="utf-8")
    return files


def init_command(
    template: Annotated[Template, typer.Argument(help="grpo (text GRPO after SFT), mpo (preference pairs), "
                                                      "flow_grpo (diffusion), verl (verl as the trainer).")],
    directory: Annotated[Path, typer.Argument(help="Folder to write into (created); paths in the pipeline file "
                                                   "are relative to where you run omni.")] = Path("."),
    force: Annotated[bool, typer.Option("--force", help="Overwrite files that exist.")] = False,
) -> None:
    """Write a starter pipeline file (and a reward stub with verl's compute_score signature) that
    `omni validate` accepts and `omni run` runs on the tiny built-in models as written."""
    from omni_core.config import load_pipeline

    files = render(template, directory)
    existing = [str(directory / name) for name in files if (directory / name).exists()]
    if existing and not force:
        raise ConfigError(f"omni init: {', '.join(existing)} already exist(s); pass --force to overwrite, or "
                          "choose another folder")
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text, encoding="utf-8")
        console.print(f"wrote {directory / name}")
    load_pipeline(directory / "pipeline.yaml")  # what was written validates (else it is this command's bug)
    pipeline = directory / "pipeline.yaml"
    console.print(f"{template.value}: {ABOUT[template][0]}")
    if template is Template.verl:
        console.print("needs a Ray job server: ray start --head --num-cpus 8")
    console.print(f"next: omni validate {pipeline} && omni run {pipeline}")
