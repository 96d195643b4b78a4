"""A sweep checked against its pipeline, before anything runs: the swept keys exist and can take the
values, the metrics are ones the stages log, which stages every variant shares (run once, then taken
from the stage cache) and which each runs, the rungs of early stopping, how many variants the Ray can
place at once; and each variant's pipeline mapping.

Sharing: a stage is per-variant when a swept key is in its own config (`stages.NAME.…`), when a swept
pipeline-level key it reads changes (`seed`: the stage kinds that have it in their cache key;
`datasets.KEY.…`: the stages that ingest or read KEY), or when a stage upstream of it is per-variant.
Every other stage is shared. A variant runs every stage but the register stages (only the best
variant registers); its shared stages are cache hits.
"""

from __future__ import annotations

import copy
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import BaseModel

from omni_core.config import PipelineConfig, apply_overrides, read_yaml, validate_pipeline
from omni_core.config.algorithms import LANGUAGE_MODEL, pair_converters
from omni_core.config.loader import ConfigValidationError, set_path
from omni_core.config.models import TRAINING_KINDS, EvalStage, RLStage, upstream_stage
from omni_core.errors import ConfigError
from omni_core.pipeline.names import unknown_names
from omni_core.sweep.space import Space
from omni_core.sweep.spec import NUMERIC_DISTRIBUTIONS, SweepSpec

REGISTER_KIND = "register"
NOT_SWEPT = ("name", "store", "tracking_uri", "ray")  # where a run lives, not what it computes
PAIR_METRICS = ("eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies", "eval_rewards/margins",
                "eval_logps/chosen", "eval_logps/rejected", "eval_loss")
REWARD_METRICS = ("val/reward_mean",)
REWARD_PREFIXES = ("val-core/", "val-aux/")


@dataclass
class Asha:
    stage: str
    metric: str
    goal: str
    min_steps: int
    eta: int
    smooth: int
    mode: str

    def rungs(self, total_steps: int) -> list[int]:
        """The rung steps below `total_steps` (a rung at the last step would decide nothing: training is over)."""
        out, step = [], self.min_steps
        while step < total_steps:
            out.append(step)
            step *= self.eta
        return out


@dataclass
class Variant:
    index: int
    setting: int  # variants of one setting differ only in seed
    seed: int
    params: dict[str, Any]

    @property
    def label(self) -> str:
        return f"v{self.index:03d}"

    def overrides(self) -> list[str]:
        """The dotted overrides that turn the pipeline file into this variant (`omni run FILE ...`)."""
        return [override_text(k, v) for k, v in self.params.items()] + [override_text("seed", self.seed)]


@dataclass
class SweepPlan:
    spec: SweepSpec
    pipeline_file: str
    overrides: list[str]
    data: dict[str, Any]  # the pipeline mapping with the fixed overrides and the held-out eval, if any
    config: PipelineConfig
    seed: int
    seeds: list[int]
    shared: list[str]
    per_variant: list[str]
    register: list[str]
    select_stage: str
    report_stage: str
    metric: str
    goal: str
    asha: Asha | None
    space: Space
    variants: list[Variant]  # all of them for grid and random; bayes: drawn as the sweep goes
    n_settings: int
    added_stage: str | None = None
    warnings: list[str] = field(default_factory=list)
    demand: dict[str, float] = field(default_factory=dict)  # one variant's peak Ray resources
    demand_of: str = ""

    @property
    def n_variants(self) -> int:
        return self.n_settings * len(self.seeds)

    def variant(self, index: int, params: dict[str, Any]) -> Variant:
        setting, k = divmod(index, len(self.seeds))
        return Variant(index, setting, self.seeds[k], params)

    def variant_data(self, variant: Variant, *, register: bool = False) -> dict[str, Any]:
        """The variant's pipeline mapping: its values, its seed; without the register stages unless asked."""
        data = copy.deepcopy(self.data)
        for key, value in variant.params.items():
            set_path(data, key, copy.deepcopy(value), f"parameters.{key}")
        data["seed"] = variant.seed
        if not register:
            data["stages"] = [s for s in data["stages"] if s["name"] not in self.register]
        return data

    def shared_data(self) -> dict[str, Any]:
        data = copy.deepcopy(self.data)
        data["stages"] = [s for s in data["stages"] if s["name"] in self.shared]
        return data


