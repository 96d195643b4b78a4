"""Running a whole pipeline in the test process: every stage in dependency order, then the finish
(the Prefect flow does the same with a task per stage; these tests are about the stages); and the
small ingest -> rl -> eval -> register pipeline that several test modules run, and the sweep of
three such runs at once (tests/test_concurrency.py, tests/test_scaled_stack.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from omni_core.config import PipelineConfig
from omni_core.lineage.model_registry import CANDIDATE, CHAMPION
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
    """configs/eval_register.yaml, smaller: 16 digits rows, 2 steps of 2 prompts x 2 responses scored on
    the rollout worker, the reward above (written to workdir/reward.py); `register`: more options of the
    register stage."""
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
             "trainer": {"total_steps": 2, "batch_size": 2, "lr": 1e-2},
             # the rollout worker scores its own batch: no reward actor, one process less to start per run
             "execution": {"async_reward": False}},
            {"name": "eval", "kind": "eval", "after": ["rl"], "data": "digits:test", "max_new_tokens": 6,
             "reward": {"name": f"{reward}:score"}, "samples": samples},
            {"name": "register", "kind": "register", "after": ["eval"], "model_name": model_name,
             **(register or {})},
        ],
    }


SWEEP = [(0, 1e-2), (1, 3e-2), (0, 1e-2)]  # seed, lr; the last is the first again


def sweep_configs(workdir: Path, *, store: str, tracking_uri: str, model_name: str, ray_address: str,
                  name: str = "sweep") -> list[Path]:
    """The three pipeline files of the sweep (one reward file for all: the duplicate is exact)."""
    paths = []
    for i, (seed, lr) in enumerate(SWEEP):
        folder = workdir / f"p{i}"
        folder.mkdir(parents=True, exist_ok=True)
        config = digits_pipeline(workdir, name=name, store=store, tracking_uri=tracking_uri, seed=seed,
                                 model_name=model_name, samples=2)
        next(s for s in config["stages"] if s["name"] == "rl")["trainer"]["lr"] = lr
        config["ray"] = {"address": ray_address}
        (folder / "pipeline.yaml").write_text(yaml.safe_dump(config))
        paths.append(folder / "pipeline.yaml")
    return paths


def check_sweep(client: Any, model_name: str, experiment: str, runs: int) -> dict[str, float]:
    """One MLflow experiment; a register stage run per pipeline run, each naming a version that exists;
    one version per distinct checkpoint (the duplicate shares the first's); `candidate` on the newest,
    `champion` on the best score (ties: the lower version). Returns version -> score."""
    [exp] = client.search_experiments(filter_string=f"name = '{experiment}'")
    registers = client.search_runs([exp.experiment_id], "tags.`omni.stage_kind` = 'register'")
    assert len(registers) == runs, [r.data.tags for r in registers]
    versions = list(client.search_model_versions(f"name='{model_name}'"))
    by_checkpoint: dict[str, list[str]] = {}
    for v in versions:
        by_checkpoint.setdefault(v.tags["omni.checkpoint_sha256"], []).append(str(v.version))
    assert all(len(vs) == 1 for vs in by_checkpoint.values()), by_checkpoint  # the duplicate shares one
    assert len(versions) == runs - 1, by_checkpoint  # two distinct pipelines (seed and lr differ), one duplicate
    assert {r.data.tags["omni.registered_version"] for r in registers} == {str(v.version) for v in versions}
    newest = max(int(v.version) for v in versions)
    assert str(client.get_model_version_by_alias(model_name, CANDIDATE).version) == str(newest)
    scores = {str(v.version): float(v.tags["omni.score"]) for v in versions}
    best = max(scores.values())
    champion = str(client.get_model_version_by_alias(model_name, CHAMPION).version)
    assert scores[champion] == best, (champion, scores)
    assert min((v for v, s in scores.items() if s == best), key=int) == champion
    promoted = [v for v in versions if v.tags.get("omni.promotion") == "promoted"]
    assert str(champion) in {str(v.version) for v in promoted}
    return scores


# ---- the sweep of tests/test_sweep.py and tests/test_scaled_stack.py ------------------------------

# Three learning rates in the order the grid's seed 14 gives (0.03, 0.001, 0.01); with the training seed 0,
# ASHA (sync, eta 2: rungs at steps 2 and 4 of 6) prunes the second at step 2 (its reward falls behind the
# first's) and keeps the third (started when the second stopped) at both rungs.
SWEEP_FILE = {
    "name": "tiny-lr", "method": "grid", "seed": 14,
    "parameters": {"stages.rl.trainer.lr": {"values": [1e-2, 3e-2, 1e-3]}},
    "early_terminate": {"type": "asha", "min_steps": 2, "eta": 2, "mode": "sync"},
    "report_on": {"skip_rows": 2, "max_rows": 2},  # the held-out eval: rows 2-3 of the test split
    "max_concurrent": 2,
}


def sweep_files(workdir: Path, *, store: str, tracking_uri: str, model_name: str,
                ray: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """The digits pipeline above with 6 rl steps (a checkpoint each) and 2 eval rows, and SWEEP_FILE."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = digits_pipeline(workdir, name="sweep-digits", store=store, tracking_uri=tracking_uri, seed=0,
                             model_name=model_name, samples=0)
    rl = next(s for s in config["stages"] if s["name"] == "rl")
    rl["trainer"]["total_steps"] = 6
    rl["checkpoint"] = {"save_freq": 1}
    next(s for s in config["stages"] if s["name"] == "eval")["max_rows"] = 2
    if ray is not None:
        config["ray"] = ray
    pipeline, sweep = workdir / "pipeline.yaml", workdir / "sweep.yaml"
    pipeline.write_text(yaml.safe_dump(config))
    sweep.write_text(yaml.safe_dump(SWEEP_FILE))
    return pipeline, sweep
