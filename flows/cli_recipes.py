"""`omni recipes list | show NAME | import run_x.sh`: VeRL-Omni's recipes (omni_core.backends.verl_omni).

Mounted by flows/cli.py (`register_commands(app)`). `show` renders the recipe's command for a shared
folder (`--shared-dir`, default /shared): our dataset exports, staged model and run folder under it.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(highlight=False, soft_wrap=True)
recipes_app = typer.Typer(no_args_is_help=True, help="VeRL-Omni recipes as pipeline stages.")


def register_commands(app: typer.Typer) -> None:
    app.add_typer(recipes_app, name="recipes")


def example_paths(shared_dir: str, name: str, stage: str = "rl"):  # -> RecipePaths
    from omni_core.backends.verl_omni.render import RecipePaths

    root = shared_dir.rstrip("/")
    run = f"{root}/runs/PIPELINE/RUN_KEY/{stage}"
    return RecipePaths(train_files=[f"{root}/exports/DATASET_VERSION/train.parquet"],
                       val_files=[f"{root}/exports/DATASET_VERSION/test.parquet"],
                       model=f"{root}/models/MODEL", default_local_dir=f"{run}/checkpoints", run_dir=run,
                       experiment_name=f"PIPELINE-{stage}")


def _export_line(name: str) -> str:
    """How the pipeline gets the recipe its data (omni_core.backends.verl_omni.export)."""
    from omni_core.backends.verl_omni.export import RECIPE_LAYOUTS, TOKENIZED

    if name not in RECIPE_LAYOUTS:
        return ("not exported by omni yet: name the files in backend.overrides (data.train_files=..., "
                "data.val_files=...), prepared with the recipe's data script")
    layout, converter = RECIPE_LAYOUTS[name]
    tokens = " (prompt_token_ids from the stage model's tokenizer)" if layout in TOKENIZED else ""
    return f"exported by omni from a dataset of `converter: {converter}` as verl_omni-{layout}{tokens}"


def _command_text(command: Any) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in command.env.items())
    lines = [f"{command.python} -m {command.module} \\"] + [f"    {shlex.quote(o)} \\" for o in command.overrides]
    lines[-1] = lines[-1][:-2]
    return (f"env: {env}\n" if env else "env: (none)\n") + "\n".join(lines)


@recipes_app.command("list")
def list_command(as_json: Annotated[bool, typer.Option("--json", help="One JSON array.")] = False) -> None:
    """Every recipe: name, model, algorithm, modalities, entry point, hardware as published."""
    from omni_core.backends.verl_omni.catalog import VERL_OMNI_COMMIT, recipes

    rows = [{"name": r.name, "model": r.model, "algorithm": r.algorithm, "modalities": r.modalities,
             "entry_point": f"{r.python} -m {r.module}", "published": r.published, "script": r.script}
            for r in recipes().values()]
    if as_json:
        print(json.dumps(rows))
        return
    table = Table(title=f"VeRL-Omni recipes (verl-project/verl-omni@{VERL_OMNI_COMMIT[:8]})")
    # the name is what `recipes show` and a stage take: never cut short, however narrow the terminal
    table.add_column("name", no_wrap=True, min_width=max(len(row["name"]) for row in rows))
    for column in ("model", "algorithm", "modalities", "entry_point", "published"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(escape(row[c]) for c in ("name", "model", "algorithm", "modalities", "entry_point",
                                                  "published")))
    console.print(table)


@recipes_app.command("show")
def show_command(
    name: Annotated[str, typer.Argument(help="A recipe name (`omni recipes list`).")],
    shared_dir: Annotated[str, typer.Option(help="The folder every Ray node sees.")] = "/shared",
) -> None:
    """The command a recipe renders, its data layout and a pipeline stage to start from."""
    from omni_core.backends.verl_omni.catalog import VERL_OMNI_COMMIT, get_recipe
    from omni_core.backends.verl_omni.render import SUBSTITUTIONS, render_recipe

    recipe = get_recipe(name)
    command = render_recipe(name, recipe.example, example_paths(shared_dir, name))
    print(f"# {recipe.name}: {recipe.model}, {recipe.algorithm}, {recipe.modalities}")
    print(f"# script: verl-project/verl-omni@{VERL_OMNI_COMMIT} {recipe.script}")
    print(f"# published on: {recipe.published}")
    print(f"# data ({recipe.dataset}): {recipe.data_layout}")
    print(f"#   {_export_line(name)}")
    print("# substituted by the pipeline:")
    for item in command.substituted:
        kind = item.split(": ", 1)[1].split(":", 1)[0]
        print(f"#   {item} ({SUBSTITUTIONS[kind]})")
    for note in recipe.notes:
        print(f"#   {note}")
    print(_command_text(command))
    from omni_core.backends.verl_omni.stage import NATIVE_ALGORITHM

    stage = {"name": recipe.algorithm.lower().replace("-", "_"), "kind": "rl", "model": recipe.model,
             "data": f"{recipe.dataset}:train", "algorithm": {"name": NATIVE_ALGORITHM[recipe.algorithm.lower()]},
             "backend": {"name": "verl_omni", "recipe": recipe.name, "shared_dir": shared_dir, **recipe.example}}
    print("# pipeline stage to start from:")
    print(yaml.safe_dump({"stages": [stage]}, sort_keys=False).rstrip())


@recipes_app.command("import")
def import_command(script: Annotated[Path, typer.Argument(help="A VeRL-Omni recipe script (run_x.sh).")]) -> None:
    """Print the pipeline stage backend that runs the script's command."""
    from omni_core.backends.verl_omni.importer import import_script
    from omni_core.errors import ConfigError

    try:
        text = script.read_text()
    except OSError as exc:
        raise ConfigError(f"{script}: cannot read it ({exc.strerror})") from exc
    backend = import_script(text, str(script))
    print(yaml.safe_dump({"backend": backend}, sort_keys=False, width=10_000).rstrip())
