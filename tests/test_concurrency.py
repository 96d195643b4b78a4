"""Several runs at once on one store and one tracking database.

The races, each forced deterministically against the real thing (a sqlite MLflow database, a local
store; no mocks): a fresh sqlite database opened by several processes at once; the registry's
get-or-creates, a duplicate registration, aliases written stale by the slower of two register
stages or created by two at once, a version tag two identical runs insert at once
(`omni_core.lineage.model_registry`); ingests of one dataset version at once, and LATEST
pointers written stale. Then the real sweep on the embedded default (slow): three `omni run` started
together on one store and one sqlite URI, two pipelines that differ in seed and lr registering into
one model, and an exact duplicate of the first; all finish, one registered version per distinct
checkpoint, `candidate` on the newest, `champion` on the best score, lineage and `omni verify` pass.
The same sweep on the scaled-out stack is in tests/test_scaled_stack.py (its servers).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from mlflow.exceptions import MlflowException
from pipeline_runs import check_sweep, sweep_configs
from ray_cluster import start_cluster

from omni_core.config import DatasetConfig
from omni_core.data import ingest, load_version
from omni_core.lineage import Tracker, verify
from omni_core.lineage.model_registry import (
    CANDIDATE,
    CHAMPION,
    REGISTER_KEY,
    ensure_registered_model,
    keep_first_of_key,
    set_version_tags,
    settle_alias,
    settle_candidate,
    settle_champion,
)
from omni_core.storage import Store, settle_pointer
from omni_core.training.checkpoint import LATEST, checkpoint_prefix, settle_latest

ROOT = Path(__file__).resolve().parents[1]
METRIC = "val/reward_mean"


# ---- MLflow ----------------------------------------------------------------------------------------

OPEN_TRACKER = """
import sys
from omni_core.lineage import Tracker
tracker = Tracker(sys.argv[1])
print(tracker.experiment_id("sweep"))
"""


def test_a_fresh_sqlite_database_opened_by_four_processes_at_once(tmp_path: Path) -> None:
    """Each process creates the database's tables (MLflow migrates a fresh one when it opens it) and
    the experiment: without the lock, `duplicate column name: step` and `Experiment ... already exists`."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_TRACKER, uri], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-2000:] for o in outs)
    assert len({o.strip().splitlines()[-1] for o in outs}) == 1  # one experiment, the same id for all


@pytest.fixture
def client(tmp_path: Path) -> Any:
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}").client


def version(client: Any, name: str, score: float | None, *, champion: str = "", promotion: str = "promoted",
            key: str = "") -> str:
    tags = {"omni.metric": METRIC, "omni.champion_version": champion, "omni.promotion": promotion}
    if score is not None:
        tags["omni.score"] = repr(score)
    if key:
        tags[REGISTER_KEY] = key
    return str(client.create_model_version(name, source="file:///checkpoint", tags=tags).version)


def tag_score(client: Any) -> Any:
    return lambda v: float(v.tags["omni.score"]) if v.tags.get("omni.score") else None


def test_registered_model_get_or_create_from_many_threads(client: Any) -> None:
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: ensure_registered_model(client, "m", "p"), range(6)))
    assert [m.name for m in client.search_registered_models()] == ["m"]
    ensure_registered_model(client, "m", "p")  # there: nothing happens


def test_the_slower_of_two_racing_promotions_cannot_put_a_worse_version_over_a_better(client: Any) -> None:
    """v1 is champion; v2 (0.6) and v3 (0.7) both passed against it at once. v3 moves `champion` first,
    then v2's stale move lands: whichever settles next puts v3 back; both settle on v3."""
    ensure_registered_model(client, "m", "p")
    v1 = version(client, "m", 0.5)
    client.set_registered_model_alias("m", CHAMPION, v1)
    v2, v3 = version(client, "m", 0.6, champion=v1), version(client, "m", 0.7, champion=v1)
    client.set_registered_model_alias("m", CHAMPION, v3)
    client.set_registered_model_alias("m", CHAMPION, v2)  # the stale write
    assert settle_champion(client, "m", METRIC, True, tag_score(client)) == v3
    assert settle_champion(client, "m", METRIC, True, tag_score(client)) == v3
    # lower is better: the same race settles on v2
    client.set_registered_model_alias("m", CHAMPION, v1)
    assert settle_champion(client, "m", METRIC, False, tag_score(client)) == v1  # v1 0.5 is the lowest
    # a version that did not pass its gate never takes it; nor one decided against another champion
    version(client, "m", 0.99, champion=v1, promotion="kept")
    version(client, "m", 0.98, champion="77")
    client.set_registered_model_alias("m", CHAMPION, v2)
    assert settle_champion(client, "m", METRIC, True, tag_score(client)) == v3  # v2's sibling, better


