"""MLflow lineage: run hierarchy, dataset inputs, checkpoints."""

from omni_core.lineage.datasets import log_dataset_version
from omni_core.lineage.tracking import Tracker, git_commit, normalize_tracking_uri, sqlite_path, ui_command

__all__ = ["Tracker", "log_dataset_version", "git_commit", "normalize_tracking_uri", "sqlite_path", "ui_command"]
