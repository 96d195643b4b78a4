"""omni_core.storage: the same behaviour on a local directory and on S3 (a moto server)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omni_core.errors import StorageError
from omni_core.storage import ObjectNotFoundError, Store, open_store

MiB = 2**20


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return Store(str(tmp_path / "store"))
    bucket = request.getfixturevalue("s3_bucket")
    return Store(f"s3://{bucket}/some/prefix")


def _is_s3(store: Store) -> bool:
    return store.root.startswith("s3://")


def _pending_uploads(s3_client, store: Store) -> list[dict]:
    bucket = store.root[len("s3://") :].split("/")[0]
    return s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _payload(n_chunks: int, chunk: int = 4 * MiB) -> list[bytes]:
    return [os.urandom(16) * (chunk // 16) for _ in range(n_chunks)]


# ---- the same cases on both backends ------------------------------------------------------------


def test_bytes_and_text_round_trip(store: Store) -> None:
    store.write_bytes("a/b/c.bin", b"\x00\x01hello")
    assert store.read_bytes("a/b/c.bin") == b"\x00\x01hello"
    store.write_text("t.txt", "héllo\n")
    assert store.read_text("t.txt") == "héllo\n"
    store.write_bytes("empty", b"")
    assert store.read_bytes("empty") == b""
    assert store.uri("a/b/c.bin") == f"{store.root}/a/b/c.bin"


def test_streamed_multi_mb_write_and_read(store: Store, request: pytest.FixtureRequest) -> None:
    chunks = _payload(3)  # 12 MiB in 4 MiB writes: more than one 8 MiB part on S3
    with store.open_write("big/blob.bin") as f:
        for c in chunks:
            f.write(c)
    data = b"".join(chunks)
    with store.open_read("big/blob.bin") as f:
        got = b"".join(iter(lambda: f.read(MiB), b""))
        f.seek(5 * MiB)
        assert f.read(10) == data[5 * MiB : 5 * MiB + 10]
    assert got == data
    if _is_s3(store):  # it really went through a multipart upload
        s3 = request.getfixturevalue("s3_client")
        bucket, _, prefix = store.root[len("s3://") :].partition("/")
        etag = s3.head_object(Bucket=bucket, Key=f"{prefix}/big/blob.bin")["ETag"]
        assert etag.strip('"').endswith("-2")


def test_put_file_uploads_a_local_file_whole(store: Store, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    data = b"".join(_payload(4)) + b"tail"  # 16 MiB + 4 bytes: three 8 MiB parts on S3, sent in parallel
    (tmp_path / "f.bin").write_bytes(data)
    store.put_file(tmp_path / "f.bin", "up/f.bin")
    assert store.read_bytes("up/f.bin") == data and store.list("up") == ["up/f.bin"]
    if _is_s3(store):
        s3 = request.getfixturevalue("s3_client")
        bucket, _, prefix = store.root[len("s3://") :].partition("/")
        assert s3.head_object(Bucket=bucket, Key=f"{prefix}/up/f.bin")["ETag"].strip('"').endswith("-3")
        assert _pending_uploads(s3, store) == []
        with pytest.raises(StorageError, match="omni-no-such-bucket"):
            Store("s3://omni-no-such-bucket/p").put_file(tmp_path / "f.bin", "x.bin")


def test_list_sorted_recursive_prefix_filtered_no_temp_files(store: Store) -> None:
    for key in ["c", "ab/3", "a/b/2", "a/1"]:
        store.write_bytes(key, b"x")
    with store.open_write("a/in-progress") as f:
        f.write(b"y" * (9 * MiB))  # on S3 a part is already uploaded, locally a temp file exists
        assert store.list() == ["a/1", "a/b/2", "ab/3", "c"]
        assert store.list("a") == ["a/1", "a/b/2"]
        assert store.list("a/") == ["a/1", "a/b/2"]
    assert store.list("a") == ["a/1", "a/b/2", "a/in-progress"]
    modified = store.list_modified("a")  # the same keys, each with its time from the listing itself
    assert sorted(modified) == ["a/1", "a/b/2", "a/in-progress"]
    assert all(abs(t - time.time()) < 300 for t in modified.values()), modified
    assert store.list("a/b") == ["a/b/2"]
    assert store.list("c") == ["c"]
    assert store.list("missing") == []


def test_exists_and_delete_object_and_prefix(store: Store) -> None:
    for key in ["d/x/1", "d/x/2", "d/y", "dd/z"]:
        store.write_bytes(key, b"1")
    assert store.exists("d/y")
    assert not store.exists("d/nope")
    store.delete("d/y")
    assert not store.exists("d/y")
    store.delete("d/y")  # missing is not an error
    store.delete("d")  # a prefix: everything under it, but not the sibling "dd/..."
    assert store.list() == ["dd/z"]
    assert not store.exists("d/x/1")
    store.delete("no/such/prefix")


def test_sha256_matches_hashlib(store: Store) -> None:
    data = b"".join(_payload(2, MiB)) + b"tail"
    store.write_bytes("h.bin", data)
    assert store.sha256("h.bin") == hashlib.sha256(data).hexdigest()


def test_json_round_trip_is_canonical(store: Store) -> None:
    obj = {"b": [1, 2.5, None], "a": {"z": "ü", "y": True}}
    store.write_json("m/_manifest.json", obj)
    assert store.read_json("m/_manifest.json") == obj
    assert store.read_text("m/_manifest.json") == json.dumps(obj, sort_keys=True, indent=2) + "\n"


def test_parquet_through_open_write_and_open_read(store: Store) -> None:
    table = pa.table({"id": list(range(50_000)), "text": [f"row {i}" for i in range(50_000)]})
    with store.open_write("datasets/x/v1/train-00000.parquet") as f:
        writer = pq.ParquetWriter(f, table.schema)
        for batch in table.to_batches(max_chunksize=10_000):
            writer.write_batch(batch)
        writer.close()
    with store.open_read("datasets/x/v1/train-00000.parquet") as f:
        pf = pq.ParquetFile(f)
        assert pf.metadata.num_rows == 50_000
        assert pf.read().equals(table)


def test_interrupted_write_leaves_previous_version(store: Store, request: pytest.FixtureRequest) -> None:
    store.write_bytes("obj.bin", b"version 1")
    with pytest.raises(RuntimeError, match="boom"), store.open_write("obj.bin") as f:
        for c in _payload(3):
            f.write(c)
        raise RuntimeError("boom")
    with pytest.raises(KeyboardInterrupt), store.open_write("new.bin") as f:
        f.write(b"z" * (9 * MiB))
        raise KeyboardInterrupt
    assert store.read_bytes("obj.bin") == b"version 1"
    assert not store.exists("new.bin")
    assert store.list() == ["obj.bin"]
    if _is_s3(store):  # the multipart uploads were aborted, not left behind
        assert _pending_uploads(request.getfixturevalue("s3_client"), store) == []
    else:
        assert sorted(p.name for p in Path(store.root).iterdir()) == ["obj.bin"]


def test_write_path_commits_only_on_success(store: Store, request: pytest.FixtureRequest) -> None:
    table = pa.table({"id": list(range(1000))})
    store.write_bytes("t.parquet", b"version 1")
    with pytest.raises(RuntimeError, match="boom"), store.write_path("t.parquet") as path:
        pq.write_table(table, path)
        raise RuntimeError("boom")
    assert store.read_bytes("t.parquet") == b"version 1"
    with store.write_path("t.parquet") as path:
        pq.write_table(table, path)
        assert store.read_bytes("t.parquet") == b"version 1"  # the new object is not visible yet
    with store.open_read("t.parquet") as f:
        assert pq.read_table(f).equals(table)
    assert store.list() == ["t.parquet"]
    if _is_s3(store):
        assert _pending_uploads(request.getfixturevalue("s3_client"), store) == []
    else:
        assert sorted(p.name for p in Path(store.root).iterdir()) == ["t.parquet"]  # no temp file left


def test_file_digest_matches_hashlib(tmp_path: Path) -> None:
    from omni_core.storage import file_digest

    data = os.urandom(3 * MiB + 17)
    (tmp_path / "f.bin").write_bytes(data)
    assert file_digest(tmp_path / "f.bin") == (len(data), hashlib.sha256(data).hexdigest())
    (tmp_path / "empty").write_bytes(b"")
    assert file_digest(tmp_path / "empty") == (0, hashlib.sha256(b"").hexdigest())


def test_write_killed_with_the_process_leaves_nothing(store: Store, request: pytest.FixtureRequest) -> None:
    store.write_bytes("obj.bin", b"version 1")
    child = textwrap.dedent(
        """
        import sys, time
        from omni_core.storage import Store
        store = Store(sys.argv[1])
        with store.open_write("obj.bin") as f1, store.open_write("fresh.bin") as f2:
            for _ in range(3):
                f1.write(b"a" * 4 * 2**20)
                f2.write(b"b" * 4 * 2**20)
            print("half-written", flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child, store.root], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "half-written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert store.read_bytes("obj.bin") == b"version 1"
    assert not store.exists("fresh.bin")
    assert store.list() == ["obj.bin"]
    if _is_s3(store):  # parts had been uploaded, but no upload was completed
        assert len(_pending_uploads(request.getfixturevalue("s3_client"), store)) == 2
    else:  # the half-written temp files are there on disk, yet invisible to the store
        names = sorted(p.name for p in Path(store.root).iterdir())
        assert len(names) == 3 and names[-1] == "obj.bin"
        assert all(".tmp-" in n for n in names[:2])


