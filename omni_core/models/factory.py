"""Model factory: one URI names a model; an adapter decides how it is loaded and trained.

Accepted forms:
- `tiny://<name>`: a built-in tiny model (random weights, local tokenizer), see `omni_core.models.tiny`;
- a local `save_pretrained` directory: `/abs/path`, `./rel/path`, `~/path` or `file:///abs/path`;
- `s3://bucket/prefix`: such a directory in an object store, downloaded once into the cache;
- a Hugging Face hub id, `org/name` (needs network access or a populated HF cache).

What comes back depends on the adapter (`omni_core.models.adapters`): `(model, tokenizer)` for causal
LMs (as before), `(model, processor)` for Qwen3-Omni (the processor has `.tokenizer`), and
`(SD3Model, tokenizer)` for SD3 folders. Without `adapter=`/`stage=` the adapter registered for the
model's architecture and stage "all" is used: the model comes back whole, as saved.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from omni_core.errors import ModelError, StorageError
from omni_core.models.adapters import OmniModelBase, resolve_adapter
from omni_core.models.diffusion import read_pipeline_file
from omni_core.models.lora import LoraSpec
from omni_core.models.tiny import cache_root, digest, tiny_model_dir

ACCEPTED_FORMS = (
    "tiny://<name> (e.g. tiny://lm), a local save_pretrained directory, s3://bucket/prefix, "
    "or a hub id 'org/name'"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_PATH_PREFIXES = ("/", "./", "../", "~", "file://")


def load_model(
    uri: str,
    *,
    seed: int = 0,
    adapter: str | type[OmniModelBase] | None = None,
    stage: str | None = None,
    lora: LoraSpec | dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Load the model named by `uri` and what feeds it (tokenizer or processor); eval mode.

    - `adapter`: a registered adapter name (`causal_lm`, `qwen3_omni`, `qwen3_omni_thinker`, `sd3`)
      or class; `stage`: pick the adapter by (architecture, stage) instead (`thinker`, `all`).
    - `lora`: `{rank, alpha, dropout, target_modules}`; then only the LoRA weights are trainable.
      Without it, the adapter's `trainable_modules` are (all parameters for most adapters).
    - `seed` sets the random init of a `tiny://` model (each seed is its own cached build) and
      seeds torch while loading (LoRA init, any freshly initialised weights).
    """
    source, local_only = _resolve_source(uri, seed)
    architecture = _architecture(source, uri, local_only)
    adapter_cls = resolve_adapter(architecture, adapter=adapter, stage=stage)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return adapter_cls.load(source, local_only=local_only, lora=lora)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load model {uri!r} from {_where(local_only)}: {exc}") from exc


def model_architecture(uri: str, *, seed: int = 0) -> str:
    """The architecture name adapters are registered under, e.g. `Qwen3ForCausalLM`."""
    source, local_only = _resolve_source(uri, seed)
    return _architecture(source, uri, local_only)


def model_source(uri: str, seed: int = 0) -> str | Path:
    """What an engine that loads the model itself (vLLM) takes: the local folder of `uri` (a `tiny://` build,
    an `s3://` prefix downloaded once) or its hub id."""
    return _resolve_source(uri, seed)[0]


def _resolve_source(uri: str, seed: int) -> tuple[str | Path, bool]:
    """(a local directory or a hub id, whether it is local)."""
    if not isinstance(uri, str) or not uri:
        raise ModelError(f"model URI {uri!r} is empty or not a string; use {ACCEPTED_FORMS}")
    if uri.startswith("tiny://"):
        return tiny_model_dir(uri.removeprefix("tiny://"), seed=seed), True
    if uri.startswith("s3://"):
        return _download_s3(uri), True
    local = Path(uri.removeprefix("file://")).expanduser()
    if uri.startswith(_PATH_PREFIXES) or local.is_dir():
        if not (local / "config.json").is_file() and read_pipeline_file(local) is None:
            raise ModelError(
                f"model URI {uri!r}: {local} is not a save_pretrained directory (no config.json); "
                f"fix the path or use {ACCEPTED_FORMS}"
            )
        return local, True
    if "://" not in uri and _HUB_ID.match(uri):
        return uri, False
    raise ModelError(f"model URI {uri!r} is not understood; use {ACCEPTED_FORMS}")


def _architecture(source: str | Path, uri: str, local_only: bool) -> str:
    if local_only:
        pipeline = read_pipeline_file(source)
        if pipeline is not None:
            return pipeline["architecture"]
        config = json.loads((Path(source) / "config.json").read_text())
        architectures = config.get("architectures") or []
    else:
        from transformers import AutoConfig

        try:
            architectures = AutoConfig.from_pretrained(source).architectures or []
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"cannot load model {uri!r} from {_where(local_only)}: {exc}") from exc
    if not architectures:
        raise ModelError(f"model {uri!r}: its config.json names no `architectures`; cannot pick an adapter")
    return architectures[0]


def _where(local_only: bool) -> str:
    return "the directory" if local_only else "the hub (is the network reachable and the id right?)"


def _download_s3(uri: str) -> Path:
    """Copy every object under an s3:// prefix into `<cache>/models/s3/<digest>/` (once; atomic).

    The digest covers the URI, the object keys and, where there is one, the `_manifest.json`, so a
    prefix written again with other content is downloaded again.
    """
    from omni_core.storage import Store
    from omni_core.storage.local_copy import download_prefix, materialise

    try:
        store = Store(uri)
        keys = store.list()
        if not keys:
            raise ModelError(f"model URI {uri!r}: no objects under it; use {ACCEPTED_FORMS}")
        manifest = store.read_text("_manifest.json") if "_manifest.json" in keys else ""
        final = cache_root() / "models" / "s3" / digest([uri, keys, manifest])
        if final.is_dir():
            return final
        materialise(final, lambda tmp: download_prefix(store, keys, tmp))
    except StorageError as exc:
        raise ModelError(f"cannot load model {uri!r} from S3: {exc}; use {ACCEPTED_FORMS}") from exc
    if not (final / "config.json").is_file() and read_pipeline_file(final) is None:
        raise ModelError(
            f"model URI {uri!r} holds no config.json at its top; point it at a save_pretrained folder"
        )
    return final
