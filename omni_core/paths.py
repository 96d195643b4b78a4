"""Where omni keeps local caches (built-in tiny models, generated fixtures, downloaded raw data)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """`$OMNI_CACHE_DIR` (default `~/.cache/omni`) joined with `parts`, created if missing."""
    root = Path(os.environ.get("OMNI_CACHE_DIR") or Path.home() / ".cache" / "omni")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


# The embedded default: everything a run writes stays under ./.omni/ (docs/design/deployment.md).
OMNI_HOME = Path(".omni")
DEFAULT_STORE = ".omni/store"
DEFAULT_TRACKING_URI = "sqlite:///.omni/mlflow.db"
