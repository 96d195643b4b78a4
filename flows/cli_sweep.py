"""`omni sweep PIPELINE.yaml SWEEP.yaml [overrides]` (also `omni sweep run ...`), with `--dry-run`, and
`omni sweep status [NAME]`. Mounted by flows/cli.py; the work is omni_core.sweep, run by the `sweep`
flow (flows/sweep.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from flows.cli_options import DEFAULT_STORE

console = Console(highlight=False, soft_wrap=True)


class _RunByDefault(TyperGroup):
    """`omni sweep FILE ...` is `omni sweep run FILE ...`; `omni sweep status` is the status command."""

    default_command = "run"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)


sweep_app = typer.Typer(cls=_RunByDefault, no_args_is_help=True, help=(
    "One pipeline over many settings: `omni sweep PIPELINE.yaml SWEEP.yaml \\[overrides]` (--dry-run: the "
    "variants and what they share), `omni sweep status [NAME]` (docs/sweeps.md)."))


@sweep_app.command("run")
def run_command(
    pipeline_file: Annotated[Path, typer.Argument(help="Pipeline YAML file.")],
    sweep_file: Annotated[Path, typer.Argument(help="Sweep YAML file (name, method, parameters, metric, ...).")],
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides of the pipeline for every "
                                                               "variant: ray.num_cpus=4")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the variants, the stages they share and each "
                                                            "runs, and how many run at once; run nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: the plan as one JSON object.")] = False,
    poll_s: Annotated[float, typer.Option("--poll", min=0.1, help="Seconds between looks at the running variants.")] = 1.0,
) -> None:
    """Run a sweep: the shared stages once, then the variants (each a pipeline run) in parallel, ASHA
    stopping the weak ones, a comparison, and the best variant registered. Run it again to resume."""
    from omni_core.sweep.plan import describe, plan_sweep, settle_concurrency
    from omni_core.sweep.shared_ray import shared_ray
    from omni_core.sweep.spec import load_sweep

    plan = plan_sweep(load_sweep(sweep_file), str(pipeline_file), list(overrides or []))
    if dry_run:
        with shared_ray(plan.config.ray, start=False) as ray:
            concurrency = settle_concurrency(plan, ray.resources, ray.where)
        if as_json:
            from omni_core.sweep.run import plan_summary

            print(json.dumps({**plan_summary(plan), "max_concurrent": concurrency, "demand": plan.demand,
                              "warnings": plan.warnings, "variants": [
                                  {"label": v.label, "seed": v.seed, "params": v.params, "overrides": v.overrides()}
                                  for v in plan.variants]}, indent=2, default=str))
        else:
            for line in describe(plan, concurrency, ray.where):
                console.print(escape(line))
        return
    from omni_core.storage import Store

    Store(plan.config.store).check_writable()
    from flows.prefect_env import (
        quiet_prefect_tracebacks,
        start_embedded_api,
        start_embedded_prefect_once,
        use_embedded_prefect,
    )

    prefect_home = use_embedded_prefect()
    api_ready = start_embedded_api(prefect_home)
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.sweep import sweep

    quiet_prefect_tracebacks()
    local_server = api_ready()
    if local_server is None:
        start_embedded_prefect_once(prefect_home)
    started = time.perf_counter()
    # a thread per variant running (each waits on its process; how many run at once is settled in the flow,
    # against the Ray), one for the shared stages' run and one for the winner's
    runner = ThreadPoolTaskRunner(max_workers=min(plan.n_variants, plan.spec.max_concurrent or plan.n_variants) + 2)
    outcome = sweep.with_options(task_runner=runner, flow_run_name=f"sweep-{plan.spec.name}")(
        pipeline_file=str(pipeline_file), sweep_file=str(sweep_file), overrides=list(overrides or []), poll_s=poll_s)
    print_outcome(outcome, time.perf_counter() - started, outcome.get("prefect_flow_run_url")
                  or (local_server.url if local_server else None))


def print_outcome(outcome: dict[str, Any], seconds: float, prefect_ui: str | None) -> None:
    head = outcome["headline"]
    print_table(outcome["rows"], f"sweep {outcome['name']} finished in {seconds:.0f}s: {head['variants']} variants, "
                                 f"{head['completed']} completed, {head['pruned']} pruned, {head['failed']} failed")
    print_best(outcome["spec"], head)
    registered = outcome.get("registered")
    if registered:
        console.print(f"registered   {registered['model_name']} version {registered['version']} "
                      f"({'champion' if registered.get('promoted') else 'candidate'}); "
                      f"omni lineage models:/{registered['model_name']}/{registered['version']}")
    console.print(f"report       {outcome['report_uri']}")
    console.print(f"mlflow       sweep run {outcome['mlflow_run_id']} at {outcome['tracking_uri']}")
    if prefect_ui:
        console.print(f"open Prefect {prefect_ui}")


def print_best(spec: dict[str, Any], head: dict[str, Any]) -> None:
    best = head.get("best")
    if not best:
        console.print("best         none: no variant completed")
        return
    spread = f" (± {best['select_std']:.3g} over {best['seeds']} seeds)" if best.get("select_std") is not None else ""
    values = " ".join(f"{k}={v}" for k, v in best["params"].items())
    console.print(escape(f"best         {best['variant']}: {values}"))
    console.print(escape(f"             {spec['metric']} {best['select']:.4g}{spread} on {spec['select_stage']} "
                         f"(selected), {best['report']:.4g} on {spec['report_stage']} (reported)"))


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    for column in columns:
        table.add_column(escape(column.removeprefix("stages.")))
    for row in rows:
        table.add_row(*(escape(f"{v:.4g}" if isinstance(v, float) else str(v)) for v in (row.get(c, "") for c in columns)))
    console.print(table)


@sweep_app.command("status")
def status_command(
    name: Annotated[str | None, typer.Argument(help="A sweep's name; without it, every sweep in the store.")] = None,
    pipeline: Annotated[Path | None, typer.Option("--pipeline", help="Read the store from this pipeline file.")] = None,
    store: Annotated[str | None, typer.Option("--store", help=f"The store (default: {DEFAULT_STORE}).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """A sweep's variants as the store records them (also while it runs), or the sweeps in the store."""
    from omni_core.storage import Store
    from omni_core.sweep.run import compare
    from omni_core.sweep.state import find_sweeps

    if pipeline is not None and store is None:
        from omni_core.config import load_pipeline

        store = load_pipeline(pipeline).store
    found = find_sweeps(Store(store or DEFAULT_STORE), name)
    if name is None:
        summaries = [{"name": s.spec["name"], "pipeline": s.spec["pipeline"], "key": s.prefix.rsplit("/", 1)[-1],
                      "method": s.spec["method"], "variants": s.spec["n_variants"],
                      "finished": sum(1 for r in s.records.values() if r["status"] in ("completed", "pruned")),
                      "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(s.spec.get("created_at", 0)))}
                     for s in found]
        if as_json:
            print(json.dumps(summaries, indent=2))
        else:
            print_table(summaries, f"sweeps in {store or DEFAULT_STORE}")
        return
    state = found[0]
    records, rows, head, _ = compare(state)
    if as_json:
        print(json.dumps({"spec": state.spec, "state": state.state, "headline": head, "rows": rows}, indent=2,
                         default=str))
        return
    spec = state.spec
    running = [r["label"] for r in records if r["status"] == "running"]
    print_table(rows, f"sweep {spec['name']} of {spec['pipeline']} ({spec['method']}): {len(records)} of "
                      f"{spec['n_variants']} variants started, {head['completed']} completed, {head['pruned']} pruned, "
                      f"{head['failed']} failed" + (f"; running: {', '.join(running)}" if running else ""))
    print_best(spec, head)
    if registered := state.state.get("registered"):
        console.print(f"registered   {registered['model_name']} version {registered['version']}")
    console.print(f"records      {state.store.uri(state.prefix)}")
