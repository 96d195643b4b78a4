"""`omni deploy`, `omni serve`, `omni status`: the pipeline flows on a Prefect server.

Mounted by flows/cli.py (`register_commands(app)`). Prefect is imported inside the commands, so
mounting these costs `omni` no start-up time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

console = Console(highlight=False, soft_wrap=True)

NamesArg = Annotated[list[str] | None, typer.Argument(help="Deployment names from prefect.yaml (default: all).")]
FileOption = Annotated[Path | None, typer.Option("--file", help="The prefect.yaml (default: the repository's).")]


def register_commands(app: typer.Typer) -> None:
    app.command("deploy")(deploy_command)
    app.command("serve")(serve_command)
    app.command("status")(status_command)


def _schedules_text(schedules: list[Any]) -> str:
    parts = []
    for s in schedules:
        spec = s.schedule
        what = (getattr(spec, "cron", None) or getattr(spec, "rrule", None)
                or f"every {getattr(spec, 'interval', '?')}")
        tz = getattr(spec, "timezone", None)
        parts.append(f"{what}{f' {tz}' if tz else ''} ({'active' if s.active else 'inactive'})")
    return "; ".join(parts) or "-"


def deploy_command(
    names: NamesArg = None,
    file: FileOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", help="Show `prefect deploy`'s own output.")] = False,
) -> None:
    """Register the deployments of prefect.yaml with the Prefect server at PREFECT_API_URL."""
    from flows.deployments import (
        CRASH_AUTOMATION,
        PREFECT_FILE,
        api_url,
        deploy,
        ensure_crash_automation,
        ensure_work_pools,
        load_prefect_file,
        read_deployments,
    )

    prefect_file = load_prefect_file(file or PREFECT_FILE)
    specs = prefect_file.select(names)
    url = api_url()
    console.print(f"[bold]omni[/bold] deploying {len(specs)} deployment(s) from {prefect_file.path} to {url}")
    for pool in ensure_work_pools(specs):
        console.print(f"created work pool [cyan]{pool}[/cyan] ({prefect_file.pool_types[pool]})")
    with console.status("prefect deploy ..."):
        result = deploy(prefect_file, specs)
    done, window = ensure_crash_automation()
    console.print(f"automation [cyan]{CRASH_AUTOMATION}[/cyan] {done}: a flow run without a heartbeat for "
                  f"{window} s is marked Crashed (workers: PREFECT_FLOWS_HEARTBEAT_FREQUENCY={window // 2})")
    if verbose:
        console.print(result.stdout, markup=False, end="")
    table = Table(title=f"deployments on {url}")
    for column in ("deployment", "work pool", "schedules", "parameters", "id"):
        table.add_column(column, overflow="fold")
    for flow_name, d in read_deployments(specs):
        table.add_row(f"{flow_name}/{d.name}", d.work_pool_name or "-", _schedules_text(d.schedules),
                      json.dumps(d.parameters, sort_keys=True), str(d.id))
    console.print(table)
    pools = sorted({s.pool for s in specs if s.pool})
    console.print("run them:     " + "  |  ".join(f"prefect worker start --pool {p}" for p in pools))
    console.print("or here:      omni serve   (process-pool deployments, no worker)")
    console.print(f"trigger one:  prefect deployment run 'pipeline/local' --param pipeline_file=...  "
                  f"or 'Run' in the UI at {url.removesuffix('/api')}")


def serve_command(
    names: NamesArg = None,
    file: FileOption = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="Most flow runs at once.")] = None,
) -> None:
    """Serve the process-pool deployments of prefect.yaml from this machine (until interrupted)."""
    from flows.deployments import (
        PREFECT_FILE,
        DeploymentError,
        api_url,
        drop_pool_bindings,
        load_prefect_file,
        servable,
        to_runner_deployments,
    )

    prefect_file = load_prefect_file(file or PREFECT_FILE)
    specs = prefect_file.select(names)
    here = servable(specs)
    if names and len(here) < len(specs):
        others = ", ".join(f"{s.name} ({s.pool_type})" for s in specs if s not in here)
        raise DeploymentError(f"cannot serve {others} from this machine: start a worker of that pool instead")
    url = api_url()
    os.chdir(prefect_file.path.parent)  # entrypoints and relative parameters are relative to prefect.yaml
    deployments = to_runner_deployments(prefect_file, here)
    table = Table(title=f"serving from this machine ({url})")
    for column in ("deployment", "entrypoint", "schedules", "parameters"):
        table.add_column(column, overflow="fold")
    for spec, d in zip(here, deployments, strict=True):
        schedules = "; ".join(f"{s.get('cron') or s.get('rrule') or s.get('interval')} "
                              f"({'active' if s.get('active', True) else 'inactive'})" for s in spec.schedules)
        table.add_row(f"{d.flow_name}/{d.name}", spec.entrypoint, schedules or "-", json.dumps(d.parameters))
    console.print(table)
    for name in drop_pool_bindings(deployments):
        console.print(f"replaced the work-pool deployment {name} with the served one (omni deploy restores it)")
    console.print("Ctrl+C stops serving (and pauses these schedules).")

    from prefect import serve

    serve(*deployments, limit=limit, print_starting_message=False)


def _when(value: Any) -> str:
    return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def status_command(
    run: Annotated[str | None, typer.Argument(help="Flow run id or name (default: the latest pipeline run).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run and its stages as one JSON object.")] = False,
) -> None:
    """The stage table of the latest (or a given) pipeline run, from Prefect's API."""
    from dataclasses import asdict

    from flows.prefect_env import use_embedded_prefect, use_running_api
    from flows.run_status import RunNotFoundError, run_status

    home = use_embedded_prefect()  # without PREFECT_API_URL: the runs `omni run` recorded under .omni/
    use_running_api(home)  # read through omni's local server when it runs (else Prefect's temporary one)
    if home and not Path(home).is_dir():
        raise RunNotFoundError(f"no pipeline runs recorded in {home}: PREFECT_API_URL is not set, so omni status "
                               "reads what `omni run` recorded in this directory; run it where you ran `omni run`, "
                               "or set PREFECT_API_URL")
    status = run_status(run)
    if as_json:
        print(json.dumps(asdict(status), default=str, sort_keys=True))
        return
    where = f", deployment {status.deployment}" if status.deployment else ""
    table = Table(title=f"{status.flow} run {status.name} ({status.id}{where}): {status.state}, "
                        f"started {_when(status.start)}, {_duration(status.seconds)}")
    for column in ("stage", "state", "start", "duration", "cache", "retries"):
        table.add_column(column)
    for stage in status.stages:
        state = stage.state + (f": {stage.message}" if stage.message and stage.state not in ("Completed", "Cached")
                               else "")
        table.add_row(stage.name, state, _when(stage.start), _duration(stage.seconds),
                      "hit" if stage.cache_hit else "-", str(stage.retries) if stage.retries else "")
    console.print(table)
    if not status.stages:
        console.print("no stages have started in this run")
    if status.parameters:
        console.print(f"parameters   {json.dumps(status.parameters, sort_keys=True, default=str)}", markup=False)
    if status.artifacts:
        console.print("artifacts    " + ", ".join(f"{key} ({kind})" for key, kind in status.artifacts))
