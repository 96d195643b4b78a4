"""Model factory: one URI names a causal LM and its tokenizer.

Accepted forms:
- `tiny://<name>`: a built-in tiny model (random weights, local tokenizer), see `omni_core.models.tiny`;
- a local `save_pretrained` directory: `/abs/path`, `./rel/path`, `~/path` or `file:///abs/path`;
- a Hugging Face hub id, `org/name` (needs network access or a populated HF cache).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from omni_core.errors import ModelError
from omni_core.models.tiny import tiny_model_dir

ACCEPTED_FORMS = "tiny://<name> (e.g. tiny://lm), a local save_pretrained directory, or a hub id 'org/name'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_PATH_PREFIXES = ("/", "./", "../", "~", "file://")


def load_model(uri: str, *, seed: int = 0) -> tuple[Any, Any]:
    """Load `(model, tokenizer)` named by `uri`; the model is float32-or-as-saved, in eval mode.

    `seed` sets the random init of a `tiny://` model (each seed is its own cached build); for other
    forms it seeds torch before loading, so any freshly initialised weights are reproducible.
    """
    if not isinstance(uri, str) or not uri:
        raise ModelError(f"model URI {uri!r} is empty or not a string; use {ACCEPTED_FORMS}")
    if uri.startswith("tiny://"):
        return _from_pretrained(tiny_model_dir(uri.removeprefix("tiny://"), seed=seed), uri, seed, True)
    local = Path(uri.removeprefix("file://")).expanduser()
    if uri.startswith(_PATH_PREFIXES) or local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelError(
                f"model URI {uri!r}: {local} is not a save_pretrained directory (no config.json); "
                f"fix the path or use {ACCEPTED_FORMS}"
            )
        return _from_pretrained(local, uri, seed, True)
    if "://" not in uri and _HUB_ID.match(uri):
        return _from_pretrained(uri, uri, seed, False)
    raise ModelError(f"model URI {uri!r} is not understood; use {ACCEPTED_FORMS}")


def _from_pretrained(source: str | Path, uri: str, seed: int, local_only: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
            model = AutoModelForCausalLM.from_pretrained(source, local_files_only=local_only)
    except (OSError, ValueError, KeyError) as exc:
        where = "the directory" if local_only else "the hub (is the network reachable and the id right?)"
        raise ModelError(f"cannot load model {uri!r} from {where}: {exc}") from exc
    model.eval()
    return model, tokenizer