def test_first_registrations_at_once_settle_on_the_best_and_ties_on_the_lower(client: Any) -> None:
    ensure_registered_model(client, "m", "p")
    v1, v2, v3 = (version(client, "m", s) for s in (0.4, 0.8, 0.8))  # all decided with no champion
    client.set_registered_model_alias("m", CHAMPION, v1)
    assert settle_champion(client, "m", METRIC, True, tag_score(client)) == v2
    # one champion at a time: a champion with no score is replaced by a scored rival
    ensure_registered_model(client, "n", "p")
    n1 = version(client, "n", None)
    client.set_registered_model_alias("n", CHAMPION, n1)
    n2 = version(client, "n", 0.1, champion=n1)
    assert settle_champion(client, "n", METRIC, True, tag_score(client)) == n2
    assert v3


def test_candidate_settles_on_the_newest_version_after_a_stale_write(client: Any) -> None:
    ensure_registered_model(client, "m", "p")
    v1, v2 = version(client, "m", 0.1), version(client, "m", 0.2)
    client.set_registered_model_alias("m", CANDIDATE, v1)  # the slower run's stale write
    assert settle_candidate(client, "m") == v2
    assert str(client.get_model_version_by_alias("m", CANDIDATE).version) == v2


def test_an_alias_named_a_version_that_a_racer_then_dropped_settles_on_the_next(client: Any) -> None:
    """The sweep's race: `candidate`'s rule reads the newest version, whose creator (a duplicate run)
    deletes it before the alias is written (keep_first_of_key); the alias settles on what is left."""
    ensure_registered_model(client, "m", "p")
    v1, v2 = version(client, "m", 0.1), version(client, "m", 0.2)
    rounds: list[str] = []

    def newest_then_dropped(_: Any) -> str:
        newest = str(max(int(v.version) for v in client.search_model_versions("name='m'")))
        rounds.append(newest)
        if newest == v2:
            client.delete_model_version("m", v2)  # the racer drops it between the read and the write
        return newest

    assert settle_alias(client, "m", CANDIDATE, newest_then_dropped) == v1
    assert rounds[:2] == [v2, v1] and str(client.get_model_version_by_alias("m", CANDIDATE).version) == v1


@contextlib.contextmanager
def racer_insert_first(client: Any, table: str, racer: Callable[[], Any]) -> Iterator[list[bool]]:
    """Runs `racer` (on its own thread: its own connection), to its commit, right before the first
    INSERT into `table` of the registry database: MLflow's set of an alias or tag reads it and then
    inserts it, so when both write a new one at once the slower insert fails on the unique key
    (sqlite's IntegrityError, Postgres's alike). Yields a list that holds True once it raced."""
    from sqlalchemy import event

    engine = client._get_registry_client().store.engine
    raced: list[bool] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith(f"INSERT INTO {table.upper()}") and not raced:
            raced.append(True)
            other = threading.Thread(target=racer)
            other.start()
            other.join()

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield raced
    finally:
        event.remove(engine, "before_cursor_execute", before)


def test_an_alias_created_by_a_racer_between_mlflows_read_and_insert_settles(client: Any) -> None:
    """The sweep's race on CI: `candidate` unset, two register stages set it at once; the racer's
    (naming the older version) commits first and this run's insert fails: one more settle round."""
    ensure_registered_model(client, "m", "p")
    v1, v2 = version(client, "m", 0.1), version(client, "m", 0.2)
    with racer_insert_first(client, "registered_model_aliases",
                            lambda: client.set_registered_model_alias("m", CANDIDATE, v1)) as raced:
        assert settle_candidate(client, "m") == v2
    assert raced and str(client.get_model_version_by_alias("m", CANDIDATE).version) == v2


