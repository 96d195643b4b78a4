"""`omni verify`: the sha256 in dataset and checkpoint manifests, checked again against the store's bytes.

A real fixture dataset (ingest) and a real checkpoint of a tiny model (save_checkpoint) are written to a
local store and to a bucket on the moto S3 server; verify passes; then one dataset shard and one
checkpoint file are tampered with (bytes flipped in place, same size) and another checkpoint file is
deleted, and verify names exactly those, through the library and through the `omni` command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_core.config import DatasetConfig
from omni_core.data import ingest
from omni_core.errors import OmniError
from omni_core.lineage.verify import (
    INVALID,
    MISMATCH,
    MISSING,
    OK,
    VerifyError,
    resolve_target,
    verify,
    verify_target,
)
from omni_core.storage import Store

REPO = Path(__file__).resolve().parents[1]
STAGE_ROOT = "runs/verify-demo/abc123/sft"
CHECKPOINT = f"{STAGE_ROOT}/checkpoints/global_step_2"


def omni(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The `omni` command in a subprocess (inherits the S3 settings of the s3_env fixture)."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})


def flip(store: Store, key: str) -> None:
    """Rewrite `key` with the same length but some bytes inverted (what bit rot or a bad copy does)."""
    data = bytearray(store.read_bytes(key))
    for i in range(len(data) // 2, min(len(data), len(data) // 2 + 4)):
        data[i] ^= 0xFF
    store.write_bytes(key, bytes(data))


@pytest.fixture
def populated(store: Store, tiny_model_env: Path) -> tuple[Store, str, dict]:
    """The `store` fixture (local, then S3) holding the digits dataset and one tiny-model checkpoint."""
    from omni_core.models import load_model
    from omni_core.training.checkpoint import save_checkpoint

    dv = ingest(store, "digits", DatasetConfig(source="fixtures://digits?rows=8&seed=0", converter="digits"),
                progress=lambda _: None)
    model, tokenizer = load_model("tiny://lm", seed=0)
    manifest = save_checkpoint(store, STAGE_ROOT, 2, model, tokenizer, {"stage": "sft"})
    return store, dv.version, manifest


def test_verify_passes_then_reports_exactly_the_tampered_files(populated: tuple[Store, str, dict],
                                                                 tmp_path: Path) -> None:
    store, version, manifest = populated
    shards = [f"datasets/digits/{version}/train-00000.parquet", f"datasets/digits/{version}/test-00000.parquet"]
    ckpt_files = sorted(f"{CHECKPOINT}/{f['path']}" for f in manifest["files"])
    assert len(ckpt_files) >= 3 and any(k.endswith(".safetensors") for k in ckpt_files)

    summary, checks = verify_target(None, store.root)
    assert sorted(c.key for c in checks) == sorted(shards + ckpt_files)  # every listed file, nothing else
    assert all(c.status == OK and c.actual_sha256 == c.expected_sha256 for c in checks)
    assert summary.ok and summary.datasets == {f"digits@{version}"} and summary.checkpoints == {CHECKPOINT}

    weights = f"{CHECKPOINT}/{manifest['weights']}"
    deleted = next(k for k in ckpt_files if k != weights and not k.endswith(".safetensors"))
    flip(store, shards[0])
    flip(store, weights)
    store.delete(deleted)

    summary, checks = verify_target(None, store.root)
    bad = {c.key: c for c in checks if c.status != OK}
    assert set(bad) == {shards[0], weights, deleted}
    assert bad[shards[0]].status == MISMATCH and bad[weights].status == MISMATCH and bad[deleted].status == MISSING
    for key in (shards[0], weights):
        assert bad[key].actual_sha256 == store.sha256(key) != bad[key].expected_sha256
    assert bad[shards[0]].expected_sha256 == next(
        s["sha256"] for s in store.read_json(f"datasets/digits/{version}/_manifest.json")["splits"]["train"]["shards"])
    assert not summary.ok and summary.counts == {OK: len(checks) - 3, MISMATCH: 2, MISSING: 1, "INVALID": 0}

    # a scoped target checks only its own files
    only_dataset = list(verify(store, resolve_target(f"digits@{version}", store.root).prefix))
    assert sorted(c.key for c in only_dataset) == sorted(shards)
    assert [c.key for c in only_dataset if c.status != OK] == [shards[0]]
    by_uri = resolve_target(store.uri(CHECKPOINT), "unused-store")
    assert by_uri.store.root == store.root and by_uri.prefix == CHECKPOINT
    assert {c.key for c in verify(by_uri.store, by_uri.prefix) if c.status != OK} == {weights, deleted}

    # the command: human lines, a non-zero exit, and --json for machines
    cli = omni("verify", "--store", store.root, cwd=tmp_path)
    assert cli.returncode == 1, cli.stderr
    lines = cli.stdout.splitlines()
    assert sum(line.startswith("MISMATCH") for line in lines) == 2
    assert sum(line.startswith("MISSING") for line in lines) == 1
    assert sum(line.startswith("ok ") for line in lines) == len(checks) - 3
    mismatch_shard = next(line for line in lines if shards[0] in line)
    assert mismatch_shard.startswith("MISMATCH") and bad[shards[0]].expected_sha256 in mismatch_shard
    assert bad[shards[0]].actual_sha256 in mismatch_shard
    assert f"{len(checks) - 3} ok, 2 MISMATCH, 1 MISSING" in lines[-1]

    cli_json = omni("verify", store.uri(f"datasets/digits/{version}"), "--json", cwd=tmp_path)
    assert cli_json.returncode == 1, cli_json.stderr
    report = json.loads(cli_json.stdout)
    assert report["ok"] is False and report["counts"] == {"ok": 1, "MISMATCH": 1, "MISSING": 0, "INVALID": 0}
    assert {r["key"]: r["status"] for r in report["results"]} == {shards[0]: MISMATCH, shards[1]: OK}


@pytest.mark.parametrize("store", ["local"], indirect=True)  # the S3 store goes through the CLI above
def test_cli_exits_zero_on_an_intact_store_and_two_on_a_bad_target(populated: tuple[Store, str, dict],
                                                                   tmp_path: Path) -> None:
    store, version, _ = populated
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"name: verify-demo\nstore: {store.root}\n"
                        "datasets: {digits: {source: 'fixtures://digits?rows=8', converter: digits}}\n"
                        "stages: [{name: ingest, kind: ingest, datasets: [digits]}]\n")
    cli = omni("verify", "--pipeline", str(pipeline), cwd=tmp_path)  # the store of a pipeline file
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert cli.stdout.splitlines()[-1].endswith(" ok")
    assert "1 dataset version(s) and 1 checkpoint(s)" in cli.stdout

    by_key = omni("verify", CHECKPOINT, "--store", store.root, "--json", cwd=tmp_path)
    assert by_key.returncode == 0 and json.loads(by_key.stdout)["checkpoints"] == [CHECKPOINT]

    missing = omni("verify", f"digits@{'0' * 16}", "--store", store.root, cwd=tmp_path)
    assert missing.returncode == 2
    assert f"datasets/digits/{'0' * 16}" in missing.stderr and "no committed dataset version" in missing.stderr


def test_malformed_targets_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(VerifyError, match="not found; give NAME@VERSION"):
        resolve_target(str(tmp_path / "no-such-store"), str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(OmniError, match=r"nothing to verify at .*empty.*check the store root \(--store\)"):
        verify_target(None, str(empty))


def test_an_unreadable_manifest_is_reported_not_skipped(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "store"))
    store.write_text("datasets/broken/v1/_manifest.json", "{not json")
    store.write_json("datasets/fine/v1/_manifest.json", {"splits": {}})
    store.write_text("datasets/fine/v2/train-00000.parquet", "no manifest: an uncommitted version, not checked")
    summary, checks = verify_target(None, store.root)
    assert [(c.key, c.status) for c in checks] == [("datasets/broken/v1/_manifest.json", INVALID)]
    assert "not valid JSON" in checks[0].detail and not summary.ok


def test_raw_source_files_are_checked_with_raw(tmp_path: Path) -> None:
    """`--raw` resolves the version's source again and compares every raw file lineage shows."""
    from omni_core.data.fixtures import write_fixture

    raw = tmp_path / "raw"
    write_fixture("gsm8k", raw, rows=6)
    store = Store(str(tmp_path / "store"))
    version = ingest(store, "gsm8k", DatasetConfig(source=str(raw), converter="gsm8k"), progress=lambda _: None).version
    listed = sorted(f["path"] for f in store.read_json(f"datasets/gsm8k/{version}/_manifest.json")["raw_files"])
    assert listed  # the manifest names the raw files it was made from

    summary, checks = verify_target(f"gsm8k@{version}", store.root, raw=True)
    assert summary.ok and sorted(c.key for c in checks if c.kind == "raw") == listed
    summary, checks = verify_target(f"gsm8k@{version}", store.root)
    assert not [c for c in checks if c.kind == "raw"]  # only when asked: it may download a whole dataset

    first = raw / listed[0]
    first.write_bytes(first.read_bytes() + b"\n")  # the source changed after the ingest
    (raw / listed[-1]).unlink() if len(listed) > 1 else None
    summary, checks = verify_target(f"gsm8k@{version}", store.root, raw=True)
    status = {c.key: c.status for c in checks if c.kind == "raw"}
    assert not summary.ok and status[listed[0]] == "MISMATCH"
    if len(listed) > 1:
        assert status[listed[-1]] == "MISSING"
    assert all(c.status == "ok" for c in checks if c.kind == "dataset")  # the store itself is intact

    cli = omni("verify", f"gsm8k@{version}", "--store", store.root, "--raw", cwd=tmp_path)
    assert cli.returncode == 1 and "MISMATCH" in cli.stdout and listed[0] in cli.stdout
