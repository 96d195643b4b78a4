"""What the verl backend's launcher costs, side by side in one run (issue 17's targets):

(a) the launcher's own overhead per stage: `run_verl_stage`'s wall time minus the verl job's own run
    time (Ray's job info: end_time - start_time) for a verl SFT job of about two minutes on this CPU
    (tiny://lm's weights under an s3:// prefix, verl 0.9.1's sft_trainer with backend.device cpu, a real
    `ray start --head`, an S3 store on a moto server). Reported: the fixed part in seconds, its ratio to the job's run time (target < 10%),
    and the breakdown (export, model staging, resume check, submission, Ray's start of the job, the end
    of the job to the end of following it, the final mirror, verl's model merger as a second Ray Job
    with `backend.hf_model: merge`, committing the Hugging Face weights). Both `hf_model` modes run side
    by side in one run by default (`save`: verl writes the weights with every checkpoint, no merger job).
    Mirroring while the job runs overlaps the job and is shown apart.
(b) checkpoint mirroring throughput to S3 (moto on 127.0.0.1): `mirror.mirror_new` of a checkpoint
    folder shaped like verl's (model / optimizer shards, extra state, data cursor, huggingface/) against
    a plain boto3 upload of the same folder (files in a ThreadPoolExecutor, each `upload_file` with a
    multipart TransferConfig), alternating, several repetitions; the ratio of the medians (target >= 0.9x).

    python bench/verl_launcher.py [--quick] [--json] [--only launcher|mirror] [--steps N]
                                  [--hf-model save|merge|both]

Needs the verl environment (`make setup` builds .venv-verl; or OMNI_VERL_PYTHON). `--quick`: a shorter
job and a smaller folder (under two minutes on an idle 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from omni_core.storage import Store  # noqa: E402

MB = 2**20


def _moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


def _s3_env(endpoint: str) -> None:
    os.environ.update({"OMNI_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})


# ---- (b) mirroring throughput -----------------------------------------------------------------------


def _checkpoint_folder(root: Path, model_mb: int) -> Path:
    """run_dir with global_step_1/ shaped like verl's SFT checkpoint (sizes scaled by model_mb)."""
    step = root / "global_step_1"
    (step / "huggingface").mkdir(parents=True)
    sizes = {"model_world_size_1_rank_0.pt": model_mb * MB, "optim_world_size_1_rank_0.pt": 2 * model_mb * MB,
             "extra_state_world_size_1_rank_0.pt": 16 * 1024, "data_0.pt": 2 * 1024, "fsdp_config.json": 200,
             "huggingface/config.json": 800, "huggingface/tokenizer.json": 2 * MB,
             "huggingface/generation_config.json": 150}
    for rel, size in sizes.items():
        (step / rel).write_bytes(os.urandom(size))
    (root / "latest_checkpointed_iteration.txt").write_text("1\n")
    return step


def bench_mirror(model_mb: int, repeats: int) -> dict[str, Any]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    from omni_core.backends.jobs.mirror import mirror_new

    proc, endpoint = _moto()
    _s3_env(endpoint)
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        store = Store(f"s3://{bucket}/omni")
        config = TransferConfig(multipart_threshold=8 * MB, multipart_chunksize=8 * MB, max_concurrency=10)
        with tempfile.TemporaryDirectory(prefix="omni-bench-ckpt-") as tmp:
            run_dir = Path(tmp)
            folder = _checkpoint_folder(run_dir, model_mb)
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            total_mb = sum(p.stat().st_size for p in files) / MB

            def ours(i: int) -> None:
                assert mirror_new(run_dir, store, f"runs/bench/ours{i}/sft") == [1]

            def plain(i: int) -> None:
                def one(path: Path) -> None:
                    key = f"omni/runs/bench/plain{i}/{path.relative_to(folder).as_posix()}"
                    client.upload_file(str(path), bucket, key, Config=config)

                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(one, files))

            ours(-1)  # warm-up, untimed: both clients made, connections open
            plain(-1)
            times: dict[str, list[float]] = {"ours": [], "plain": []}
            for i in range(repeats):
                order = (("ours", ours), ("plain", plain)) if i % 2 == 0 else (("plain", plain), ("ours", ours))
                for name, fn in order:
                    start = time.perf_counter()
                    fn(i)
                    times[name].append(time.perf_counter() - start)
        ours_mb_s = total_mb / statistics.median(times["ours"])
        plain_mb_s = total_mb / statistics.median(times["plain"])
        return {"mirror_folder_mb": round(total_mb, 1), "mirror_repeats": repeats,
                "mirror_ours_mb_s": round(ours_mb_s, 1), "mirror_plain_boto3_mb_s": round(plain_mb_s, 1),
                "mirror_ratio": round(ours_mb_s / plain_mb_s, 3),
                "mirror_ours_s": [round(t, 2) for t in times["ours"]],
                "mirror_plain_s": [round(t, 2) for t in times["plain"]]}
    finally:
        proc.kill()


