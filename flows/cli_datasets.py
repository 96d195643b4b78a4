"""`omni ingest` and `omni datasets list|show`: dataset versions from the command line."""

from __future__ import annotations

import io
import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from flows.cli_options import DEFAULT_STORE, DEFAULT_TRACKING_URI, StoreOption, TrackingUriOption

console = Console(highlight=False, soft_wrap=True)
datasets_app = typer.Typer(no_args_is_help=True, help="Dataset versions in the store.")


def ingest_command(
    name: Annotated[str, typer.Argument(help="Dataset name in the store (and default converter).")],
    source: Annotated[str, typer.Option("--source", help="fixtures://NAME?rows=N, a folder, s3://... or hf://...")],
    converter: Annotated[str | None, typer.Option("--converter", help="Converter (default: NAME).")] = None,
    store: StoreOption = DEFAULT_STORE,
    tracking_uri: TrackingUriOption = DEFAULT_TRACKING_URI,
    workers: Annotated[int, typer.Option("--workers", min=1, help="Conversion processes.")] = 1,
    max_quarantine_fraction: Annotated[float, typer.Option("--max-quarantine-fraction", min=0, max=1)] = 0.05,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Ingest a raw dataset into a versioned Parquet dataset (a Prefect flow; logged to MLflow)."""
    from flows.prefect_env import (
        quiet_prefect_tracebacks,
        start_embedded_api,
        start_embedded_prefect_once,
        use_embedded_prefect,
    )
    from omni_core.config import validate_dataset
    from omni_core.storage import Store

    validate_dataset(name, {"source": source, "converter": converter or name,  # before any server starts
                            "max_quarantine_fraction": max_quarantine_fraction})
    Store(store).check_writable()
    home = use_embedded_prefect()
    api_ready = start_embedded_api(home)  # omni's local Prefect server, started or reused
    from flows.ingest import ingest

    quiet_prefect_tracebacks()
    if api_ready() is None:  # Prefect's temporary server: the first of several runs migrates its database
        start_embedded_prefect_once(home)
    [result] = ingest(name=name, source=source, converter=converter, store=store, tracking_uri=tracking_uri,
                      workers=workers, max_quarantine_fraction=max_quarantine_fraction)
    if as_json:
        print(json.dumps(result, sort_keys=True))
        return
    counts = result["counts"]
    state = "already committed (no work done)" if result["reused"] else "committed"
    console.print(f"dataset {name} version [bold]{result['version']}[/bold] {state}: {result['uri']}")
    console.print("rows: " + ", ".join(f"{s}={n}" for s, n in result["rows"].items())
                  + f"; read {counts['read']} = written {counts['rows']} + quarantined {counts['quarantined']}"
                  + f" + skipped {counts['skipped']}")
    console.print(f"mlflow run {result['mlflow_run_id']} at {result['tracking_uri']}")


@datasets_app.command("list")
def list_command(store: StoreOption = DEFAULT_STORE) -> None:
    """Every dataset, its committed versions and their counts (* = LATEST)."""
    from omni_core.data import load_version
    from omni_core.data.ingest import list_versions
    from omni_core.storage import Store

    st = Store(store)
    names = sorted({k.split("/")[1] for k in st.list("datasets") if k.count("/") >= 2})
    table = Table(title=f"datasets in {st.root}")
    for column in ("dataset", "version", "latest", "splits (rows)", "quarantined", "skipped", "source"):
        table.add_column(column)
    for name in names:
        latest = st.read_text(f"datasets/{name}/LATEST").strip() if st.exists(f"datasets/{name}/LATEST") else ""
        for version in list_versions(st, name):
            m = load_version(st, name, version).manifest
            table.add_row(name, version, "*" if version == latest else "",
                          ", ".join(f"{s}={e['rows']}" for s, e in m["splits"].items()),
                          str(m["counts"]["quarantined"]), str(m["counts"].get("skipped", 0)), m["source_uri"])
    console.print(table)


def describe(value: Any, limit: int = 160) -> str:
    """A short, readable form of a cell: media bytes become their format and size."""
    if isinstance(value, bytes):
        try:
            from PIL import Image

            with Image.open(io.BytesIO(value)) as image:
                return f"<{image.format} {image.width}x{image.height}, {len(value)} bytes>"
        except Exception:  # not an image: audio or other media
            kind = "WAV" if value[:4] == b"RIFF" else "bytes"
            return f"<{kind}, {len(value)} bytes>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v, limit)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(describe(v, limit) for v in value) + "]"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@datasets_app.command("show")
def show_command(
    ref: Annotated[str, typer.Argument(help="NAME or NAME@VERSION")],
    store: StoreOption = DEFAULT_STORE,
    rows: Annotated[int, typer.Option("--rows", min=0, help="Sample rows to decode.")] = 2,
    split: Annotated[str | None, typer.Option("--split", help="Split to sample (default: the first).")] = None,
) -> None:
    """A version's manifest summary and a few decoded sample rows."""
    from omni_core.data import load_version
    from omni_core.storage import Store

    st = Store(store)
    name, _, version = ref.partition("@")
    dv = load_version(st, name, version or None)
    m = dv.manifest
    console.print(f"[bold]{name}@{dv.version}[/bold]  {dv.uri}")
    console.print(f"source {m['source_uri']}  converter {m['converter']['name']} v{m['converter']['version']}")
    console.print(f"counts {m['counts']}")
    for s, entry in m["splits"].items():
        console.print(f"  {s}: {entry['rows']} rows in {len(entry['shards'])} shard(s)")
    console.print("schema " + ", ".join(f"{f['name']}: {f['type']}" for f in m["schema"]))
    split = split or next(iter(m["splits"]))
    keys = dv.shard_keys(split)
    if rows and keys:
        import pyarrow.parquet as pq  # here, not at the top: every `omni` command imports this module (~1 s)

        # read in this thread only: Arrow's pool threads (pre-buffering, decoding) that are still being torn
        # down when a short command exits can abort the process ("terminate called without an active
        # exception", SIGABRT: apache/arrow#34314), seen once on `omni datasets show` in the test suite
        with st.open_read(keys[0]) as f:
            sample = pq.ParquetFile(f, pre_buffer=False).read_row_group(0, use_threads=False).slice(0, rows).to_pylist()
        for i, row in enumerate(sample):
            console.print(f"[bold]{split}[{i}][/bold]")
            for column, value in row.items():
                console.print(f"  {column}: {describe(value)}")