@pytest.mark.parametrize("key", ["../x", "a/../../x", "a/..", "/etc/passwd", "s3://other/x"])
def test_path_traversal_keys_are_rejected(store: Store, key: str) -> None:
    for op in (store.read_bytes, store.exists, store.delete, store.list, store.uri, store.sha256):
        with pytest.raises(StorageError, match="store key"):
            op(key)
    with pytest.raises(StorageError, match="store key"):
        store.write_bytes(key, b"x")
    with pytest.raises(StorageError, match="store key"), store.open_write(key):
        pass


def test_missing_key_raises_not_found(store: Store) -> None:
    with pytest.raises(ObjectNotFoundError, match="missing.bin") as err:
        store.read_bytes("missing.bin")
    assert isinstance(err.value, FileNotFoundError)
    with pytest.raises(ObjectNotFoundError):
        store.open_read("missing.bin")


def test_check_writable_passes_and_leaves_nothing(store: Store) -> None:
    store.check_writable()
    assert store.list() == []


# ---- roots and settings ---------------------------------------------------------------------------


def test_local_roots_are_normalized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rel = Store(".omni/store")
    assert rel.root == str(tmp_path / ".omni" / "store")
    uri = open_store(f"file://{tmp_path}/s")
    assert uri.root == f"file://{tmp_path}/s"
    uri.write_bytes("k/v", b"1")
    assert (tmp_path / "s" / "k" / "v").read_bytes() == b"1"
    assert uri.uri("k/v") == f"file://{tmp_path}/s/k/v"
    assert Store("s3://bucket/pre/fix/").root == "s3://bucket/pre/fix"
    with pytest.raises(StorageError, match="gs://b"):
        Store("gs://b/x")


