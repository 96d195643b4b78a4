"""`omni validate`, `omni plan` and `omni run` compose every verl stage's command in verl's interpreter
before anything runs (omni_core/backends/verl/precheck.py): refused with Hydra's message, or a note that
the check was skipped and why."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from omni_core.config import PipelineConfig


def check_verl_stages(config: PipelineConfig, console: Console) -> list[str]:
    """Notes for stderr, one per verl stage; the refusals (each `stages.NAME.backend.overrides: ...`) are
    returned, for the caller to report as errors."""
    from omni_core.backends.verl.precheck import check_pipeline

    refused = []
    for result in check_pipeline(config):
        if result.status == "refused":
            refused.append(f"stages.{result.stage}.backend.overrides: {result.message}")
        else:
            console.print(escape(f"verl hydra check, stage {result.stage}: {result.status}: {result.message}"))
    return refused
