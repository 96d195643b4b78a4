"""MLflow lineage: run hierarchy, dataset inputs, checkpoints."""

from omni_core.lineage.tracking import Tracker, git_commit, normalize_tracking_uri, sqlite_path, ui_command

__all__ = ["Tracker", "git_commit", "normalize_tracking_uri", "sqlite_path", "ui_command"]
