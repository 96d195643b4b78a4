"""`omni server start|status|stop`: omni's local Prefect server of this directory (flows/local_prefect.py).

`omni run` and `omni ingest` start it on first need; these commands show where it is and stop it.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
server_app = typer.Typer(no_args_is_help=True, help="omni's local Prefect server (the embedded default's API and UI).")
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def _home() -> str:
    from flows.prefect_env import embedded_home

    return embedded_home()


def _print(server, state: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"state": state, "url": server.url if server else None, "pid": server.pid if server else None,
                          "prefect_home": server.home if server else None}, sort_keys=True))
    elif server:
        console.print(f"omni's local Prefect server {state}: {server.url} (pid {server.pid}, PREFECT_HOME={server.home})")
    else:
        console.print(f"omni's local Prefect server: {state}")


@server_app.command("start")
def start_command(as_json: JsonOption = False) -> None:
    """Start it now (else the first `omni run` does) and wait until it answers."""
    from flows.local_prefect import start_local_server

    _, wait = start_local_server(_home())
    _print(wait(), "running", as_json)


@server_app.command("status")
def status_command(as_json: JsonOption = False) -> None:
    """Where it runs, or that it does not."""
    from flows.local_prefect import running_server

    server = running_server(_home())
    _print(server, "running" if server else "not running", as_json)


@server_app.command("stop")
def stop_command(as_json: JsonOption = False) -> None:
    """Stop it (the next `omni run` starts it again); its runs stay in .omni/prefect."""
    from flows.local_prefect import stop_local_server

    server = stop_local_server(_home())
    _print(server, "stopped" if server else "not running", as_json)