def test_a_version_tag_inserted_by_a_racer_at_once_is_set(client: Any) -> None:
    """Two identical runs share one version (keep_first_of_key) and both write their promotion decision
    on it: the racer's tag committed first leaves this run's value, not an IntegrityError."""
    ensure_registered_model(client, "m", "p")
    v1 = version(client, "m", 0.1, promotion="")
    with racer_insert_first(client, "model_version_tags",
                            lambda: client.set_model_version_tag("m", v1, "omni.reason", "racer")) as raced:
        set_version_tags(client, "m", v1, {"omni.reason": "mine", "omni.promotion": "promoted"})
    tags = client.get_model_version("m", v1).tags
    assert raced and tags["omni.reason"] == "mine" and tags["omni.promotion"] == "promoted"
    with pytest.raises(MlflowException, match="not found"):  # not a race: the error stands
        set_version_tags(client, "m", "99", {"omni.reason": "x"})


def test_two_registrations_of_one_key_leave_one_version(client: Any) -> None:
    ensure_registered_model(client, "m", "p")
    first = client.get_model_version("m", version(client, "m", 0.3, key="k1"))
    second = client.get_model_version("m", version(client, "m", 0.3, key="k1"))
    other = client.get_model_version("m", version(client, "m", 0.3, key="k2"))
    assert keep_first_of_key(client, "m", first, "k1") == (first, True)
    kept, created = keep_first_of_key(client, "m", second, "k1")
    assert (str(kept.version), created) == (str(first.version), False)
    assert keep_first_of_key(client, "m", other, "k2")[1]
    assert sorted(int(v.version) for v in client.search_model_versions("name='m'")) == [int(first.version),
                                                                                         int(other.version)]


# ---- the store -------------------------------------------------------------------------------------


def test_four_ingests_of_one_version_at_once_commit_it_whole(tmp_path: Path, omni_cache: Path) -> None:
    store = Store(str(tmp_path / "store"))
    config = DatasetConfig(source="fixtures://gsm8k?rows=40&seed=0", converter="gsm8k", shard_rows=8)
    with ThreadPoolExecutor(4) as pool:
        versions = list(pool.map(lambda _: ingest(Store(store.root), "gsm8k", config, progress=lambda _: None),
                                 range(4)))
    assert len({v.version for v in versions}) == 1
    assert len({json.dumps(v.manifest, sort_keys=True) for v in versions}) == 1  # the same bytes, whoever wrote
    checks = list(verify(store, "datasets/gsm8k"))
    assert checks and all(c.status == "ok" for c in checks)
    assert load_version(store, "gsm8k").version == versions[0].version
    # another version committed meanwhile, then the first writer's stale LATEST: settled on the newest
    other = ingest(store, "gsm8k", DatasetConfig(source="fixtures://gsm8k?rows=41&seed=0", converter="gsm8k"),
                   progress=lambda _: None)
    store.write_text("datasets/gsm8k/LATEST", versions[0].version + "\n")
    from omni_core.data.ingest import settle_latest as settle_dataset_latest

    settle_dataset_latest(store, "gsm8k")
    assert load_version(store, "gsm8k").version == other.version
    # re-ingesting the first version makes it the latest again (committed again, now)
    time.sleep(0.01)
    ingest(store, "gsm8k", config, progress=lambda _: None)
    assert load_version(store, "gsm8k").version == versions[0].version


