"""`omni image build|tag|ls`: content-addressed container images. Mounted by flows/cli.py as
`app.add_typer(image_app, name="image")`. omni_core is imported inside the commands, so mounting
this costs `omni` no start-up time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flows.cli_options import DEFAULT_STORE, StoreOption

console = Console(highlight=False, soft_wrap=True)
image_app = typer.Typer(no_args_is_help=True, help="Container images: build, content tags, build records.")

TargetArg = Annotated[str, typer.Argument(help="cuda, ascend, or an image spec file (.yaml/.json).")]
RegistryOption = Annotated[str | None, typer.Option("--registry", help=r"HOST\[:PORT]\[/NAMESPACE] (default $OMNI_IMAGE_REGISTRY).")]  # \[ : not rich markup
BuildArgOption = Annotated[list[str] | None, typer.Option("--build-arg", help="NAME=VALUE; changes the tag.")]
PlatformOption = Annotated[list[str] | None, typer.Option("--platform", help="os/arch (repeatable); changes the tag.")]


def _target(target: str) -> str:
    """Spec files are passed on as absolute paths (the flow may run elsewhere)."""
    return str(Path(target).resolve()) if target.endswith((".yaml", ".yml", ".json")) else target


def _build_args(items: list[str] | None) -> dict[str, str]:
    from omni_core.images import ImageBuildError

    args: dict[str, str] = {}
    for item in items or []:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise ImageBuildError(f"--build-arg {item!r}: write NAME=VALUE")
        args[name] = value
    return args


@image_app.command("build")
def build_command(
    target: TargetArg,
    push: Annotated[bool, typer.Option("--push", help="Push to the registry (needs --registry).")] = False,
    registry: RegistryOption = None,
    store: StoreOption = DEFAULT_STORE,
    builder: Annotated[str | None, typer.Option("--builder", help="auto, buildah or docker.")] = None,
    build_arg: BuildArgOption = None,
    platform: PlatformOption = None,
    tls_verify: Annotated[bool | None, typer.Option("--tls-verify/--no-tls-verify",
                          help="Default: verify, except for a registry on 127.0.0.1/localhost.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the build record as one JSON object.")] = False,
) -> None:
    """Build (and push) an image unless its content tag already exists (a Prefect flow with retries)."""
    from flows.prefect_env import quiet_prefect_tracebacks, start_embedded_api, use_embedded_prefect
    from omni_core.images import load_spec
    from omni_core.images.registry import default_registry
    from omni_core.storage import Store

    args = _build_args(build_arg)
    load_spec(_target(target)).with_overrides(args, platform)  # a bad target or spec fails before Prefect starts
    Store(store).check_writable()
    api_ready = start_embedded_api(use_embedded_prefect())  # omni's local Prefect server, started or reused
    from flows.build_images import build_images

    quiet_prefect_tracebacks()
    api_ready()

    results = build_images(targets=[_target(target)], push=push, registry=registry or default_registry(),
                           store=store, builder=builder, build_args=args or None, platforms=platform or None,
                           verify_tls=tls_verify)
    for result in results.values():
        if as_json:
            print(json.dumps(result, sort_keys=True))
            continue
        state = "exists (nothing built)" if result["reused"] else ("built and pushed" if result["pushed"] else "built")
        console.print(f"image {result['target']} {result['tag']} {state}: {result['pinned_ref']}")
        console.print(f"record images/{result['target']}/{result['tag']}.json in {store}")


@image_app.command("tag")
def tag_command(target: TargetArg, registry: RegistryOption = None, build_arg: BuildArgOption = None,
                platform: PlatformOption = None) -> None:
    """Print the content-addressed tag (or full reference with --registry) without building anything."""
    from omni_core.images import content_tag, image_ref, load_spec
    from omni_core.images.registry import default_registry

    spec = load_spec(_target(target)).with_overrides(_build_args(build_arg), platform)
    tag = content_tag(spec)
    print(image_ref(spec, tag, registry or default_registry()) if (registry or default_registry()) else tag)


@image_app.command("ls")
def ls_command(store: StoreOption = DEFAULT_STORE,
               target: Annotated[str | None, typer.Option("--target", help="Only this target.")] = None,
               as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False) -> None:
    """Build records in the store, oldest first."""
    from omni_core.images import list_records
    from omni_core.storage import Store

    records = list_records(Store(store), target)
    if as_json:
        for record in records:
            print(json.dumps({**record.model_dump(mode="json"), "pinned_ref": record.pinned_ref}, sort_keys=True))
        return
    if not records:
        console.print(f"no image build records in {store}")
        return
    table = Table(title=f"images in {store}")
    for column in ("target", "tag", "image", "platforms", "built", "seconds"):
        table.add_column(column, overflow="fold")
    for r in records:
        table.add_row(r.target, r.tag, r.pinned_ref, ",".join(r.platforms), r.built_at, f"{r.seconds:.1f}")
    console.print(table)
