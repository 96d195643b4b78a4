"""The verl environment the verl backend's tests run verl in: `$OMNI_VERL_PYTHON`, else
`.venv-verl/bin/python` under the repository root (`make setup` builds it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def verl_python() -> str:
    """The interpreter that has verl 0.9.1; a test fails (never skips) when it is missing."""
    python = os.environ.get("OMNI_VERL_PYTHON") or str(REPO / ".venv-verl" / "bin" / "python")
    if not os.access(python, os.X_OK):
        pytest.fail(f"no verl environment at {python}: run `make setup` (it builds .venv-verl) "
                    "or set OMNI_VERL_PYTHON to an interpreter that has verl[verl-core]==0.9.1")
    return python
