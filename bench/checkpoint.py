"""Checkpoint cost of a training stage: save and restore time and bytes for `tiny://qwen3-omni`, full
model vs LoRA (rank 8), to a local store and to an S3-compatible moto server on 127.0.0.1.

    python bench/checkpoint.py [--quick] [--json] [--repeats N] [--no-s3]

Each case builds the stage's model as the trainer actor does (`load_model` with the stage's adapter
and `lora_spec`), an AdamW over its trainable parameters (`build_optimizer`) after one optimizer step
(a small random gradient), so Adam's moments exist, and a `TrainingState` as `TrainerWorker.save`
makes it: policy = the trainable weights (the adapter only with LoRA), optimizer state, the trainer's
RNG, info. `save_s` is `save_checkpoint` (state files, the model's save_pretrained and its processor,
upload, manifest, latest pointer, pruning); `restore_s` is `load_training_state` (read, sha256 check,
deserialise); `apply_s` loads it into the model and optimizer as `TrainerWorker.restore` does. Bytes
are the manifest's files: all of them, and those under state/. Times are the median of `--repeats`
saves (each to a new step of the same stage root, keep-last 2 as by default) and restores.
The moto server (`python -m moto.server`, as tests/conftest.py starts it) runs in its own process on
this machine: the S3 figures are the S3 protocol's cost (HTTP, multipart upload), not a network's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "tiny://qwen3-omni"


def stage_for(lora: bool) -> Any:
    from omni_core.config.models import RLStage

    return RLStage.model_validate({"name": "rl", "data": "digits", "model": MODEL, "reward": {"name": "digits"},
                                   **({"lora": {"rank": 8}} if lora else {})})


def build(lora: bool) -> tuple[Any, Any, Any, Any]:
    """(stage, model, processor, optimizer after one step)."""
    from omni_core.models import load_model
    from omni_core.training.components import build_optimizer
    from omni_core.training.stage_trainers import lora_spec

    stage = stage_for(lora)
    model, text_io = load_model(stage.model, seed=0, adapter=stage.adapter, stage=stage.adapter_stage,
                                lora=lora_spec(stage))
    optimizer = build_optimizer(model, stage.trainer.lr)
    generator = torch.Generator().manual_seed(0)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=generator, dtype=p.dtype) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stage, model, text_io, optimizer


def training_state(model: Any, optimizer: Any, step: int) -> Any:
    from omni_core.training.actors import rng_state, trainable_weights
    from omni_core.training.checkpoint import TrainingState

    rng = rng_state()
    return TrainingState(policy=trainable_weights(model), optimizer=optimizer.state_dict(),
                         rng={"trainer": rng["torch"]},
                         info={"global_step": step, "policy_version": step, "data_cursor": {"next_step": step},
                               "python_rng": {"trainer": list(rng["python"])}})


def measure(store: Any, lora: bool, repeats: int, built: tuple[Any, Any, Any, Any]) -> dict[str, Any]:
    from omni_core.training.actors import trainable_module
    from omni_core.training.checkpoint import load_training_state, save_checkpoint

    stage, model, text_io, optimizer = built
    root = f"runs/bench/{uuid.uuid4().hex[:8]}/{stage.name}"
    saves, restores, applies = [], [], []
    manifest: dict[str, Any] = {}
    for step in range(1, repeats + 1):
        state = training_state(model, optimizer, step)
        start = time.perf_counter()
        manifest = save_checkpoint(store, root, step, model, text_io, {"bench": True}, state=state, keep=2)
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        loaded = load_training_state(store, manifest)
        restores.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            trainable_module(model).load_state_dict(loaded.policy, strict=False)
        optimizer.load_state_dict(loaded.optimizer)
        applies.append(time.perf_counter() - start)
        assert loaded.policy.keys() == state.policy.keys()
    files = manifest["files"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "params": sum(p.numel() for p in model.parameters()), "trainable_params": trainable,
        "bytes": sum(f["bytes"] for f in files),
        "state_bytes": sum(f["bytes"] for f in files if f["path"].startswith("state/")),
        "files": {f["path"]: f["bytes"] for f in files},
        "save_s": round(statistics.median(saves), 4), "restore_s": round(statistics.median(restores), 4),
        "apply_s": round(statistics.median(applies), 4),
        "save_all_s": [round(s, 3) for s in saves], "restore_all_s": [round(s, 3) for s in restores],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_store(folder: Path):
    """A Store on a fresh bucket of a moto S3 server on 127.0.0.1 (env as tests/conftest.py sets it)."""
    port = _free_port()
    with open(folder / "moto.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
    saved = dict(os.environ)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited: {(folder / 'moto.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not answer on port {port}") from None
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update({"OMNI_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": str(folder / "no-aws-config"),
                           "AWS_SHARED_CREDENTIALS_FILE": str(folder / "no-aws-credentials")})
        for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
            os.environ.pop(var, None)
        import boto3

        from omni_core.storage import Store

        bucket = f"omni-bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield Store(f"s3://{bucket}/omni")
    finally:
        os.environ.clear()
        os.environ.update(saved)
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one save and restore per case")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--repeats", type=int, default=None, help="saves/restores per case, median (default 5, quick 1)")
    parser.add_argument("--no-s3", action="store_true", help="local store only (no moto server)")
    args = parser.parse_args()
    repeats = args.repeats or (1 if args.quick else 5)
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    figures: dict[str, Any] = {"model": MODEL, "repeats": repeats, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="omni-bench-ckpt-") as tmp:
        folder = Path(tmp)
        models = {}
        for lora in (False, True):
            start = time.perf_counter()
            models[lora] = build(lora)
            print(f"{MODEL} {'lora rank 8' if lora else 'full'}: built, one optimizer step "
                  f"({time.perf_counter() - start:.1f}s)", flush=True)
        stores = [("local", lambda: _local(folder))] + ([] if args.no_s3 else [("s3", lambda: moto_store(folder))])
        for store_name, open_store in stores:
            with open_store() as store:
                for lora in (False, True):
                    case = f"{store_name}_{'lora' if lora else 'full'}"
                    result = measure(store, lora, repeats, models[lora])
                    figures["cases"][case] = result
                    print(f"  {case:11s} save {result['save_s']:.3f}s  restore {result['restore_s']:.3f}s  "
                          f"bytes {result['bytes']:,} (state/ {result['state_bytes']:,})", flush=True)
    cases = figures["cases"]
    print(f"\n{'case':11s} {'params':>11s} {'trainable':>11s} {'bytes':>13s} {'state_bytes':>13s} {'save_s':>8s} "
          f"{'restore_s':>9s} {'apply_s':>8s}")
    for name, c in cases.items():
        print(f"{name:11s} {c['params']:11,d} {c['trainable_params']:11,d} {c['bytes']:13,d} {c['state_bytes']:13,d} "
              f"{c['save_s']:8.3f} {c['restore_s']:9.3f} {c['apply_s']:8.3f}")
    for store_name in [s for s, _ in stores]:
        full, lora = cases[f"{store_name}_full"], cases[f"{store_name}_lora"]
        for key in ("bytes", "state_bytes", "save_s", "restore_s"):
            figures[f"{store_name}_full_over_lora_{key}"] = round(full[key] / max(lora[key], 1e-9), 2)
        print(f"{store_name}: full / LoRA = bytes {figures[f'{store_name}_full_over_lora_bytes']}x, state/ bytes "
              f"{figures[f'{store_name}_full_over_lora_state_bytes']}x, save {figures[f'{store_name}_full_over_lora_save_s']}x, "
              f"restore {figures[f'{store_name}_full_over_lora_restore_s']}x")
    if "s3_full" in cases:
        for kind in ("full", "lora"):
            for key in ("save_s", "restore_s"):
                figures[f"s3_over_local_{kind}_{key}"] = round(cases[f"s3_{kind}"][key] / cases[f"local_{kind}"][key], 2)
    for name, c in cases.items():  # flat figures for RESULTS tables
        for key in ("bytes", "state_bytes", "save_s", "restore_s", "apply_s"):
            figures[f"{name}_{key}"] = c[key]
    if args.json:
        print(json.dumps(figures, sort_keys=True))


@contextmanager
def _local(folder: Path):
    from omni_core.storage import Store

    yield Store(str(folder / "store"))


if __name__ == "__main__":
    main()
