"""Deployments of the omni flows, read from `prefect.yaml`: register them (`omni deploy`), serve them
(`omni serve`). Prefect's own `prefect deploy` applies the file, so the YAML means what Prefect's
documentation says it means; this module adds what that command leaves to the user: a clear error
without a reachable API, the work pools, and the CUDA image reference.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from omni_core.errors import OmniError

PREFECT_FILE = Path(__file__).resolve().parents[1] / "prefect.yaml"
CUDA_IMAGE_ENV = "OMNI_CUDA_IMAGE"
GPU_LIMIT_VARIABLE = "gpu_limit"
# The kubernetes pool's job template: Prefect's default `with_gpu_limit`, plus the `omni-secrets`
# Secret as the container's environment (optional), and parallelism/completions on the Job's spec
# where Kubernetes reads them (Prefect's default puts them on the pod's); tests/test_infra.py
# validates it against Kubernetes' Job schema.
KUBERNETES_JOB_TEMPLATE = Path(__file__).resolve().parents[1] / "infra" / "k8s" / "prefect-work-pool.json"


class DeploymentError(OmniError):
    """The Prefect API is missing or unreachable, or prefect.yaml cannot be applied."""


@dataclass
class DeploymentSpec:
    """One entry of prefect.yaml's `deployments:` (anchors resolved), with its pool's type."""

    name: str
    entrypoint: str
    raw: dict[str, Any]
    pool: str | None = None
    pool_type: str | None = None

    @property
    def schedules(self) -> list[dict[str, Any]]:
        return list(self.raw.get("schedules") or [])


@dataclass
class PrefectFile:
    path: Path
    deployments: list[DeploymentSpec]
    pool_types: dict[str, str] = field(default_factory=dict)  # pool name -> type

    def select(self, names: list[str] | None) -> list[DeploymentSpec]:
        if not names:
            return list(self.deployments)
        known = {d.name: d for d in self.deployments}
        missing = [n for n in names if n not in known]
        if missing:
            raise DeploymentError(f"{self.path}: no deployment named {', '.join(missing)} "
                                  f"(deployments: {', '.join(known)})")
        return [known[n] for n in names]


def load_prefect_file(path: Path | str = PREFECT_FILE) -> PrefectFile:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise DeploymentError(f"{path}: no such file (prefect.yaml is at the repository root)") from None
    except yaml.YAMLError as exc:
        raise DeploymentError(f"{path}: not valid YAML: {exc}") from None
    pools = ((data.get("definitions") or {}).get("work_pools") or {})
    pool_types = {spec["name"]: kind for kind, spec in pools.items() if isinstance(spec, dict) and spec.get("name")}
    specs = []
    for i, raw in enumerate(data.get("deployments") or []):
        if not raw.get("name") or not raw.get("entrypoint"):
            raise DeploymentError(f"{path}: deployments[{i}] needs a name and an entrypoint")
        pool = (raw.get("work_pool") or {}).get("name")
        specs.append(DeploymentSpec(raw["name"], raw["entrypoint"], raw, pool, pool_types.get(pool)))
    return PrefectFile(path, specs, pool_types)


# ---- the API ------------------------------------------------------------------------------------


def api_url() -> str:
    """PREFECT_API_URL from the environment or the active Prefect profile, checked to answer."""
    from prefect.settings import get_current_settings

    url = os.environ.get("PREFECT_API_URL") or get_current_settings().api.url
    if not url:
        raise DeploymentError(
            "PREFECT_API_URL is not set: deployments live on a Prefect server. Start one "
            "(`prefect server start`) and `export PREFECT_API_URL=http://127.0.0.1:4200/api`")
    check_api(url)
    return url


def check_api(url: str, timeout: float = 5.0) -> None:
    import httpx

    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        reason = exc.__class__.__name__ if not str(exc) else str(exc)
        raise DeploymentError(f"Prefect API at {url} is unreachable ({reason}): start the server "
                              "(`prefect server start`) or fix PREFECT_API_URL") from None


# ---- crashed flow runs ----------------------------------------------------------------------------

CRASH_AUTOMATION = "omni: crash flow runs without heartbeats"


def heartbeat_seconds() -> int:
    """How often a flow run sends its heartbeat (PREFECT_FLOWS_HEARTBEAT_FREQUENCY, Prefect's default 180 s);
    the workers must run with the same value as `omni deploy`."""
    from prefect.settings import get_current_settings

    return int(get_current_settings().flows.heartbeat_frequency or 180)


def ensure_crash_automation() -> tuple[str, int]:
    """Prefect's zombie detection: a running flow run whose heartbeat stops (its worker or host died)
    is set Crashed once two heartbeats are missed. Prefect offers it as an automation one creates
    (a proactive trigger on `prefect.flow-run.heartbeat`); created here when missing, or updated to
    this heartbeat. Returns (what was done, the window in seconds)."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    within = 2 * heartbeat_seconds()
    automation = Automation(
        name=CRASH_AUTOMATION,
        description="A flow run whose heartbeat stopped (its worker or its host died) is marked Crashed.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=within)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                    message=f"no heartbeat for {within} s: its worker or host died")])
    try:
        existing = Automation.read(name=CRASH_AUTOMATION)
    except ValueError:
        automation.create()
        return "created", within
    if existing.trigger.within == automation.trigger.within:
        return "present", within
    existing.trigger, existing.actions = automation.trigger, automation.actions
    existing.update()
    return "updated", within


# ---- work pools ---------------------------------------------------------------------------------


def ensure_work_pools(specs: list[DeploymentSpec]) -> list[str]:
    """Create the work pools these deployments name when missing; returns the names created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
    from prefect.workers.utilities import get_default_base_job_template_for_infrastructure_type

    created = []
    with get_client(sync_client=True) as client:
        for pool, kind in sorted({(s.pool, s.pool_type) for s in specs if s.pool}):
            try:
                client.read_work_pool(pool)
                continue
            except ObjectNotFound:
                pass
            if kind is None:
                raise DeploymentError(f"work pool {pool!r} does not exist and prefect.yaml does not say its type "
                                      "(name it under definitions.work_pools.<type>), or create it: "
                                      f"prefect work-pool create {pool} --type process")
            template = (json.loads(KUBERNETES_JOB_TEMPLATE.read_text()) if kind == "kubernetes"
                        else asyncio.run(get_default_base_job_template_for_infrastructure_type(kind)))
            if template is None:
                raise DeploymentError(f"work pool {pool!r}: Prefect knows no job template for type {kind!r}")
            try:
                client.create_work_pool(WorkPoolCreate(name=pool, type=kind, base_job_template=template))
            except ObjectAlreadyExists:  # made meanwhile (a worker started with --type creates its pool)
                continue
            created.append(pool)
    return created


def cuda_image_ref() -> str:
    from omni_core.images import content_tag, image_ref, load_spec
    from omni_core.images.registry import default_registry

    spec = load_spec("cuda")
    return image_ref(spec, content_tag(spec), default_registry())


# ---- deploy -------------------------------------------------------------------------------------


def deploy(prefect_file: PrefectFile, specs: list[DeploymentSpec]) -> subprocess.CompletedProcess[str]:
    """`prefect deploy` of these deployments (non-interactive), from the file's directory."""
    env = dict(os.environ)
    if not env.get(CUDA_IMAGE_ENV):
        env[CUDA_IMAGE_ENV] = cuda_image_ref()
    names = [arg for s in specs for arg in ("--name", s.name)]
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file", str(prefect_file.path),
               *names]
    result = subprocess.run(command, cwd=prefect_file.path.parent, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise DeploymentError(f"prefect deploy failed (exit {result.returncode}):\n{tail}")
    return result


def read_deployments(specs: list[DeploymentSpec]) -> list[Any]:
    """The deployments as the API has them now, in prefect.yaml's order."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[s.name for s in specs])))
        flows = {f.id: f.name for f in client.read_flows()} if found else {}
    by_name = {d.name: d for d in found}
    return [(flows.get(by_name[s.name].flow_id, "?"), by_name[s.name]) for s in specs if s.name in by_name]


# ---- serve --------------------------------------------------------------------------------------


def schedule_of(item: dict[str, Any]) -> Any:
    """A prefect.yaml schedule entry (cron, interval or rrule + options) as a prefect Schedule."""
    from prefect.schedules import Schedule

    options = {k: v for k, v in item.items()
               if k in ("cron", "interval", "rrule", "timezone", "day_or", "active", "parameters", "slug")}
    if isinstance(options.get("interval"), int | float):
        options["interval"] = datetime.timedelta(seconds=options["interval"])
    if item.get("anchor_date"):
        options["anchor_date"] = datetime.datetime.fromisoformat(str(item["anchor_date"]))
    return Schedule(**options)


def servable(specs: list[DeploymentSpec]) -> list[DeploymentSpec]:
    """Deployments that run on this machine: those on a process pool (containers need their worker)."""
    return [s for s in specs if s.pool_type in (None, "process")]


def drop_pool_bindings(deployments: list[Any]) -> list[str]:
    """Delete the work-pool deployments these served ones replace (same flow and name).

    Serving updates a deployment in place but keeps a work pool it had, and a run of such a hybrid
    looks for code storage that does not exist; so `omni serve` replaces them (`omni deploy` puts
    them back). Their scheduled runs go with them; the served schedules make new ones."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    replaced = []
    with get_client(sync_client=True) as client:
        for deployment in deployments:
            name = f"{deployment.flow_name}/{deployment.name}"
            try:
                existing = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            if existing.work_pool_name:
                client.delete_deployment(existing.id)
                replaced.append(f"{name} ({existing.work_pool_name})")
    return replaced


def to_runner_deployments(prefect_file: PrefectFile, specs: list[DeploymentSpec]) -> list[Any]:
    """RunnerDeployments for `prefect.serve`: each flow loaded from its entrypoint, with the file's
    parameters, schedules, tags and description (work pools do not apply to served deployments)."""
    from prefect.flows import load_flow_from_entrypoint

    deployments = []
    for spec in specs:
        flow = load_flow_from_entrypoint(str(prefect_file.path.parent / spec.entrypoint)
                                         if ":" in spec.entrypoint else spec.entrypoint)
        raw = spec.raw
        deployments.append(flow.to_deployment(
            name=spec.name, parameters=raw.get("parameters") or {},
            schedules=[schedule_of(s) for s in spec.schedules], tags=raw.get("tags"),
            description=raw.get("description"), paused=raw.get("paused"),
            concurrency_limit=raw.get("concurrency_limit")))
    return deployments
