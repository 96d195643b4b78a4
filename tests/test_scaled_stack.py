"""THE SCALED-OUT STACK, END TO END (slow; one stack for the module, started once): on 127.0.0.1,
a fresh Postgres cluster (Debian's postgresql, a temporary folder, a non-root owner) holding
Prefect's, MLflow's and MLflow's user store's databases; `prefect server` on it with basic auth and
a Prefect process worker; `mlflow server --app-name basic-auth` on it with artifacts on S3; moto as
S3 with IAM auth (only the IAM key it issued is let in); a two-node Ray cluster with token auth
whose nodes lack the driver's S3 variables. Then:
`omni deploy`, a sweep of three runs of `pipeline/local` created at once through the Prefect API (as
the UI's Run button does) pointing the digits pipeline (ingest -> rl -> eval -> register) at the S3
store, the MLflow server and the cluster (tests/test_concurrency.py's sweep); they complete, the rl
stage's actors ran on the cluster's worker node, the registry holds one version per distinct
checkpoint, the registered model's lineage and `omni verify --store s3://...` pass; then `omni sweep` with
tests/test_sweep.py's sweep file on the same servers, store and cluster. Faults: Postgres restarted
while the servers run (the next run succeeds, no earlier run lost); unauthenticated calls refused
by Prefect, MLflow and the Ray job server; no secret in a dump of the databases or in a log (the
servers', the worker's, Postgres', every Ray log); the worker node's raylet SIGKILLed during a
training, a replacement node started: the stage resumes from its last checkpoint and ends with the
weights of an uninterrupted run; the Prefect worker SIGKILLed (with its flow run's process, as when
its host dies) during a deployment run, then started again: `omni deploy`'s automation marks the run
Crashed when its heartbeats stop, and a re-run takes ingest from the stage cache and trains rl on
from its last committed checkpoint, no step trained twice beyond it (that fault comes first: the
sweep runs on the new worker during the 60 s Prefect waits for the missed heartbeats).
About 4 minutes in `make test` on a 2-core machine (starting the stack, its servers side by side: ~30 s)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from auth_servers import iam_moto, mlflow_server, prefect_server, stop
from pipeline_runs import check_sweep, digits_pipeline, sweep_configs, sweep_files
from postgres import pg_bin, start_postgres
from ray_cluster import start_cluster

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "omni-process"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(pg_bin() is None, reason="Debian's postgresql is not installed")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> Any:
    folder = tmp_path_factory.mktemp("stack")
    secrets_ = {"prefect": f"omni:{secrets.token_urlsafe(16)}", "mlflow": secrets.token_urlsafe(18),
                "ray": secrets.token_hex(32)}
    bucket = f"stack-{uuid.uuid4().hex[:10]}"
    started: list[Any] = []
    try:
        def two_node_cluster() -> Any:
            cluster = start_cluster(head_cpus=1, token=secrets_["ray"])
            started.append(cluster.stop)
            cluster.add_node(num_cpus=2, resources={"omni_worker": 4})
            return cluster

        def kept(start: Any, *args: Any) -> Any:  # a server, stopped at the end even if another fails
            server = start(*args)
            started.append(server.stop)
            return server

        def s3_store() -> Any:  # S3 checking IAM keys: only the key it issued is let in
            moto = iam_moto(folder / "s3")
            started.append(moto.stop)
            moto.client().create_bucket(Bucket=bucket)
            return moto

        # side by side: the Ray cluster, moto, and Postgres then the Prefect and MLflow servers on it
        with ThreadPoolExecutor(4) as pool:
            cluster_, moto_ = pool.submit(two_node_cluster), pool.submit(s3_store)
            pg = start_postgres(Path(f"/tmp/pg{uuid.uuid4().hex[:6]}"))
            started.append(pg.remove)
            for db in ("prefect", "mlflow", "mlflow_auth"):
                pg.createdb(db)
            prefect_ = pool.submit(kept, prefect_server, folder / "prefect", pg.url("prefect", "postgresql+asyncpg"),
                                   secrets_["prefect"], compose_prefect_ui())
            moto = moto_.result()
            secrets_["s3"] = moto.secret_access_key
            s3 = moto.client_env()
            mlflow_ = pool.submit(kept, mlflow_server, folder / "mlflow", pg.url("mlflow", "postgresql+psycopg"),
                                  f"s3://{bucket}/mlflow", pg.url("mlflow_auth", "postgresql+psycopg"),
                                  secrets_["mlflow"], s3)
            prefect, mlflow, cluster = prefect_.result(), mlflow_.result(), cluster_.result()
        env = {**os.environ, **s3, **prefect.client_env(), **mlflow.client_env(), **{
            k: v for k, v in cluster.driver_env({}).items()}, "OMNI_CACHE_DIR": str(model_cache),
            "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
            # Prefect's least heartbeat: `omni deploy`'s crash automation then waits 60 s, not 360
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",
            # the worker asks for scheduled runs every second (Prefect's default: 10 s), so a run created
            # through the API starts at once (three runs in this module)
            "PREFECT_WORKER_QUERY_SECONDS": "1"}
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
            env.pop(var, None)
        result = {"folder": folder, "pg": pg, "prefect": prefect, "mlflow": mlflow, "cluster": cluster, "env": env,
                  "bucket": bucket, "secrets": secrets_, "worker_log": folder / "worker.log"}
        # the worker starts while `omni deploy` runs (whichever comes first creates the work pool)
        start_worker(result)
        started.append(lambda: stop(result["worker"]))
        deployed = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "local"],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        result["deploy_out"] = deployed.stdout
        yield result
    finally:
        for stop_ in reversed(started):
            stop_()


def compose_prefect_ui() -> dict[str, str]:
    """The UI settings infra/compose/compose.yaml gives its Prefect server, UI on."""
    compose = yaml.safe_load((ROOT / "infra" / "compose" / "compose.yaml").read_text())
    env = compose["services"]["prefect-server"]["environment"]
    return {"PREFECT_UI_ENABLED": "true", **{k: str(v) for k, v in env.items() if k.startswith("PREFECT_UI_")}}


def start_worker(stack: dict) -> None:
    """A Prefect process worker for the pool (its log appended to worker.log), as stack["worker"]."""
    with open(stack["worker_log"], "ab") as out:
        stack["worker"] = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "process"],
            cwd=ROOT, env=stack["env"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextmanager
def api(stack: dict) -> Iterator[Any]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    prefect = stack["prefect"]
    with temporary_settings(updates={PREFECT_API_URL: prefect.url, PREFECT_API_AUTH_STRING: prefect.auth}), \
            get_client(sync_client=True) as client:
        yield client


def create_run(stack: dict, parameters: dict) -> Any:
    """A run of pipeline/local created through the Prefect API, as the UI's Run button does."""
    with api(stack) as client:
        deployment = client.read_deployment_by_name("pipeline/local")
        return client.create_flow_run_from_deployment(deployment.id, parameters=parameters)


