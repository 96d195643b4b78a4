"""An eval stage's work as plain data (`EvalJob`), run where the model fits: a Ray task with the stage's
resources on the pipeline's Ray (`run_on_ray`), or in this process (`run_eval_job`, for benchmarks).

The job names the models it scores as `ModelSpec`s (a URI the model loader reads, plus a LoRA adapter
in the store when the checkpoint holds only that), the rows, the settings and the seed; the task loads
them, scores the candidate (and the baseline, the trained stage's starting model, when asked) and
returns metrics, per-response records, a grid PNG for images, timings and where it ran. Nothing in the
job or the result refers to the caller's process, so the task runs on any node of a cluster.

Baseline scores are kept in the store under `evals/baselines/{digest}.json`, the digest taken over the
baseline's weights (sha256 of its tensors, or the upstream checkpoint's recorded digest) and everything
else that decides its score (rows, settings, seed, reward file): a sweep over training settings that all
start from the same model scores it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_core.errors import ConfigError, OmniError
from omni_core.storage import Store

TEXT, IMAGES, PAIRS = "text", "images", "pairs"
BASELINE_CACHE = "evals/baselines"


@dataclass(frozen=True)
class ModelSpec:
    """How to load one model: `uri` with the adapter / LoRA settings of the stage that trained it; with
    `adapter_key`, `uri` is the base and the store file `adapter_key` holds the trained LoRA weights
    (of the model, or of an SD3 model's transformer). `weights_sha256` when it is known without loading."""

    uri: str
    seed: int = 0
    adapter: str | None = None
    adapter_stage: str | None = None
    lora: dict[str, Any] | None = None
    adapter_key: str | None = None
    weights_sha256: str | None = None

    def load(self, store: Store) -> tuple[Any, Any]:
        from omni_core.models import load_model

        model, text_io = load_model(self.uri, seed=self.seed, adapter=self.adapter, stage=self.adapter_stage,
                                    lora=self.lora if self.adapter_key else None)
        if self.adapter_key:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load as load_safetensors

            target = model.transformer if hasattr(model, "transformer") and hasattr(model, "scheduler") else model
            result = set_peft_model_state_dict(target, load_safetensors(store.read_bytes(self.adapter_key)))
            unexpected = getattr(result, "unexpected_keys", None)
            if unexpected:
                raise ConfigError(f"the LoRA adapter {store.uri(self.adapter_key)} does not fit {self.uri} with "
                                  f"LoRA {self.lora} ({len(unexpected)} unexpected keys, e.g. {unexpected[0]})")
        return model.eval(), text_io

    def load_text_io(self) -> Any:
        """The model's tokenizer alone (an engine that loads the weights itself, vLLM, needs only it)."""
        from transformers import AutoTokenizer

        from omni_core.models.factory import model_source

        return AutoTokenizer.from_pretrained(model_source(self.uri, self.seed))


@dataclass
class EvalJob:
    """What one eval stage scores (module docstring). `settings` is the eval stage's config (json);
    `sampler`: a diffusion model's sampling settings, a preference model's beta and log-prob mode."""

    kind: str
    candidate: ModelSpec
    rows: list[dict[str, Any]]
    seed: int
    store: Store
    settings: dict[str, Any]
    reward: str | None = None
    reward_sha256: str | None = None
    sampler: dict[str, Any] = field(default_factory=dict)
    baseline: ModelSpec | None = None
    reference: ModelSpec | None = None  # pairs: the reference; None: the candidate with its LoRA disabled


def weights_digest(model: Any) -> str:
    """sha256 over the model's tensors (module, name, dtype, shape, bytes) in name order; an SD3 model's
    transformer and text encoder."""
    import torch

    modules = {"": model} if isinstance(model, torch.nn.Module) else {
        part: getattr(model, part) for part in ("transformer", "text_encoder") if hasattr(model, part)}
    digest = hashlib.sha256()
    for part, module in modules.items():
        for name, tensor in sorted(module.state_dict().items()):
            digest.update(f"{part}/{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# Each kind's scorer, named by "module:function" and imported when an eval runs: the scorers import
# EvalJob from here, so importing them here would make a circle.
SCORERS = {TEXT: "omni_core.evaluation.text:score_text", IMAGES: "omni_core.evaluation.images:score_images",
           PAIRS: "omni_core.evaluation.pairs:score_pairs"}


def _score(job: EvalJob, model: Any, text_io: Any, *, reference: Any = None) -> dict[str, Any]:
    import importlib

    if job.kind not in SCORERS:
        raise ValueError(f"unknown eval kind {job.kind!r}")
    module, _, name = SCORERS[job.kind].partition(":")
    scorer = getattr(importlib.import_module(module), name)
    if job.kind == TEXT:
        return scorer(job, model, text_io)
    if job.kind == IMAGES:
        return scorer(job, model)
    return scorer(job, model, text_io, reference)


def _baseline_key(job: EvalJob, digest: str) -> str:
    payload = {"weights_sha256": digest, "kind": job.kind, "settings": {k: v for k, v in job.settings.items()
                                                                        if k not in ("name", "after", "resources",
                                                                                     "samples", "baseline")},
               "reward": job.reward, "reward_sha256": job.reward_sha256, "sampler": job.sampler, "seed": job.seed,
               "rows": hashlib.sha256(json.dumps(job.rows, sort_keys=True, default=str).encode()).hexdigest()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def _score_baseline(job: EvalJob, timings: dict[str, float]) -> dict[str, Any]:
    """The baseline's scores: from the store's cache when the same weights were scored the same way."""
    assert job.baseline is not None
    t = time.perf_counter()
    model, text_io = job.baseline.load(job.store)
    digest = job.baseline.weights_sha256 or weights_digest(model)
    timings["baseline_load_s"] = time.perf_counter() - t
    key = f"{BASELINE_CACHE}/{_baseline_key(job, digest)}.json"
    if job.store.exists(key):
        cached = job.store.read_json(key)
        return {**cached, "cached": True, "cache_uri": job.store.uri(key)}
    t = time.perf_counter()
    reference = None
    if job.kind == PAIRS:  # the starting model against itself: rewards 0, but its log-probs are informative
        reference = model
    scored = _score(job, model, text_io, reference=reference)
    timings["baseline_score_s"] = time.perf_counter() - t
    kept = {"weights_sha256": digest, "metrics": scored["metrics"], "records": scored["records"]}
    job.store.write_json(key, kept)
    return {**kept, "cached": False, "cache_uri": job.store.uri(key)}


def run_eval_job(job: EvalJob) -> dict[str, Any]:
    """Load and score the candidate (and the baseline): metrics, records, grid PNG, timings, where it ran."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the task's output reaches the driver's terminal: no loading bars
    started = time.perf_counter()
    timings: dict[str, float] = {}
    t = time.perf_counter()
    if job.kind == TEXT and job.settings.get("engine") == "vllm_omni":  # vLLM loads the weights itself
        model, text_io = None, job.candidate.load_text_io()
    else:
        model, text_io = job.candidate.load(job.store)
    reference = job.reference.load(job.store)[0] if job.reference is not None else None
    timings["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    result = _score(job, model, text_io, reference=reference)
    timings["score_s"] = time.perf_counter() - t
    del model, reference
    if job.baseline is not None:
        result["baseline"] = _score_baseline(job, timings)
    timings["task_s"] = time.perf_counter() - started
    result["timings"] = timings
    result["where"] = where_this_runs()
    return result


def where_this_runs() -> dict[str, Any]:
    """The Ray node, task and process this runs in (no Ray: the process only)."""
    out: dict[str, Any] = {"pid": os.getpid(), "hostname": os.uname().nodename}
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            out.update(node_id=ctx.get_node_id(), task_id=ctx.get_task_id() or "", job_id=ctx.get_job_id())
    except ImportError:
        pass
    return out


TASK_NAME = "omni-eval"


def run_on_ray(job: EvalJob, resources: dict[str, float], *, name: str, local: bool) -> dict[str, Any]:
    """`run_eval_job(job)` as a Ray task named `name` asking for `resources` (CPU and GPU by name, the rest
    as custom resources) on the Ray this process is connected to. A local Ray that lacks them is an
    error (they would never come); a cluster may still add nodes."""
    import ray
    from ray.exceptions import RayTaskError

    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 1.0), "max_retries": 0, "name": name}
    if resources.get("GPU"):
        options["num_gpus"] = resources["GPU"]
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU") and v}
    if custom:
        options["resources"] = custom
    total = ray.cluster_resources()
    short = {k: (v, total.get(k, 0.0)) for k, v in resources.items() if v > total.get(k, 0.0) + 1e-9}
    if short and local:
        what = ", ".join(f"{k} {need:g} (Ray has {have:g})" for k, (need, have) in short.items())
        raise OmniError(f"{name}: the eval task needs {what}: lower the eval stage's resources or run on a "
                        "cluster that has them (ray.address)")
    task = ray.remote(run_eval_job).options(**options)
    try:
        return ray.get(task.remote(job))
    except RayTaskError as exc:
        if isinstance(exc.cause, OmniError):  # a user-fixable error inside the task: show it as such
            raise exc.cause from None
        raise


def job_summary(job: EvalJob) -> dict[str, Any]:
    """The job without its rows and store (for logs)."""
    return {"kind": job.kind, "candidate": asdict(job.candidate), "rows": len(job.rows), "seed": job.seed,
            "baseline": asdict(job.baseline) if job.baseline else None, "sampler": job.sampler}
