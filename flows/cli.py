"""The `omni` command line: run and validate pipelines, write fixtures.

User-caused errors (OmniError) print one line and exit 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.cli_options import state
from flows.prefect_env import (
    quiet_prefect_tracebacks,
    start_embedded_api,
    start_embedded_prefect_once,
    use_embedded_prefect,
)
from omni_core.config import ConfigValidationError, PipelineConfig, load_pipeline
from omni_core.errors import OmniError

if TYPE_CHECKING:
    from flows.local_prefect import LocalServer

# Registered at import, so it runs after the exit handlers registered later (Prefect stopping its
# temporary server), just before the interpreter's own clean-up: the ~400k objects torch, MLflow and
# Prefect built at import go to the permanent generation, which the finalising garbage collections skip.
# Without it an `omni run` spent 5-6 s (busy 2-core machine) in those collections after its last line.
atexit.register(gc.freeze)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reproducible multimodal RL post-training pipelines.")
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

def _mount_subcommands() -> None:
    from flows.cli_datasets import datasets_app, ingest_command
    from flows.cli_deploy import register_commands
    from flows.cli_image import image_app
    from flows.cli_init import init_command
    from flows.cli_lineage import register_commands as register_lineage
    from flows.cli_recipes import register_commands as register_recipes
    from flows.cli_server import server_app
    from flows.cli_sweep import sweep_app
    from flows.cli_verify import register_commands as register_verify

    app.command("ingest")(ingest_command)
    app.command("init")(init_command)
    app.add_typer(datasets_app, name="datasets")
    app.add_typer(image_app, name="image")
    app.add_typer(server_app, name="server")
    app.add_typer(sweep_app, name="sweep")  # sweep PIPELINE SWEEP | status
    register_commands(app)  # deploy, serve, status
    register_verify(app)  # verify
    register_lineage(app)  # lineage
    register_recipes(app)  # recipes list | show | import


_mount_subcommands()


@app.callback()
def _options(debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False) -> None:
    state.debug = debug


@app.command()
def validate(
    pipeline_file: Annotated[Path, typer.Argument(help="Pipeline YAML file.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides: stages.rl.trainer.total_steps=3")] = None,
) -> None:
    """Print the resolved pipeline config, or every error with its key path."""
    try:
        config = load_pipeline(pipeline_file, overrides or [])
    except ConfigValidationError as exc:
        err_console.print(f"[red]{pipeline_file}: {len(exc.errors)} error(s)[/red]")
        for line in exc.errors:
            err_console.print(f"  {line}")
        raise typer.Exit(2) from None
    _prechecks(config, pipeline_file)
    console.print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")


def _prechecks(config: PipelineConfig, pipeline_file: Path) -> None:
    """The converter and reward names (omni_core.pipeline.names), then each used backend's own checks
    (omni_core.backends.precheck_pipeline: verl's Hydra composition, TRL's config fields): notes on
    stderr; exit 2 on a refusal, naming its key."""
    from omni_core.backends import precheck_pipeline
    from omni_core.pipeline.names import unknown_names

    _refuse(pipeline_file, unknown_names(config))  # first: verl's check starts its interpreter
    refused = []
    for result in precheck_pipeline(config):
        if result.refused:
            refused.append(result.error())
        else:
            err_console.print(escape(result.note()))
    _refuse(pipeline_file, refused)


def _refuse(pipeline_file: Path, errors: list[str]) -> None:
    """Exit 2 with `errors`, one a line, if there are any."""
    if errors:
        err_console.print(f"[red]{pipeline_file}: {len(errors)} error(s)[/red]")
        for line in errors:
            err_console.print(f"  {escape(line)}")
        raise typer.Exit(2)


@app.command()
def run(
    pipeline_file: Annotated[Path, typer.Argument(help="Pipeline YAML file.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides: stages.rl.trainer.total_steps=3")] = None,
    force: Annotated[list[str] | None, typer.Option("--force", metavar="STAGE",
                                                    help="Redo this stage although cached (repeatable).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan (as `omni plan`) and run nothing.")] = False,
) -> None:
    """Run a pipeline end to end (Prefect flow; stages on Ray; lineage in MLflow). Stages whose config
    and inputs are unchanged since they last finished are taken from the cache in the store."""
    from omni_core.pipeline.params import check_force
    from omni_core.storage import Store

    config = load_pipeline(pipeline_file, overrides or [])
    check_force(config, force)
    _prechecks(config, pipeline_file)
    if dry_run:
        _print_plan(config, as_json=False)
        return
    Store(config.store).check_writable()  # fail in a second, not after starting Prefect and Ray
    prefect_home = use_embedded_prefect()
    api_ready = start_embedded_api(prefect_home)  # omni's local Prefect server: starts while the flow imports
    console.print(f"[bold]omni[/bold] running pipeline [cyan]{config.name}[/cyan] "
                  f"({len(config.stages)} stages) from {pipeline_file}")
    from flows.pipeline import pipeline  # imports Prefect: only when a run is asked for

    quiet_prefect_tracebacks()
    local_server = api_ready()
    if local_server is None:  # Prefect's temporary server: the first of several runs migrates its database
        start_embedded_prefect_once(prefect_home)

    started = time.perf_counter()
    summary = pipeline(pipeline_file=str(pipeline_file), overrides=list(overrides or []), force=list(force or []))
    print_summary(config, summary, time.perf_counter() - started, prefect_home, local_server)


@app.command()
def plan(
    pipeline_file: Annotated[Path, typer.Argument(help="Pipeline YAML file.")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides: stages.rl.trainer.total_steps=3")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as one JSON list.")] = False,
) -> None:
    """Print what every stage would do, in run order, and run nothing; for a verl stage its Ray Job's
    entry point, runtime environment (credentials redacted) and the files it stages."""
    config = load_pipeline(pipeline_file, overrides or [])
    _prechecks(config, pipeline_file)
    _print_plan(config, as_json)


def _print_plan(config: PipelineConfig, as_json: bool) -> None:
    import json

    from omni_core.pipeline.plan import format_plan, plan_pipeline

    entries = plan_pipeline(config)
    if as_json:
        print(json.dumps(entries, indent=2))
    else:
        console.print(escape(format_plan(entries)))


def print_summary(config: PipelineConfig, summary: dict, seconds: float, prefect_home: str | None,
                  local_server: LocalServer | None = None) -> None:
    table = Table(title=f"pipeline {summary['pipeline']} finished in {seconds:.1f}s")
    for column in ("stage", "kind", "status", "seconds", "output"):
        table.add_column(column)
    for stage in summary["stages"]:
        outputs = stage["outputs"]
        if "datasets" in outputs:
            detail = ", ".join(f"{k}@{d['version']} ({sum(d['rows'].values())} rows, {d['quarantined']} quarantined)"
                               for k, d in outputs["datasets"].items())
        elif "checkpoint_uri" in outputs and stage["kind"] in ("rl", "sft"):
            detail = f"global_step_{outputs['global_step']}"
        elif "metrics" in outputs:
            detail = eval_detail(outputs["metrics"])
        elif "model_name" in outputs:
            detail = f"{outputs['model_name']} version {outputs['version']}"
        else:
            detail = ""
        table.add_row(stage["name"], stage["kind"], stage["status"], f"{stage['seconds']:.1f}", detail)
    console.print(table)
    for stage in summary["stages"]:
        for key, d in stage["outputs"].get("datasets", {}).items():
            console.print(f"dataset      {key} version {d['version']}: {d['uri']}")
        if "checkpoint_uri" in stage["outputs"] and stage["kind"] in ("rl", "sft"):
            out = stage["outputs"]
            console.print(f"checkpoint   {out['checkpoint_uri']} (sha256 {out['weights_sha256'][:16]}…)")
    console.print(f"mlflow       parent run {summary['mlflow_parent_run_id']} at {summary['tracking_uri']}")
    from omni_core.lineage.tracking import mlflow_experiment_url

    console.print(f"mlflow       runs {mlflow_experiment_url(summary['tracking_uri'], summary['mlflow_experiment_id'])}")
    for stage in summary["stages"]:
        if stage["kind"] == "register" and stage["outputs"].get("version"):
            print_registered(summary, stage["outputs"])
    from omni_core.lineage import ui_command

    console.print(f"open MLflow  {ui_command(summary['tracking_uri'])}")
    if local_server:  # the flow run's page (the server's front page lists only counts)
        keep = "" if local_server.idle_minutes is None else "; `omni server start` keeps it running"
        console.print(f"open Prefect {summary.get('prefect_flow_run_url') or local_server.url}   (omni's local Prefect "
                      f"server: it {local_server.stops()}{keep})")
    elif prefect_home:
        console.print(f"open Prefect PREFECT_HOME={prefect_home} prefect server start   (then http://127.0.0.1:4200)")
    else:
        console.print(f"open Prefect {summary.get('prefect_flow_run_url') or os.environ.get('PREFECT_API_URL', '').removesuffix('/api')}")


HEADLINE_METRICS = ("val/reward_mean", "eval_rewards/accuracies")


def eval_detail(metrics: dict) -> str:
    """An eval's headline metric, with its baseline and the gain over it when the stage scored one."""
    for name in HEADLINE_METRICS:
        if name in metrics:
            text = f"{name} {metrics[name]:.4g}"
            if f"{name}_baseline" in metrics:
                text += f" (baseline {metrics[name + '_baseline']:.4g}, gain {metrics[name + '_gain']:+.4g})"
            return text
    return ""