def override_text(key: str, value: Any) -> str:
    return f"{key}={yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix('...').strip()}"


# ---- the swept keys --------------------------------------------------------------------------------


def _leaves(model: BaseModel, prefix: str = "") -> dict[str, Any]:
    """Every dotted key path of a config model (stages by name) -> its field's annotation."""
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        key = f"{prefix}{info.alias or name}"
        value = getattr(model, name)
        if name == "stages":
            for stage in value:
                out.update(_leaves(stage, f"{key}.{stage.name}."))
        elif isinstance(value, BaseModel):
            out[key] = info.annotation
            out.update(_leaves(value, f"{key}."))
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            for item, sub in value.items():
                out.update(_leaves(sub, f"{key}.{item}."))
        else:
            out[key] = info.annotation
    return out


def _types(annotation: Any) -> set[type]:
    if isinstance(annotation, type):
        return {annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        return set().union(*(_types(a) for a in typing.get_args(annotation)))
    return set()


def check_keys(spec: SweepSpec, config: PipelineConfig) -> list[str]:
    """Each swept key exists in the pipeline's schema (else the nearest one is named) and a distribution
    sweeps a number; returns warnings (a dataset's source swept: nothing downstream can be shared)."""
    leaves = _leaves(config)
    warnings = []
    for key, param in spec.parameters.items():
        root = key.split(".")[0]
        if root in NOT_SWEPT:
            raise ConfigError(f"parameters.{key}: '{root}' says where a run lives, not what it computes; it cannot "
                              "be swept (give it as an override after the sweep file)")
        if key not in leaves and not _under_a_mapping(key, leaves):
            near = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.6)
            hint = f"the nearest existing key is {near[0]}" if near else "check `omni validate` for the keys"
            raise ConfigError(f"parameters.{key}: not a key of pipeline {config.name}; {hint}")
        kinds = _types(leaves.get(key))
        if param.distribution in NUMERIC_DISTRIBUTIONS:
            numeric = {int, float} & kinds and bool not in kinds
            if not numeric:
                raise ConfigError(f"parameters.{key}: distribution {param.distribution} needs a numeric key; "
                                  f"{key} is {_type_names(kinds)}: list its values instead (values: [...])")
            if param.distribution != "int_uniform" and float not in kinds:
                raise ConfigError(f"parameters.{key}: an integer key; use distribution int_uniform (or values)")
        if root == "datasets" and key.endswith(".source"):
            warnings.append(f"parameters.{key} changes a dataset's source: every stage that reads "
                            f"'{key.split('.')[1]}' runs per variant; nothing downstream of it can be shared")
    return warnings


def current_values(plan: SweepPlan) -> dict[str, Any]:
    """The pipeline's own value of each swept key (what it runs without the sweep)."""
    out = {}
    for key in plan.spec.parameters:
        node: Any = plan.config
        for part in key.split("."):
            if isinstance(node, list):
                node = next((item for item in node if getattr(item, "name", None) == part), None)
            elif isinstance(node, BaseModel):
                name = next((n for n, f in type(node).model_fields.items() if (f.alias or n) == part), part)
                node = getattr(node, name, None)
            elif isinstance(node, dict):
                node = node.get(part)
        out[key] = node.model_dump(mode="json") if isinstance(node, BaseModel) else node
    return out


