"""Sweeps (`omni sweep`, omni_core.sweep), on real components: a `prefect server`, a sqlite MLflow, a local
store, the sweep's own local Ray; `omni sweep` run as a user runs it (a process).

The module runs one small sweep (slow): three learning rates of the tiny digits pipeline
(tests/pipeline_runs.py: ingest -> rl 6 steps -> eval + a held-out eval -> register), ASHA in sync mode,
SIGKILLed during its last variant's training (started once ASHA stopped the second) and run again; asserted many times: the shared stage ran
once, the variants ran at once on one Ray, what finished was kept and the rest resumed, a pruned variant
was never evaluated or registered, the winner's tags and lineage, the comparison (store, MLflow,
Prefect, the terminal).
The checks before anything runs (bad input, materialisation, sharing, ASHA's rule) need no server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import yaml
from pipeline_runs import SWEEP_FILE, sweep_files

from omni_core.errors import ConfigError
from omni_core.lineage import Tracker
from omni_core.sweep.asha import Rungs, decide, rung_value
from omni_core.sweep.plan import plan_sweep, settle_concurrency, split_stages
from omni_core.sweep.space import Space, Tried
from omni_core.sweep.spec import SweepFileError, validate_sweep

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")


def sweep_of(**fields: Any) -> dict[str, Any]:
    base = {"name": "s", "method": "grid", "parameters": {"stages.rl.trainer.lr": {"values": [1e-3, 3e-3]}}}
    return {**base, **fields}


def plan_of(tmp_path: Path, sweep: dict[str, Any], pipeline: str = DEMO, overrides: list[str] | None = None) -> Any:
    return plan_sweep(validate_sweep(sweep, "sweep.yaml"), pipeline, overrides)


# ---- before anything runs -------------------------------------------------------------------------


def test_each_method_materialises_its_variants_from_the_seed() -> None:
    grid = validate_sweep(sweep_of(parameters={"a": {"values": [1, 2, 3]}, "b": {"values": [[1], [2]]}}))
    orders = [Space(grid, seed).up_front() for seed in (0, 0, 1)]
    assert orders[0] == orders[1] and orders[0] != orders[2]  # the seed fixes the order, another seed another
    assert sorted(map(json.dumps, orders[0])) == sorted(map(json.dumps, orders[2]))  # the same grid either way
    assert len({json.dumps(p, sort_keys=True) for p in orders[0]}) == 6
    ranged = {"lr": {"distribution": "log_uniform", "min": 1e-5, "max": 1e-2}, "n": {"distribution": "int_uniform",
                                                                                      "min": 2, "max": 8}}
    random = validate_sweep(sweep_of(method="random", run_cap=5, parameters=ranged))
    draws = Space(random, 7).up_front()
    assert draws == Space(random, 7).up_front() != Space(random, 8).up_front()
    assert all(1e-5 <= d["lr"] <= 1e-2 and isinstance(d["n"], int) and 2 <= d["n"] <= 8 for d in draws)
    bayes = validate_sweep(sweep_of(method="bayes", run_cap=6, parameters=ranged))
    tried = [Tried({"lr": 1e-3, "n": 4}, "completed", 0.5), Tried({"lr": 1e-4, "n": 2}, "pruned", None, {2: 0.1}),
             Tried({"lr": 3e-3, "n": 8}, "running")]
    asked = Space(bayes, 0).ask(3, tried)
    assert asked == Space(bayes, 0).ask(3, tried)  # the same finished trials: the same next setting
    assert asked != Space(bayes, 0).ask(4, tried) and 1e-5 <= asked["lr"] <= 1e-2


def test_the_plan_shares_what_no_swept_key_reaches(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, sweep_of(report_on={"skip_rows": 128}))
    assert (plan.shared, plan.per_variant, plan.register) == (
        ["ingest", "sft", "eval_sft"], ["rl", "eval", "eval_report"], ["register"])
    assert plan.report_stage == "eval_report" and plan.select_stage == "eval"
    data = plan.variant_data(plan.variants[1])
    assert [s["name"] for s in data["stages"]] == ["ingest", "sft", "rl", "eval_sft", "eval", "eval_report"]
    added = next(s for s in data["stages"] if s["name"] == "eval_report")
    assert added["skip_rows"] == 128 and "max_rows" not in added and added["after"] == ["rl"]
    assert {s["name"] for s in plan.shared_data()["stages"]} == {"ingest", "sft", "eval_sft"}
    # a seed sweep re-runs what the seed reaches: every stage but the ingest
    config = plan.config
    assert split_stages(config, ["seed"])[0] == ["ingest"]
    seeded = plan_of(tmp_path, sweep_of(seeds=[0, 1]))
    assert seeded.shared == ["ingest"] and seeded.n_variants == 4 and [v.seed for v in seeded.variants] == [0, 1, 0, 1]
    assert seeded.variants[0].params == seeded.variants[1].params != seeded.variants[2].params
    # a key of the sft stage reaches everything downstream of it
    assert plan_of(tmp_path, sweep_of(parameters={"stages.sft.trainer.lr": {"values": [1e-3]}})).shared == ["ingest"]


@pytest.mark.parametrize(("sweep", "message"), [
    (sweep_of(parameters={"stages.rl.trainer.lrr": {"values": [1e-3]}}),
     "parameters.stages.rl.trainer.lrr: not a key of pipeline digits-grpo-demo; the nearest existing key is "
     "stages.rl.trainer.lr"),
    (sweep_of(method="random", run_cap=3, parameters={"stages.rl.algorithm.loss_agg_mode": {
        "distribution": "uniform", "min": 0, "max": 1}}), "distribution uniform needs a numeric key"),
    (sweep_of(method="random", run_cap=3, parameters={"stages.rl.rollout.n": {
        "distribution": "uniform", "min": 2, "max": 8}}), "an integer key; use distribution int_uniform"),
    (sweep_of(parameters={"stages.rl.trainer.lr": {"values": []}}), "values is empty"),
    (sweep_of(run_cap=0), "run_cap: Input should be greater than or equal to 1"),
    (sweep_of(method="random"), "run_cap: method random needs run_cap"),
    (sweep_of(parameters={"stages.rl.trainer.lr": {"distribution": "log_uniform", "min": 1e-4, "max": 1e-2}}),
     "method grid takes values"),
    (sweep_of(metric={"name": "val/accuracy"}), "metric.name: 'val/accuracy' is not logged by the eval stage"),
    (sweep_of(metric={"stage": "rl"}), "metric.stage: 'rl' is not an eval stage"),
    (sweep_of(early_terminate={"min_steps": 5, "metric": "critic/nothing"}),
     "early_terminate.metric: 'critic/nothing' is not logged per step"),
    (sweep_of(early_terminate={"min_steps": 40}), "early_terminate.min_steps: 40 is not below"),
    (sweep_of(parameters={"stages.eval_sft.max_new_tokens": {"values": [4, 8]}}),
     "no swept key reaches the eval stage eval"),
    (sweep_of(parameters={"store": {"values": ["a", "b"]}}), "parameters.store: 'store' says where a run lives"),
    (sweep_of(parameters={"stages.rl.trainer.lr": {"values": [-1.0]}}),
     "parameters: the variant stages.rl.trainer.lr=-1.0 is not a valid pipeline: stages.rl.trainer.lr:"),
    (sweep_of(parameters={"stages.rl.reward.name": {"values": ["digits", "digitz"]}}),
     "parameters: the variant stages.rl.reward.name='digitz' is not a valid pipeline: stages.rl.reward.name: "
     "unknown reward 'digitz'"),
])
def test_bad_sweeps_fail_before_anything_runs(tmp_path: Path, sweep: dict[str, Any], message: str) -> None:
    with pytest.raises((ConfigError, SweepFileError)) as raised:
        plan_of(tmp_path, sweep)
    assert message in str(raised.value)


def test_a_misspelt_reward_in_the_pipeline_is_refused_by_the_plan(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        plan_of(tmp_path, sweep_of(), overrides=["stages.rl.reward.name=digit"])
    assert "stages.rl.reward.name: unknown reward 'digit'" in str(raised.value)


def test_a_swept_dataset_source_warns_that_nothing_downstream_is_shared(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, sweep_of(parameters={"datasets.digits.source": {
        "values": ["fixtures://digits?rows=1000", "fixtures://digits?rows=500"]}}))
    assert plan.shared == [] and any("changes a dataset's source" in w for w in plan.warnings)


def test_max_concurrent_the_ray_cannot_place_is_refused_naming_the_resources(tmp_path: Path) -> None:
    plan = plan_of(tmp_path, sweep_of(max_concurrent=3))
    with pytest.raises(ConfigError, match=r"max_concurrent: 3 variants cannot run at once: each needs CPU 1 "
                                          r"\(stage rl \(trainer 1 CPU\)\) and the Ray has CPU 2, room for 2"):
        settle_concurrency(plan, {"CPU": 2.0, "memory": 1e9}, "the Ray")
    assert settle_concurrency(plan_of(tmp_path, sweep_of()), {"CPU": 8.0}, "the Ray") == 2  # capped at 2 variants
    # from the command line: the same refusal for a local Ray of 1 CPU, before anything starts
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep_of(max_concurrent=2)))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "sweep", DEMO, "sweep.yaml", "ray.num_cpus=1", "--dry-run"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "the sweep's local Ray (1 CPUs: ray.num_cpus) has CPU 1" in done.stderr, done.stderr
    assert not (tmp_path / ".omni").exists()  # nothing ran, nothing was written


def test_asha_stops_below_the_quantile_of_earlier_values() -> None:
    assert decide(0.5, [], 3, "maximize").keep  # the first at a rung goes on
    kept = decide(0.6, [0.2, 0.4, 0.6, 0.8], 3, "maximize")
    assert kept.keep and kept.cutoff == pytest.approx(float(np.percentile([0.2, 0.4, 0.6, 0.8], 200 / 3)))
    assert not decide(0.5, [0.2, 0.4, 0.6, 0.8], 3, "maximize").keep
    assert decide(0.3, [0.2, 0.4, 0.6, 0.8], 3, "minimize").keep and not decide(0.5, [0.2, 0.4], 2, "minimize").keep
    assert rung_value({1: 0.1, 2: 0.3, 3: 0.5}, 3, 2) == pytest.approx(0.4) and rung_value({1: 0.1, 3: 0.5}, 3, 2) is None
    # sync: variant 2 is decided against variants 0 and 1 only, once both are known (whatever arrived first)
    rungs = Rungs(eta=2, goal="maximize", mode="sync")
    assert not rungs.ready(5, 2, lambda rung, index: False)
    rungs.decide(5, 1, 0.9)
    assert not rungs.ready(5, 2, lambda rung, index: False)
    assert rungs.ready(5, 2, lambda rung, index: index == 0)  # variant 0 ended before step 5
    rungs.decide(5, 0, 0.1)
    assert rungs.decide(5, 2, 0.4).keep is False  # below the median of 0.1 and 0.9 is 0.5


def test_the_comparison_ranks_settings_by_their_mean_over_seeds() -> None:
    from omni_core.sweep.report import headline, rows

    spec = {"parameters": {"lr": {}}, "select_stage": "eval", "report_stage": "eval_report", "seeds": [0, 1]}
    done = {"status": "completed"}
    records = [{"index": 0, "setting": 0, "seed": 0, "label": "v000", "params": {"lr": 1}, **done, "select": 0.5, "report": 0.4},
               {"index": 1, "setting": 0, "seed": 1, "label": "v001", "params": {"lr": 1}, **done, "select": 0.7, "report": 0.6},
               {"index": 2, "setting": 1, "seed": 0, "label": "v002", "params": {"lr": 2}, "status": "pruned",
                "pruned": {"step": 2}},
               {"index": 3, "setting": 1, "seed": 1, "label": "v003", "params": {"lr": 2}, **done, "select": 0.9, "report": 0.9}]
    table = rows(spec, records, "maximize", defaults={"lr": 2})
    assert [(r["variant"], r["rank"], r["status"]) for r in table] == [
        ("v000", 1, "completed"), ("v001", 1, "completed"), ("v002", "", "pruned@2"), ("v003", "", "completed")]
    assert table[0]["eval mean"] == 0.6 and table[0]["eval std"] == pytest.approx(0.141421)
    assert table[3].get("note") == "the pipeline's own settings"  # a setting with a pruned seed is not ranked
    best = headline(spec, records, "maximize")["best"]
    assert (best["variant"], best["select"], best["report"], best["seeds"]) == ("v001", 0.6, 0.5, 2)  # its best seed


# ---- the sweep, on real components (slow) -------------------------------------------------------------


def omni(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 540) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def killed_then_run_again(cwd: Path, env: dict[str, str], args: list[str], label: str, line: str
                          ) -> tuple[str, subprocess.CompletedProcess]:
    """`omni sweep` SIGKILLed once variant `label`'s log has `line` (its variants and its Ray go with it:
    none is left after), then the same command again; (the killed run's output, the second run)."""
    log = cwd / "killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 500
    try:
        while True:
            logs = list(cwd.glob(f".omni/sweeps/*/{label}.log"))
            if logs and line in logs[0].read_text(errors="replace"):
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _, alive = psutil.wait_procs(children, timeout=120)  # the variants stop themselves, Ray ends
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
    return log.read_text(), omni(args, cwd, env)


# The first slow test waits for this fixture: 543 s of set-up at load 11-16 on the shared 2-core machine
# (each of its seven processes starts Prefect, MLflow and Ray clients), hence their timeout of 1200 s.
@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory, prefect_server: dict[str, str], prefect_client: Any,
          model_cache: Path, mlflow_db: Any) -> dict[str, Any]:
    """The module's sweep on the module's Prefect server: SIGKILLed once its last variant (started when
    ASHA stopped the second) committed its first training checkpoint, then run again."""
    env = {**os.environ, **prefect_server, "OMNI_CACHE_DIR": str(model_cache)}
    for var in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    folder = tmp_path_factory.mktemp("sweep")
    uri = mlflow_db(folder / "mlflow.db")
    pipeline, sweep_file = sweep_files(folder, store=str(folder / "store"), tracking_uri=uri, model_name="tiny-sweep")
    killed, done = killed_then_run_again(folder, env, ["sweep", str(pipeline), str(sweep_file)], "v002",
                                         "checkpoint global_step_1 committed")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [spec] = (folder / "store" / "sweeps").glob("*/*/*/spec.json")
    return {"folder": folder, "uri": uri, "store": folder / "store", "pipeline": pipeline, "prefix": spec.parent,
            "records": [json.loads(p.read_text()) for p in sorted((spec.parent / "variants").glob("*.json"))],
            "client": Tracker(uri).client, "killed": killed, "done": done, "model": "tiny-sweep", "env": env,
            "prefect": prefect_client}


