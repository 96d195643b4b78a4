"""What every `omni` command shares: the embedded defaults, the common options and the `--debug` state.

The command modules (flows/cli_*.py) import this, never flows/cli.py, which only mounts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer

from omni_core.paths import DEFAULT_STORE, DEFAULT_TRACKING_URI

__all__ = ["DEFAULT_STORE", "DEFAULT_TRACKING_URI", "StoreOption", "TrackingUriOption", "state"]


@dataclass
class CliState:
    debug: bool = False  # set by `omni --debug`: show tracebacks (also Prefect's)


state = CliState()

StoreOption = Annotated[str, typer.Option("--store", help="Store root: a path or s3://bucket/prefix.")]
TrackingUriOption = Annotated[str, typer.Option("--tracking-uri")]