def _under_a_mapping(key: str, leaves: dict[str, Any]) -> bool:
    """`stages.rl.resources.trainer.CPU`: inside a free-form mapping the schema cannot list."""
    parts = key.split(".")
    return any(dict in _types(leaves.get(".".join(parts[:i]))) or typing.get_origin(leaves.get(".".join(parts[:i]))) is dict
               for i in range(1, len(parts)))


def _type_names(kinds: set[type]) -> str:
    return " or ".join(sorted(k.__name__ for k in kinds)) or "not a number"


# ---- which stages each variant runs -----------------------------------------------------------------


def reached_stages(config: PipelineConfig, keys: list[str]) -> set[str]:
    """The stages a swept key reaches, directly (without their descendants)."""
    from omni_core.pipeline.stages import stage_kind

    reached: set[str] = set()
    for key in keys:
        parts = key.split(".")
        if parts[0] == "stages":
            names = [s.name for s in config.stages]
            reached.add(parts[1] if parts[1] in names else names[int(parts[1])])
        elif parts[0] == "seed":
            reached |= {s.name for s in config.stages if stage_kind(s.kind).seeded}
        elif parts[0] == "datasets":
            for stage in config.stages:
                kind = stage_kind(stage.kind)
                if parts[1] in kind.reads(stage) or parts[1] in kind.produces(stage) \
                        or parts[1] in getattr(stage, "datasets", ()):
                    reached.add(stage.name)
    return reached


