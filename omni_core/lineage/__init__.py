"""MLflow lineage: run hierarchy, dataset inputs, checkpoints; redaction of secrets; store digest checks."""

from omni_core.lineage.datasets import log_dataset_version
from omni_core.lineage.redact import REDACTED, is_secret_key, redact, redact_text
from omni_core.lineage.tracking import Tracker, git_commit, normalize_tracking_uri, sqlite_path, ui_command
from omni_core.lineage.verify import FileCheck, VerifyError, resolve_target, verify, verify_target

__all__ = ["REDACTED", "FileCheck", "Tracker", "VerifyError", "git_commit", "is_secret_key", "log_dataset_version",
           "normalize_tracking_uri", "redact", "redact_text", "resolve_target", "sqlite_path", "ui_command", "verify",
           "verify_target"]