def runs(sweep: dict[str, Any], query: str) -> list[Any]:
    client = sweep["client"]
    experiment = client.get_experiment_by_name("sweep-digits").experiment_id
    return client.search_runs([experiment], query, max_results=500)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_shared_stage_ran_once_and_every_variant_took_it_from_the_cache(sweep: dict[str, Any]) -> None:
    ingests = runs(sweep, "tags.`omni.stage` = 'ingest'")
    ran = [r for r in ingests if r.data.tags.get("omni.stage_cache") != "hit"]
    assert len(ran) == 1 and ran[0].data.tags["omni.sweep.role"] == "shared"
    variants = {r.data.tags["omni.sweep.variant"] for r in ingests if r.data.tags["omni.sweep.role"] == "variant"}
    assert variants == {"0", "1", "2"}  # each variant's ingest: a cache hit
    assert "shared stages ingest: one run for all variants" in sweep["killed"]
    assert "shared stages" not in sweep["done"].stdout  # the resumed sweep found them done


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_variants_ran_at_once_on_the_sweeps_one_ray(sweep: dict[str, Any]) -> None:
    first, second = sorted(runs(sweep, "tags.`omni.sweep.role` = 'variant' and tags.`omni.stage` = 'rl'"),
                           key=lambda r: r.info.start_time)[:2]
    assert second.info.start_time < first.info.end_time  # the first two trained at once
    requests = {p.name.split(".")[0]: json.loads(p.read_text())["data"]["ray"]["address"]
                for p in sweep["folder"].glob(".omni/sweeps/*/*.request.json")}
    # one Ray of the sweep's for all its runs: the killed sweep's (the shared stages' run), the resumed one's
    # (its last variant's and the winner's), never a Ray of a variant's own
    assert len(requests) == 5 and "local" not in requests.values(), requests
    assert requests["v002"] == requests["winner"] != requests["shared"] and len(set(requests.values())) == 2
    assert "at most 2 at once on the sweep's local Ray (2 CPUs" in sweep["done"].stdout + sweep["done"].stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_sigkilled_sweep_run_again_keeps_what_finished_and_resumes_the_rest(sweep: dict[str, Any]) -> None:
    """What finished before the SIGKILL is kept; the last variant (killed during its training) ran again
    from its checkpoint. The variants' results do not depend on the interruption (a resumed training ends
    with the weights of an uninterrupted one: tests/test_scaled_stack.py), and the sync rung decisions and
    the ranking are functions of those results: they are checked as such here and in the next tests."""
    records = {r["label"]: r for r in sweep["records"]}
    kept = [label for label, r in records.items() if r["attempts"] == 1]
    assert records["v002"]["attempts"] == 2 and kept and "v002" not in kept
    assert f"resuming: {len(kept)} of 3 variants already finished (kept)" in sweep["done"].stdout
    assert records["v002"]["status"] == "completed"
    trainings = sorted(runs(sweep, "tags.`omni.sweep.variant` = '2' and tags.`omni.stage` = 'rl' and "
                                   "tags.`omni.sweep.role` = 'variant'"),
                       key=lambda r: r.info.start_time)
    assert len(trainings) == 2
    again = trainings[1].data.tags
    if again.get("omni.stage_cache") != "hit":  # else the killed run's training had finished as it went
        resumed = int(again["omni.resumed_from_step"])
        logged = {m.step for m in sweep["client"].get_metric_history(trainings[1].info.run_id, "critic/score/mean")}
        assert resumed >= 1 and min(logged) == resumed + 1  # nothing up to its checkpoint trained again


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_asha_pruned_a_variant_that_was_never_evaluated_nor_registered(sweep: dict[str, Any]) -> None:
    records = sweep["records"]
    statuses = [r["status"] for r in records]
    assert statuses.count("pruned") >= 1 and statuses.count("completed") >= 2, statuses
    eta = SWEEP_FILE["early_terminate"]["eta"]
    for record in records:  # sync mode: each decision against the lower-index variants' values at the rung
        for step, value in record["rungs"].items():
            earlier = [r["rungs"][step] for r in records if r["index"] < record["index"] and step in r["rungs"]]
            kept = decide(value, earlier, eta, "maximize").keep
            assert kept == (record["status"] != "pruned" or record["pruned"]["step"] != int(step)), record
    pruned = [r for r in records if r["status"] == "pruned"]
    for record in pruned:
        stages = {r.data.tags["omni.stage"] for r in runs(sweep, f"tags.`omni.sweep.variant` = '{record['index']}'")
                  if "omni.stage" in r.data.tags}
        assert "rl" in stages and not stages & {"eval", "eval_report", "register"}, stages
        assert record.get("select") is None and record["pruned"]["value"] < record["pruned"]["cutoff"]
    registers = runs(sweep, "tags.`omni.stage` = 'register'")
    assert len(registers) == 1 and registers[0].data.tags["omni.sweep.variant"] not in {str(r["index"]) for r in pruned}
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    flow_runs = sweep["prefect"].read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["sweep:tiny-lr"])))
    mine = [f for f in flow_runs if f.parameters["config"]["store"] == str(sweep["store"])]
    pruned_runs = [f for f in mine if f.state.is_cancelled() and "pruned at step" in (f.state.message or "")]
    assert {f.name.rsplit("/", 1)[1] for f in pruned_runs} == {r["label"] for r in pruned}
    parents = {sweep["prefect"].read_task_run(f.parent_task_run_id).flow_run_id for f in mine}
    assert len(parents) == 2  # every pipeline run under a sweep flow run: the killed one's, then the resumed one's


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_winner_alone_registered_with_the_sweeps_tags_and_lineage(sweep: dict[str, Any]) -> None:
    table = json.loads((sweep["prefix"] / "report" / "comparison.json").read_text())
    best = table["headline"]["best"]
    completed = [r for r in sweep["records"] if r["status"] == "completed"]
    assert best["variant"] == min(completed, key=lambda r: (-r["select"], r["index"]))["label"]
    tags = sweep["client"].get_model_version(sweep["model"], "1").tags
    assert tags["omni.sweep.variant"] == best["variant"] and tags["omni.sweep.rank"] == "1"
    assert float(tags["omni.sweep.score_select"]) == best["select"] and tags["omni.sweep.select_on"] == "eval"
    assert float(tags["omni.sweep.score_report"]) == best["report"] and tags["omni.sweep.report_on"] == "eval_report"
    assert tags["omni.sweep.n_variants"] == "3" and tags["omni.sweep.spec_digest"]
    assert json.loads(tags["omni.sweep.overrides"])[0].startswith("stages.rl.trainer.lr=")
    assert len(sweep["client"].search_model_versions(f"name='{sweep['model']}'")) == 1
    lineage = omni(["lineage", f"models:/{sweep['model']}/1", "--pipeline", str(sweep["pipeline"]), "--json"],
                   sweep["folder"], sweep["env"], timeout=120)
    assert lineage.returncode == 0, lineage.stderr
    won = json.loads(lineage.stdout)["model_version"]["sweep"]
    assert won["name"] == "tiny-lr" and won["rank"] == "1" and won["variant"] == best["variant"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_comparison_in_the_store_mlflow_prefect_and_the_terminal(sweep: dict[str, Any]) -> None:
    from PIL import Image

    report = sweep["prefix"] / "report"
    for name in ("metric_by_parameter.png", "training_curves.png", "parallel_coordinates.png"):
        assert Image.open(report / name).size[0] > 300
    rows = json.loads((report / "comparison.json").read_text())["rows"]
    assert [r["rank"] for r in rows if r["rank"]] == [1, 2] and {"eval", "eval_report", "steps", "wall_s"} <= set(rows[0])
    assert (report / "comparison.csv").read_text().splitlines()[0].startswith("variant,rank,status,")
    [sweep_run] = runs(sweep, "tags.`omni.sweep.role` = 'sweep'")
    assert sweep_run.data.metrics["variants"] == 3
    assert sweep_run.data.metrics["best_select"] == pytest.approx(rows[0]["eval"], abs=1e-6)
    artifacts = {f.path for f in sweep["client"].list_artifacts(sweep_run.info.run_id)}
    assert {"comparison.csv", "training_curves.png", "summary.md", "sweep.json"} <= artifacts
    variants = runs(sweep, "tags.`omni.sweep.role` = 'variant' and tags.`omni.sweep.status` = 'completed'")
    parents = [r for r in variants if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 2 and all("sweep.stages.rl.trainer.lr" in r.data.params and "sweep/select" in r.data.metrics
                                     for r in parents)
    assert "tiny-lr finished" in sweep["done"].stdout and "best         v" in sweep["done"].stdout
    status = omni(["sweep", "status", "tiny-lr", "--store", str(sweep["store"])], sweep["folder"], sweep["env"],
                  timeout=120)
    assert status.returncode == 0 and "2 completed, 1 pruned" in status.stdout and "pruned@2" in status.stdout, \
        status.stdout
    keys = {art.key for art in sweep["prefect"].read_artifacts() if art.key}
    assert {"tiny-lr-sweep-table", "tiny-lr-sweep"} <= keys
