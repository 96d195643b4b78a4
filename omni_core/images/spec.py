"""Image specs: what to build (Dockerfile, context, build args, platforms) and under which name.

Two specs are built in: `cuda` and `ascend` (`infra/docker/{target}/Dockerfile`, context the repository
root). Any other image is a spec file (YAML or JSON) with the same fields; its relative paths are
relative to the file.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from omni_core.config.loader import UniqueKeyLoader
from omni_core.images.errors import ImageBuildError

BUILTIN_PLATFORMS = {"cuda": ["linux/amd64"], "ascend": ["linux/arm64", "linux/amd64"]}
_SECRET_LIKE = re.compile(r"TOKEN|PASSW|SECRET|CREDENTIAL|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY", re.IGNORECASE)
_PLATFORM = re.compile(r"^[a-z0-9]+/[a-z0-9_]+(/[a-z0-9]+)?$")


class ImageSpec(BaseModel):
    """One image to build. Paths are absolute once loaded (see `load_spec`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target: str = Field(pattern=r"^[a-z0-9][a-z0-9_.-]*$", description="Name of the image target (cuda, ascend, ...).")
    dockerfile: Path
    context: Path
    repository: str = Field("", pattern=r"^([a-z0-9]+([._-][a-z0-9]+)*(/[a-z0-9]+([._-][a-z0-9]+)*)*)?$",
                            description="Repository under the registry; default omni-{target}.")
    build_args: dict[str, str] = Field(default_factory=dict, description="Overrides of the Dockerfile's ARG defaults.")
    platforms: list[str] = Field(default_factory=lambda: ["linux/amd64"], min_length=1)
    stage: str | None = Field(None, description="Multi-stage target to build (default: the last stage).")

    @field_validator("build_args")
    @classmethod
    def _no_secrets(cls, args: dict[str, str]) -> dict[str, str]:
        for name in args:
            if _SECRET_LIKE.search(name):
                raise ValueError(f"build arg {name} looks like a secret: build args stay in the image history "
                                 "and in the build record; pass secrets with a secret mount (RUN --mount=type=secret)")
        return args

    @field_validator("platforms")
    @classmethod
    def _platforms(cls, platforms: list[str]) -> list[str]:
        for platform in platforms:
            if not _PLATFORM.match(platform):
                raise ValueError(f"platform {platform!r} is not os/arch[/variant], e.g. linux/amd64")
        return sorted(set(platforms))

    @property
    def image_name(self) -> str:
        return self.repository or f"omni-{self.target}"

    def with_overrides(self, build_args: dict[str, str] | None = None, platforms: list[str] | None = None) -> ImageSpec:
        """A copy with more build args and/or other platforms (validated again)."""
        data = self.model_dump()
        data["build_args"] = {**self.build_args, **(build_args or {})}
        if platforms:
            data["platforms"] = platforms
        return _validate(data, f"{self.target} with overrides")


def project_root() -> Path:
    """The repository holding infra/docker: the current directory or one above it, else this checkout."""
    for candidate in (Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[2]):
        if (candidate / "infra" / "docker").is_dir():
            return candidate
    raise ImageBuildError("cannot find infra/docker in the current directory or above it; "
                          "run from the repository checkout or pass a spec file")


def builtin_spec(target: str, root: Path | None = None) -> ImageSpec:
    """The spec of a built-in target (cuda or ascend)."""
    if target not in BUILTIN_PLATFORMS:
        raise ImageBuildError(f"unknown image target {target!r}; use one of {', '.join(BUILTIN_PLATFORMS)} "
                              "or a spec file (.yaml/.json)")
    root = (root or project_root()).resolve()
    return _validate({"target": target, "dockerfile": root / "infra" / "docker" / target / "Dockerfile",
                      "context": root, "platforms": BUILTIN_PLATFORMS[target]}, f"image target {target}")


def load_spec(target_or_file: str | Path, root: Path | None = None) -> ImageSpec:
    """A built-in target by name, or a spec file (YAML/JSON) whose relative paths are relative to it."""
    name = str(target_or_file)
    if not name.endswith((".yaml", ".yml", ".json")):
        return builtin_spec(name, root)
    path = Path(name).resolve()
    try:
        data = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # a key written twice is an error
    except OSError as exc:
        raise ImageBuildError(f"cannot read image spec {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ImageBuildError(f"image spec {path} is not valid YAML/JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ImageBuildError(f"image spec {path} must be a mapping with target, dockerfile and context")
    for key in ("dockerfile", "context"):
        if isinstance(data.get(key), str):
            data[key] = path.parent / data[key]
    return _validate(data, str(path))


def spec_from_dict(data: dict) -> ImageSpec:
    """A spec from a mapping (e.g. a Prefect flow parameter); paths are taken as given."""
    return _validate(dict(data), "image spec")


def _validate(data: dict, where: str) -> ImageSpec:
    try:
        spec = ImageSpec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise ImageBuildError(f"{where}: {problems}") from None
    spec = spec.model_copy(update={"dockerfile": spec.dockerfile.resolve(), "context": spec.context.resolve()})
    if not spec.dockerfile.is_file():
        raise ImageBuildError(f"{where}: Dockerfile {spec.dockerfile} does not exist")
    if not spec.context.is_dir():
        raise ImageBuildError(f"{where}: build context {spec.context} is not a directory")
    return spec