def test_omni_endpoint_takes_precedence(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    store = Store(f"s3://{s3_bucket}")
    store.write_bytes("k", b"v")
    assert store.read_bytes("k") == b"v"


# ---- errors -----------------------------------------------------------------------------------------


def test_unreachable_endpoint_fails_fast_with_a_clear_message(
    s3_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("OMNI_S3_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sEcReT-do-not-leak")
    store = Store("s3://bucket/prefix")
    start = time.monotonic()
    with pytest.raises(StorageError) as err:
        store.check_writable()
    assert time.monotonic() - start < 10
    msg = str(err.value)
    assert endpoint in msg and "OMNI_S3_ENDPOINT_URL" in msg
    assert "\n" not in msg
    assert "sEcReT" not in msg and "sEcReT" not in repr(store)
    with pytest.raises(StorageError, match="cannot reach"):
        store.read_bytes("x")


def test_missing_bucket_is_named(s3_env: str) -> None:
    with pytest.raises(StorageError, match="omni-no-such-bucket") as err:
        Store("s3://omni-no-such-bucket/prefix").check_writable()
    assert "does not exist" in str(err.value)


def test_missing_credentials_are_reported(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    start = time.monotonic()
    with pytest.raises(StorageError, match="AWS_ACCESS_KEY_ID"):
        Store(f"s3://{s3_bucket}/p").check_writable()
    assert time.monotonic() - start < 10


def test_local_root_under_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a directory")
    store = Store(str(blocker / "store"))
    with pytest.raises(StorageError, match=str(blocker)) as err:
        store.check_writable()
    assert "regular file" in str(err.value)
    with pytest.raises(StorageError, match="regular file"):
        store.write_bytes("k", b"v")


class _FlakyS3:
    """An HTTP front for the moto server that answers the first `failures` PUTs with S3's own 500
    InternalError (what S3, or moto when two PUTs of one key race, sends back) and forwards every other
    request to moto unchanged."""

    def __init__(self, target: str, failures: int) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        self.failures, self.puts = failures, 0
        flaky, host = self, urlsplit(target)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                import http.client

                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.command == "PUT":
                    flaky.puts += 1
                    if flaky.puts <= flaky.failures:
                        error = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                                 b"<Message>We encountered an internal error. Please try again.</Message></Error>")
                        self.send_response(500)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(error)))
                        self.end_headers()
                        self.wfile.write(error)
                        return
                conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body or None, headers=dict(self.headers))
                    answer = conn.getresponse()
                    data = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("failures, lands", [(2, True), (3, False)])
def test_s3_server_errors_are_retried_then_reported(
    s3_bucket: str, moto_server: str, monkeypatch: pytest.MonkeyPatch, failures: int, lands: bool
) -> None:
    """A 500 InternalError is retried (S3 asks for it; a PUT of the same bytes is safe to repeat) up to the
    store's attempts; past them the error names the object."""
    flaky = _FlakyS3(moto_server, failures)
    try:
        monkeypatch.setenv("OMNI_S3_ENDPOINT_URL", flaky.url)
        store = Store(f"s3://{s3_bucket}/flaky")
        if lands:
            store.write_bytes("a/b.bin", b"payload")
            assert store.read_bytes("a/b.bin") == b"payload"
        else:
            with pytest.raises(StorageError, match=f"s3://{s3_bucket}/flaky/a/b.bin") as err:
                store.write_bytes("a/b.bin", b"payload")
            assert "\n" not in str(err.value)
            assert not store.exists("a/b.bin")
        assert flaky.puts == min(failures + 1, 3)
    finally:
        flaky.close()
