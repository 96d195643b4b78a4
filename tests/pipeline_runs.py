"""Running a whole pipeline in the test process: every stage in dependency order, then the finish
(the Prefect flow does the same with a task per stage; these tests are about the stages); and the
small ingest -> rl -> eval -> register pipeline that several test modules run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_core.config import PipelineConfig
from omni_core.pipeline.run import PipelineRun


def run_in_order(config: PipelineConfig, progress: Callable[[str], None] = lambda line: None) -> PipelineRun:
    run = PipelineRun.start(config, progress=progress)
    ok = False
    try:
        for stage in config.ordered_stages():
            run.run_stage(stage.name)
        ok = True
    finally:
        run.finish(ok)
    return run


# A reward that depends on every character of the response, so seeds and steps change the scores.
REWARD = '''def score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 97) / 96.0  # depends on every character of the response
'''


def digits_pipeline(workdir: Path, *, name: str, store: str, tracking_uri: str, seed: int, model_name: str,
                    samples: int, register: dict[str, Any] | None = None) -> dict[str, Any]:
    """configs/eval_register.yaml, smaller: 16 digits rows, 2 steps of 2 prompts x 2 responses, the
    reward above (written to workdir/reward.py); `register`: more options of the register stage."""
    reward = workdir / "reward.py"
    reward.write_text(REWARD)
    return {
        "name": name, "store": store, "tracking_uri": tracking_uri, "ray": {"address": "local", "num_cpus": 2},
        "seed": seed,
        "datasets": {"digits": {"source": "fixtures://digits?rows=16&seed=0", "converter": "digits"}},
        "stages": [
            {"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
            {"name": "rl", "kind": "rl", "after": ["ingest"], "model": "tiny://lm", "data": "digits:train",
             "rollout": {"n": 2, "max_new_tokens": 6}, "reward": {"name": f"{reward}:score"},
             "trainer": {"total_steps": 2, "batch_size": 2, "lr": 1e-2}},
            {"name": "eval", "kind": "eval", "after": ["rl"], "data": "digits:test", "max_new_tokens": 6,
             "reward": {"name": f"{reward}:score"}, "samples": samples},
            {"name": "register", "kind": "register", "after": ["eval"], "model_name": model_name,
             **(register or {})},
        ],
    }
