"""What a stage's Ray actors and jobs need, handed to them by the driver; and starting or joining Ray.

On a cluster, actors run in processes started by each node's raylet, which never saw the driver's
shell: without help they have no S3 endpoint or credentials, no tracking server and maybe not this
project's code. `runtime_env(cfg)` is the Ray runtime env that carries them:

- the driver's store and tracking settings, by the names the user's environment has
  (`OMNI_S3_*`, `AWS_*` but the two local file paths, `MLFLOW_TRACKING_*`, `MLFLOW_S3_*`, `HF_TOKEN`,
  `HF_ENDPOINT`) plus the names listed in `ray.env_vars`. Only names are configured: the values stay
  in the environment, never in the pipeline file, a manifest, MLflow or a log: they reach the
  workers through a worker setup hook that Ray keeps in its internal store (a submitted Ray Job's
  runtime env must be JSON, so there they are `env_vars`, which Ray's runtime env agent logs).
- the code, as `ray.code` says: `image` (installed there), `py_modules` (the omni_core package is
  uploaded to the cluster), `working_dir` (the project folder is); `auto` is `py_modules` on a
  cluster and nothing for a local Ray (its workers are this machine's processes).

`init_ray(cfg)` starts or joins Ray: `ray.address: local` always starts a fresh Ray in this process
(never joins one already running on the machine, whatever `RAY_ADDRESS` or a stale
`ray_current_cluster` file says) unless this process is a Ray Job's driver, which joins the cluster
it was submitted to; any other address joins that cluster with the runtime env above. Ray's token
authentication (`RAY_AUTH_MODE=token`, `RAY_AUTH_TOKEN` or `RAY_AUTH_TOKEN_PATH`) is read by Ray
itself from the environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from omni_core.config.models import RayConfig
from omni_core.errors import OmniError

FORWARDED_PREFIXES = ("OMNI_S3_", "AWS_", "MLFLOW_TRACKING_", "MLFLOW_S3_")
FORWARDED_NAMES = frozenset({"HF_TOKEN", "HF_ENDPOINT"})
LOCAL_ONLY = frozenset({"AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"})  # paths on the driver's machine
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray in a submitted job's driver
CODE_EXCLUDES = ["__pycache__", "*.pyc", ".git", ".venv", ".omni", ".pytest_cache", ".ruff_cache", "bench/out"]


def in_ray_job() -> bool:
    """This process is the driver of a Ray Job (submitted to a cluster's job server)."""
    return bool(os.environ.get(JOB_CONFIG_ENV))


def is_local(cfg: RayConfig) -> bool:
    """Ray runs in this process (resources it lacks will never come)."""
    return cfg.address == "local" and not in_ray_job()


def forwarded_env(cfg: RayConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's variables the actors get: store, tracking and hub settings, and `cfg.env_vars`."""
    environ = dict(os.environ if environ is None else environ)
    wanted = set(cfg.env_vars)
    return {name: value for name, value in sorted(environ.items())
            if name in wanted or (name not in LOCAL_ONLY and (name in FORWARDED_NAMES
                                                             or name.startswith(FORWARDED_PREFIXES)))}


def code_mode(cfg: RayConfig) -> str:
    if cfg.code != "auto":
        return cfg.code
    return "image" if is_local(cfg) else "py_modules"


def env_setup_hook(variables: dict[str, str]) -> Callable[[], None]:
    """A worker setup hook that puts `variables` into the worker's environment. Ray pickles it into
    its internal key-value store; `env_vars` would do the same job but Ray's runtime env agent
    writes a runtime env's `env_vars`, values and all, into its log on every node."""
    def omni_forwarded_env() -> None:
        import os

        os.environ.update(variables)

    return omni_forwarded_env


def runtime_env(cfg: RayConfig, environ: dict[str, str] | None = None, *, job: bool = False) -> dict[str, Any]:
    """The Ray runtime env of a stage's actors; `job`: of a Ray Job that trains it, which must be
    plain JSON, so the variables go as `env_vars` (and so into Ray's runtime env agent log)."""
    import omni_core

    env: dict[str, Any] = {}
    if variables := forwarded_env(cfg, environ):
        if job:
            env["env_vars"] = variables
        else:
            env["worker_process_setup_hook"] = env_setup_hook(variables)
    package = Path(omni_core.__file__).resolve().parent
    mode = code_mode(cfg)
    if mode == "py_modules":
        env["py_modules"] = [str(package)]
        env["excludes"] = CODE_EXCLUDES
    elif mode == "working_dir":
        env["working_dir"] = str(package.parent)
        env["excludes"] = CODE_EXCLUDES
    return env


def merge_runtime_env(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`; their env_vars merged (`base`'s, e.g. given on the command line, win)."""
    merged = {**extra, **base}
    if "env_vars" in extra or "env_vars" in base:
        merged["env_vars"] = {**extra.get("env_vars", {}), **base.get("env_vars", {})}
    return merged


GCS_WAIT_S = 30.0  # a cluster that is starting or restarting its head gets this long to listen


def wait_for_gcs(address: str, timeout: float | None = None) -> None:
    """Raises ConnectionError unless something listens at a HOST:PORT `address` (the head's GCS) within
    `timeout` (default GCS_WAIT_S). Ray's own `ray.init` retries an unreachable GCS 20 times at about
    40 s each, so a driver whose cluster is gone would sit silent for ~13 minutes before failing.
    (`ray://` and `auto` addresses are left to Ray.)"""
    import socket
    import time

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    timeout = GCS_WAIT_S if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"nothing listens at {address} after {timeout:g} s: {exc}") from exc
            time.sleep(1.0)


def init_ray(cfg: RayConfig) -> None:
    """Start a fresh local Ray, join the cluster of the Ray Job this process drives, or join
    `cfg.address` with the actors' runtime env (see the module's docstring)."""
    import ray

    if ray.is_initialized():
        return
    if in_ray_job():  # the job's own cluster; its runtime env came with the job
        with _cannot_connect(cfg.address):
            ray.init(logging_level=logging.WARNING)
    elif cfg.address == "local":
        with _cannot_connect(cfg.address):
            init_local_ray(cfg.num_cpus)
    else:
        join_cluster(cfg.address, runtime_env(cfg))


@contextlib.contextmanager
def _cannot_connect(address: str) -> Iterator[None]:
    try:
        yield
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise OmniError(f"ray.address {address}: cannot connect ({exc}); start the cluster (with "
                        "RAY_AUTH_TOKEN set if it uses token authentication) or use ray.address=local") from exc


def join_cluster(address: str, runtime_env: dict[str, Any] | None = None) -> None:
    """This process joins the Ray cluster at `address` (None: no runtime env of ours)."""
    import ray

    with _cannot_connect(address):
        wait_for_gcs(address)
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)


RAY_START_TIMED_OUT = "timed out during startup"  # Ray gives a node 30 s to register, hard-coded


def init_local_ray(num_cpus: int | None) -> None:
    """A fresh local Ray of `num_cpus` CPUs in this process; started again once when it missed Ray's own
    start-up timeout (a busy small machine does, now and then)."""
    import ray

    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
            return
        except Exception as exc:  # Ray raises a bare Exception for it
            ray.shutdown()
            if RAY_START_TIMED_OUT not in str(exc):
                raise
            if attempt == 2:
                raise OmniError(f"the local Ray did not start ({exc}); the machine is too busy: try again, or "
                                "start one with `ray start --head` and give its address as ray.address") from exc


# Ray ties its processes to the thread that starts it (prctl PDEATHSIG): started from a task runner's
# worker thread, it would die when that pool shuts down at the end of a flow run. So it is started
# from the main thread, or from a daemon thread that lives until the process ends (not joined at exit,
# so Ray's own atexit shutdown still finds its processes alive).
_ray_calls: queue.Queue[tuple[Future, Any]] = queue.Queue()
_ray_owner_lock = threading.Lock()
_ray_owner: list[threading.Thread] = []


def _own_ray() -> None:
    while True:
        future, config = _ray_calls.get()
        try:
            init_ray(config)
            future.set_result(None)
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)


def start_ray(config: RayConfig) -> None:
    """Ray for the pipeline's `ray:` config (`init_ray`), started from a thread that outlives the caller's:
    what a stage calls (a native stage's actors, a trl stage's Ray Train run, an eval task)."""
    import ray

    if ray.is_initialized():
        return
    if threading.current_thread() is threading.main_thread():
        init_ray(config)
        return
    with _ray_owner_lock:
        if not _ray_owner:
            _ray_owner.append(threading.Thread(target=_own_ray, name="omni-ray-owner", daemon=True))
            _ray_owner[0].start()
    future: Future = Future()
    _ray_calls.put((future, config))
    future.result()
