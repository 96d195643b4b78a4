"""`omni lineage [TARGET]`: a registered model version's chain back to its raw data, from MLflow.

Mounted by flows/cli.py (`register_commands(app)`). Prints the chain as a tree (or one JSON object
with --json), with a `re-check: omni verify URI` line under the checkpoint and each dataset version: every
checkpoint and dataset digest shown is the one the store's `_manifest.json` records, and `omni
verify` re-hashes the bytes against it. Exit status 0; 2 (via flows.cli.main) when the target, the
tracking URI or the store cannot be used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from flows.cli_options import DEFAULT_STORE, DEFAULT_TRACKING_URI

console = Console(highlight=False, soft_wrap=True)


def register_commands(app: typer.Typer) -> None:
    app.command("lineage")(lineage_command)


def settings(pipeline: Path | None, tracking_uri: str | None, store: str | None) -> tuple[str, str]:
    """(tracking URI, store root): the options, else the pipeline file's, else the embedded defaults."""
    if pipeline:
        from omni_core.config import load_pipeline

        config = load_pipeline(pipeline)
        return tracking_uri or config.tracking_uri, store or config.store
    return tracking_uri or DEFAULT_TRACKING_URI, store or DEFAULT_STORE


def open_tracker(tracking_uri: str):  # -> omni_core.lineage.Tracker
    """A Tracker for reading: a sqlite database that does not exist is an error (not a new database)."""
    from omni_core.lineage import Tracker, sqlite_path
    from omni_core.lineage.chain import LineageError

    db = sqlite_path(tracking_uri)
    if db is not None and not db.is_file():
        raise LineageError(f"no MLflow database at {db}; run a pipeline first (omni run PIPELINE.yaml), or give "
                           "the tracking URI it logged to (--tracking-uri URI or --pipeline FILE)")
    return Tracker(tracking_uri)


def lineage_command(
    target: Annotated[str | None, typer.Argument(
        help="models:/NAME@ALIAS, models:/NAME/VERSION, models:/NAME, or an MLflow run id (a register, eval or "
             "training stage run, or a pipeline run). Default: the newest registered model version.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (every raw file included).")] = False,
    files: Annotated[bool, typer.Option("--files", help="List every raw source file and its sha256 (by default "
                                                      "one line: their count and the sha256 of the list).")] = False,
    pipeline: Annotated[Path | None, typer.Option(
        "--pipeline", "-p", help="Take the tracking URI and store from this pipeline file.")] = None,
    tracking_uri: Annotated[str | None, typer.Option(
        "--tracking-uri", help=f"MLflow tracking URI (default: the pipeline's, else {DEFAULT_TRACKING_URI}).")] = None,
    store: Annotated[str | None, typer.Option(
        "--store", help=f"Store root to cross-check manifests in (default: the pipeline's, else {DEFAULT_STORE}; "
                        "the store each URI recorded in MLflow names is read too).")] = None,
) -> None:
    """Show where a model came from: model version -> eval run -> training run(s) -> checkpoint ->
    dataset versions -> raw source files, with every digest and how to re-check it.

    A dataset version's raw files print as one line, `raw files N, list sha256 D`: D is the sha256 of
    the lines `PATH<TAB>SHA256<LF>` of its manifest's raw files, sorted (LC_ALL=C sort), so `jq -r
    '.raw_files[] | "\\(.path)\\t\\(.sha256)"' _manifest.json | LC_ALL=C sort | sha256sum` gives it too.
    --files lists every file; --json always does."""
    from omni_core.lineage.chain import format_lineage, lineage

    uri, store_root = settings(pipeline, tracking_uri, store)
    chain = lineage(open_tracker(uri), target, store_root=store_root)
    if as_json:
        print(json.dumps(chain, sort_keys=True))
        return
    for line in format_lineage(chain, files=files):  # with a `re-check: omni verify URI` line per checkpoint and dataset
        console.print(escape(line))
