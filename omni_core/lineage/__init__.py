"""MLflow lineage: run hierarchy, dataset inputs, checkpoints; redaction of secrets; store digest checks.

The MLflow-backed names (`Tracker`, `log_dataset_version`, ...) load lazily, so `omni verify`
(`omni_core.lineage.verify`: a store's bytes against its manifests) starts without importing MLflow,
which took most of the command's time."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from omni_core.lineage.redact import REDACTED, is_secret_key, redact, redact_text
from omni_core.lineage.verify import FileCheck, VerifyError, resolve_target, verify, verify_target

_LAZY = {"log_dataset_version": "datasets", "Tracker": "tracking", "git_commit": "tracking",
         "normalize_tracking_uri": "tracking", "sqlite_path": "tracking", "ui_command": "tracking"}

__all__ = ["REDACTED", "FileCheck", "Tracker", "VerifyError", "git_commit", "is_secret_key", "log_dataset_version",
           "normalize_tracking_uri", "redact", "redact_text", "resolve_target", "sqlite_path", "ui_command", "verify",
           "verify_target"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"omni_core.lineage.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'omni_core.lineage' has no attribute {name!r}")
