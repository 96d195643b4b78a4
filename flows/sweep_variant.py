"""One pipeline run of a sweep, in a process of its own: `python -m flows.sweep_variant REQUEST.json`.

The sweep (flows/sweep.py) created the run's Prefect flow run (a child of the sweep's, tagged) and
wrote REQUEST.json: that flow run's id, the pipeline mapping, the MLflow tags, the stages to hold and
where to write the summary. This process runs the `pipeline` flow as that flow run and talks to the
sweep through its stdin: a line `go` lets the held stages start; the end of stdin (the sweep is gone)
stops the run as a SIGTERM does (the pipeline's cancellation path), which is also how the sweep stops a
pruned variant. Exit status: 0 completed, 1 failed, 143 stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

STOPPED = 128 + signal.SIGTERM


class VariantHooks:
    def __init__(self, request: dict[str, Any]):
        self.tags: dict[str, str] = request["tags"]
        self.hold = set(request["hold"])
        self.summary_path = Path(request["summary_path"])
        self.released = threading.Event()
        threading.Thread(target=self._listen, name="omni-sweep-stdin", daemon=True).start()

    def _listen(self) -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                self.released.set()
        os.kill(os.getpid(), signal.SIGTERM)  # stdin closed: the sweep that started this run is gone

    def before_stage(self, name: str) -> None:
        if name in self.hold and not self.released.is_set():
            print(f"stage {name}: waiting for the sweep's decision on this variant", flush=True)
            while not self.released.wait(0.5):  # short waits: a SIGTERM meanwhile is handled at once
                pass

    def finished(self, summary: dict[str, Any]) -> None:
        staged = self.summary_path.with_suffix(".tmp")
        staged.write_text(json.dumps(summary, default=str))
        staged.replace(self.summary_path)


def main(request_file: str) -> int:
    from prefect import get_client
    from prefect.flow_engine import run_flow

    from flows.pipeline import pipeline, use_hooks

    request = json.loads(Path(request_file).read_text())
    use_hooks(VariantHooks(request))
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(request["flow_run_id"])
    state = run_flow(pipeline, flow_run=flow_run, parameters={"config": request["data"]}, return_type="state")
    return 0 if state.is_completed() else 1


def _drain() -> None:
    """What Prefect still has to send (the run's logs and events) before the process goes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):  # best effort: the run's state is already recorded
            worker.drain_all(timeout=5)


if __name__ == "__main__":
    code = 1
    try:
        code = main(sys.argv[1])
    except BaseException as exc:  # a SIGTERM (Prefect's TerminationSignal), a failure to start the run
        code = STOPPED if type(exc).__name__ == "TerminationSignal" else 1
        if code == 1:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    _drain()
    # os._exit: the interpreter's exit would join the stage threads, and a stopped variant's training
    # thread waits on actors that Ray ends only once this driver is gone
    os._exit(code)
