"""Plugins from outside the repository (omni_core.plugins): a distribution declaring an entry point in
the `omni_core.plugins` group adds an algorithm, a reward, a backend and a stage kind, and a pipeline runs with
them, in a subprocess whose sys.path holds the distribution (its `*.dist-info/entry_points.txt`
is what importlib.metadata reads, as for a pip-installed package). The backend runs its stage
through the Backend protocol (here by training natively and marking that it was asked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""A plugin package: one algorithm, one reward, one backend, one stage kind."""
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from omni_core.config.algorithms import LANGUAGE_MODEL, PROMPTS, ALL, Algorithm, AlgorithmOptions, register_algorithm
from omni_core.config.backends import BackendOptions, BackendRecord, register_backend
from omni_core.config.models import StageBase, register_stage_config
from omni_core.pipeline.stages import register_stage
from omni_core.rewards.registry import register_reward


def mark(what: str) -> None:
    with open(os.environ["PLUGIN_MARKS"], "a") as out:
        out.write(what + "\\n")


class ScaledOptions(AlgorithmOptions):
    name: Literal["scaled_grpo"] = "scaled_grpo"
    clip: float = 0.2


def build(stage: Any, rows: list, seed: int, **parts: Any) -> Any:
    """GRPO's trainer with this algorithm's clip ratio."""
    from omni_core.training.algorithms.grpo import PolicyGradientOptions
    from omni_core.training.grpo_loop import build_trainer

    mark("trainer")
    options = PolicyGradientOptions(name="grpo", clip_ratio_low=stage.algorithm.clip, clip_ratio_high=stage.algorithm.clip)
    return build_trainer(stage.model_copy(update={"algorithm": options}), rows, seed, **parts)


register_algorithm(Algorithm(
    name="scaled_grpo", options=ScaledOptions, trainer=f"{__name__}:build", data=PROMPTS, model_kind=LANGUAGE_MODEL,
    separate_async=True, stage_keys={"trainer": ALL, "rollout": ALL, "reward": ALL},
    progress=(("critic/score/mean", "score"),)))


@register_reward("length_mod5", data_sources=("plugin_lengths",))
def length_mod5(data_source, solution_str, ground_truth, extra_info=None):
    return (len(solution_str) % 5) / 4.0


class MarkedOptions(BackendOptions):
    name: Literal["marked"] = "marked"
    label: str = "x"
    run_key_excluded: ClassVar[frozenset[str]] = frozenset({"label"})


class MarkedBackend:
    """Trains with the native backend and marks each protocol call."""
    name = "marked"

    def _native(self):
        from omni_core.config.backends import backend_of_name
        return backend_of_name("native")

    def check(self, stage, config):
        mark("check")
        return None

    def plan(self, planned):
        return {"backend": self.name, "does": f"marked training of {planned.stage.name}"}

    def run(self, run):
        mark(f"run {run.stage.backend.label}")
        return self._native().run(run)

    def cancel(self):
        return {}

    def retries(self, stage):
        return None


BACKEND = MarkedBackend()
register_backend(BackendRecord(name="marked", options=MarkedOptions, implementation=f"{__name__}:BACKEND"))


class GreetStage(StageBase):
    kind: Literal["greet"] = "greet"
    greeting: str


register_stage_config(GreetStage)


@register_stage("greet")
def run_greet(ctx):
    steps = {name: outcome.outputs.get("global_step") for name, outcome in ctx.upstream.items()}
    return {"said": ctx.stage.greeting, "upstream_steps": steps}
'''

RUN = '''
import json, sys
sys.path.insert(0, "tests")
from omni_core.config import validate_pipeline
from omni_core.pipeline.plan import plan_pipeline
from omni_core.pipeline.run import PipelineRun

from omni_core.training.ray_stage import rl_run_key

config = validate_pipeline(json.loads(sys.argv[1]))
plan = plan_pipeline(config)
marked = config.stage("rl_marked")
relabelled = marked.model_copy(update={"backend": marked.backend.model_copy(update={"label": "other"})})
same_key = rl_run_key(marked, 0, "v") == rl_run_key(relabelled, 0, "v")
native_key = rl_run_key(config.stage("rl"), 0, "v") == rl_run_key(marked, 0, "v")
run, ok = PipelineRun.start(config), False
try:
    for name in ("ingest", "rl_marked", "greet"):  # rl (the same stage on the native backend) is only planned
        run.run_stage(name)
    ok = True
