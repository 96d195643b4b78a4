"""What the content-addressed tag saves: the first build + push of the test image against the second,
no-op run (tag computed, found in the registry, nothing built), side by side.

    python bench/images.py [--quick] [--json]

Uses the test image (tests/data/images: FROM scratch + a static busybox), buildah with vfs storage
and chroot isolation in a temporary root, and a docker-registry started on 127.0.0.1 by this script.
Each repeat starts from empty buildah storage and an empty registry. Also times a rebuild after one
context file changed (buildah's layer cache keeps the unchanged steps). Needs the Debian packages
buildah, skopeo, docker-registry and busybox-static.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from omni_core.images import BuildahBuilder, content_tag, ensure_image, spec_from_dict
from omni_core.images.local_registry import LocalRegistry
from omni_core.storage import Store

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "images"


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def one_round(work: Path) -> dict[str, float]:
    (work / "storage.conf").write_text(
        f'[storage]\ndriver = "vfs"\ngraphroot = "{work / "graph"}"\nrunroot = "{work / "run"}"\n')
    os.environ["CONTAINERS_STORAGE_CONF"] = str(work / "storage.conf")
    os.environ["BUILDAH_ISOLATION"] = "chroot"
    ctx = work / "ctx"
    shutil.copytree(DATA, ctx)
    shutil.copy2(shutil.which("busybox") or "busybox", ctx / "busybox")
    spec = spec_from_dict({"target": "bench", "dockerfile": ctx / "Dockerfile", "context": ctx})
    store = Store(str(work / "store"))
    quiet = {"builder": BuildahBuilder(), "log_dir": work / "logs", "progress": lambda line: None}
    with LocalRegistry(work / "registry") as registry:
        tag_s, _ = _timed(lambda: content_tag(spec))
        first_s, first = _timed(lambda: ensure_image(spec, store, registry=registry, push=True, **quiet))
        noop_s, noop = _timed(lambda: ensure_image(spec, store, registry=registry, push=True, **quiet))
        assert not first.reused and noop.reused and noop.record.digest == first.record.digest
        (ctx / "app" / "message.txt").write_text("one context file changed\n")
        rebuild_s, rebuilt = _timed(lambda: ensure_image(spec, store, registry=registry, push=True, **quiet))
        assert not rebuilt.reused and rebuilt.record.tag != first.record.tag
    return {"tag_s": tag_s, "first_build_push_s": first_s, "noop_s": noop_s, "rebuild_one_file_s": rebuild_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat (well under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures last")
    args = parser.parse_args()
    missing = [t for t in ("buildah", "skopeo", "docker-registry", "busybox") if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing tools {missing}: apt-get install buildah skopeo docker-registry busybox-static")
    repeats = 1 if args.quick else 3
    rounds = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="omni-bench-images-") as tmp:
            rounds.append(one_round(Path(tmp)))
    figures: dict[str, float | int] = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    figures["first_over_noop"] = round(figures["first_build_push_s"] / figures["noop_s"], 1)
    figures["repeats"] = repeats
    print(f"test image, buildah (vfs, chroot) + docker-registry on 127.0.0.1, median of {repeats}:")
    print(f"  content tag only           {figures['tag_s']:.3f} s")
    print(f"  first build + push         {figures['first_build_push_s']:.2f} s")
    print(f"  second run (no-op)         {figures['noop_s']:.2f} s   ({figures['first_over_noop']}x faster)")
    print(f"  one context file changed   {figures['rebuild_one_file_s']:.2f} s   (layer cache for the rest)")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