def split_stages(config: PipelineConfig, keys: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(shared, per-variant, register stages) in dependency order."""
    from omni_core.pipeline.graph import StageGraph

    graph = StageGraph(config)
    direct = reached_stages(config, keys)
    registering = {s.name for s in config.stages if s.kind == REGISTER_KIND}
    registering |= {d for r in list(registering) for d in graph.descendants(r)}
    per = {n for n in graph.order if n in direct or any(a in direct for a in graph.ancestors(n))}
    shared = [n for n in graph.order if n not in per and n not in registering]
    return shared, [n for n in graph.order if n in per and n not in registering], \
        [n for n in graph.order if n in registering]


# ---- metrics -----------------------------------------------------------------------------------------


def eval_stages(config: PipelineConfig) -> list[str]:
    return [s.name for s in config.ordered_stages() if isinstance(s, EvalStage)]


def eval_metric_problem(config: PipelineConfig, stage: EvalStage, metric: str) -> str | None:
    """Why `stage` never logs `metric` (None: it does), naming what it logs."""
    source = config.stage(upstream_stage(config, stage.name, "checkpoint_from", stage.checkpoint_from, TRAINING_KINDS))
    pairs = config.datasets[stage.split()[0]].converter in pair_converters()
    names, prefixes = (PAIR_METRICS, tuple(f"{m}/" for m in PAIR_METRICS)) if pairs else (REWARD_METRICS, REWARD_PREFIXES)
    base = metric
    if stage.baseline:
        base = metric.removesuffix("_baseline").removesuffix("_gain")
    if base in names or base.startswith(prefixes):
        return None
    kind = "preference pairs" if pairs else ("images" if source.record.model_kind != LANGUAGE_MODEL else "responses")
    logged = ", ".join([*names, *(f"{p}..." for p in prefixes)])
    extra = " (each also as _baseline and _gain)" if stage.baseline else ""
    return f"stage {stage.name} scores {kind} and logs {logged}{extra}"


def training_metric_problem(stage: RLStage, metric: str) -> str | None:
    logged = [name for name, _ in stage.record.progress]
    if metric in logged:
        return None
    return f"stage {stage.name} ({stage.algorithm.name}) logs per step: {', '.join(logged)}"


# ---- the plan --------------------------------------------------------------------------------------


def plan_sweep(spec: SweepSpec, pipeline_file: str, overrides: list[str] | None = None) -> SweepPlan:
    overrides = list(overrides or [])
    data = apply_overrides(read_yaml(pipeline_file), overrides)
    config = validate_pipeline(copy.deepcopy(data), pipeline_file)
    if unknown := unknown_names(config):
        raise ConfigError(f"{pipeline_file}: " + "; ".join(unknown))
    warnings = check_keys(spec, config)
    evals = eval_stages(config)
    select = spec.select_on or spec.metric.stage or (evals[-1] if evals else None)
    if select is None:
        raise ConfigError(f"metric.stage: pipeline {config.name} has no eval stage to rank the variants by; add one")
    if spec.metric.stage and spec.select_on and spec.metric.stage != spec.select_on:
        raise ConfigError(f"select_on: {spec.select_on} differs from metric.stage {spec.metric.stage}; give one of them")
    where = "select_on" if spec.select_on else "metric.stage"
    if select not in evals:
        raise ConfigError(f"{where}: '{select}' is not an eval stage of pipeline {config.name} "
                          f"(eval stages: {', '.join(evals) or 'none'})")
    data, report, added = _with_report_stage(spec, data, config, select, evals)
    config = validate_pipeline(copy.deepcopy(data), pipeline_file)
    for name in dict.fromkeys([select, report]):
        if problem := eval_metric_problem(config, config.stage(name), spec.metric.name):
            raise ConfigError(f"metric.name: '{spec.metric.name}' is not logged by the eval stage: {problem}")
    if report == select:
        warnings.append(f"report_on: the best variant's score is reported on {select}, the eval that chose it, so "
                        "it overstates itself; give report_on a held-out eval (see docs/sweeps.md)")
    keys = list(spec.parameters) + (["seed"] if spec.seeds else [])
    shared, per_variant, register = split_stages(config, keys)
    if select not in per_variant:
        raise ConfigError(f"parameters: no swept key reaches the eval stage {select} (it runs once for all "
                          f"variants: {', '.join(shared)}); sweep a key of {select} or of a stage upstream of it")
    asha = _asha(spec, config, select, per_variant)
    seed = config.seed if spec.seed is None else spec.seed
    space = Space(spec, seed)
    n_settings = space.size() or 0
    seeds = list(spec.seeds or [config.seed])
    plan = SweepPlan(spec, pipeline_file, overrides, data, config, seed, seeds, shared, per_variant, register,
                     select, report, spec.metric.name, spec.metric.goal, asha, space, [], n_settings, added, warnings)
    settings = space.up_front()
    if settings is not None:
        plan.variants = [plan.variant(i, settings[i // len(seeds)]) for i in range(plan.n_variants)]
    check_variants(plan)
    return plan


def _with_report_stage(spec: SweepSpec, data: dict[str, Any], config: PipelineConfig, select: str,
                       evals: list[str]) -> tuple[dict[str, Any], str, str | None]:
    report = spec.report_on
    if report is None:
        return data, select, None
    if isinstance(report, str):
        if report not in evals:
            raise ConfigError(f"report_on: '{report}' is not an eval stage of pipeline {config.name} "
                              f"(eval stages: {', '.join(evals) or 'none'}); or give a held-out eval (skip_rows: ...)")
        return data, report, None
    name = report.name or f"{select}_report"
    if name in {s.name for s in config.stages}:
        raise ConfigError(f"report_on.name: the pipeline has a stage '{name}' already; name the held-out eval otherwise")
    selecting = next(s for s in data["stages"] if s["name"] == select)
    added = {**copy.deepcopy(selecting), "name": name, "skip_rows": report.skip_rows, "samples": 0}
    added.pop("max_rows", None)
    if report.max_rows is not None:
        added["max_rows"] = report.max_rows
    if report.data:
        added["data"] = report.data
    data = copy.deepcopy(data)
    at = next(i for i, s in enumerate(data["stages"]) if s["name"] == select)
    data["stages"].insert(at + 1, added)
    return data, name, name


def _asha(spec: SweepSpec, config: PipelineConfig, select: str, per_variant: list[str]) -> Asha | None:
    early = spec.early_terminate
    if early is None:
        return None
    select_stage = config.stage(select)
    default = upstream_stage(config, select, "checkpoint_from", select_stage.checkpoint_from, TRAINING_KINDS)
    name = early.stage or default
    if name not in {s.name for s in config.stages} or config.stage(name).kind not in TRAINING_KINDS:
        trained = [s.name for s in config.stages if s.kind in TRAINING_KINDS]
        raise ConfigError(f"early_terminate.stage: '{name}' is not a training stage of pipeline {config.name} "
                          f"(training stages: {', '.join(trained) or 'none'})")
    if name not in per_variant:
        raise ConfigError(f"early_terminate.stage: {name} runs once for all variants (no swept key reaches it): "
                          "there is nothing to stop; watch a stage the swept keys reach")
    stage: RLStage = config.stage(name)
    metric = early.metric or stage.record.progress[0][0]
    if problem := training_metric_problem(stage, metric):
        raise ConfigError(f"early_terminate.metric: '{metric}' is not logged per step: {problem}")
    goal = early.goal or ("minimize" if "loss" in metric else "maximize")
    return Asha(name, metric, goal, early.min_steps, early.eta, early.smooth, early.mode)


def check_variants(plan: SweepPlan) -> None:
    """Every variant's pipeline is valid (bayes: the corners of its ranges); the rungs fall inside training."""
    if plan.variants:
        samples = plan.variants
    else:
        low = {k: (p.values[0] if p.values else p.min) for k, p in plan.spec.parameters.items()}
        high = {k: (p.values[-1] if p.values else p.max) for k, p in plan.spec.parameters.items()}
        for params in (low, high):
            for k, p in plan.spec.parameters.items():
                if p.distribution == "int_uniform":
                    params[k] = int(params[k])
        samples = [plan.variant(0, low), plan.variant(0, high)]
    steps = []
    for variant in samples:
        try:
            config = validate_pipeline(plan.variant_data(variant, register=True), plan.pipeline_file)
            errors = unknown_names(config)  # a swept converter or reward name
        except ConfigValidationError as exc:
            errors = exc.errors
        if errors:
            values = ", ".join(f"{k}={v!r}" for k, v in variant.params.items())
            raise ConfigError(f"parameters: the variant {values} is not a valid pipeline: {'; '.join(errors)}")
        if plan.asha is not None:
            steps.append(config.stage(plan.asha.stage).trainer.total_steps)
    if plan.asha is not None and not plan.asha.rungs(min(steps)):
        raise ConfigError(f"early_terminate.min_steps: {plan.asha.min_steps} is not below "
                          f"stages.{plan.asha.stage}.trainer.total_steps ({min(steps)}): there is no rung to decide at; "
                          "lower min_steps")


# ---- what a variant places on Ray ------------------------------------------------------------------


def variant_demand(plan: SweepPlan) -> tuple[dict[str, float], str]:
    """The most Ray resources one variant's stages place at once, and which stage that is. A native
    training stage gang-places its actors (omni_core.training.placement); an eval is one Ray task."""
    from omni_core.config.backends import DEFAULT_BACKEND, backend_name
    from omni_core.training.placement import actor_demand, actor_roles

    peak: dict[str, float] = {}
    what = ""
    for name in plan.per_variant:
        stage = plan.config.stage(name)
        if isinstance(stage, RLStage) and backend_name(stage.backend) == DEFAULT_BACKEND:
            demand = actor_demand(stage)
            roles = actor_roles(stage)
            detail = ", ".join(f"{r} {stage.role_resources(r).get('CPU', 0):g}" for r in dict.fromkeys(roles))
            label = f"stage {name} ({detail} CPU)"
        elif isinstance(stage, EvalStage) and stage.engine != "trainer":
            demand, label = stage.task_resources(), f"stage {name} (its Ray task)"
        else:
            continue
        if sum(demand.values()) > sum(peak.values()):
            peak, what = demand, label
    return peak, what


def placeable(demand: dict[str, float], total: dict[str, float]) -> int | None:
    """How many variants of `demand` fit in `total` at once (None: nothing to place)."""
    counts = [math.floor(total.get(k, 0.0) / v + 1e-9) for k, v in demand.items() if v > 0]
    return min(counts) if counts else None


def settle_concurrency(plan: SweepPlan, total: dict[str, float] | None, where: str) -> int:
    """`max_concurrent` checked against what the Ray can place (`total`: its resources; None: unknown):
    a ConfigError naming the resources when it cannot be placed; the default is as many as fit."""
    demand, what = variant_demand(plan)
    plan.demand, plan.demand_of = demand, what
    wanted = plan.spec.max_concurrent
    fit = placeable(demand, total) if total is not None else None
    if fit is not None and fit < 1:
        need = ", ".join(f"{k} {v:g}" for k, v in demand.items())
        raise ConfigError(f"max_concurrent: one variant needs {need} at once ({what}) and {where} has "
                          f"{_resources(total, demand)}; raise ray.num_cpus or use a larger cluster")
    if wanted is not None and fit is not None and wanted > fit:
        need = ", ".join(f"{k} {v:g}" for k, v in demand.items())
        raise ConfigError(f"max_concurrent: {wanted} variants cannot run at once: each needs {need} ({what}) and "
                          f"{where} has {_resources(total, demand)}, room for {fit}; set max_concurrent to {fit} or less "
                          "(or give the Ray more resources)")
    chosen = wanted or fit or 1
    return max(1, min(chosen, plan.n_variants))


def _resources(total: dict[str, float] | None, demand: dict[str, float]) -> str:
    return ", ".join(f"{k} {(total or {}).get(k, 0.0):g}" for k in demand)


# ---- what --dry-run prints ------------------------------------------------------------------------


def describe(plan: SweepPlan, concurrency: int, where: str) -> list[str]:
    spec, asha = plan.spec, plan.asha
    seeds = f" x {len(plan.seeds)} seeds" if len(plan.seeds) > 1 else ""
    lines = [f"sweep {spec.name} over pipeline {plan.config.name} ({plan.pipeline_file}): method {spec.method}, "
             f"seed {plan.seed}, {plan.n_variants} variants ({plan.n_settings} settings{seeds})",
             f"shared (run once, then every variant takes them from the stage cache): {', '.join(plan.shared) or 'none'}",
             f"per variant: {', '.join(plan.per_variant)}"
             + (f" ({plan.added_stage}: added by the sweep, the held-out eval)" if plan.added_stage else ""),
             f"best variant only: {', '.join(plan.register) or 'none (the pipeline has no register stage)'}"
             + ("" if spec.register_best else " (register_best: false: not run)"),
             f"ranked by {plan.metric} on {plan.select_stage} ({plan.goal}); reported on {plan.report_stage}"]
    if asha is not None:
        steps = plan.config.stage(asha.stage).trainer.total_steps
        lines.append(f"early stop: ASHA ({asha.mode}) on {asha.stage} {asha.metric} ({asha.goal}), rungs at steps "
                     f"{', '.join(map(str, asha.rungs(steps)))} of {steps} (eta {asha.eta}, smooth {asha.smooth})")
    need = ", ".join(f"{k} {v:g}" for k, v in plan.demand.items()) or "nothing on Ray"
    lines.append(f"at once: {concurrency} variants (each places {need}"
                 + (f" at most, in {plan.demand_of}" if plan.demand_of else "") + f"; {where})")
    lines += [f"warning: {w}" for w in plan.warnings]
    if not plan.variants:
        lines.append("variants: drawn by Optuna's TPE sampler as the sweep goes, each from the finished ones")
        return lines
    lines.append("variants:")
    for variant in plan.variants:
        lines.append(f"  {variant.label}  " + "  ".join(variant.overrides()))
    return lines