# ---- (a) the launcher's overhead per stage ------------------------------------------------------------


def bench_launcher(steps: int, rows: int, modes: tuple[str, ...] = ("save", "merge")) -> dict[str, Any]:
    """One cluster, one store; each `backend.hf_model` mode in `modes` runs the same stage with its own
    shared_dir (so each stages its inputs afresh) and run key, one after the other."""
    from ray_cluster import start_cluster

    proc, endpoint = _moto()
    _s3_env(endpoint)
    work = Path(tempfile.mkdtemp(prefix="omni-bench-verl-"))
    os.environ.setdefault("OMNI_CACHE_DIR", str(work / "cache"))
    cluster = start_cluster(head_cpus=2)
    try:
        out: dict[str, Any] = {"launcher_steps": steps, "launcher_modes": list(modes)}
        for mode in modes:
            figures = _one_stage(cluster, endpoint, work / mode, steps, rows, mode)
            out.update({f"launcher_{mode}_{k}": v for k, v in figures.items()})
        return out
    finally:
        cluster.stop()
        proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _one_stage(cluster: Any, endpoint: str, work: Path, steps: int, rows: int, hf_model: str) -> dict[str, Any]:
    from mlflow import MlflowClient
    from ray.job_submission import JobSubmissionClient
    from verl_env import verl_python

    from omni_core.backends.verl.runner import run_verl_stage
    from omni_core.config import DatasetConfig, validate_pipeline
    from omni_core.data import ingest

    work.mkdir(parents=True)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    store = Store(f"s3://{bucket}/store")
    # the model as on a cluster: a save_pretrained folder under an s3:// prefix (uploaded untimed)
    from omni_core.models.tiny import tiny_model_dir

    model_dir = tiny_model_dir("lm", seed=0)
    model_store = Store(f"s3://{bucket}/models/lm")
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        model_store.put_file(path, path.relative_to(model_dir).as_posix())
    source = f"fixtures://gsm8k?rows={rows}&seed=7"
    dv = ingest(store, "gsm8k", DatasetConfig(source=source, converter="gsm8k"), progress=lambda _: None)
    config = validate_pipeline({
        "name": "bench-verl", "store": store.root, "ray": {"address": cluster.job_server},
        "datasets": {"gsm8k": {"source": source, "converter": "gsm8k"}},
        "stages": [{"name": "sft", "kind": "sft", "model": model_store.root, "data": "gsm8k:train",
                    "trainer": {"total_steps": steps, "batch_size": 4, "lr": 1e-3},
                    "checkpoint": {"save_freq": max(1, steps // 2)},
                    "backend": {"name": "verl", "python": verl_python(), "shared_dir": str(work / "shared"),
                                "hf_model": hf_model,
                                "device": "cpu", "overrides": ["data.max_length=512", "trainer.total_epochs=1000"]}}]})
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    mlflow = MlflowClient(tracking)
    run_id = mlflow.create_run(mlflow.create_experiment("bench-verl")).info.run_id
    timings: dict[str, float] = {}
    lines: list[str] = []
    start = time.time()
    result = run_verl_stage(pipeline="bench-verl", stage=config.stage("sft"), seed=0, store=store,
                            dataset="gsm8k", version=dv.version, split="train", run_key=f"bench-{hf_model}",
                            ray_address=cluster.job_server, tracking_uri=tracking, mlflow_run_id=run_id,
                            progress=lines.append, log_dir=work / "logs", timings=timings)
    wall = time.time() - start
    client = JobSubmissionClient(cluster.job_server)
    info = client.get_job_info(result["submission_id"])
    job_start, job_end = info.start_time / 1000, info.end_time / 1000
    job_s = job_end - job_start
    submitted = start + sum(timings.get(k, 0.0) for k in ("export", "model", "resume", "submit"))
    breakdown = {k: round(timings.get(k, 0.0), 2) for k in
                 ("export", "model", "resume", "submit", "mirror_final", "merge", "commit")}
    breakdown["job_start_wait"] = round(job_start - submitted, 2)  # Ray: submitted -> entrypoint started
    breakdown["job_end_to_followed"] = round(start + timings["export"] + timings["model"] + timings.get("resume", 0)
                                             + timings["submit"] + timings["follow"] - job_end, 2)
    if hf_model == "merge":
        merge = client.get_job_info(f"{result['submission_id']}-merge-global_step_{steps}")
        breakdown["merge_job_run"] = round((merge.end_time - merge.start_time) / 1000, 2)
    overhead = wall - job_s
    return {"stage_wall_s": round(wall, 1), "job_run_s": round(job_s, 1), "overhead_s": round(overhead, 1),
            "overhead_ratio": round(overhead / job_s, 3), "breakdown_s": breakdown,
            "mirror_during_job_s": round(timings.get("mirror_during_job", 0.0), 2),
            "global_step": result["global_step"], "verl_version": result["verl_version"],
            "weights_mb": round(next(f["bytes"] for f in result["files"] if f["path"] == "model.safetensors") / MB, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter job and a smaller folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    parser.add_argument("--only", choices=("launcher", "mirror"), help="run one of the two parts")
    parser.add_argument("--steps", type=int, help="training steps of the verl job (default: ~2 min of work)")
    parser.add_argument("--hf-model", choices=("save", "merge", "both"), default="both",
                        help="backend.hf_model of the launcher's stage: verl saves the weights (save), verl's "
                             "model merger as a second job (merge), or both side by side (default)")
    args = parser.parse_args()
    figures: dict[str, Any] = {"quick": args.quick, "load_avg_1m": round(os.getloadavg()[0], 2),
                               "cpus": os.cpu_count()}
    if args.only != "launcher":
        figures.update(bench_mirror(model_mb=16 if args.quick else 96, repeats=3 if args.quick else 7))
        print(f"mirror  ours {figures['mirror_ours_mb_s']} MB/s  plain boto3 {figures['mirror_plain_boto3_mb_s']} MB/s  "
              f"ratio {figures['mirror_ratio']}  ({figures['mirror_folder_mb']} MB, median of "
              f"{figures['mirror_repeats']})", flush=True)
    if args.only != "mirror":
        steps = args.steps or (4 if args.quick else 500)
        modes = ("save", "merge") if args.hf_model == "both" else (args.hf_model,)
        figures.update(bench_launcher(steps, rows=64 if args.quick else 256, modes=modes))
        for mode in modes:
            f = {k.removeprefix(f"launcher_{mode}_"): v for k, v in figures.items() if k.startswith(f"launcher_{mode}_")}
            print(f"launcher hf_model={mode}  stage {f['stage_wall_s']} s  job {f['job_run_s']} s  "
                  f"overhead {f['overhead_s']} s ({100 * f['overhead_ratio']:.1f}%)  breakdown {f['breakdown_s']}",
                  flush=True)
    figures["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
