"""Raw dataset sources: resolve a source URI to a local directory of raw files with their digests."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from omni_core.data.fixtures import fixture_names, write_fixture
from omni_core.errors import DataError
from omni_core.paths import cache_dir
from omni_core.storage.digest import file_sha256


@dataclass(frozen=True)
class RawSource:
    uri: str  # as configured, recorded in manifests and lineage
    root: Path  # local directory holding the raw files
    files: dict[str, str]  # relative posix path -> sha256 of the raw bytes

    def path(self, rel: str) -> Path:
        return self.root / rel


def _digest_tree(root: Path) -> dict[str, str]:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    # hashlib releases the GIL on large updates, so threads digest several files at once.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(file_sha256, files))
    return {p.relative_to(root).as_posix(): d for p, d in zip(files, digests, strict=True)}


def resolve_source(uri: str) -> RawSource:
    """fixtures://NAME?rows=N&seed=S[&bad_rows=K], a local directory, file://..., s3://... or hf://ORG/NAME."""
    parsed = urlparse(uri)
    if parsed.scheme == "fixtures":
        root = _fixture_dir(parsed.netloc, parse_qs(parsed.query), uri)
    elif parsed.scheme == "s3":
        root = _download_s3(uri)
    elif parsed.scheme == "hf":
        root = _download_hub(parsed.netloc + parsed.path)
    elif parsed.scheme in ("", "file"):
        root = Path(parsed.path if parsed.scheme == "file" else uri).expanduser().resolve()
        if not root.is_dir():
            raise DataError(f"dataset source {uri}: no such directory; point source: at the raw dataset's folder")
    else:
        raise DataError(f"dataset source {uri}: unknown scheme '{parsed.scheme}'; use fixtures://, a path, s3:// or hf://")
    files = _digest_tree(root)
    if not files:
        raise DataError(f"dataset source {uri}: no files under {root}; check the path")
    return RawSource(uri=uri, root=root, files=files)


def _fixture_dir(name: str, query: dict[str, list[str]], uri: str) -> Path:
    if name not in fixture_names():
        raise DataError(f"dataset source {uri}: no fixture '{name}'; known: {', '.join(fixture_names())}")
    try:
        args = {k: int(query.pop(k, [default])[0]) for k, default in (("rows", 64), ("seed", 0), ("bad_rows", 0))}
    except ValueError as exc:
        raise DataError(f"dataset source {uri}: rows, seed and bad_rows must be integers") from exc
    if query:
        raise DataError(f"dataset source {uri}: unknown parameters {sorted(query)}; use rows, seed, bad_rows")
    final = cache_dir("fixtures") / f"{name}-rows{args['rows']}-seed{args['seed']}-bad{args['bad_rows']}"
    if not final.is_dir():
        # Generate beside the final name and rename, so concurrent runs never read a half-written fixture.
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        write_fixture(name, tmp, **args)
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is identical
    return final


def _download_s3(uri: str) -> Path:
    """Copies the prefix to a local cache, streamed; fetched anew each time so a changed source is never stale."""
    from omni_core.storage import Store

    store = Store(uri)
    keys = store.list()
    if not keys:
        raise DataError(f"dataset source {uri}: no objects under this prefix; check the URI")
    final = cache_dir("raw") / hashlib.sha256(uri.encode()).hexdigest()[:16]
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        for key in keys:
            target = tmp / key
            target.parent.mkdir(parents=True, exist_ok=True)
            with store.open_read(key) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _download_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=repo_id, repo_type="dataset"))
    except Exception as exc:  # network, auth, or unknown repo: all user-fixable
        raise DataError(f"dataset source hf://{repo_id}: download failed ({exc.__class__.__name__}); "
                        "check the id and network access, or copy the files to a local folder or s3://") from exc
