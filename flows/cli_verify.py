"""`omni verify [TARGET]`: re-check the sha256 of dataset shards and checkpoint files against their manifests.

Mounted by flows/cli.py (`register_commands(app)`). Exit status: 0 when every file matches, 1 when
any is MISMATCH, MISSING or its manifest INVALID, 2 (via flows.cli.main) when the target or the
store cannot be used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from flows.cli_options import DEFAULT_STORE

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

_STYLE = {"ok": "green", "MISMATCH": "red", "MISSING": "red", "INVALID": "red"}


def register_commands(app: typer.Typer) -> None:
    app.command("verify")(verify_command)


def store_root(store: str | None, pipeline: Path | None) -> str:
    """--store, else the `store:` of --pipeline, else DEFAULT_STORE (as `omni datasets list`)."""
    from omni_core.errors import ConfigError

    if store and pipeline:
        raise ConfigError(f"give --store or --pipeline, not both (--store {store}, --pipeline {pipeline})")
    if pipeline:
        from omni_core.config import load_pipeline

        return load_pipeline(pipeline).store
    return store or DEFAULT_STORE


def verify_command(
    target: Annotated[str | None, typer.Argument(
        help="NAME@VERSION, a store key (datasets/NAME/VERSION, runs/.../checkpoints/global_step_N), or a "
             "store URI or path (a store root, dataset version or checkpoint folder). Default: the whole store.")] = None,
    store: Annotated[str | None, typer.Option(
        "--store", help=f"Store root: a path or s3://bucket/prefix (default: {DEFAULT_STORE}).")] = None,
    pipeline: Annotated[Path | None, typer.Option(
        "--pipeline", "-p", help="Take the store root from this pipeline file's `store:`.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (every file and the summary).")] = False,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Files hashed at once.")] = 4,
    raw: Annotated[bool, typer.Option("--raw", help="Also re-hash each dataset version's raw source files "
                                                    "(resolving its source again: read, downloaded or regenerated).")] = False,
) -> None:
    """Re-hash every dataset shard and checkpoint file and compare it with the sha256 its manifest
    recorded: one line per file (ok, MISMATCH, MISSING), then a summary; exit 1 if any does not match."""
    from omni_core.lineage.verify import Summary, resolve_target, verify

    t = resolve_target(target, store_root(store, pipeline))
    summary = Summary(t.store.root, t.label)
    checks = []
    for check in verify(t.store, t.prefix, workers=workers, raw=raw):
        summary.add(check)
        if as_json:
            checks.append(check.to_json())
            continue
        line = f"[{_STYLE[check.status]}]{check.status:<8}[/] {escape(check.object)}  {escape(check.key)}"
        if check.status == "MISMATCH":
            line += f"  expected sha256 {check.expected_sha256}, actual {check.actual_sha256}"
        elif check.status == "MISSING":
            line += f"  expected sha256 {check.expected_sha256}: " + (escape(check.detail) or "no such object")
        elif check.status == "INVALID":
            line += f"  {escape(check.detail)}"
        console.print(line)
    if as_json:
        print(json.dumps({**summary.to_json(), "results": checks}, sort_keys=True))
    else:
        console.print(f"[{'green' if summary.ok else 'red'}]{escape(summary.line())}[/]")
        if not summary.ok:
            err_console.print("[red]some files do not match their manifest;[/red] do not train on them: restore "
                              "them from a copy, or delete that dataset version folder and run `omni ingest` again "
                              "(a version whose manifest exists is reused as it is), or delete that checkpoint "
                              "folder and train again")
    if not summary.ok:
        raise typer.Exit(1)
