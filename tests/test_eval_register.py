"""The `eval` and `register` stage kinds: the eval of a LoRA checkpoint (the base model with the trained
adapter), and the pipeline errors of an eval without an rl stage upstream, a register without an eval
stage upstream, an eval of data it cannot score. The eval and register stages of a whole pipeline run
(seeds 0 and 1, then a margin no score can beat, then an unchanged re-run) are checked in
tests/test_lineage_server.py, on that module's runs (an MLflow server, an S3 store)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from pipeline_runs import digits_pipeline, run_in_order

from omni_core.config import validate_pipeline
from omni_core.data import load_version
from omni_core.errors import ConfigError
from omni_core.models import load_model
from omni_core.pipeline.run import PipelineRun
from omni_core.pipeline.stages.eval import SAMPLES_TABLE
from omni_core.storage import Store
from omni_core.training.components import Sampling, encode_prompts, generate_rollouts
from omni_core.training.ray_stage import read_split

pytestmark = pytest.mark.slow

MODEL_NAME = "digits-tiny"


@pytest.fixture(scope="module")
def env(pipeline_model_env: Path) -> Path:
    return pipeline_model_env


def pipeline(workdir: Path, seed: int, margin: float = 0.0, samples: int = 3) -> dict[str, Any]:
    return digits_pipeline(workdir, name="eval-register-test", store=str(workdir / "store"),
                           tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}", seed=seed, model_name=MODEL_NAME,
                           samples=samples, register={"margin": margin})


def run(data: dict[str, Any]) -> PipelineRun:
    return run_in_order(validate_pipeline(data))


def outputs(run: PipelineRun, stage: str) -> dict[str, Any]:
    return run.outcomes[stage].outputs


def small_pipeline(tmp_path: Path, stages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "eval-register-errors", "store": str(tmp_path / "store"),
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
            "datasets": {"digits": {"source": "fixtures://digits?rows=8&seed=0", "converter": "digits"}},
            "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]}, *stages]}


@pytest.mark.parametrize(("stages", "expected"), [
    ([{"name": "eval", "kind": "eval", "after": ["ingest"], "data": "digits:test"}],
     "stages.eval.after: no upstream rl or sft stage"),
    ([{"name": "eval", "kind": "eval", "after": ["ingest"], "data": "digits:test", "checkpoint_from": "ingest"}],
     "stages.eval.checkpoint_from: 'ingest' is a stage of kind ingest, not rl"),
    ([{"name": "eval", "kind": "eval", "after": ["ingest"], "data": "digits:test", "checkpoint_from": "nope"}],
     "stages.eval.checkpoint_from: 'nope' is not a stage"),
    ([{"name": "register", "kind": "register", "after": ["ingest"], "model_name": "m"}],
     "stages.register.after: no upstream eval stage"),
])
def test_missing_upstream_stage_is_a_config_error(tmp_path: Path, stages: list[dict[str, Any]],
                                                   expected: str) -> None:
    """Caught when the pipeline is validated, before any stage runs."""
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        validate_pipeline(small_pipeline(tmp_path, stages))


def test_eval_and_register_config_keys() -> None:
    base = {"name": "p", "datasets": {"digits": {"source": "fixtures://digits?rows=8", "converter": "digits"}},
            "stages": [{"name": "rl", "kind": "rl", "data": "digits"},
                       {"name": "eval", "kind": "eval", "after": ["rl"], "data": "digits:test"},
                       {"name": "register", "kind": "register", "after": ["eval"], "model_name": "m"}]}
    config = validate_pipeline(base)
    evaluated, registered = config.stage("eval"), config.stage("register")
    assert (evaluated.split(), evaluated.greedy, evaluated.n) == (("digits", "test"), True, 1)
    assert (registered.metric, registered.greater_is_better, registered.margin) == ("val/reward_mean", True, 0.0)
    assert evaluated.pipeline_problem(config) is None and registered.pipeline_problem(config) is None
    bad = json.loads(json.dumps(base))
    bad["stages"][2]["promote_if"] = {"metric": "x"}
    with pytest.raises(ConfigError, match=r"stages\.register\.promote_if: unknown key"):
        validate_pipeline(bad)
    bad = json.loads(json.dumps(base))
    bad["stages"][1]["data"] = "gsm8k:test"
    with pytest.raises(ConfigError, match="stages.eval.data: 'gsm8k' is not under datasets"):
        validate_pipeline(bad)


def greedy_responses(model: Any, tokenizer: Any, rows: list[dict[str, Any]]) -> list[str]:
    prompts = encode_prompts(tokenizer, rows, 256)
    return generate_rollouts(model, tokenizer, prompts, n=1, sampling=Sampling(max_new_tokens=6, greedy=True),
                             seed=0).responses


def test_eval_of_a_lora_checkpoint_scores_the_base_model_with_the_trained_adapter(
        env: Path, tmp_path_factory: pytest.TempPathFactory, mlflow_db: Callable[[Path], str]) -> None:
    """A LoRA checkpoint holds only the adapter: the stage scores its rl stage's base model with it."""
    workdir = tmp_path_factory.mktemp("eval-lora")
    mlflow_db(workdir / "mlflow.db")
    data = pipeline(workdir, seed=0, samples=100)
    data["stages"][1].update(lora={"rank": 4, "alpha": 8}, trainer={"total_steps": 2, "batch_size": 2, "lr": 0.05})
    data["stages"] = data["stages"][:3]
    done = run(data)
    evaluated = outputs(done, "eval")
    folder = Path(evaluated["checkpoint_uri"].removeprefix("file://"))
    assert (folder / "adapter_config.json").is_file() and not (folder / "config.json").exists()

    store = Store(done.config.store)
    rows = read_split(store, load_version(store, "digits", evaluated["dataset_version"]).shard_keys("test"))
    base, tokenizer = load_model("tiny://lm", seed=0, lora={"rank": 4, "alpha": 8})
    before = greedy_responses(base, tokenizer, rows)
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(base, load_file(folder / "adapter_model.safetensors"))
    after = greedy_responses(base, tokenizer, rows)
    assert after != before, "the trained adapter should change some greedy response"

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    eval_run_id = done.outcomes["eval"].mlflow_run_id
    table = json.loads(Path(client.download_artifacts(eval_run_id, SAMPLES_TABLE, str(workdir))).read_text())
    assert [row[table["columns"].index("response")] for row in table["data"]] == after
    assert evaluated["metrics"]["val/reward_mean"] == pytest.approx(
        sum((sum(map(ord, r)) % 97) / 96.0 for r in after) / len(after))


