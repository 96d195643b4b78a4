"""omni's local Prefect servers (flows/local_prefect.py): started once by the first command that runs a
flow, shared by concurrent commands, reused, replaced when stale, stopped by `omni server stop`; one
per directory for `omni run`s started at once from several, each stopping itself when unused (or at
once when its directory is deleted) unless `omni server start` made it stay, all listed by `omni
server status` and stopped by `omni server stop --all`; the Prefect link `omni run` prints shows its
flow run in a real browser; and the commands that only read (`--help`, `validate`, `plan`,
`lineage`) start no server and import no torch. Real `prefect server start` processes, listed in a
registry private to this module (its own OMNI_CACHE_DIR); every one this module starts is stopped
at its end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from browser import chromium, dump_dom, visible_text

from flows import local_prefect
from flows.local_prefect import RECORD, _alive, running_server, stop_local_server

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_UI_URL",
                                                             "OMNI_PREFECT_SERVER", local_prefect.IDLE_VARIABLE)}
    return {**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


@pytest.fixture(scope="module", autouse=True)
def private_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's OMNI_CACHE_DIR (this process's, so its commands' too): the servers' registry is the
    module's own, and `omni server stop --all` here stops only what this module started. At the end,
    every server left in it is stopped."""
    folder = tmp_path_factory.mktemp("omni-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_CACHE_DIR", str(folder))
        try:
            yield folder
        finally:
            local_prefect.stop_all_servers()