def wait_final(stack: dict, flow_run_id: Any, timeout: float = 540) -> Any:
    with api(stack) as client:
        deadline = time.monotonic() + timeout
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            assert time.monotonic() < deadline, f"flow run {run.state}: {stack['worker_log'].read_text()[-4000:]}"
            time.sleep(0.5)


def run_deployment(stack: dict, parameters: dict, timeout: float = 540) -> Any:
    return wait_final(stack, create_run(stack, parameters).id, timeout)


def omni(stack: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=stack["env"],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def crash(stack: dict) -> dict:
    """The worker and its flow run's process SIGKILLed once rl committed a checkpoint (its host died);
    the worker started again at once (it takes only Scheduled runs, not the Running one) and a re-run of
    the deployment created. Prefect marks the killed run Crashed only after two missed heartbeats (60 s,
    `omni deploy`'s automation), so this comes first in the module: the sweep runs on the new worker while
    that time passes, and the test after the sweep's checks what became of both runs. (The pipeline is
    ingest -> rl: what comes after rl proves nothing here.)"""
    import psutil

    from omni_core.storage import Store

    workdir = stack["folder"] / "crash"
    workdir.mkdir()
    store = f"s3://{stack['bucket']}/crash"
    config = digits_pipeline(workdir, name="stack-crash", store=store, tracking_uri=stack["mlflow"].url, seed=7,
                             model_name="stack-crash", samples=2)
    config["ray"] = {"address": stack["cluster"].address}
    config["stages"] = [s for s in config["stages"] if s["name"] in ("ingest", "rl")]
    rl = next(s for s in config["stages"] if s["name"] == "rl")
    rl["trainer"]["total_steps"] = 4
    rl["checkpoint"] = {"save_freq": 1}
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    parameters = {"pipeline_file": str(path), "overrides": []}
    first = create_run(stack, parameters)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("OMNI_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            mp.setenv(name, stack["env"][name])
        s3 = Store(store)
        deadline = time.monotonic() + 300
        while not any("global_step_1/_manifest.json" in k for k in s3.list("runs/stack-crash")):
            assert time.monotonic() < deadline and stack["worker"].poll() is None, \
                stack["worker_log"].read_text()[-4000:]
            time.sleep(0.5)
        worker = psutil.Process(stack["worker"].pid)
        for proc in [*worker.children(recursive=True), worker]:  # the host dies: the run's process with it
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        stack["worker"].wait(timeout=30)
        start_worker(stack)
        # the killed driver's actors are gone (Ray kills an owner's actors): no checkpoint commits after this
        deadline = time.monotonic() + 60
        while alive := stage_actors_alive(stack["cluster"]):
            assert time.monotonic() < deadline, alive
            time.sleep(0.5)
        committed = max(int(k.split("global_step_")[1].split("/")[0]) for k in s3.list("runs/stack-crash")
                        if k.endswith("/_manifest.json") and "global_step_" in k)
    # the re-run, created while Prefect has yet to notice the crash (it runs meanwhile: the automation
    # waits two missed heartbeats for nothing the re-run needs)
    again = create_run(stack, parameters)
    return {"first": first, "again": again, "committed": committed}


@pytest.fixture(scope="module")
def sweep(stack: dict, crash: dict) -> dict:
    """tests/test_concurrency.py's sweep on the stack, the module's one run of the pipeline deployment:
    three runs created at once through the API (two pipelines differing in seed and lr, one an exact
    duplicate of the first), one S3 store, the Postgres-backed MLflow server, the cluster. After `crash`
    (its re-run shares the cluster with them)."""
    store = f"s3://{stack['bucket']}/sweep"
    paths = sweep_configs(stack["folder"] / "sweep", store=store, tracking_uri=stack["mlflow"].url,
                          model_name="stack-sweep", ray_address=stack["cluster"].address, name="stack-sweep")
    created = [create_run(stack, {"pipeline_file": str(p), "overrides": []}) for p in paths]
    with ThreadPoolExecutor(len(created)) as pool:
        finals = list(pool.map(lambda run: wait_final(stack, run.id), created))
    return {"store": store, "paths": paths, "finals": finals}


def test_unauthenticated_calls_are_refused(stack: dict) -> None:
    assert httpx.post(f"{stack['prefect'].url}/flows/filter", json={}).status_code == 401
    assert httpx.get(f"{stack['mlflow'].url}/api/2.0/mlflow/experiments/search?max_results=1",
                     timeout=60).status_code == 401
    assert httpx.get(f"{stack['cluster'].job_server}/api/jobs/", timeout=30).status_code == 401


def test_the_prefect_ui_calls_the_api_at_the_address_the_browser_used(stack: dict) -> None:
    """The stack's Prefect UI (compose's settings) finds its API wherever a browser reached it (the
    address the link names, another name of the host): its ui-settings' api_url, resolved against the
    page as the UI's fetch does, is that address's API, which (after the UI's login) lists what `omni
    deploy` registered, the deployment the UI's Run button starts. Unset, the api_url named
    http://127.0.0.1:4200/api, where no server is."""
    from urllib.parse import urljoin

    server = stack["prefect"].url.removesuffix("/api")
    user, password = stack["prefect"].auth.split(":", 1)
    for address in (server, server.replace("127.0.0.1", "localhost")):
        settings = httpx.get(f"{address}/ui-settings", timeout=30).json()
        assert settings["auth"] == "BASIC"  # the UI asks for the login first
        api = urljoin(f"{address}/runs", settings["api_url"])
        assert api == f"{address}/api", settings
        deployments = httpx.post(f"{api}/deployments/filter", json={}, auth=(user, password), timeout=30).json()
        assert "local" in {d["name"] for d in deployments}, deployments


def test_a_deployment_run_on_the_stack_completes_on_the_cluster(stack: dict, sweep: dict) -> None:
    path, run = sweep["paths"][0], sweep["finals"][0]
    assert run.state.is_completed(), f"{run.state}: {stack['worker_log'].read_text()[-4000:]}"
    # the rl stage's actors ran on the cluster, on its worker node (the head has 1 CPU, no room)
    cluster = stack["cluster"]
    response = httpx.get(f"{cluster.job_server}/api/v0/actors", params={"detail": "1", "limit": "1000"},
                         headers={"Authorization": f"Bearer {cluster.token}"}, timeout=30)
    actors = response.json()["data"]["result"]["result"]
    trainers = [a for a in actors if a.get("class_name") == "TrainerWorker"]
    nodes = {n["raylet"]["nodeId"] for n in cluster.alive_nodes()}
    assert trainers and all(a["node_id"] in nodes for a in trainers), trainers
    lineage = omni(stack, "lineage", "models:/stack-sweep", "--pipeline", str(path), "--json")
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr


def test_a_sweep_of_three_runs_at_once_on_the_stack(stack: dict, sweep: dict) -> None:
    """All three complete, the registry holds one version per distinct checkpoint with `candidate` and
    `champion` settled, lineage and `omni verify` pass. (Before the Postgres restart's re-run adds a run.)"""
    store, paths, finals = sweep["store"], sweep["paths"], sweep["finals"]
    assert all(run.state.is_completed() for run in finals), \
        f"{[str(r.state) for r in finals]}: {stack['worker_log'].read_text()[-4000:]}"
    from mlflow import MlflowClient

    os.environ.update(stack["mlflow"].client_env())
    try:
        check_sweep(MlflowClient(stack["mlflow"].url), "stack-sweep", "stack-sweep", len(paths))
    finally:
        for name in stack["mlflow"].client_env():
            os.environ.pop(name, None)
    lineage = omni(stack, "lineage", "models:/stack-sweep@champion", "--pipeline", str(paths[0]), "--json")
    assert lineage.returncode == 0, lineage.stdout + lineage.stderr
    verify = omni(stack, "verify", "--store", store)
    assert verify.returncode == 0, verify.stdout + verify.stderr


def test_the_sweep_of_tests_test_sweep_runs_unchanged_on_the_stack(stack: dict) -> None:
    """`omni sweep` with tests/test_sweep.py's sweep file, its pipeline pointed at the S3 store, the MLflow
    server and the cluster: the shared stage once, every run of it on the cluster,
    ASHA's decisions (sync: the same as on the embedded default), the winner registered with the sweep's
    tags, the comparison in S3, the variants' flow runs under the sweep's on the Postgres-backed Prefect."""
    from mlflow import MlflowClient

    from omni_core.storage import Store

    store = f"s3://{stack['bucket']}/sweep-omni"
    pipeline, sweep_file = sweep_files(stack["folder"] / "omni-sweep", store=store, tracking_uri=stack["mlflow"].url,
                                       model_name="stack-omni-sweep", ray={"address": stack["cluster"].address})
    done = subprocess.run([sys.executable, "-m", "flows.cli", "sweep", str(pipeline), str(sweep_file)],
                          cwd=stack["folder"] / "omni-sweep", env=stack["env"], capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "on the cluster at " in done.stdout + done.stderr and "shared stages ingest" in done.stdout
    with pytest.MonkeyPatch.context() as mp:
        for name in ("OMNI_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            mp.setenv(name, stack["env"][name])
        s3 = Store(store)
        [spec] = [k for k in s3.list("sweeps/") if k.endswith("/spec.json")]
        prefix = spec.rsplit("/", 1)[0]
        records = [s3.read_json(k) for k in sorted(s3.list(f"{prefix}/variants/"))]
        assert s3.exists(f"{prefix}/report/training_curves.png")
    statuses = [r["status"] for r in records]
    assert statuses.count("completed") >= 2 and statuses.count("pruned") >= 1, statuses
    os.environ.update(stack["mlflow"].client_env())
    try:
        client = MlflowClient(stack["mlflow"].url)
        experiment = client.get_experiment_by_name("sweep-digits").experiment_id
        ingests = [r for r in client.search_runs([experiment], "tags.`omni.stage` = 'ingest'")
                   if r.data.tags.get("omni.stage_cache") != "hit"]
        version = client.get_model_version("stack-omni-sweep", "1")
    finally:
        for name in stack["mlflow"].client_env():
            os.environ.pop(name, None)
    assert len(ingests) == 1 and ingests[0].data.tags["omni.sweep.role"] == "shared"
    best = min((r for r in records if r["status"] == "completed"), key=lambda r: (-r["select"], r["index"]))
    assert version.tags["omni.sweep.variant"] == best["label"] and version.tags["omni.sweep.rank"] == "1"
    requests = [json.loads(p.read_text()) for p in (stack["folder"] / "omni-sweep").glob(".omni/sweeps/*/*.request.json")]
    assert {r["data"]["ray"]["address"] for r in requests} == {stack["cluster"].address}  # no Ray of the sweep's own
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with api(stack) as prefect:
        runs = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["sweep:tiny-lr"])))
        parents = {prefect.read_task_run(r.parent_task_run_id).flow_run_id for r in runs if r.parent_task_run_id}
    assert len(runs) >= 5 and len(parents) == 1  # shared, three variants, the winner: children of one sweep run


def test_the_worker_killed_during_a_run_crashes_it_and_a_rerun_resumes_from_the_checkpoint(
        stack: dict, sweep: dict, crash: dict) -> None:
    """The `crash` fixture's runs, after the sweep: Prefect marked the killed run Crashed when its
    heartbeats stopped; the re-run took ingest from the stage cache and trained rl from the last committed
    checkpoint on."""
    committed = crash["committed"]
    assert committed < 4, "the training finished before the worker was killed: nothing to resume"
    crashed = wait_final(stack, crash["first"].id, timeout=200)  # the automation: 60 s without a heartbeat
    assert crashed.state.is_crashed(), crashed.state
    again = wait_final(stack, crash["again"].id)
    assert again.state.is_completed(), f"{again.state}: {stack['worker_log'].read_text()[-4000:]}"
    runs = mlflow_runs(stack, "stack-crash", f"tags.`prefect.flow_run_id` = '{again.id}'")
    by_stage = {r.data.tags.get("omni.stage"): (r, steps) for r, steps in runs}
    assert by_stage["ingest"][0].data.tags["omni.stage_cache"] == "hit", by_stage["ingest"][0].data.tags
    rl_run, steps = by_stage["rl"]
    assert rl_run.data.tags["omni.resumed_from_step"] == str(committed), rl_run.data.tags
    assert steps == set(range(committed + 1, 5)), steps  # nothing before the checkpoint trained again


def test_postgres_restarted_next_run_succeeds_and_no_run_is_lost(stack: dict, sweep: dict) -> None:
    first = sweep["finals"][0]
    stack["pg"].restart()  # the Prefect and MLflow servers keep running
    # the sweep's first pipeline again: its stages come from the stage cache
    again = run_deployment(stack, {"pipeline_file": str(sweep["paths"][0]), "overrides": []})
    assert again.state.is_completed(), f"{again.state}: {stack['worker_log'].read_text()[-4000:]}"
    with api(stack) as client:
        assert client.read_flow_run(first.id).state.is_completed()
    from mlflow import MlflowClient

    os.environ.update(stack["mlflow"].client_env())
    try:
        client = MlflowClient(stack["mlflow"].url)
        runs = client.search_runs([client.get_experiment_by_name("stack-sweep").experiment_id],
                                  filter_string="attributes.status = 'FINISHED'")
    finally:
        for name in stack["mlflow"].client_env():
            os.environ.pop(name, None)
    flow_runs = {r.data.tags.get("prefect.flow_run_id") for r in runs}
    assert {str(run.id) for run in sweep["finals"]} | {str(again.id)} <= flow_runs, flow_runs


def test_no_secret_in_a_database_dump_or_a_log(stack: dict, sweep: dict) -> None:
    pg = stack["pg"]
    texts = {f"pg_dump {db}": pg.dump(db) for db in ("prefect", "mlflow", "mlflow_auth")}
    ray_logs = [p for p in Path(stack["cluster"].temp).glob("session_*/logs/*") if p.is_file()]
    assert ray_logs
    logs = [stack["prefect"].log, stack["mlflow"].log, stack["worker_log"], *stack["cluster"].logs,
            pg.folder / "postgres.log", *ray_logs]
    texts.update({str(p): p.read_text(errors="replace") for p in logs})
    values = {name: value for name, value in stack["secrets"].items()}
    values["prefect"] = values["prefect"].split(":", 1)[1]
    for where, text in texts.items():
        for name, value in values.items():
            assert value not in text, f"the {name} secret is in {where}"
    assert "pipeline/local" in stack["deploy_out"]


def fault_pipeline(stack: dict, store: str, address: str) -> Path:
    workdir = stack["folder"] / f"fault-{address.replace(':', '-').replace('.', '-')}"
    workdir.mkdir(exist_ok=True)
    config = digits_pipeline(workdir, name="stack-fault", store=store, tracking_uri=stack["mlflow"].url, seed=5,
                             model_name="stack-fault", samples=4)
    config["ray"] = {"address": address, **({"num_cpus": 2} if address == "local" else {})}
    rl = next(s for s in config["stages"] if s["name"] == "rl")
    rl["trainer"]["total_steps"] = 6
    rl["checkpoint"] = {"save_freq": 1}
    rl["execution"] = {"retry_backoff_s": 1.0}
    if address != "local":  # every actor on a worker node (the head has no omni_worker)
        rl["resources"] = {role: {"CPU": 1 if role != "reward" else 0, "omni_worker": 1}
                           for role in ("trainer", "rollout", "reward")}
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(stack: dict, path: Path, out: Any = subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "omni_core.training", "run", str(path), "--stage", "rl"],
                            cwd=ROOT, env=stack["env"], stdout=out, stderr=subprocess.STDOUT, text=True)


