"""What atomic writes cost: Store.open_write (temp + fsync + rename locally; aborted-or-completed
multipart on S3) against a plain write of the same bytes to the same backend, side by side.

    python bench/storage.py [--quick] [--json]

Prints MB/s for each and the ratio ours/plain (1.0 = atomicity is free). S3 runs against a moto
server started on 127.0.0.1 by this script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3

from omni_core.storage import Store

CHUNK = 1 << 20


def _timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _payload(mb: int) -> list[bytes]:
    return [os.urandom(CHUNK) for _ in range(mb)]


def bench_local(chunks: list[bytes], repeats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(tmp)

        def ours() -> None:
            with store.open_write("bench/ours.bin") as f:
                for chunk in chunks:
                    f.write(chunk)

        def plain() -> None:
            path = Path(tmp) / "bench" / "plain.bin"
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())  # same durability as ours, so the ratio isolates temp + rename

        return {"ours": _timed(ours, repeats), "plain": _timed(plain, repeats)}


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


def bench_s3(chunks: list[bytes], repeats: int) -> dict[str, float]:
    proc, endpoint = _moto()
    os.environ.update({"OMNI_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=bucket)
        store = Store(f"s3://{bucket}/omni")
        body = b"".join(chunks)

        def ours() -> None:
            with store.open_write("bench/ours.bin") as f:
                for chunk in chunks:
                    f.write(chunk)

        def plain() -> None:  # boto3's managed upload (multipart above its threshold), the usual way
            import io

            client.upload_fileobj(io.BytesIO(body), bucket, "omni/bench/plain.bin")

        return {"ours": _timed(ours, repeats), "plain": _timed(plain, repeats)}
    finally:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller payloads (well under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    args = parser.parse_args()
    mb, repeats = (32, 3) if args.quick else (256, 5)
    chunks = _payload(mb)
    figures: dict[str, float] = {"payload_mb": mb}
    for backend, fn in (("local", bench_local), ("s3", bench_s3)):
        times = fn(chunks, repeats)
        ours_mb_s, plain_mb_s = mb / times["ours"], mb / times["plain"]
        figures[f"{backend}_ours_mb_s"] = round(ours_mb_s, 1)
        figures[f"{backend}_plain_mb_s"] = round(plain_mb_s, 1)
        figures[f"{backend}_ratio"] = round(ours_mb_s / plain_mb_s, 3)
        print(f"{backend:5s}  atomic {ours_mb_s:8.1f} MB/s   plain {plain_mb_s:8.1f} MB/s   "
              f"ratio {ours_mb_s / plain_mb_s:.2f}  (best of {repeats}, {mb} MB)")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