def omni(cwd: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def imported(stderr: str) -> set[str]:
    """The modules `python -X importtime` reports."""
    return set(re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", stderr, re.MULTILINE))


def _server_pids(home: Path) -> list[int]:
    """The `prefect server start` processes whose PREFECT_HOME is `home`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prefect" in cmd and b"server" in cmd and f"PREFECT_HOME={home}".encode() in env:
            pids.append(int(proc.name))
    return pids


def test_read_only_commands_start_no_server_and_import_no_torch(tmp_path: Path) -> None:
    (tmp_path / ".omni").mkdir()
    (tmp_path / ".omni" / "mlflow.db").touch()  # an empty tracking database: lineage reads it, finds nothing
    env = _env()  # OMNI_PREFECT_SERVER unset: a command that ran a flow would start the local server
    for args in (["--help"], ["validate", str(DEMO)], ["plan", str(DEMO)], ["lineage"]):
        out = subprocess.run([sys.executable, "-X", "importtime", "-m", "flows.cli", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode in (0, 2), (args, out.stderr[-3000:])
        names = imported(out.stderr)
        assert "typer" in names, args  # the report was read
        assert not {"torch", "ray", "transformers", "prefect", "prefect.server.api.server"} & names, args
    assert not (tmp_path / ".omni" / "prefect" / RECORD).exists()
    assert _server_pids((tmp_path / ".omni" / "prefect").resolve()) == []


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A project directory whose local server (if any) is stopped at the end, whatever happened."""
    folder = tmp_path_factory.mktemp("local-prefect")
    home = (folder / ".omni" / "prefect").resolve()
    try:
        yield folder
    finally:
        stop_local_server(home)
        for pid in _server_pids(home):  # one this module failed to record (a bug it would have found)
            os.kill(pid, signal.SIGKILL)


def test_concurrent_starts_share_one_server_which_later_commands_reuse(project: Path) -> None:
    home = (project / ".omni" / "prefect").resolve()
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: omni(project, "server", "start", "--json"), range(2)))
    started = [json.loads(o.stdout.strip().splitlines()[-1]) for o in outs]
    assert all(o.returncode == 0 for o in outs), [o.stderr[-2000:] for o in outs]
    assert started[0]["pid"] == started[1]["pid"] and started[0]["url"] == started[1]["url"]
    assert _server_pids(home) == [started[0]["pid"]]
    assert httpx.get(f"{started[0]['url']}/api/health", timeout=10).status_code == 200
    status = json.loads(omni(project, "server", "status", "--json").stdout)
    assert status == {**started[0], "state": "running", "servers": [{k: v for k, v in started[0].items() if k != "state"}]}
    assert started[0]["idle_minutes"] is None  # `omni server start`: it stays

    # a flow run by `omni ingest` goes to that server (no other one starts), and its UI shows it
    out = omni(project, "ingest", "digits", "--source", "fixtures://digits?rows=20", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Starting temporary server" not in out.stdout + out.stderr
    assert _server_pids(home) == [started[0]["pid"]]
    runs = httpx.post(f"{started[0]['url']}/api/flow_runs/filter", json={}, timeout=30).json()
    assert [r["state_type"] for r in runs] == ["COMPLETED"]


def test_a_stale_record_is_replaced_and_stop_stops_the_server(project: Path) -> None:
    home = (project / ".omni" / "prefect").resolve()
    before = json.loads((home / RECORD).read_text())
    os.killpg(before["pid"], signal.SIGKILL)  # the server dies (machine sleep, OOM, kill): its record stays
    deadline = time.monotonic() + 30
    while _server_pids(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running_server(home) is None
    assert json.loads(omni(project, "server", "status", "--json").stdout)["state"] == "not running"

    # a record naming a live process that is not a Prefect server (a reused pid) is stale too
    (home / RECORD).write_text(json.dumps({**before, "pid": os.getpid()}))
    after = json.loads(omni(project, "server", "start", "--json").stdout)
    assert after["state"] == "running" and after["pid"] not in (before["pid"], os.getpid())
    assert _server_pids(home) == [after["pid"]]
    assert json.loads((home / RECORD).read_text())["pid"] == after["pid"]

    stopped = json.loads(omni(project, "server", "stop", "--json").stdout)
    assert stopped["state"] == "stopped" and stopped["pid"] == after["pid"]
    assert _server_pids(home) == [] and not (home / RECORD).exists()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{after['url']}/api/health", timeout=5)
    assert json.loads(omni(project, "server", "stop", "--json").stdout)["state"] == "not running"


TINY = {"name": "tiny", "store": ".omni/store", "tracking_uri": "sqlite:///.omni/mlflow.db",
        "datasets": {"digits": {"source": "fixtures://digits?rows=16&seed=0", "converter": "digits"}},
        "stages": [{"name": "ingest", "kind": "ingest", "datasets": ["digits"]}]}
IDLE_MINUTES = 0.15  # the runs' servers stop 9 s after their last use


@contextmanager
def polled(*homes: Path) -> Iterator[None]:
    """What a browser tab left open on a UI does: asks the API of each home's server (once it has one)
    every second, on kept-alive connections, until the with-block ends."""
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=5) as client:
            while not done.is_set():
                for server in filter(None, map(local_prefect.read_record, homes)):
                    with contextlib.suppress(httpx.HTTPError):
                        client.get(f"{server.api_url}/health")
                done.wait(1.0)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _gone(home: Path, timeout: float) -> float:
    """Seconds until no `prefect server` of `home` runs any more (fails after `timeout`)."""
    started = time.monotonic()
    while _server_pids(home):
        assert time.monotonic() - started < timeout, f"the server of {home} still runs after {timeout:.0f} s"
        time.sleep(0.2)
    return time.monotonic() - started


def _flow_runs(url: str) -> dict[str, str]:
    """id -> name of the flow runs a server holds."""
    return {r["id"]: r["name"] for r in httpx.post(f"{url}/api/flow_runs/filter", json={}, timeout=30).json()}


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (make setup installs it)")
def test_runs_from_several_directories_each_get_one_server_that_shows_them_and_stops_when_unused(
        tmp_path: Path, prefect_db) -> None:
    """Two `omni run` in folder a, one in folder b and an `omni server start` in folder c, all at once:
    one server per folder (a's two runs share one), each holding its folder's runs; `omni server status`
    lists all three. The Prefect link a run printed, opened in headless Chromium, names its flow run.
    a's and b's APIs are polled throughout (a browser tab on each UI). b is deleted (a script's
    temporary folder): its server stops at once, polled or not. a's stays up past its quiet period while
    polled, then stops once unused for that period, not before; c's (`omni server start`) stays until
    `omni server stop --all`."""
    folders = {name: tmp_path / name for name in "abc"}
    for folder in folders.values():
        prefect_db(folder / ".omni" / "prefect" / "prefect.db")  # migrated: a fresh database is tested above
        (folder / "tiny.yaml").write_text(json.dumps(TINY))
    homes = {name: (folder / ".omni" / "prefect").resolve() for name, folder in folders.items()}
    env = _env(**{local_prefect.IDLE_VARIABLE: str(IDLE_MINUTES)})
    jobs = [("a", "run", "tiny.yaml"), ("a", "run", "tiny.yaml"), ("b", "run", "tiny.yaml"), ("c", "server", "start")]
    with polled(homes["a"], homes["b"]):
        with ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(lambda job: omni(folders[job[0]], *job[1:], env=env), jobs))
        ended = time.monotonic()
        checked = check_runs_and_servers(folders, homes, outs, env)
        time.sleep(max(0.0, ended + IDLE_MINUTES * 60 + 1 - time.monotonic()))
        assert _server_pids(homes["a"]) == [checked["a"]["pid"]]  # polled: in use past its quiet period
    quiet = _gone(homes["a"], timeout=IDLE_MINUTES * 60 + 40)  # from the last poll
    assert quiet >= IDLE_MINUTES * 60 - 1.5, f"a's server stopped {quiet:.1f} s after its last use"
    assert not (homes["a"] / RECORD).exists()
    assert f"unused for {IDLE_MINUTES:g} min" in (homes["a"] / local_prefect.LOG).read_text()

    # c stays, until `omni server stop --all`; then no server is left and the registry is empty
    url_c = f"http://127.0.0.1:{checked['c']['port']}"
    assert httpx.get(f"{url_c}/api/health", timeout=10).status_code == 200
    listed = json.loads(omni(folders["a"], "server", "status", "--json", env=env).stdout)
    assert listed["state"] == "not running" and [s["pid"] for s in listed["servers"]] == [checked["c"]["pid"]]
    assert len(list(local_prefect.registry().iterdir())) == 1  # a's and b's left it
    stopped = json.loads(omni(folders["a"], "server", "stop", "--all", "--json", env=env).stdout)
    assert [s["pid"] for s in stopped["stopped"]] == [checked["c"]["pid"]]
    assert all(_server_pids(home) == [] for home in homes.values())
    assert list(local_prefect.registry().iterdir()) == []