def print_registered(summary: dict, registered: dict) -> None:
    """The model version a register stage created (or found) and its lineage, as `omni lineage` shows it."""
    from mlflow.exceptions import MlflowException

    from omni_core.lineage import Tracker
    from omni_core.lineage.chain import format_lineage, lineage

    uri = f"models:/{registered['model_name']}/{registered['version']}"
    try:
        chain = lineage(Tracker(summary["tracking_uri"]), uri, store_root=summary["store"])
    except (OmniError, MlflowException) as exc:
        console.print(f"registered   {uri} (lineage unavailable: {escape(str(exc))})")
        return
    mv = chain["model_version"]
    score = f"{mv['metric']} {mv['score']:.6g}" if mv["score"] is not None else "no score"
    reason = f" ({mv['promotion_reason']})" if mv["promotion_reason"] else ""
    console.print(escape(f"registered   {mv['name']} version {mv['version']} "
                         f"[{', '.join(mv['aliases']) or 'no alias'}] {score}: {mv['promotion'] or '-'}{reason}"))
    console.print(escape(f"lineage      omni lineage {uri} --tracking-uri {summary['tracking_uri']}"))
    for line in format_lineage(chain):
        console.print(f"  {escape(line)}")


@app.command()
def fixtures(
    name: Annotated[str, typer.Argument(help="Dataset name, e.g. gsm8k.")],
    out: Annotated[Path, typer.Option("--out", help="Directory to write the raw files into.")],
    rows: Annotated[int, typer.Option("--rows", min=1, help="Rows in the train split.")] = 64,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    bad_rows: Annotated[int, typer.Option("--bad-rows", min=0, help="Unusable rows to mix in (for testing).")] = 0,
) -> None:
    """Write a dataset's raw files exactly as it ships (for tests and offline demos)."""
    from omni_core.data import write_fixture

    for path in write_fixture(name, out, rows=rows, seed=seed, bad_rows=bad_rows):
        console.print(str(path))


def main() -> None:
    try:
        app()
    except OmniError as exc:
        if state.debug:
            traceback.print_exc()
        err_console.print(f"[red]error:[/red] {escape(str(exc))}")
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]")
        sys.exit(130)
    except Exception as exc:
        if state.debug:
            traceback.print_exc()
        from flows.access import refused

        if hint := refused(exc):
            err_console.print(f"[red]error:[/red] {escape(hint)}")
            sys.exit(2)
        err_console.print(f"[red]unexpected error:[/red] {exc.__class__.__name__}: {escape(str(exc))} "
                          "(rerun with --debug for the traceback)")
        sys.exit(1)


if __name__ == "__main__":
    main()
