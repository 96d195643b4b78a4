"""The scaled-out stack's files, validated against their schemas: infra/compose/compose.yaml against
the compose-spec JSON schema (as vendored by check-jsonschema), infra/k8s/raycluster.yaml against
this repository's RayCluster (ray.io/v1) schema with its pod templates against Kubernetes' own
PodTemplateSpec schema, and the Prefect Kubernetes work pool's job template (rendered with its
defaults) against Kubernetes' batch/v1 Job schema (both from kubernetes-validate). Secrets come
only from the git-ignored env file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "infra" / "compose"
K8S = ROOT / "infra" / "k8s"
K8S_VERSION = "1.37.0"


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).with_name("check-jsonschema")), "--builtin-schema",
                           "vendor.compose-spec", str(path)], capture_output=True, text=True, timeout=120)


def test_compose_file_matches_the_compose_spec(tmp_path: Path) -> None:
    ok = check_compose(COMPOSE / "compose.yaml")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "compose.yaml"  # the check bites: a misspelt key fails
    broken.write_text((COMPOSE / "compose.yaml").read_text().replace("    depends_on:\n", "    depends:\n", 1))
    assert check_compose(broken).returncode != 0


def test_compose_stack_has_every_service_with_auth_and_secrets_from_the_env_file() -> None:
    text = (COMPOSE / "compose.yaml").read_text()
    compose = yaml.safe_load(text)
    services = compose["services"]
    assert {"postgres", "s3", "prefect-server", "prefect-worker", "mlflow", "ray-head", "ray-worker"} <= set(services)
    assert "postgresql+asyncpg://" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert "PREFECT_SERVER_API_AUTH_STRING" in services["prefect-server"]["environment"]
    assert "PREFECT_API_AUTH_STRING" in services["prefect-worker"]["environment"]
    mlflow = " ".join(services["mlflow"]["command"])
    assert "--app-name basic-auth" in mlflow and "postgresql://" in mlflow and "s3://" in mlflow
    for name in ("ray-head", "ray-worker"):
        assert services[name]["environment"]["RAY_AUTH_MODE"] == "token"
        assert services[name]["image"] == services["mlflow"]["image"] == "${OMNI_CUDA_IMAGE:?set OMNI_CUDA_IMAGE " \
            "to the CUDA image (omni image tag cuda)}"
    assert services["ray-worker"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    # every variable the file reads is in the template, the filled-in copy is git-ignored, no secret is inline
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", text))
    template = {line.split("=", 1)[0] for line in (COMPOSE / "env.example").read_text().splitlines()
                if re.match(r"^[A-Z0-9_]+=", line)}
    assert used <= template, used - template
    ignored = subprocess.run(["git", "check-ignore", "-q", "infra/compose/.env"], cwd=ROOT)
    assert ignored.returncode == 0
    for key in ("PASSWORD", "SECRET", "TOKEN", "AUTH_STRING"):
        for service in services.values():
            env = service.get("environment", {})
            for name, value in (env.items() if isinstance(env, dict) else ()):
                if key in name:
                    assert str(value).startswith("${"), f"{name} is inline"


def ray_cluster() -> dict:
    return yaml.safe_load((K8S / "raycluster.yaml").read_text())


def test_raycluster_matches_its_schema_and_pod_templates_kubernetes() -> None:
    schema = json.loads((K8S / "schemas" / "raycluster.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    cluster = ray_cluster()
    jsonschema.validate(cluster, schema)
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    for group in groups:
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                      "template": group["template"]}, K8S_VERSION, strict=True)
    gpu = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "1" and gpu["image"] == "omni-cuda"
    for group in groups:
        container = group["template"]["spec"]["containers"][0]
        assert {"name": "RAY_AUTH_MODE", "value": "token"} in container["env"]
        assert container["envFrom"] == [{"secretRef": {"name": "omni-secrets"}}]
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["images"][0]["name"] == "omni-cuda" and "raycluster.yaml" in kustomization["resources"]
    # the checks bite: a misspelt field, a bad pod template
    bad = ray_cluster()
    bad["spec"]["workerGroupSpecs"][0]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = ray_cluster()["spec"]["headGroupSpec"]["template"]
    bad["spec"]["containers"][0]["imagePullPolice"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                      "template": bad}, K8S_VERSION, strict=True)


def test_prefect_kubernetes_job_template_renders_a_valid_job() -> None:
    from prefect.utilities.templating import apply_values

    from flows.deployments import GPU_LIMIT_VARIABLE

    template = json.loads((K8S / "prefect-work-pool.json").read_text())
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    defaults = {name: spec["default"] for name, spec in template["variables"]["properties"].items()
                if "default" in spec}
    values = {**defaults, "image": "registry.example.com/omni/cuda:abc", "name": "omni-run",
              "namespace": "omni", "command": ["prefect", "flow-run", "execute"], "env": {"A": "1"},
              "labels": {"app": "omni"}, "cpu_request": "8", "memory_limit": "64Gi"}
    job = apply_values(template["job_configuration"]["job_manifest"], values, remove_notset=True)
    job["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}]  # the worker's form
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["envFrom"] == [{"secretRef": {"name": "omni-secrets", "optional": True}}]
    assert job["spec"]["parallelism"] == 1 and job["spec"]["completions"] == 1
    assert GPU_LIMIT_VARIABLE in template["variables"]["properties"]