def test_a_checkpoint_pointer_never_goes_back_to_an_older_step(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    root = "runs/p/key/rl"
    for step in (1, 2, 3):
        store.write_json(f"{checkpoint_prefix(root, step)}/_manifest.json", {"global_step": step})
    store.write_text(f"{root}/{LATEST}", "2\n")  # the slower writer's stale pointer, after step 3's
    settle_latest(store, root)
    assert store.read_text(f"{root}/{LATEST}").strip() == "3"
    assert settle_pointer(store, "p/none", lambda: None) is None  # nothing committed: nothing written
    assert not store.exists("p/none")


# ---- the sweep on the embedded default --------------------------------------------------------------

def omni(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_a_sweep_of_three_runs_at_once_on_the_embedded_default(tmp_path: Path, model_cache: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """As a user would: three `omni run` started together in one folder, on its ./.omni store, sqlite
    MLflow database and Prefect home, all fresh (created by whichever run comes first), and omni's
    local Prefect server (the default: one started for the three, stopped at the end). The runs share
    one Ray started with `ray start --head` (`ray.address`), as docs/concepts/concurrency.md advises for a sweep: several
    local Rays starting at once on a busy 2-core machine miss Ray's own start-up timeout."""
    monkeypatch.setenv("OMNI_CACHE_DIR", str(model_cache))  # the Ray nodes' environment: actors find the models
    cluster = start_cluster(head_cpus=8)
    store, uri = ".omni/store", "sqlite:///.omni/mlflow.db"
    paths = sweep_configs(tmp_path, store=store, tracking_uri=uri, model_name="sweep-digits",
                          ray_address=cluster.address)
    env = {**cluster.driver_env(), "PYTHONPATH": str(ROOT), "OMNI_CACHE_DIR": str(model_cache),
           "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMNI_PREFECT_SERVER": "local"}
    for var in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        env.pop(var, None)
    logs = [tmp_path / f"run{i}.log" for i in range(len(paths))]
    procs = []
    for path, log in zip(paths, logs, strict=True):
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(path)], cwd=tmp_path,
                                          env=env, stdout=out, stderr=subprocess.STDOUT))
    deadline, nodes = time.monotonic() + 450, ""  # under pytest's 600 s: a hang fails with the logs below
    try:
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if any(proc.poll() != 0 for proc in procs):
            nodes = cluster.log_tails()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        cluster.stop()
        stopped = omni(["server", "stop"], tmp_path, env)
    failed = [log.read_text()[-3000:] for proc, log in zip(procs, logs, strict=True) if proc.returncode != 0]
    assert not failed, "\n-----\n".join(failed) + f"\n----- the cluster's nodes:\n{nodes}"
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    client = Tracker(f"sqlite:///{tmp_path / '.omni/mlflow.db'}").client
    check_sweep(client, "sweep-digits", "sweep", len(paths))
    # one local Prefect server served the three runs: their flow runs' links share its address
    runs = client.search_runs([client.get_experiment_by_name("sweep").experiment_id], max_results=200)
    links = [r.data.tags.get("prefect.flow_run_url", "") for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(links) == len(paths) and len({urlsplit(u).netloc for u in links}) == 1, links
    lineage = omni(["lineage", "models:/sweep-digits@champion", "--pipeline", str(paths[0]), "--json"], tmp_path, env)
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr
    chain = json.loads(lineage.stdout)
    champion = client.get_model_version_by_alias("sweep-digits", CHAMPION)
    assert chain["model_version"]["version"] == str(champion.version)
    assert chain["training"] and chain["datasets"][0]["name"] == "digits"
    verified = omni(["verify", "--store", str(tmp_path / store)], tmp_path, env)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_runs_logging_one_new_dataset_version_at_once_all_link_it(tmp_path: Path) -> None:
    """MLflow inserts an experiment's dataset row on first use: runs of a sweep logging the same new
    dataset version at once race on that insert, and the loser's whole call failed (`UNIQUE constraint
    failed` on sqlite, `UniqueViolation` on Postgres: the stack's sweep saw it). Each now links it."""
    from threading import Barrier

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = tracker.experiment_id("sweep")
    runs = [tracker.client.create_run(experiment).info.run_id for _ in range(6)]
    for digest in ("d0", "d1", "d2", "d3"):
        barrier = Barrier(len(runs))

        def log(run_id: str, digest: str = digest, barrier: Barrier = barrier) -> None:
            barrier.wait()
            tracker.log_dataset_input(run_id, name="digits", digest=digest, source_uri=f"file:///store/{digest}",
                                      raw_source_uri="fixtures://digits", schema=[], profile={}, context="training")

        with ThreadPoolExecutor(len(runs)) as pool:
            list(pool.map(log, runs))
    for run_id in runs:
        inputs = tracker.client.get_run(run_id).inputs.dataset_inputs
        assert sorted(i.dataset.digest for i in inputs) == ["d0", "d1", "d2", "d3"]