def last_json(out: str) -> dict:
    """The driver's result: its last JSON line (a Ray log line may come after it, as the driver shuts down)."""
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))


def test_a_worker_node_lost_during_training_resumes_and_ends_with_the_same_weights(stack: dict) -> None:
    """The worker node's raylet SIGKILLed after the second checkpoint; the test starts a replacement
    node; the stage resumes from its last checkpoint there and ends with the weights of an
    uninterrupted run (the same stage on a local Ray, another store)."""
    import psutil

    from omni_core.config import DatasetConfig
    from omni_core.data import ingest
    from omni_core.storage import Store

    cluster = stack["cluster"]
    store = f"s3://{stack['bucket']}/fault"
    local_store = str(stack["folder"] / "fault-local-store")
    dataset = DatasetConfig(source="fixtures://digits?rows=16&seed=0", converter="digits")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("OMNI_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
            mp.setenv(name, stack["env"][name])
        versions = {ingest(Store(s), "digits", dataset, progress=lambda _: None).version for s in (store, local_store)}
        assert len(versions) == 1
        s3 = Store(store)
        proc = train(stack, fault_pipeline(stack, store, cluster.address))
        local: subprocess.Popen | None = None
        local_log = stack["folder"] / "fault-local.log"
        worker_node = cluster.nodes[1]
        try:
            deadline = time.monotonic() + 300
            while not any("global_step_2/_manifest.json" in k for k in s3.list("runs/stack-fault")):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-4000:]
                time.sleep(0.5)
            raylets = [p for p in psutil.Process(worker_node.pid).children(recursive=True) if "raylet" in p.name()]
            assert raylets, "no raylet under the worker node's `ray start`"
            for p in raylets:
                p.kill()
            cluster.add_node(num_cpus=2, resources={"omni_worker": 4})  # the replacement
            # the uninterrupted run, on a local Ray of its own, runs beside the recovery (mostly waiting for
            # the actors to come back); started once the replacement joined: a Ray starting beside the
            # replacement's start-up made that miss Ray's 30 s limit at load ~10
            with open(local_log, "w") as log:  # a file: nobody reads a pipe while the other run is awaited
                local = train(stack, fault_pipeline(stack, local_store, "local"), out=log)
            out, _ = proc.communicate(timeout=420)
            local.wait(timeout=420)
        finally:
            for child in (proc, local):
                if child is not None and child.poll() is None:
                    child.kill()
    assert proc.returncode == 0, out[-4000:]
    result = last_json(out)
    assert result["global_step"] == 6 and result["recoveries"] >= 1, out[-3000:]
    assert "restart" in out.lower() or "recover" in out.lower(), out[-3000:]
    local_out = local_log.read_text()
    assert local is not None and local.returncode == 0, local_out[-4000:]
    uninterrupted = last_json(local_out)
    assert uninterrupted["recoveries"] == 0
    assert result["weights_sha256"] == uninterrupted["weights_sha256"]


def mlflow_runs(stack: dict, experiment: str, filter_string: str) -> list[Any]:
    from mlflow import MlflowClient

    os.environ.update(stack["mlflow"].client_env())
    try:
        client = MlflowClient(stack["mlflow"].url)
        runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                                  filter_string=filter_string)
        return [(r, {m.step for m in client.get_metric_history(r.info.run_id, "timing_s/step")}) for r in runs]
    finally:
        for name in stack["mlflow"].client_env():
            os.environ.pop(name, None)


def stage_actors_alive(cluster: Any) -> list[dict]:
    """The stage actors (trainer, rollout, reward workers) alive on the cluster."""
    response = httpx.get(f"{cluster.job_server}/api/v0/actors", params={"detail": "1", "limit": "1000"},
                         headers={"Authorization": f"Bearer {cluster.token}"}, timeout=30)
    return [a for a in response.json()["data"]["result"]["result"] if a.get("state") == "ALIVE"
            and a.get("class_name") in ("TrainerWorker", "RolloutWorker", "RewardWorker")]
