"""A local folder made whole or not at all: filled in a temporary sibling, then renamed into place.

    materialise(final, fill)            fill(tmp) writes the folder's files; a concurrent maker that got
                                        there first wins (its folder is kept, ours removed)
    download_prefix(store, keys, tmp)   every key of `store` copied to tmp/key (streamed)

Used for models taken from an s3:// prefix into the local cache (omni_core.models.factory) and onto
the shared path of a verl cluster (omni_core.backends.jobs.export).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from omni_core.storage.store import CHUNK, Store


def materialise(final: str | os.PathLike[str], fill: Callable[[Path], object]) -> Path:
    """Create folder `final` from `fill(tmp)`; readers never see a half-filled folder."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        fill(tmp)
        tmp.chmod(0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a concurrent maker that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def download_prefix(store: Store, keys: Iterable[str], folder: str | os.PathLike[str]) -> None:
    """Copy each of `keys` from `store` to `folder/key`."""
    for key in keys:
        target = Path(folder) / key
        target.parent.mkdir(parents=True, exist_ok=True)
        with store.open_read(key) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
