"""Start-up noise of Ray and transformers, silenced at its source before a pipeline starts Ray.

What a run prints should be about the run. Three messages are not, and each is switched off where it
comes from (a switch, or the one logger that emits it), not filtered out of the output afterwards:

- transformers' "Loading weights" progress bar (one per model load): its progress-bar switch, and
  `HF_HUB_DISABLE_PROGRESS_BARS=1` for the processes started later (Ray workers inherit the
  environment). A value the user set is kept (`HF_HUB_DISABLE_PROGRESS_BARS=0` shows the bars).
- Ray's "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out."
  (logger `ray._private.authentication.authentication_token_setup`): `ray.init()` says so whenever it
  starts a local cluster, which then uses token authentication as before. Setting `RAY_AUTH_MODE=token`
  instead would not do: Ray reads it when it is imported, and a pipeline has imported Ray by then.
  Ray's warning that authentication is *disabled* is kept.
- Ray's "SIGTERM handler is not set because current thread is not the main thread." (logger
  `ray._private.worker`): a stage calls `ray.init()` from a Prefect task thread, where Ray cannot
  install its handler; expected, so not worth a warning.

Only those messages are dropped: the loggers' other records pass.
"""

from __future__ import annotations

import logging
import os
import sys

SIGTERM_NOTICE = "SIGTERM handler is not set because current thread is not the main thread"
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"
DROPPED = {"ray._private.worker": SIGTERM_NOTICE,
           "ray._private.authentication.authentication_token_setup": TOKEN_AUTH_NOTICE}
_TRUE = ("1", "true", "yes", "on")


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def quiet_startup() -> None:
    """Silence the messages above for this process and the Ray workers it starts (idempotent)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"].lower() in _TRUE and "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging  # it reads the variable once, at import

        hf_logging.disable_progress_bar()
    for name, prefix in DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))
