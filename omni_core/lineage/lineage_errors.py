"""The error lineage queries raise: its own module, so that the lineage modules can all import it."""

from __future__ import annotations

from omni_core.errors import OmniError


class LineageError(OmniError):
    """A lineage target (model, alias, version, run) that does not exist or cannot be read."""
