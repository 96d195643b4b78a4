"""Reading the store for lineage: each checkpoint's and dataset version's `_manifest.json`, cross-checked
against what MLflow recorded (status OK, MISMATCH, MISSING, UNREACHABLE or not checked). Only reads."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omni_core.errors import OmniError
from omni_core.storage import Store
from omni_core.storage.digest import file_list_sha256

MANIFEST = "_manifest.json"
OK, MISMATCH, MISSING, UNREACHABLE, UNKNOWN = "ok", "MISMATCH", "MISSING", "UNREACHABLE", "not checked"


def _split_root(uri: str, marker: str) -> tuple[str, str] | None:
    """(store root, key) of a store URI whose key starts with `marker` (datasets/ or runs/)."""
    index = uri.rfind(f"/{marker}/")
    if not uri or index < 0:
        return None
    return uri[:index] or "/", uri[index + 1:].rstrip("/")


def _read_manifest(roots: Iterable[str | None], key: str) -> tuple[Store | None, dict[str, Any] | None, str, str]:
    """The first store of `roots` holding `key/_manifest.json`: (store, manifest, status, detail);
    status MISSING when every store answered without it, UNREACHABLE when one could not be read."""
    problems, status, seen = [], MISSING, set()
    for root in roots:
        if not root or root in seen:
            continue
        seen.add(root)
        try:
            store = Store(root)
            manifest_key = f"{key}/{MANIFEST}"
            if store.exists(manifest_key):
                return store, store.read_json(manifest_key), OK, ""
            problems.append(f"no {store.uri(manifest_key)}")
        except (OmniError, OSError, ValueError) as exc:
            status = UNREACHABLE
            problems.append(f"{root}: {exc}")
    if not seen:
        return None, None, UNKNOWN, "no store to read (give --store)"
    return None, None, status, "; ".join(problems)


def check_dataset(entry: dict[str, Any], store_root: str | None) -> None:
    key = f"datasets/{entry['name']}/{entry['version']}"
    derived = _split_root(entry["uri"], "datasets")
    store, manifest, status, detail = _read_manifest([store_root, derived[0] if derived else None], key)
    entry.update(raw_files=[], raw_files_count=0, raw_files_sha256="", manifest_uri="",
                 store_check={"status": status, "detail": detail})
    if manifest is None:
        entry["recheck"] = f"omni verify {entry['uri'] or entry['name'] + '@' + entry['version']} --raw"
        return
    assert store is not None
    entry["uri"] = entry["uri"] or store.uri(key)
    entry["manifest_uri"] = store.uri(f"{key}/{MANIFEST}")
    rows = {s: e.get("rows") for s, e in (manifest.get("splits") or {}).items()}
    differences = []
    if manifest.get("version", entry["version"]) != entry["version"]:
        differences.append(f"manifest version {manifest.get('version')} != MLflow digest {entry['version']}")
    if entry["rows"] and rows != entry["rows"]:
        differences.append(f"rows per split {rows} in the manifest, {entry['rows']} in MLflow")
    if entry["raw_source_uri"] and manifest.get("source_uri") not in (None, entry["raw_source_uri"]):
        differences.append(f"raw source {manifest.get('source_uri')} in the manifest, {entry['raw_source_uri']} in MLflow")
    entry["rows"] = rows
    entry["raw_source_uri"] = manifest.get("source_uri", entry["raw_source_uri"])
    entry["raw_files"] = [{"path": f.get("path", ""), "sha256": f.get("sha256", "")} for f in manifest.get("raw_files", [])]
    entry["raw_files_count"] = len(entry["raw_files"])  # a real source has thousands: shown as a count and
    entry["raw_files_sha256"] = file_list_sha256((f["path"], f["sha256"]) for f in entry["raw_files"])  # one digest
    entry["counts"] = manifest.get("counts", entry["counts"])
    entry["converter"] = manifest.get("converter", entry["converter"])
    entry["store_check"] = {"status": MISMATCH if differences else OK, "detail": "; ".join(differences)}
    entry["recheck"] = f"omni verify {store.uri(key)} --raw"  # --raw: the raw files' sha256s too


def checkpoint_summary(uri: str, sha256: str, global_step: str | int | None, model_id: str, run_key: str,
                store_root: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"uri": uri, "global_step": int(global_step) if str(global_step or "").isdigit() else None,
                             "sha256": sha256, "model_id": model_id, "run_key": run_key, "weights_file": "",
                             "files": 0, "manifest_uri": "", "store_check": {"status": UNKNOWN, "detail": ""},
                             "recheck": f"omni verify {uri}" if uri else ""}
    derived = _split_root(uri, "runs")
    if derived is None:
        entry["store_check"] = {"status": UNKNOWN, "detail": f"{uri or 'no URI'} is not a checkpoint folder of a store"}
        return entry
    roots = [store_root] if store_root and uri.startswith(Store(store_root).root + "/") else []
    store, manifest, status, detail = _read_manifest([*roots, derived[0]], derived[1])
    if manifest is None:
        entry["store_check"] = {"status": status, "detail": detail}
        return entry
    assert store is not None
    entry["manifest_uri"] = store.uri(f"{derived[1]}/{MANIFEST}")
    files = manifest.get("files") or []
    path = manifest.get("weights")
    weights = next((f for f in files if (f.get("path") == path if path else f.get("path", "").endswith(".safetensors"))),
                   {})
    entry.update(weights_file=weights.get("path", ""), files=len(files))
    differences = []
    if weights.get("sha256") != sha256:
        differences.append(f"weights sha256 {weights.get('sha256')} in the manifest, {sha256} in MLflow")
    if entry["global_step"] is not None and manifest.get("global_step") not in (None, entry["global_step"]):
        differences.append(f"global_step {manifest.get('global_step')} in the manifest, {entry['global_step']} in MLflow")
    if entry["global_step"] is None:
        entry["global_step"] = manifest.get("global_step")
    entry["store_check"] = {"status": MISMATCH if differences else OK, "detail": "; ".join(differences)}
    return entry