def check_runs_and_servers(folders: dict[str, Path], homes: dict[str, Path], outs: list, env: dict[str, str]) -> dict:
    """The test above, while a's and b's servers are polled: one server per folder holding that folder's runs,
    the printed link's page naming its run, status listing all three; b deleted, its server gone.
    Returns the servers' records."""
    assert all(o.returncode == 0 for o in outs), [o.stdout[-2000:] + o.stderr[-2000:] for o in outs]
    assert not any("Starting temporary server" in o.stdout + o.stderr for o in outs)
    links = [re.search(rf"^open Prefect (\S+)\s+\(omni's local Prefect server: it stops after {IDLE_MINUTES:g} min "
                       "without use", o.stdout, re.MULTILINE) for o in outs[:3]]
    assert all(links), [o.stdout[-1500:] for o in outs[:3]]
    links = [m.group(1) for m in links]
    records = {name: json.loads((home / RECORD).read_text()) for name, home in homes.items()}
    urls = {name: f"http://127.0.0.1:{record['port']}" for name, record in records.items()}
    for name, home in homes.items():
        assert _server_pids(home) == [records[name]["pid"]], name
    assert [link.split("/flow-runs/")[0] for link in links] == [urls["a"], urls["a"], urls["b"]]
    assert records["c"]["idle_minutes"] is None and records["a"]["idle_minutes"] == IDLE_MINUTES

    # the UI at the printed link shows the run (its API at the address the browser used)
    runs = {name: _flow_runs(urls[name]) for name in "ab"}
    page = visible_text(dump_dom(links[0]))
    assert runs["a"][links[0].rsplit("/", 1)[1]] in page, page[:2000]
    assert "Can't connect" not in page

    # each server holds its folder's runs, the flow runs the links name; status lists every server
    assert set(runs["b"]) == {links[2].rsplit("/", 1)[1]}
    assert set(runs["a"]) == {link.rsplit("/", 1)[1] for link in links[:2]}
    status = json.loads(omni(folders["c"], "server", "status", "--json", env=env).stdout)
    assert status["state"] == "running" and status["pid"] == records["c"]["pid"]
    assert sorted(s["prefect_home"] for s in status["servers"]) == sorted(str(h) for h in homes.values())

    # b deleted: its server stops at once (within a few polls), and leaves the registry
    shutil.rmtree(folders["b"])
    _gone(homes["b"], timeout=30)

    return records


def test_a_server_spawned_a_moment_ago_counts_as_running_while_its_exec_finishes(monkeypatch) -> None:
    """Popen returns as soon as the child's exec has begun (vfork released, close-on-exec pipe closed),
    before the kernel has placed the new program's argv: /proc/PID/cmdline of a just-spawned server often
    reads empty. A concurrent `omni server start` that judged the recorded server by it took it for a stale
    record and started a second server (seen in a full suite run). Spawns alternate: one reads the raw
    command line at once (the premise: some are caught mid-exec), the next asks `_alive` at once."""
    empty_reads, judged = 0, []
    for attempt in range(400):
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "prefect", "server"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        try:
            if attempt % 2:
                empty_reads += Path(f"/proc/{proc.pid}/cmdline").read_bytes() == b""
            else:
                judged.append(_alive(proc.pid))
        finally:
            proc.kill()
            proc.wait()
        if empty_reads >= 3 and len(judged) >= 10:
            break
    if not empty_reads:
        pytest.skip(f"none of {attempt // 2} spawns was caught mid-exec on this machine: nothing to judge")
    assert all(judged), f"{judged.count(False)} of {len(judged)} just-spawned servers taken for stale records"
    # what has no command line and is never our server: a kernel thread (kthreadd), judged after the wait
    monkeypatch.setattr(local_prefect, "EXEC_WAIT_S", 0.5)
    assert not _alive(2)
