"""`omni server start|status|stop`: omni's local Prefect servers (flows/local_prefect.py).

`omni run` and `omni ingest` start this directory's server on first need and it stops itself once
unused (OMNI_PREFECT_SERVER_IDLE_MINUTES, default 30); `start` starts one that stays, `status` lists
every server omni started on this machine, `stop` stops this directory's (`--all`: every one).
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.console import Console

console = Console(highlight=False, soft_wrap=True)
server_app = typer.Typer(no_args_is_help=True, help="omni's local Prefect servers (the embedded default's API and UI).")
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def _home() -> str:
    from flows.prefect_env import embedded_home

    return embedded_home()


def _fields(server) -> dict:
    return {"url": server.url if server else None, "pid": server.pid if server else None,
            "prefect_home": server.home if server else None,
            "idle_minutes": server.idle_minutes if server else None}


def _print(server, state: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"state": state, **_fields(server)}, sort_keys=True))
    elif server:
        stops = f"; it {server.stops()}" if state == "running" else ""
        console.print(f"omni's local Prefect server {state}: {server.url} (pid {server.pid}, "
                      f"PREFECT_HOME={server.home}){stops}")
    else:
        console.print(f"omni's local Prefect server: {state}")


@server_app.command("start")
def start_command(as_json: JsonOption = False) -> None:
    """Start this directory's server now, or keep the running one: either stays until `omni server stop`
    (one started by `omni run` stops itself after OMNI_PREFECT_SERVER_IDLE_MINUTES without use)."""
    from flows.local_prefect import start_local_server

    _, wait = start_local_server(_home(), stay=True)
    _print(wait(), "running", as_json)


@server_app.command("status")
def status_command(as_json: JsonOption = False) -> None:
    """This directory's server, then every server omni started on this machine (as this user)."""
    from flows.local_prefect import registered_servers, running_server

    home = _home()
    server = running_server(home)
    servers = registered_servers()
    if as_json:
        print(json.dumps({"state": "running" if server else "not running", **_fields(server),
                          "servers": [_fields(s) for s in servers]}, sort_keys=True))
        return
    _print(server, "running" if server else "not running", False)
    if not servers:
        return
    console.print("every local Prefect server omni started on this machine:")
    for s in servers:
        stops = "stays until `omni server stop`" if s.idle_minutes is None else f"stops after {s.idle_minutes:g} min unused"
        console.print(f"  {s.url}  pid {s.pid}  up {(time.time() - s.started_at) / 60:.0f} min  {stops}  "
                      f"PREFECT_HOME={s.home}")


@server_app.command("stop")
def stop_command(
    every: Annotated[bool, typer.Option("--all", help="Every server omni started on this machine.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Stop this directory's server (`--all`: every one omni started); the runs stay in each
    PREFECT_HOME, and the next `omni run` starts a server again."""
    from flows.local_prefect import stop_all_servers, stop_local_server

    if not every:
        server = stop_local_server(_home())
        _print(server, "stopped" if server else "not running", as_json)
        return
    stopped = stop_all_servers()
    if as_json:
        print(json.dumps({"stopped": [_fields(s) for s in stopped]}, sort_keys=True))
        return
    for server in stopped:
        _print(server, "stopped", False)
    if not stopped:
        console.print("no local Prefect server was running")