finally:
    run.finish(ok)
print(json.dumps({"summary": run.summary(), "plan": plan, "same_key": same_key, "native_key": native_key}))
'''


def plugin_site(tmp_path: Path, entry: str, module: str) -> Path:
    site = tmp_path / "site"
    (site / "omni_test_plugin").mkdir(parents=True)
    (site / "omni_test_plugin" / "__init__.py").write_text(module)
    info = site / "omni_test_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-test-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[omni_core.plugins]\ntest = {entry}\n")
    return site


def run_python(site: Path, args: list[str], tmp_path: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "PLUGIN_MARKS": str(tmp_path / "marks.txt"),
           "OMNI_CACHE_DIR": os.environ.get("OMNI_CACHE_DIR", str(tmp_path / "cache"))}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_plugin_package_adds_an_algorithm_a_reward_a_backend_and_a_stage_kind_a_pipeline_runs(tmp_path: Path) -> None:
    site = plugin_site(tmp_path, "omni_test_plugin", PLUGIN)
    rl = {"kind": "rl", "after": ["ingest"], "model": "tiny://lm", "data": "digits:train",
          "algorithm": {"name": "scaled_grpo", "clip": 0.3}, "reward": {"name": "length_mod5"},
          "rollout": {"n": 2, "max_new_tokens": 4}, "trainer": {"total_steps": 2, "batch_size": 2, "lr": 1e-2}}
    pipeline = {
        "name": "plugins", "store": str(tmp_path / "store"), "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "ray": {"address": "local", "num_cpus": 2},
        "datasets": {"digits": {"source": "fixtures://digits?rows=16&seed=0", "converter": "digits"}},
        "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]},
                   {"name": "rl", **rl},
                   {"name": "rl_marked", **rl, "backend": {"name": "marked", "label": "hello"}},
                   {"name": "greet", "kind": "greet", "after": ["rl_marked"], "greeting": "hi"}]}
    done = run_python(site, ["-c", RUN, json.dumps(pipeline)], tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    stages = {s["name"]: s for s in out["summary"]["stages"]}
    assert stages["rl_marked"]["status"] == "completed" and stages["rl_marked"]["outputs"]["global_step"] == 2
    assert stages["rl_marked"]["outputs"]["weights_sha256"]  # the plugin's algorithm and reward trained it
    assert stages["rl_marked"]["outputs"]["backend"] == "marked"
    # another backend trains it: another run key; its label is where it runs, not what it trains (its rule)
    assert not out["native_key"] and out["same_key"]
    marks = (tmp_path / "marks.txt").read_text().splitlines()
    assert "check" in marks and "run hello" in marks
    assert marks.count("trainer") >= 1  # the plugin's factory built the trainer (looked up by its string)
    assert stages["greet"]["outputs"]["said"] == "hi"  # the plugin's stage kind ran after the others
    assert stages["greet"]["outputs"]["upstream_steps"]["rl_marked"] == 2
    planned = {e["name"]: e for e in out["plan"]}
    assert planned["rl_marked"]["does"] == "marked training of rl_marked"


def test_a_broken_plugin_is_an_error_naming_it(tmp_path: Path) -> None:
    site = plugin_site(tmp_path, "omni_test_plugin", "raise RuntimeError('no such thing')\n")
    done = run_python(site, ["-c", "from omni_core.config.algorithms import algorithm_names; algorithm_names()"],
                      tmp_path, timeout=120)
    assert done.returncode != 0
    assert "PluginError: plugin 'test = omni_test_plugin' (from distribution omni-test-plugin 0.1) failed to load: " \
           "RuntimeError: no such thing" in done.stderr


@pytest.mark.parametrize("entry", ["omni_test_plugin:register"])
def test_an_entry_point_naming_a_function_is_called(tmp_path: Path, entry: str) -> None:
    module = ("from omni_core.rewards.registry import register_reward\n"
              "def register():\n"
              "    register_reward('called_plugin')(lambda data_source, solution_str, ground_truth, extra_info=None: 1.0)\n")
    site = plugin_site(tmp_path, entry, module)
    done = run_python(site, ["-c", "from omni_core.rewards import reward_names; print(reward_names())"], tmp_path,
                      timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "called_plugin" in done.stdout