@pytest.mark.parametrize(("stage", "expected"), [
    ({"name": "on_pairs", "kind": "eval", "after": ["flow"], "data": "pairs:test"},
     "stages.on_pairs.data: 'pairs' holds preference pairs"),
    ({"name": "on_gsm8k", "kind": "eval", "after": ["flow"], "data": "gsm8k:test"},
     "stages.on_gsm8k.data: 'gsm8k' is not under datasets"),
])
def test_eval_refuses_what_it_cannot_score(stage: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate_pipeline({
            "name": "p", "datasets": {"pairs": {"source": "fixtures://omni_preference?rows=8",
                                                "converter": "omni_preference"},
                                      "ocr": {"source": "fixtures://ocr?rows=8", "converter": "ocr"},
                                      "digits": {"source": "fixtures://digits?rows=8", "converter": "digits"}},
            "stages": [{"name": "flow", "kind": "rl", "model": "tiny://sd3", "data": "ocr",
                        "algorithm": {"name": "flow_grpo"}}, stage]})


def test_a_custom_reward_reaches_the_eval_job_by_its_absolute_path(tmp_path, monkeypatch) -> None:
    """The eval's work runs as a Ray task, or a Ray Job on a cluster's job server, in another working
    directory: a `path.py:function` reward relative to where omni runs is handed over absolute (seen:
    `omni init verl`'s eval failed with 'file v/reward.py does not exist' on a job server)."""
    from omni_core.pipeline.stages.eval import absolute_reward

    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "reward.py").write_text("def compute_score(*args, **kwargs):\n    return 1.0\n")
    assert absolute_reward("proj/reward.py:compute_score") == f"{tmp_path / 'proj' / 'reward.py'}:compute_score"
    assert absolute_reward("gsm8k") == "gsm8k" and absolute_reward(None) is None
    assert absolute_reward("missing.py:f") == "missing.py:f"  # the job names the missing file
