"""Retry conditions for Prefect tasks: retry what can pass on a second try, never a user's mistake."""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError, DataError, OmniError


def _exception(state: Any) -> BaseException | None:
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001  (we only classify it)
        return exc
    return None


def retry_unless_user_error(task: Any, task_run: Any, state: Any) -> bool:
    """A bad config or bad input fails the same way every time: retrying only hides it."""
    return not isinstance(_exception(state), OmniError)


def retry_transient_storage(task: Any, task_run: Any, state: Any) -> bool:
    """Retry storage and network errors; bad data or config fail at once."""
    return not isinstance(_exception(state), ConfigError | DataError)
